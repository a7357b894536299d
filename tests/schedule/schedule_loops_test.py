"""The loops gpipe.schedule plans besides the forward table, against its rules.

The forward loop's phases (which stages each run of iterations computes:
skip_bubbles), the 1f1b gradient loop (OneFOneB: its backward wave, by the
rule its docstring states over the simulator's forward calls, its phases
and diagram) and stream_io's columns (gpipe.schedule.streams.Streams,
simulated with Python lists by the rules it documents). The simulator is
schedule_reference.py's.
"""

import pytest

from gpipe.schedule import text as schedule_text
from tests.schedule import schedule_reference

schedule = schedule_reference.schedule
streams_lib = schedule_reference.streams
Schedule = schedule.Schedule
_Simulate = schedule_reference.Simulate


_PHASE_SWEEP = [(s, m, r, d) for s in range(1, 7)
                for m in (1, 2, 3, 5, 8, 13) for r in (1, 2, 3)
                for d in (False, True)]  # d: delayed sends


def _PhasesTileTheLoopAndHoldEveryUsefulCall(s, m, r, d=False):
  """Phases: consecutive runs covering [0, T); each computes a range of
  ceil(S/2) or S stages holding every valid call of its iterations; at
  most three, the narrow ones first and last."""
  sched = Schedule(s, m, r, d)
  table = _Simulate(s, m, r, d).table
  phases = sched.Phases()
  assert 1 <= len(phases) <= 3
  assert phases[0].begin == 0 and phases[-1].end == sched.num_iterations
  for before, after in zip(phases, phases[1:]):
    assert before.end == after.begin
  half = -(-s // 2)
  for k, p in enumerate(phases):
    assert p.end > p.begin
    assert p.num_stages in (half, s)
    assert 0 <= p.first_stage and p.first_stage + p.num_stages <= s
    if p.num_stages < s:
      assert k in (0, len(phases) - 1)
    for i in range(p.begin, p.end):
      for stage in range(s):
        if i < len(table) and table[i][stage] is not None:
          assert p.first_stage <= stage < p.first_stage + p.num_stages, (
              i, stage, p)


def test_phases_hand_worked():
  """The docstring's S=4, M=4 and a short circular one (S=2, M=3, R=2:
  iteration 0 holds stage 0 only; 7 and 8 stage 1 or nothing)."""
  P = schedule.Phase
  assert Schedule(4, 4).Phases() == [P(0, 2, 0, 2), P(2, 5, 0, 4),
                                     P(5, 7, 2, 2)]
  assert Schedule(2, 3, 2).Phases() == [P(0, 1, 0, 1), P(1, 7, 0, 2),
                                        P(7, 9, 1, 1)]
  assert Schedule(1, 5).Phases() == [P(0, 5, 0, 1)]
  assert Schedule(3, 1).Phases() == [P(0, 2, 0, 2), P(2, 3, 1, 2)]
  # Delayed sends, S=3, M=2 (the schedule's docstring): stages 0 and 1
  # hold all the work of iterations 0-3, stages 1 and 2 that of 4-5.
  assert Schedule(3, 2, 1, True).Phases() == [P(0, 4, 0, 2), P(4, 6, 1, 2)]


# -- The 1f1b gradient loop (OneFOneB) and stream_io's columns (Streams). -----

_ONE_F_ONE_B_DOC_DIAGRAM = """\
j            0   1   2   3   4   5   6   7
stage 0    0,. 1,. 2,. 3,. .,0 .,1 .,2 .,3
stage 1    .,. 0,. 1,. 2,0 3,1 .,2 .,3 .,.
stage 2    .,. .,. 0,0 1,1 2,2 3,3 .,. .,."""


def _ExpectedBackward(s, m, r, d=False):
  """{(microbatch, layer): gradient-loop iteration} from the rule the
  OneFOneB docstring states, over the simulator's forward calls: the last
  layer's backward in the iteration that runs its forward, each earlier
  layer's h iterations after the layer above it (h = 2 with delayed
  sends, else 1)."""
  done = _Simulate(s, m, r, d).calls
  num_layers = s * r
  hop = 2 if d else 1
  return {(mb, l): done[(mb, num_layers - 1)][0] + hop * (num_layers - 1 - l)
          for (mb, l) in done}


def _BackwardWaveRunsEveryCallOnceByTheRule(s, m, r, d=False):
  """Every real (microbatch, layer) call is differentiated exactly once, at
  the stage that ran it, at the iteration the rule gives, reading the
  input its forward wrote at the same forward iteration; its input waits
  in the ring fewer than ring_size iterations; bubbles read nothing."""
  sched = Schedule(s, m, r, d)
  waves = schedule.OneFOneB(sched)
  done = _Simulate(s, m, r, d).calls
  expected = _ExpectedBackward(s, m, r, d)
  rows = waves.BackwardRows()
  forward_rows = waves.ForwardWaveRows()
  assert len(rows) == len(forward_rows) == sched.num_iterations
  for plain, wave in zip(sched.Rows(), forward_rows):  # the forward's own
    assert [vars(w) for w in plain] == [
        {k: v for k, v in vars(w).items() if k != 'ring_index'} for w in wave]
  seen = {}
  for k in range(sched.num_iterations):
    for stage in range(s):
      work = rows[k][stage]
      if not work.valid:
        continue
      mb = work.microbatch
      layer = work.repeat * s + stage
      assert (mb, layer) not in seen, (mb, layer)
      j = k + waves.delay
      seen[(mb, layer)] = j
      forward_iteration, forward_stage = done[(mb, layer)]
      assert forward_stage == stage
      assert work.iteration == forward_iteration
      assert 0 <= j - forward_iteration < waves.ring_size
      assert work.ring_index == forward_iteration % waves.ring_size
      # ... the entry the forward wave wrote it to.
      assert forward_rows[forward_iteration][stage].ring_index == (
          work.ring_index)
      assert work.last_layer == (layer == s * r - 1)
      assert work.first_layer == (layer == 0)
      assert work.seed_offset == sched.StepSeedOffset(layer, mb)
  assert seen == expected
  assert waves.ring_size == 2 * (2 if d else 1) * (s * r - 1) + 1


def _GradientPhasesHoldBothWaves(s, m, r, d=False):
  """The phases tile the gradient loop; the forward wave runs exactly in
  [0, T), the backward wave in [delay, delay + T), in every stage of the
  rows, whose waves are their phase's."""
  sched = Schedule(s, m, r, d)
  waves = schedule.OneFOneB(sched)
  phases = waves.Phases()
  assert phases[0].begin == 0 and phases[-1].end == waves.num_iterations
  for before, after in zip(phases, phases[1:]):
    assert before.end == after.begin
  rows = waves.Rows()
  for p in phases:
    assert all(work.waves == p.waves for row in rows[p.begin:p.end]
               for work in row), p
  forward = {j for p in phases if 'forward' in p.waves
             for j in range(p.begin, p.end)}
  backward = {j for p in phases if 'backward' in p.waves
              for j in range(p.begin, p.end)}
  assert forward == set(range(sched.num_iterations))
  assert backward == set(range(waves.delay, waves.num_iterations))
  assert waves.num_iterations == (sched.num_iterations +
                                  (2 if d else 1) * (s * r - 1))


def test_one_f_one_b_docstring_diagram():
  assert _ONE_F_ONE_B_DOC_DIAGRAM in _Unindented(schedule.OneFOneB.__doc__)
  assert (schedule_text.RenderGradientLoop(Schedule(3, 4, 1)) ==
          _ONE_F_ONE_B_DOC_DIAGRAM)


def _Unindented(text):
  """text with each line's common indent removed."""
  lines = text.splitlines()
  return '\n'.join(line.strip() and line[6:] for line in lines)


def _Rotate(column):
  """One stage towards stage 0: [c0, c1, ..., cS-1] -> [c1, ..., cS-1, c0]."""
  return column[1:] + column[:1]


def _StreamsDeliverInOrderAndEndHome(s, m, r, d=False):
  """Simulated with Python lists, by the rules gpipe.schedule.streams
  documents: stage 0 reads a column's entry at stage 0, then the column
  rotates; the last stage's output goes to a column's last entry after the
  column rotates; output gradients are read at the last stage after a rotation;
  input gradients are written at stage 0, then the column rotates. Reads
  come in microbatch order; written streams, after FixupShifts more
  rotations, hold microbatch s K + k at [s][k]."""
  sched = Schedule(s, m, r, d)
  streams = streams_lib.Streams(sched)
  k_columns = streams.num_columns
  assert (streams.padded_microbatches == s * k_columns >= m >
          s * (k_columns - 1))
  home = [[st * k_columns + k for k in range(k_columns)] for st in range(s)]

  def Column(stream, k):
    return [stream[st][k] for st in range(s)]

  def SetColumn(stream, k, column):
    for st in range(s):
      stream[st][k] = column[st]

  def Home(stream):
    for k, shift in enumerate(streams.FixupShifts()):
      column = Column(stream, k)
      for _ in range(shift):
        column = _Rotate(column)
      SetColumn(stream, k, column)
    return [[x if x is not None and x < m else None for x in row]
            for row in stream]

  expected = [[x if x < m else None for x in row] for row in home]
  # Inputs, read at stage 0 in the forward schedule's order.
  stream = [list(row) for row in home]
  reads = []
  for k in streams.ReadColumns():
    if k >= 0:
      reads.append(stream[0][k])
      SetColumn(stream, k, _Rotate(Column(stream, k)))
  assert reads == list(range(m))
  # Outputs, written at the last stage.
  stream = [[None] * k_columns for _ in range(s)]
  for row, k in zip(sched.Rows(), streams.WriteColumns()):
    if k >= 0:
      column = _Rotate(Column(stream, k))
      column[-1] = row[-1].microbatch
      SetColumn(stream, k, column)
  assert Home(stream) == expected
  # Backward wave: output gradients read at the last stage, input
  # gradients written at stage 0.
  rows = schedule.OneFOneB(sched).BackwardRows()
  d_out = [list(row) for row in home]
  d_in = [[None] * k_columns for _ in range(s)]
  read_order, write_order = [], []
  for row in rows:
    if row[s - 1].last_layer:
      k = streams.Column(row[s - 1].microbatch)
      SetColumn(d_out, k, _Rotate(Column(d_out, k)))
      read_order.append(d_out[s - 1][k])
    if row[0].first_layer:
      mb = row[0].microbatch
      write_order.append(mb)
      k = streams.Column(mb)
      d_in[0][k] = mb
      SetColumn(d_in, k, _Rotate(Column(d_in, k)))
  assert read_order == list(range(m)) == write_order
  assert Home(d_in) == expected


@pytest.mark.parametrize('s,m,r,d', _PHASE_SWEEP)
def test_the_loops_follow_their_rules(s, m, r, d):
  """The forward phases, the 1f1b gradient loop and stream_io's columns on
  one (S, M, R): one test per row, not one per row and check."""
  _PhasesTileTheLoopAndHoldEveryUsefulCall(s, m, r, d)
  _BackwardWaveRunsEveryCallOnceByTheRule(s, m, r, d)
  _GradientPhasesHoldBothWaves(s, m, r, d)
  _StreamsDeliverInOrderAndEndHome(s, m, r, d)


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
