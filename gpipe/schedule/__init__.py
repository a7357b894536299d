"""Schedule arithmetic of the pipeline: the one place it is computed.

Every function here is pure and duck-typed: it works on Python ints, on NumPy
arrays (tests and the schedule printer use these) and on TensorFlow int32
tensors (the layer uses these inside its loop), because it only uses `+ - * //
%`, comparisons and `&`. Nothing here builds a graph.

Notation: S = num_stages, M = num_microbatches, R = circular_repeat, T = number
of loop iterations, h = hop, the iterations a microbatch takes from one stage
to the next (1; 2 with delayed sends). At iteration `i`, stage `s` works on
the microbatch that entered the pipeline `i - h s` iterations earlier.

Words, each with one meaning: a call is one stage's run of the body in one
iteration, the (iteration, stage) pair (a bubble: a call on no microbatch);
a row is what each stage does in one iteration (S StageWork), a table the
rows of all iterations; a slot is only stage s's share of an [S, ...]
tensor; a phase is iterations [begin, end) run as one loop.

Linear schedule (R == 1): T = M + S - 1. Stage 0 reads microbatch `i` at
iteration `i`; the buffer rotates one stage per iteration (the slot the
last stage wraps round to stage 0 is dropped for the fresh input). S=3,
M=4::

    iteration   0  1  2  3  4  5
    stage 0     0  1  2  3  .  .
    stage 1     .  0  1  2  3  .
    stage 2     .  .  0  1  2  3      ('.' = bubble)

Circular schedule (R > 1): layer `r * S + s` is repeat `r` of stage `s`. The
microbatches are cut into segments of S; each segment cycles through the S
stages R times before the next one enters, so the buffer rotates (the last
stage feeds stage 0) and stage 0 reads fresh input only in the first S
of the R * S iterations a segment spends in the stages. A short last
segment is padded, so T = R * ceil(M / S) * S + S - 1. S=2, M=3, R=2
(entries are microbatch/repeat)::

    iteration     0    1    2    3    4    5    6    7    8
    stage 0     0/0  1/0  0/1  1/1  2/0    .  2/1    .    .
    stage 1       .  0/0  1/0  0/1  1/1  2/0    .  2/1    .

The rotating buffer needs no storage beyond [S, ...]: a microbatch leaving the
last stage at repeat r is exactly what stage 0 needs next, at repeat r + 1.

Delayed sends (h = 2): what the stages make at iteration i is handed on
during iteration i + 1, beside that iteration's calls, and run at i + 2, so
the hand-off no longer sits between two iterations' calls. Everything above
holds with S replaced by h S where it counts iterations (segments of 2 S,
T = R ceil(M / 2S) 2S + 2(S - 1) circular). S=3, M=2::

    iteration   0  1  2  3  4  5
    stage 0     0  1  .  .  .  .
    stage 1     .  .  0  1  .  .
    stage 2     .  .  .  .  0  1

Besides this module, the package holds

    text         the schedule as text; the `python -m gpipe.schedule`
                 command
    plot         the schedule drawn (the command's --out)
    streams      where stream_io keeps each microbatch (Streams)
    zero_bubble  1f1b with each backward split into B and a deferred W
                 (ZeroBubble), and the bubbles both leave
    one_f_one_b  the 1f1b gradient loop's arithmetic (OneFOneB)
    work         what a stage does in an iteration (StageWork), as tables

none of which loads TensorFlow:

    python -m gpipe.schedule --num_stages 4 --num_microbatches 8 \
        --circular_repeat 2 --out schedule.png
"""

import dataclasses
import numbers
from typing import List, Sequence, Set, Tuple

from .one_f_one_b import BackwardWork
from .one_f_one_b import ForwardWaveWork
from .one_f_one_b import GradientPhase
from .one_f_one_b import GradientWork
from .one_f_one_b import OneFOneB
from .one_f_one_b import WAVES
from .work import FieldTables
from .work import StageWork
from .zero_bubble import TaskCosts
from .zero_bubble import WeightGradientWork
from .zero_bubble import ZeroBubble

__all__ = [
    'Schedule',
    'Phase',
    'StageWork',
    'OneFOneB',
    'ForwardWaveWork',
    'BackwardWork',
    'GradientWork',
    'GradientPhase',
    'ComputedCalls',
    'FieldTables',
    'ZeroBubble',
    'TaskCosts',
    'WeightGradientWork',
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
    delayed_sends: whether a stage's output is handed on one iteration
      after it is made (hop 2), beside the next iteration's calls.
  """
  num_stages: int
  num_microbatches: int
  circular_repeat: int = 1
  delayed_sends: bool = False

  def __post_init__(self):
    for name in ('num_stages', 'num_microbatches', 'circular_repeat'):
      value = getattr(self, name)
      if not IsInteger(value) or value < 1:
        raise ValueError(f'{name} must be an integer >= 1, got {value!r}.')
      # NumPy integers are accepted and stored as plain ints.
      object.__setattr__(self, name, int(value))
    if not isinstance(self.delayed_sends, bool):
      raise ValueError('delayed_sends must be True or False, got '
                       f'{self.delayed_sends!r}.')

  @classmethod
  def ForLayer(cls, params, num_microbatches):
    """The schedule of a pipelined layer's params for that many
    microbatches (its num_stages, circular_repeat and delayed_sends;
    Lingvo's own layer, which the planner plans too, has no
    delayed_sends: it hands on at once)."""
    return cls(params.num_stages, num_microbatches, params.circular_repeat,
               getattr(params, 'delayed_sends', False))

  @property
  def circular(self):
    return self.circular_repeat > 1

  @property
  def hop(self):
    """h: iterations from a microbatch's call on one stage to its call on
    the next (2 with delayed sends: one to compute, one to hand on)."""
    return 2 if self.delayed_sends else 1

  @property
  def segment(self):
    """Microbatches that enter together and cycle the stages as a group
    (circular): h S, the iterations one trip round the stages takes."""
    return self.hop * self.num_stages

  @property
  def num_layers(self):
    """Logical layers: S * R, in repeat-major order."""
    return self.num_stages * self.circular_repeat

  @property
  def num_padded_microbatches(self):
    """M rounded up to whole segments of h S (circular), or M (linear)."""
    if not self.circular:
      return self.num_microbatches
    return _CeilDiv(self.num_microbatches, self.segment) * self.segment

  @property
  def num_iterations(self):
    """T: loop iterations, bubbles included."""
    return (self.circular_repeat * self.num_padded_microbatches +
            self.hop * (self.num_stages - 1))

  @property
  def bubble_fraction(self):
    """Share of the calls ((iteration, stage) pairs) that are bubbles."""
    useful = self.num_microbatches * self.circular_repeat
    return 1.0 - useful / self.num_iterations

  # -- Per (iteration, stage) quantities; duck-typed over ints/arrays/tensors.

  def Offset(self, iteration, stage):
    """Iterations since this stage's microbatch entered stage 0 (may be < 0)."""
    return iteration - self.hop * stage

  def MicrobatchId(self, iteration, stage):
    """Microbatch processed by `stage` at `iteration` (meaningful if valid).

    Negative or >= M on bubbles; callers clamp before indexing with it.
    """
    t = self.Offset(iteration, stage)
    if not self.circular:
      return t
    s, r = self.segment, self.circular_repeat
    return (t // (r * s)) * s + t % s

  def RepeatId(self, iteration, stage):
    """Circular repeat that `stage` runs at `iteration` (0 when linear).

    Always in [0, R), bubbles included: safe to index with unclamped.
    """
    t = self.Offset(iteration, stage)
    if not self.circular:
      return t * 0
    return (t // self.segment) % self.circular_repeat

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

    Linear: always (the slot the rotation brings round from the last stage
    is dropped). Circular: in the first h S of the R h S iterations a
    segment spends in the stages; otherwise it takes the last stage's
    output.
    """
    if not self.circular:
      return iteration >= 0
    return iteration % (self.circular_repeat * self.segment) < self.segment

  def StepSeedOffset(self, layer, microbatch):
    """Offset of the random stream of (logical layer, microbatch).

    The body's step seed for that pair is base + this offset, so its
    dropout masks depend only on the layer, the microbatch and the base
    seed: not on num_stages, the schedule or which device runs it.
    """
    return (layer * self.num_microbatches + microbatch) * STEP_SEEDS_PER_CALL

  def WorkAt(self, iteration, stage):
    """What `stage` does at `iteration` (Python ints), a StageWork."""
    microbatch = min(max(self.MicrobatchId(iteration, stage), 0),
                     self.num_microbatches - 1)
    valid = bool(self.IsValid(iteration, stage))
    layer = self.LayerId(iteration, stage)
    return StageWork(
        microbatch=microbatch,
        repeat=self.RepeatId(iteration, stage),
        seed_offset=self.StepSeedOffset(self.LayerId(iteration, stage),
                                        microbatch),
        valid=valid,
        reads=stage == 0 and bool(self.StageZeroReadsInput(iteration)),
        first_layer=valid and layer == 0,
        last_layer=valid and layer == self.num_layers - 1)

  def Rows(self) -> List[Tuple[StageWork, ...]]:
    """The table: T rows of S StageWork, row i what iteration i runs."""
    return [tuple(self.WorkAt(i, s) for s in range(self.num_stages))
            for i in range(self.num_iterations)]

  def Phases(self):
    """Runs of iterations whose useful calls lie in fewer stages, as Phase.

    On one device every computed call costs time, bubbles too. The first
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

  def CallsComputed(self, phases):
    """Calls ((iteration, stage) pairs) the loop computes run in `phases`."""
    return len(ComputedCalls(phases))

  # -- Per microbatch quantities.

  def InputIteration(self, microbatch):
    """Iteration at which stage 0 reads `microbatch` (repeat 0)."""
    if not self.circular:
      return microbatch
    s, r = self.segment, self.circular_repeat
    return (microbatch // s) * r * s + microbatch % s

  def OutputIteration(self, microbatch):
    """Iteration at which the last stage finishes `microbatch` (last repeat)."""
    return self.LayerIteration(microbatch, self.num_layers - 1)

  def LayerIteration(self, microbatch, layer):
    """Iteration at which logical layer `layer` processes `microbatch`.

    Layer l = r * S + s runs on stage s: repeat r of a microbatch reaches
    stage 0 r h S iterations after the microbatch first did, and stage s
    h s iterations after that.
    """
    return self.InputIteration(microbatch) + self.hop * layer

  # -- Static index tables (Python lists) for padding and extraction.

  def StateMicrobatchPerCall(self):
    """[T][S]: the microbatch whose per-stage state call (i, s) reads.

    Call (i, s) reads and writes the state of the microbatch stage s works
    on at iteration i (any repeat); a bubble reads microbatch 0's and
    writes nothing.
    """
    return [[w.microbatch if w.valid else 0 for w in row]
            for row in self.Rows()]

  def OutputIterations(self):
    """For each microbatch, the iteration whose last-stage output is final."""
    return [self.OutputIteration(m) for m in range(self.num_microbatches)]

  def Table(self):
    """[T][S] of (microbatch, repeat) tuples, or None on bubbles."""
    return [[(w.microbatch, w.repeat) if w.valid else None for w in row]
            for row in self.Rows()]


def ComputedCalls(phases: Sequence['Phase']) -> Set[Tuple[int, int]]:
  """The calls ((iteration, stage) pairs) the phases compute, as a set."""
  return {(i, s) for p in phases for i in range(p.begin, p.end)
          for s in range(p.first_stage, p.first_stage + p.num_stages)}
