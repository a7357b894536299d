"""The arithmetic of backward_schedule='zero_bubble', and what it saves.

Zero bubble is the 1f1b gradient loop (OneFOneB) with each backward split
in two: B, the gradient of the stage's input, which the stage before waits
for, and W, the gradient of its weights, which nobody waits for. B runs
where 1f1b runs the whole backward; each stage's W's are deferred to the
W slots, ZeroBubble.SlotIterations: backward iterations in which every
stage runs its oldest deferred W (one W computation for all stages, as one
SPMD program computes it).

In one SPMD program the stages move in lockstep: an iteration lasts as long
as the work it computes, bubbles included. 1f1b computes F, B and W in each
of its T backward iterations, so S - 1 of them (R = 1) compute a W that no
stage needs. Zero bubble puts its R M slots where the stage that starts its
backward last (stage 0) has made its W's operands, so no slot is idle for
it. S=3, M=4, R=1 (entries: the microbatch whose B, then whose W, the
stage runs; '.' idle, '-' no slot)::

    backward iteration k   0    1    2    3    4    5
    stage 2                0,-  1,-  2,0  3,1  .,2  .,3
    stage 1                .,-  0,-  1,0  2,1  3,2  .,3
    stage 0                .,-  .,-  0,0  1,1  2,2  3,3

The two schedules' gradient loops, counted in lockstep (per stage: F the
forward wave's recomputation, B and W; TaskCosts), for T backward
iterations and R M calls a stage::

    1f1b         T F + T B + T W
    zero_bubble  T F + T B + R M W

so zero bubble's weighted bubble (the loop less one stage's R M (F + B +
W)) is (T - R M)(F + B): with F = B = W two thirds of 1f1b's. The rest, the
forward and backward waves' fill, no lockstep loop avoids. A partitioned
step whose devices each computed only their own stage's calls
(PerStageBranchSeconds) would get no further in this loop's order, except
where a circular schedule pads a segment with bubbles; the fill's bound,
h (S - 1) F (FillBound), would take another order of the waves.

A deferred W needs its call's stage input and output gradient until its
slot: each stage keeps them in a ring of `ring_size` entries (the longest
wait plus one): S - 1 waiting at most, h (S - 1) with delayed sends
(WaitingAtMost).
"""

import collections
import dataclasses
import functools
from typing import List, Optional, Tuple

from .one_f_one_b import GradientPhase
from .one_f_one_b import OneFOneB
from .work import Field

__all__ = [
    'TaskCosts',
    'WeightGradientWork',
    'ZeroBubble',
]


@dataclasses.dataclass(frozen=True)
class TaskCosts:
  """The time of one stage call's tasks, in any one unit: F (its forward,
  recomputed by the gradient loop's forward wave), B (its input gradient)
  and W (its weight gradient)."""
  forward: float = 1.0
  input_gradient: float = 1.0
  weight_gradient: float = 1.0

  @property
  def call(self):
    """One call's F + B + W."""
    return self.forward + self.input_gradient + self.weight_gradient


@dataclasses.dataclass(frozen=True)
class WeightGradientWork:
  """What one stage's W does in a slot (ZeroBubble.SlotRows): the W of the
  call whose B ran at backward iteration `made_at`, its operands in ring
  entry `ring_index` (valid False: nothing deferred, the stage idles)."""
  valid: bool = Field('bool')
  made_at: int = Field('int32')  # the backward iteration of its B
  ring_index: int = Field('int32')  # where B put its operands


class ZeroBubble:
  """Where zero bubble runs each stage's deferred W (see the module doc)."""

  def __init__(self, schedule: 'Schedule'):
    self.schedule = schedule
    self.one_f_one_b = OneFOneB(schedule)

  def BackwardCalls(self) -> List[List[int]]:
    """Per stage, the backward iterations whose B it runs on a microbatch
    (a valid BackwardWork), in order: each one's W is deferred."""
    return [list(stage) for stage in self._backward_calls]

  @functools.cached_property
  def _backward_calls(self):
    rows = self.one_f_one_b.BackwardRows()
    return tuple(tuple(k for k, row in enumerate(rows) if row[s].valid)
                 for s in range(self.schedule.num_stages))

  def SlotIterations(self) -> List[int]:
    """The backward iterations that run a W slot: slot n where every
    stage's n-th B has run (it runs after the B of its iteration)."""
    return list(self._slots)

  @functools.cached_property
  def _slots(self):
    calls = self._backward_calls
    return tuple(max(stage[n] for stage in calls)
                 for n in range(max(len(stage) for stage in calls)))

  @functools.cached_property
  def ring_size(self):
    """Deferred W operands each stage keeps: the longest wait plus one (B
    writes entry k % ring_size at backward iteration k)."""
    return 1 + max(slot - stage[n]
                   for n, slot in enumerate(self._slots)
                   for stage in self._backward_calls if n < len(stage))

  def RingIndex(self, backward_iteration):
    """The ring entry B of `backward_iteration` writes its W's operands
    to; no entry is written again before its slot reads it."""
    return backward_iteration % self.ring_size

  def WaitingAtMost(self):
    """The most W's a stage has waiting after a backward iteration's slot
    (what the ring holds beyond that iteration's own B)."""
    return max(
        sum(1 for b in stage if b <= k) -
        min(len(stage), sum(1 for slot in self._slots if slot <= k))
        for k in range(self.schedule.num_iterations)
        for stage in self._backward_calls)

  def SlotRows(self) -> List[Optional[Tuple[WeightGradientWork, ...]]]:
    """Per backward iteration k, the S stages' W (None: no slot in k)."""
    calls = self._backward_calls
    rows = [None] * self.schedule.num_iterations
    for n, k in enumerate(self._slots):
      rows[k] = tuple(
          WeightGradientWork(valid=True, made_at=stage[n],
                             ring_index=self.RingIndex(stage[n]))
          if n < len(stage) else
          WeightGradientWork(valid=False, made_at=0, ring_index=0)
          for stage in calls)
    return rows

  def Phases(self) -> List[GradientPhase]:
    """The gradient loop's phases: OneFOneB's, each cut where the W slots
    begin or end, so that a phase's iterations all run the same waves
    (names from WAVES, then 'weight' where each runs a slot)."""
    loop, slots = self.one_f_one_b, set(self._slots)
    phases = []
    for phase in loop.Phases():
      for j in range(phase.begin, phase.end):
        waves = phase.waves + (('weight',) if j - loop.delay in slots
                               else ())
        if phases and phases[-1].waves == waves and phases[-1].end == j:
          phases[-1] = dataclasses.replace(phases[-1], end=j + 1)
        else:
          phases.append(GradientPhase(j, j + 1, waves))
    return phases

  # What each schedule's gradient loop costs (see the module docstring).

  def UsefulSeconds(self, costs: TaskCosts):
    """One stage's work: R M calls' F + B + W."""
    sched = self.schedule
    return sched.num_microbatches * sched.circular_repeat * costs.call

  def OneFOneBSeconds(self, costs: TaskCosts):
    """The 1f1b gradient loop in lockstep: each backward iteration computes
    B and W, each forward-wave iteration F."""
    return self.schedule.num_iterations * costs.call

  def LockstepSeconds(self, costs: TaskCosts):
    """The zero-bubble gradient loop in lockstep: F and B as 1f1b, W only
    in its slots."""
    t = self.schedule.num_iterations
    return (t * (costs.forward + costs.input_gradient) +
            len(self._slots) * costs.weight_gradient)

  def PerStageBranchSeconds(self, costs: TaskCosts):
    """The zero-bubble gradient loop if each device computed only its own
    stage's calls (a per-device branch in the partitioned step): an
    iteration lasts as long as its busiest stage. Each stage runs a
    deferred W, oldest first, in the first iteration from its B on where
    it fits within that iteration's length, or where waiting longer would
    hold more than WaitingAtMost; the W's still waiting at the end run
    after the loop. A greedy placement: a bound from above of what such a
    step reaches."""
    rows, cap = self.one_f_one_b.Rows(), self.WaitingAtMost()
    waiting = [collections.deque() for _ in range(self.schedule.num_stages)]
    total = 0.0
    for row in rows:
      load = []
      for s, work in enumerate(row):
        load.append(_Valid(work.forward) * costs.forward)
        if _Valid(work.backward):
          load[s] += costs.input_gradient
          waiting[s].append(work)
        while len(waiting[s]) > cap:  # the ring is full: run one now
          waiting[s].popleft()
          load[s] += costs.weight_gradient
      length = max(load)
      for s in range(len(row)):
        while waiting[s] and load[s] + costs.weight_gradient <= length:
          waiting[s].popleft()
          load[s] += costs.weight_gradient
      total += length
    return total + max(len(w) for w in waiting) * costs.weight_gradient

  def FillBound(self, costs: TaskCosts):
    """The fill no schedule within one step avoids: the last stage's first
    call waits for h (S - 1) iterations' forwards."""
    sched = self.schedule
    return sched.hop * (sched.num_stages - 1) * costs.forward

  def Bubbles(self, costs: TaskCosts):
    """{name: weighted bubble} (each loop less one stage's work) of 1f1b,
    zero_bubble and zero_bubble with per-stage branches, and the fill
    bound beside them."""
    useful = self.UsefulSeconds(costs)
    return {'1f1b': self.OneFOneBSeconds(costs) - useful,
            'zero_bubble': self.LockstepSeconds(costs) - useful,
            'per-stage branches': self.PerStageBranchSeconds(costs) - useful,
            'fill bound': self.FillBound(costs)}


def _Valid(work):
  """Whether a wave's work is a call on a microbatch (None: not running)."""
  return work is not None and work.valid
