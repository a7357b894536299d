"""The arithmetic of the 1f1b gradient loop (OneFOneB), in pure Python.

It reads a gpipe.schedule.Schedule passed in and imports nothing of gpipe
but the schedule's work types (gpipe.schedule.work), so that it loads with
the schedule's arithmetic, without TensorFlow.
"""

import dataclasses
from typing import List, Optional, Tuple

from .work import Field
from .work import StageWork

__all__ = [
    'OneFOneB',
    'ForwardWaveWork',
    'BackwardWork',
    'GradientWork',
    'GradientPhase',
]


WAVES = ('forward', 'backward')


@dataclasses.dataclass(frozen=True)
class ForwardWaveWork(StageWork):
  """What one stage's forward wave does in iteration j of the 1f1b
  gradient loop (OneFOneB.ForwardWaveRows): the forward loop's StageWork of
  iteration j, and the ring entry its input goes to."""
  ring_index: int = Field('int32')  # the same for every stage of a row


@dataclasses.dataclass(frozen=True)
class BackwardWork(StageWork):
  """What one stage's backward wave does in one iteration of the 1f1b
  gradient loop (OneFOneB.BackwardRows): the StageWork of the forward call
  it differentiates (valid False on a bubble), and where to find that
  call's input and which gradients are the layer's."""
  iteration: int = Field('int32')  # the call's forward iteration (bubble: 0)
  ring_index: int = Field('int32')  # where the forward wave put its input
  # (first_layer, last_layer: StageWork's, the call's: its input gradient,
  # its output gradient, is the layer's.)


@dataclasses.dataclass(frozen=True)
class GradientWork:
  """What one stage does in iteration j of the 1f1b gradient loop
  (OneFOneB.Rows): each wave's work, None where that wave does not run in
  j (a wave that runs may still hand the stage a bubble). Which waves an
  iteration runs is read off these, so the phases follow from the table
  rather than from flags of their own (OneFOneB.Phases)."""
  forward: Optional[StageWork]
  backward: Optional[BackwardWork]

  @property
  def waves(self) -> Tuple[str, ...]:
    """The names of the waves that run, in WAVES order."""
    return tuple(w for w in WAVES if getattr(self, w) is not None)


@dataclasses.dataclass(frozen=True)
class GradientPhase:
  """Iterations [begin, end) of the 1f1b gradient loop, which all run the
  same waves (names from WAVES; OneFOneB.Phases)."""
  begin: int
  end: int
  waves: Tuple[str, ...]


class OneFOneB:
  """The arithmetic of the 1f1b gradient loop (gpipe.pipeline.one_f_one_b).

  The forward pass keeps nothing per iteration. Its gradient is one loop in
  forward order whose iteration j runs two waves over the S stages:

    forward wave   iteration j of the forward schedule again (j < T); each
                   stage pushes its input into its ring of `ring_size`;
    backward wave  each stage the backward of one layer call whose output
                   gradient has come back: stage s at backward iteration
                   k = j - delay takes the forward call (k, S - 1 - s)
                   mirrored, i.e. its microbatch at repeat
                   R - 1 - RepeatId(k, S - 1 - s).

  With delay = h (R S - 1) the last layer's backward runs in the iteration
  that recomputes its forward, and every gradient reaches the layer before
  it h iterations later, one stage back (the last stage takes stage 0's,
  the previous repeat). S=3, M=4 (entries: forward wave's microbatch, backward
  wave's)::

      j            0   1   2   3   4   5   6   7
      stage 0    0,. 1,. 2,. 3,. .,0 .,1 .,2 .,3
      stage 1    .,. 0,. 1,. 2,0 3,1 .,2 .,3 .,.
      stage 2    .,. .,. 0,0 1,1 2,2 3,3 .,. .,.

  A stage input waits in the ring from its forward to its backward: at most
  2 h (R S - 1) iterations (layer 0), whatever M is.
  """

  def __init__(self, schedule: 'Schedule'):
    self.schedule = schedule

  @property
  def delay(self):
    """Iterations from the forward wave's to the backward wave's start."""
    return self.schedule.hop * (self.schedule.num_layers - 1)

  @property
  def ring_size(self):
    """Stage inputs each stage keeps: the longest wait plus one."""
    return 2 * self.delay + 1

  @property
  def num_iterations(self):
    """Iterations of the gradient loop: T + delay."""
    return self.schedule.num_iterations + self.delay

  def RingIndex(self, iteration):
    """The ring entry of a stage input of forward iteration `iteration`:
    the forward wave writes it there, the backward wave reads it back; no
    entry is written again before its backward (ring_size)."""
    return iteration % self.ring_size

  def WorkAt(self, j, stage):
    """What `stage` does in iteration j, a GradientWork: the forward wave
    runs iteration j of the forward loop (j < T), the backward wave
    backward iteration k = j - delay (0 <= k < T)."""
    t, k = self.schedule.num_iterations, j - self.delay
    return GradientWork(
        forward=self.schedule.WorkAt(j, stage) if j < t else None,
        backward=self.BackwardWorkAt(k, stage) if 0 <= k < t else None)

  def Rows(self) -> List[Tuple[GradientWork, ...]]:
    """The gradient loop's table: a row of S GradientWork per iteration."""
    return [tuple(self.WorkAt(j, s) for s in range(self.schedule.num_stages))
            for j in range(self.num_iterations)]

  def Phases(self):
    """The loop's phases: each run of iterations whose rows run the same
    waves (forward wave only, both, backward only), from Rows.

    Each is a loop of its own, so that no iteration computes a wave that no
    stage needs (T > delay always: M >= 1 microbatch, padded to S when
    circular).
    """
    phases = []
    for j, row in enumerate(self.Rows()):
      waves = tuple(w for w in WAVES if any(w in work.waves for work in row))
      if phases and phases[-1].waves == waves:
        phases[-1] = dataclasses.replace(phases[-1], end=j + 1)
      else:
        phases.append(GradientPhase(j, j + 1, waves))
    return phases

  def BackwardIteration(self, k, stage):
    """The forward iteration whose call of `stage` the backward wave runs
    at backward iteration k (iteration k + delay), or None on a bubble."""
    sched = self.schedule
    mirror = sched.num_stages - 1 - stage
    if not sched.IsValid(k, mirror):
      return None
    repeat = sched.circular_repeat - 1 - sched.RepeatId(k, mirror)
    layer = repeat * sched.num_stages + stage
    return sched.LayerIteration(sched.MicrobatchId(k, mirror), layer)

  def BackwardWorkAt(self, k, stage):
    """What `stage`'s backward wave does at backward iteration k, a
    BackwardWork."""
    sched = self.schedule
    iteration = self.BackwardIteration(k, stage)
    valid = iteration is not None
    iteration = iteration if valid else 0
    work = sched.WorkAt(iteration, stage)
    layer = sched.LayerId(iteration, stage)
    return BackwardWork(
        **dict(vars(work), valid=valid and work.valid,
               last_layer=valid and layer == sched.num_layers - 1,
               first_layer=valid and layer == 0),
        iteration=iteration, ring_index=self.RingIndex(iteration))

  def ForwardWaveRows(self) -> List[Tuple[ForwardWaveWork, ...]]:
    """The forward wave's table: the forward loop's rows (j < T), each
    work with its ring entry."""
    return [tuple(ForwardWaveWork(**vars(work), ring_index=self.RingIndex(j))
                  for work in row)
            for j, row in enumerate(self.schedule.Rows())]

  def BackwardRows(self) -> List[Tuple[BackwardWork, ...]]:
    """The backward wave's table: a row of S BackwardWork per backward
    iteration k, 0 <= k < T."""
    return [tuple(self.BackwardWorkAt(k, s)
                  for s in range(self.schedule.num_stages))
            for k in range(self.schedule.num_iterations)]

