"""Schedule arithmetic of the pipeline: the one place it is computed.

Every function here is pure and duck-typed: it works on Python ints, on NumPy
arrays (tests and the schedule printer use these) and on TensorFlow int32
tensors (the layer uses these inside its loop), because it only uses `+ - * //
%`, comparisons and `&`. Nothing here builds a graph.

Notation: S = num_stages, M = num_microbatches, R = circular_repeat, T = number
of loop iterations. At iteration `i`, stage `s` works on the microbatch that
entered the pipeline `i - s` iterations earlier.

Linear schedule (R == 1): T = M + S - 1. Stage 0 reads microbatch `i` at
iteration `i`; the buffer shifts one stage per iteration. S=3, M=4::

    iteration   0  1  2  3  4  5
    stage 0     0  1  2  3  .  .
    stage 1     .  0  1  2  3  .
    stage 2     .  .  0  1  2  3      ('.' = bubble)

Circular schedule (R > 1): layer `r * S + s` is repeat `r` of stage `s`. The
microbatches are cut into segments of S; each segment cycles through the S
stages R times before the next one enters, so the buffer rotates (the last
stage feeds stage 0) and stage 0 reads fresh input only in the first S
iterations of every R * S block. A short last segment is padded, so
T = R * ceil(M / S) * S + S - 1. S=2, M=3, R=2 (cells are microbatch/repeat)::

    iteration     0    1    2    3    4    5    6    7    8
    stage 0     0/0  1/0  0/1  1/1  2/0    .  2/1    .    .
    stage 1       .  0/0  1/0  0/1  1/1  2/0    .  2/1    .

The rotating buffer needs no storage beyond [S, ...]: a microbatch leaving the
last stage at repeat r is exactly what stage 0 needs next, at repeat r + 1.

As a command (gpipe.schedule.text), prints the schedule (and with --out
draws it, see gpipe.schedule.plot):

    python -m gpipe.schedule --num_stages 4 --num_microbatches 8 \
        --circular_repeat 2 --out schedule.png

The command (`python -m gpipe.schedule`), whose modules load no
TensorFlow:

    text   the command line; a schedule printed as text
    plot   a schedule drawn (--out)
"""

import dataclasses
import numbers
from typing import Sequence, Set, Tuple

__all__ = [
    'Schedule',
    'Phase',
    'OneFOneB',
    'GradientPhase',
    'Streams',
    'ComputedSlots',
]

# Step seeds one body call may draw (each py_utils.GenerateStepSeedPair takes
# one) before its stream would run into the next (layer, microbatch)'s.
STEP_SEEDS_PER_CALL = 1 << 12


def _CeilDiv(a, b):
  return -(-a // b)


def IsInteger(value):
  """A Python or NumPy integer, not a bool (which Python counts as one)."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Phase:
  """Iterations [begin, end) of the loop, computing stages
  [first_stage, first_stage + num_stages) only (Schedule.Phases)."""
  begin: int
  end: int
  first_stage: int
  num_stages: int


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The static shape of a pipeline schedule.

  Attributes:
    num_stages: S, the number of pipeline stages (>= 1).
    num_microbatches: M, the number of microbatches (>= 1).
    circular_repeat: R, how many times each microbatch visits every stage.
  """
  num_stages: int
  num_microbatches: int
  circular_repeat: int = 1

  def __post_init__(self):
    for name in ('num_stages', 'num_microbatches', 'circular_repeat'):
      value = getattr(self, name)
      if not IsInteger(value) or value < 1:
        raise ValueError(f'{name} must be an integer >= 1, got {value!r}.')
      # NumPy integers are accepted and stored as plain ints.
      object.__setattr__(self, name, int(value))

  @property
  def circular(self):
    return self.circular_repeat > 1

  @property
  def num_layers(self):
    """Logical layers: S * R, in repeat-major order."""
    return self.num_stages * self.circular_repeat

  @property
  def num_padded_microbatches(self):
    """M rounded up to whole segments of S (circular), or M (linear)."""
    if not self.circular:
      return self.num_microbatches
    return _CeilDiv(self.num_microbatches, self.num_stages) * self.num_stages

  @property
  def num_iterations(self):
    """T: loop iterations, bubbles included."""
    return (self.circular_repeat * self.num_padded_microbatches +
            self.num_stages - 1)

  @property
  def bubble_fraction(self):
    """Share of (iteration, stage) slots that do no useful work."""
    useful = self.num_microbatches * self.circular_repeat
    return 1.0 - useful / self.num_iterations

  # -- Per (iteration, stage) quantities; duck-typed over ints/arrays/tensors.

  def Offset(self, iteration, stage):
    """Iterations since this stage's microbatch entered stage 0 (may be < 0)."""
    return iteration - stage

  def MicrobatchId(self, iteration, stage):
    """Microbatch processed by `stage` at `iteration` (meaningful if valid).

    Negative or >= M on bubbles; callers clamp before indexing with it.
    """
    t = self.Offset(iteration, stage)
    if not self.circular:
      return t
    s, r = self.num_stages, self.circular_repeat
    return (t // (r * s)) * s + t % s

  def RepeatId(self, iteration, stage):
    """Circular repeat that `stage` runs at `iteration` (0 when linear).

    Always in [0, R), bubbles included: safe to index with unclamped.
    """
    t = self.Offset(iteration, stage)
    if not self.circular:
      return t * 0
    return (t // self.num_stages) % self.circular_repeat

  def LayerId(self, iteration, stage):
    """Logical layer index repeat * S + stage."""
    return self.RepeatId(iteration, stage) * self.num_stages + stage

  def IsValid(self, iteration, stage):
    """True where `stage` does useful work at `iteration`, False on bubbles."""
    t = self.Offset(iteration, stage)
    in_range = (t >= 0) & (t < self.circular_repeat *
                           self.num_padded_microbatches)
    mb = self.MicrobatchId(iteration, stage)
    return in_range & (mb >= 0) & (mb < self.num_microbatches)

  def StageZeroReadsInput(self, iteration):
    """True where stage 0 takes a fresh microbatch instead of the buffer.

    Linear: always (the buffer shifts in zeros). Circular: in the first S
    iterations of each R * S block; otherwise it takes the last stage's output.
    """
    if not self.circular:
      return iteration >= 0
    return iteration % (self.circular_repeat * self.num_stages) < self.num_stages

  def StepSeedOffset(self, layer, microbatch):
    """Offset of the random stream of (logical layer, microbatch).

    The body's step seed for that pair is base + this offset, so its
    dropout masks depend only on the layer, the microbatch and the base
    seed: not on num_stages, the schedule or which device runs it.
    """
    return (layer * self.num_microbatches + microbatch) * STEP_SEEDS_PER_CALL

  def StageRow(self, iteration, stage):
    """What `stage` does at `iteration` (Python ints), by name:

        microbatch   its microbatch, clamped into [0, M) (bubbles: any)
        repeat       its circular repeat
        seed_offset  StepSeedOffset of its (layer, microbatch)
        valid        False on bubbles
        reads        whether it takes a fresh microbatch (stage 0 only)
    """
    microbatch = min(max(self.MicrobatchId(iteration, stage), 0),
                     self.num_microbatches - 1)
    return dict(
        microbatch=microbatch,
        repeat=self.RepeatId(iteration, stage),
        seed_offset=self.StepSeedOffset(self.LayerId(iteration, stage),
                                        microbatch),
        valid=bool(self.IsValid(iteration, stage)),
        reads=stage == 0 and bool(self.StageZeroReadsInput(iteration)))

  def StageTables(self):
    """{name: [T][S] table} of StageRow: the loop reads a row of each per
    iteration instead of computing it."""
    rows = [[self.StageRow(i, s) for s in range(self.num_stages)]
            for i in range(self.num_iterations)]
    return {name: [[cell[name] for cell in row] for row in rows]
            for name in rows[0][0]}

  def Phases(self):
    """Runs of iterations whose useful slots lie in fewer stages, as Phase.

    On one device every computed slot costs time, bubbles too. The first
    iterations only fill the pipeline from stage 0 and the last ones only
    drain it towards stage S - 1, so the loop computes those on the first
    (last) ceil(S / 2) stages alone; everything between on all S. Three
    phases at most: each is a loop of its own, traced once. S=4, M=4 ('#'
    computed, '.' a bubble not computed)::

        iteration  0 1 | 2 3 4 | 5 6
        stage 0    # # | # # # | . .
        stage 1    # # | # # # | . .
        stage 2    . . | # # # | # #
        stage 3    . . | # # # | # #
    """
    s, t = self.num_stages, self.num_iterations
    half = _CeilDiv(s, 2)
    if s == 1:
      return [Phase(0, t, 0, s)]
    useful = [[k for k in range(s) if self.IsValid(i, k)] for i in range(t)]
    fill = 0
    while fill < t and all(k < half for k in useful[fill]):
      fill += 1
    drain = t
    while drain > fill and all(k >= s - half for k in useful[drain - 1]):
      drain -= 1
    phases = [Phase(0, fill, 0, half), Phase(fill, drain, 0, s),
              Phase(drain, t, s - half, half)]
    return [p for p in phases if p.end > p.begin]

  def SlotsComputed(self, phases):
    """(iteration, stage) slots the loop computes when run in `phases`."""
    return len(ComputedSlots(phases))

  # -- Per microbatch quantities.

  def InputIteration(self, microbatch):
    """Iteration at which stage 0 reads `microbatch` (repeat 0)."""
    if not self.circular:
      return microbatch
    s, r = self.num_stages, self.circular_repeat
    return (microbatch // s) * r * s + microbatch % s

  def OutputIteration(self, microbatch):
    """Iteration at which the last stage finishes `microbatch` (last repeat)."""
    return (self.InputIteration(microbatch) +
            (self.circular_repeat - 1) * self.num_stages + self.num_stages - 1)

  def LayerIteration(self, microbatch, layer):
    """Iteration at which logical layer `layer` processes `microbatch`.

    Layer l = r * S + s runs on stage s: repeat r of a microbatch reaches
    stage 0 r * S iterations after the microbatch first did, and stage s
    s iterations after that.
    """
    return self.InputIteration(microbatch) + layer

  # -- Static index tables (Python lists) for padding and extraction.

  def StateMicrobatchPerSlot(self):
    """[T][S]: the microbatch whose per-stage state slot (i, s) holds.

    Slot (i, s) is what stage s reads and writes at iteration i: the state
    of the microbatch it works on then (any repeat); 0 on bubbles, whose
    slots are never written.
    """
    return [[
        self.MicrobatchId(i, s) if self.IsValid(i, s) else 0
        for s in range(self.num_stages)
    ] for i in range(self.num_iterations)]

  def InputIndexPerIteration(self):
    """For each iteration, the microbatch stage 0 reads, or M for none."""
    table = [self.num_microbatches] * self.num_iterations
    for m in range(self.num_microbatches):
      table[self.InputIteration(m)] = m
    return table

  def OutputIterations(self):
    """For each microbatch, the iteration whose last-stage output is final."""
    return [self.OutputIteration(m) for m in range(self.num_microbatches)]

  def OutputIndexPerIteration(self):
    """For each iteration, the microbatch the last stage finishes, or -1."""
    table = [-1] * self.num_iterations
    for m in range(self.num_microbatches):
      table[self.OutputIteration(m)] = m
    return table

  def Table(self):
    """[T][S] of (microbatch, repeat) tuples, or None on bubbles."""
    rows = []
    for i in range(self.num_iterations):
      row = []
      for s in range(self.num_stages):
        if self.IsValid(i, s):
          row.append((self.MicrobatchId(i, s), self.RepeatId(i, s)))
        else:
          row.append(None)
      rows.append(row)
    return rows


def ComputedSlots(phases: Sequence['Phase']) -> Set[Tuple[int, int]]:
  """The (iteration, stage) slots the phases compute, as a set."""
  return {(i, s) for p in phases for i in range(p.begin, p.end)
          for s in range(p.first_stage, p.first_stage + p.num_stages)}


@dataclasses.dataclass(frozen=True)
class GradientPhase:
  """Iterations [begin, end) of the 1f1b gradient loop and the waves they
  run (OneFOneB.Phases)."""
  begin: int
  end: int
  forward: bool
  backward: bool


class OneFOneB:
  """The arithmetic of the 1f1b gradient loop (gpipe.pipeline.one_f_one_b).

  The forward pass keeps nothing per iteration. Its gradient is one loop in
  forward order whose iteration j runs two waves over the S stages:

    forward wave   iteration j of the forward schedule again (j < T); each
                   stage pushes its input into its ring of `ring_size`;
    backward wave  each stage the backward of one layer call whose output
                   gradient has come back: stage s at backward step
                   k = j - delay takes the forward slot (k, S - 1 - s)
                   mirrored, i.e. its microbatch at repeat
                   R - 1 - RepeatId(k, S - 1 - s).

  With delay = R S - 1 the last layer's backward runs in the iteration that
  recomputes its forward, and every gradient reaches the layer before it
  one iteration later, one stage back (the last stage takes stage 0's, the
  previous repeat). S=3, M=4 (cells: forward wave's microbatch, backward
  wave's)::

      j            0   1   2   3   4   5   6   7
      stage 0    0,. 1,. 2,. 3,. .,0 .,1 .,2 .,3
      stage 1    .,. 0,. 1,. 2,0 3,1 .,2 .,3 .,.
      stage 2    .,. .,. 0,0 1,1 2,2 3,3 .,. .,.

  A stage input waits in the ring from its forward to its backward: at most
  2 R S - 1 iterations (layer 0), whatever M is.
  """

  def __init__(self, schedule: 'Schedule'):
    self.schedule = schedule

  @property
  def delay(self):
    """Iterations from the forward wave's to the backward wave's start."""
    return self.schedule.num_layers - 1

  @property
  def ring_size(self):
    """Stage inputs each stage keeps: the longest wait plus one."""
    return 2 * self.schedule.num_layers - 1

  @property
  def num_iterations(self):
    """Iterations of the gradient loop: T + delay."""
    return self.schedule.num_iterations + self.delay

  def Phases(self):
    """The loop's phases: forward wave only, both waves, backward only.

    Each is a loop of its own, so that no iteration computes a wave that no
    stage needs (T > delay always: M >= 1 microbatch, padded to S when
    circular).
    """
    t, d = self.schedule.num_iterations, self.delay
    phases = [GradientPhase(0, d, True, False), GradientPhase(d, t, True, True),
              GradientPhase(t, t + d, False, True)]
    return [p for p in phases if p.end > p.begin]

  def BackwardSlot(self, step, stage):
    """The forward iteration whose call of `stage` the backward wave runs
    at backward step `step` (iteration step + delay), or None on a bubble.
    """
    sched = self.schedule
    mirror = sched.num_stages - 1 - stage
    if not sched.IsValid(step, mirror):
      return None
    repeat = sched.circular_repeat - 1 - sched.RepeatId(step, mirror)
    layer = repeat * sched.num_stages + stage
    return sched.LayerIteration(sched.MicrobatchId(step, mirror), layer)

  def BackwardRow(self, step, stage):
    """What `stage` does at backward step `step`, by name: the forward
    StageRow of the call it differentiates, and

        iteration   that call's forward iteration (0 on bubbles)
        ring_slot   where the forward wave put its input
        last_layer  its output gradient is the layer's (d outputs)
        first_layer its input gradient is the layer's (d inputs)
    """
    sched = self.schedule
    iteration = self.BackwardSlot(step, stage)
    valid = iteration is not None
    iteration = iteration if valid else 0
    row = sched.StageRow(iteration, stage)
    layer = sched.LayerId(iteration, stage)
    row.update(
        valid=valid and row['valid'], iteration=iteration,
        ring_slot=iteration % self.ring_size,
        last_layer=valid and layer == sched.num_layers - 1,
        first_layer=valid and layer == 0)
    return row

  def BackwardTables(self):
    """{name: [T][S] table} of BackwardRow, one row per backward step."""
    rows = [[self.BackwardRow(k, s) for s in range(self.schedule.num_stages)]
            for k in range(self.schedule.num_iterations)]
    return {name: [[cell[name] for cell in row] for row in rows]
            for name in rows[0][0]}


class Streams:
  """Where stream_io keeps each microbatch (gpipe.pipeline.streamed_io.StreamedIo).

  A stream holds the [M, ...] inputs (outputs, their gradients) split over
  the stages: stage s keeps microbatches s K .. s K + K - 1 in its K =
  ceil(M / S) slots, slot k holding microbatches k, K + k, 2 K + k, ...
  from stage 0 up. The pipeline takes them in order at stage 0 (and gives
  them back in order at the last stage) by rotating one slot's column of
  [S] entries by one stage at a time.
  """

  def __init__(self, schedule: 'Schedule'):
    self.schedule = schedule

  @property
  def num_slots(self):
    """K: microbatches each stage keeps."""
    return _CeilDiv(self.schedule.num_microbatches, self.schedule.num_stages)

  @property
  def padded_microbatches(self):
    """S K: the stream's microbatch rows, padded past M."""
    return self.num_slots * self.schedule.num_stages

  def Slot(self, microbatch):
    return microbatch % self.num_slots

  def WritesPerSlot(self, slot):
    """How many of the M microbatches slot `slot` holds."""
    return len(range(slot, self.schedule.num_microbatches, self.num_slots))

  def FixupShifts(self):
    """Per slot, the extra rotations a written stream needs at the end:
    a slot written n < S times sits n places short of its home."""
    s = self.schedule.num_stages
    return [(s - self.WritesPerSlot(k)) % s for k in range(self.num_slots)]

  def ReadSlots(self):
    """Per forward iteration, the slot stage 0 reads (-1: none)."""
    return [-1 if m == self.schedule.num_microbatches else self.Slot(m)
            for m in self.schedule.InputIndexPerIteration()]

  def WriteSlots(self):
    """Per forward iteration, the slot the last stage's output goes to
    (-1: none)."""
    return [-1 if m < 0 else self.Slot(m)
            for m in self.schedule.OutputIndexPerIteration()]

