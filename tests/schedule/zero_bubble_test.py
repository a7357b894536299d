"""zero_bubble's arithmetic (gpipe.schedule.ZeroBubble) against a lockstep run.

The reference runs the gradient loop one backward iteration at a time by
the rules the module states, over the event simulator's forward calls
(schedule_reference.Simulate), using none of ZeroBubble's code:

  * stage s runs a B at backward iteration k where the forward call
    (k, S - 1 - s) is real (1f1b's mirrored backward wave), and defers its
    W to a queue, oldest first;
  * a W slot runs in k when every stage that still has W's to run has one
    waiting; in a slot each such stage runs its oldest;
  * each iteration of the loop costs what it computes for all stages (one
    SPMD program): F while the forward wave runs, B while the backward wave
    does, W in a slot (1f1b: with every B).

It also keeps a ring of the deferred W's operands as a list, written at
ZeroBubble.RingIndex, and checks each slot reads what its B wrote.
"""

import pytest

from tests.schedule import schedule_reference

schedule = schedule_reference.schedule
Schedule = schedule.Schedule
TaskCosts = schedule.TaskCosts
ZeroBubble = schedule.ZeroBubble

_SWEEP = [(s, m, r, d) for s in (1, 2, 3, 4, 5) for m in (1, 2, 3, 5, 8)
          for r in (1, 2, 3) for d in (False, True)]
# The grid: S = 4, 8; M = S, 2S, 4S; R = 1, 2.
_COST_SWEEP = [(s, m, r, d) for s in (1, 2, 4) for m in (1, 3, 8)
               for r in (1, 2) for d in (False, True)]
_GRID = [(s, m, r) for s in (4, 8) for m in (s, 2 * s, 4 * s) for r in (1, 2)]
_COSTS = [TaskCosts(), TaskCosts(1.0, 1.3, 0.8), TaskCosts(2.0, 3.0, 1.0),
          TaskCosts(1.0, 1.0, 3.0)]


class _LockstepRun:
  """The reference's run of the zero-bubble backward wave (module doc)."""

  def __init__(self, s, m, r, d):
    table = schedule_reference.Simulate(s, m, r, d).table
    self.num_iterations = len(table)
    self.b_iterations = [[k for k in range(len(table))
                          if table[k][s - 1 - stage] is not None]
                         for stage in range(s)]
    self.slots, self.w_made_at = [], [[] for _ in range(s)]
    waiting = [[] for _ in range(s)]
    self.most_waiting = 0
    for k in range(len(table)):
      for stage in range(s):
        if k in self.b_iterations[stage]:
          waiting[stage].append(k)
      left = [stage for stage in range(s)
              if len(self.w_made_at[stage]) < len(self.b_iterations[stage])]
      if left and all(waiting[stage] for stage in left):
        self.slots.append(k)
        for stage in left:
          self.w_made_at[stage].append(waiting[stage].pop(0))
      self.most_waiting = max([self.most_waiting] +
                              [len(w) for w in waiting])

  def Seconds(self, costs, delay, zero_bubble=True):
    """The gradient loop's lockstep time: T + delay iterations, each the
    sum of what it computes."""
    t, total = self.num_iterations, 0.0
    for j in range(t + delay):
      k = j - delay
      if j < t:
        total += costs.forward
      if 0 <= k < t:
        total += costs.input_gradient
        if not zero_bubble or k in self.slots:
          total += costs.weight_gradient
    return total


@pytest.mark.parametrize('s, m, r, d', _SWEEP)
def test_w_slots_ring_and_waits_are_the_lockstep_runs(s, m, r, d):
  sched = Schedule(s, m, r, d)
  zb = ZeroBubble(sched)
  run = _LockstepRun(s, m, r, d)
  assert zb.BackwardCalls() == run.b_iterations
  assert all(len(calls) == m * r for calls in run.b_iterations)
  assert zb.SlotIterations() == run.slots
  assert zb.WaitingAtMost() == run.most_waiting
  # Each W after its B, oldest first, one a slot: the slot rows say which.
  rows = zb.SlotRows()
  assert [k for k, row in enumerate(rows) if row is not None] == run.slots
  ring = [None] * zb.ring_size
  for k, row in enumerate(rows):
    for stage in range(s):
      if k in run.b_iterations[stage]:
        ring_entry = zb.RingIndex(k)
        assert (ring[ring_entry] or {}).get(stage) is None, (
            f'stage {stage} overwrites a W not run yet at k={k}')
        ring[ring_entry] = ring[ring_entry] or {}
        ring[ring_entry][stage] = k
    if row is None:
      continue
    for stage, work in enumerate(row):
      n = run.slots.index(k)
      if n >= len(run.w_made_at[stage]):
        assert not work.valid
        continue
      assert work.valid and work.made_at == run.w_made_at[stage][n]
      assert work.made_at <= k
      assert ring[work.ring_index][stage] == work.made_at
      ring[work.ring_index][stage] = None
  # Every W has run, and the ring is as small as the longest wait allows.
  assert all(entry is None or all(v is None for v in entry.values())
             for entry in ring)
  assert zb.ring_size == 1 + max(
      slot - made for stage in run.w_made_at
      for slot, made in zip(run.slots, stage))


@pytest.mark.parametrize('s, m, r, d', _COST_SWEEP)
def test_lockstep_seconds_are_the_runs(s, m, r, d):
  zb = ZeroBubble(Schedule(s, m, r, d))
  run = _LockstepRun(s, m, r, d)
  for costs in _COSTS:
    _CheckSeconds(zb, run, costs)


def _CheckSeconds(zb, run, costs):
  s, m, r = (zb.schedule.num_stages, zb.schedule.num_microbatches,
             zb.schedule.circular_repeat)
  delay = zb.one_f_one_b.delay
  assert zb.LockstepSeconds(costs) == pytest.approx(run.Seconds(costs, delay))
  assert zb.OneFOneBSeconds(costs) == pytest.approx(
      run.Seconds(costs, delay, zero_bubble=False))
  useful = m * r * costs.call
  bubbles = zb.Bubbles(costs)
  assert bubbles['zero_bubble'] == pytest.approx(
      run.Seconds(costs, delay) - useful)
  # Per-stage branches: no slower than lockstep, no faster than the fill.
  assert (bubbles['fill bound'] - 1e-9 <= bubbles['per-stage branches'] <=
          bubbles['zero_bubble'] + 1e-9)
  assert bubbles['fill bound'] == pytest.approx(
      zb.schedule.hop * (s - 1) * costs.forward)


@pytest.mark.parametrize('s, m, r', _GRID)
@pytest.mark.parametrize('d', [False, True])
def test_zero_bubble_leaves_at_most_two_thirds_of_1f1bs_bubble(s, m, r, d):
  bubbles = ZeroBubble(Schedule(s, m, r, d)).Bubbles(TaskCosts())
  assert bubbles['zero_bubble'] <= 2 / 3 * bubbles['1f1b'] + 1e-9
  assert bubbles['zero_bubble'] > 0  # the fill remains


@pytest.mark.parametrize('s, m, r', _GRID)
def test_deferred_ws_wait_for_at_most_s_minus_1_microbatches(s, m, r):
  # The memory the deferral adds: each waiting W's stage input and output
  # gradient, at most S - 1 a stage (h (S - 1) with delayed sends).
  assert ZeroBubble(Schedule(s, m, r)).WaitingAtMost() == s - 1
  assert ZeroBubble(Schedule(s, m, r, True)).WaitingAtMost() <= 2 * (s - 1)


@pytest.mark.parametrize('s, m, r, d', _SWEEP)
def test_phases_tile_the_loop_each_running_its_iterations_waves(s, m, r, d):
  zb = ZeroBubble(Schedule(s, m, r, d))
  run = _LockstepRun(s, m, r, d)
  t, delay = run.num_iterations, zb.one_f_one_b.delay
  phases = zb.Phases()
  assert phases[0].begin == 0 and phases[-1].end == t + delay
  for before, after in zip(phases, phases[1:]):
    assert before.end == after.begin and before.waves != after.waves
  for phase in phases:
    for j in range(phase.begin, phase.end):
      k = j - delay
      expected = ((('forward',) if j < t else ()) +
                  (('backward',) if 0 <= k < t else ()) +
                  (('weight',) if k in run.slots else ()))
      assert phase.waves == expected, (j, phase)
