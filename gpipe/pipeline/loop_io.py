"""How the pipeline loop takes its inputs and hands back its outputs: the
interface every kind implements (LoopInputs, LoopIo), and the kinds that
keep the batch whole (WholeIo) or make it at stage 0 (MadeAtStageZero);
StreamedIo is gpipe.pipeline.streamed_io's, and the layer picks one
(gpipe.pipeline.loop_choices.IoKind).

Stage 0 reads each microbatch once, in order; the last stage finishes each
once, in order. Where the [M, ...] microbatches live between is the
`stream_io` param's choice:

    WholeIo (stream_io=False)          StreamedIo (stream_io=True)
    inputs   [M, mb, ...] on every     [K, S, mb, ...]: stage s keeps the
             device                    K = ceil(M / S) microbatches s K ..
                                       s K + K - 1 (gpipe.schedule.streams)
    read     microbatch m [mb, ...]:   a column [S, mb, ...] rotates one
             stage 0 takes it          stage towards stage 0 after stage
                                       0 read its entry
    outputs  [M, S, mb, ...]: the      [K, S, mb, ...] like the inputs: a
             last stage's slot of the  column rotates, the last stage's
             iterations that finish a  output goes to its last entry
             microbatch ([M, 1, mb,
             ...] on one device)

so no device of a streamed pipeline holds the whole batch: each holds
1/S of the inputs, outputs and (in the 1f1b gradient loop) their
gradients, which stream the same way (output gradients read at the last
stage, input gradients written at stage 0). A rotation is one
collective-permute of one microbatch per iteration.
"""

import abc

import tensorflow as tf

from gpipe.loops import tensor_lists
from gpipe import nest
from gpipe.pipeline import stage_ends
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap


class LoopInputs(abc.ABC):
  """How a loop reads its inputs and writes their gradients: what the
  forward loops (gpipe.pipeline.iteration.Iterate) and the 1f1b
  gradient loop ask of every kind. `held` is the inputs as the kind keeps
  them; `reading` and `writing` its loop state ([] where it carries none).
  """

  def __init__(self, spec):
    self._spec = spec
    self._place = spec.placement

  @property
  def placement(self):
    return self._place

  @abc.abstractmethod
  def Hold(self, mb_leaves):
    """The [M, mb, ...] input leaves as this kind keeps them."""

  @abc.abstractmethod
  def Filler(self, held):
    """The first buffer, [S, mb, ...] per leaf: real data in every slot."""

  @abc.abstractmethod
  def StageInputs(self, reads, buffer, fresh):
    """The stages' inputs [S, mb, ...]: buffer [S, mb, ...], stage 0
    taking what Read gave it where reads ([S] bools) says."""

  @abc.abstractmethod
  def StartReading(self, held):
    """The reading state before iteration 0."""

  @abc.abstractmethod
  def Read(self, held, reading, row):
    """(stage 0's fresh input per leaf, reading) at the iteration of `row`
    (the schedule's row, [S] per field)."""

  @abc.abstractmethod
  def StartWritingGradients(self, like):
    """The input gradients' writing state (1f1b's gradient loop)."""

  @abc.abstractmethod
  def WriteGradient(self, writing, row, d_inputs):
    """writing with stage 0's input gradient, where its layer is the first
    (row: the backward wave's row, [S] per field)."""

  @abc.abstractmethod
  def FinishWritingGradients(self, writing, like):
    """The [M, mb, ...] input gradients per leaf (None: none)."""


class LoopIo(LoopInputs):
  """LoopInputs, and how the loop writes its outputs and reads their
  gradients: the kinds that hand outputs back (WholeIo, StreamedIo)."""

  @abc.abstractmethod
  def Outputs(self, held):
    """The loop's written outputs -> [M, mb, ...] leaves."""

  @abc.abstractmethod
  def ReverseLoopParts(self, held, filler):
    """(what the reverse loop reads as theta, the state entries it
    carries, how to undo an iteration's changes to them, or None)."""

  @abc.abstractmethod
  def ReverseLoopOutputs(self, writing, row, outputs):
    """A reverse-loop iteration's outputs [S, mb, ...] handed to the io:
    (writing after it, what the iteration keeps as extras)."""

  @abc.abstractmethod
  def ReverseHeldOutputs(self, kept, writing):
    """The reverse loop's outputs as Outputs takes them."""

  @abc.abstractmethod
  def StartWriting(self, like):
    """The outputs' writing state before iteration 0."""

  @abc.abstractmethod
  def Write(self, writing, row, outputs):
    """writing with the last stage's outputs [S, mb, ...] of the row's
    iteration, where it finishes a microbatch (row.last_layer)."""

  @abc.abstractmethod
  def FinishWriting(self, writing, like):
    """The written outputs, as Outputs takes them."""

  @abc.abstractmethod
  def StartReadingGradients(self, d_held):
    """The output gradients' reading state (1f1b's gradient loop)."""

  @abc.abstractmethod
  def ReadGradient(self, reading, row):
    """(each leaf's output gradient [S or 1, mb, ...] for the call the
    last stage differentiates, reading)."""


class WholeIo(LoopIo):
  """stream_io=False: the [M, ...] inputs and outputs on every device."""

  def StageInputs(self, reads, buffer, fresh):
    """buffer [S, mb, ...], stage 0 taking fresh [mb, ...] where reads."""
    return WithFreshMicrobatch(reads, buffer, fresh,
                                               self._place.splits_stage_dim)

  def Hold(self, mb_leaves):
    """The [M, ...] input leaves as the loop reads them."""
    return [self._place.ReplicateLoopDim(x) for x in mb_leaves]

  def Filler(self, held):
    """The first buffer [S, ...] per leaf: real data in every slot."""
    return [self._place.SplitStages(
        BubbleFiller(x, self._spec.schedule.num_stages))
            for x in held]

  def Outputs(self, held):
    """[M, S, ...] finished stage outputs ([M, 1, ...] on a whole stage
    dim: _KeptOfOutput) -> [M, ...] leaves."""
    return [self._place.ReplicateLoopDim(
        LastStageOutputs(x, self._place)) for x in held]

  def _KeptOfOutput(self, x):
    """What is kept of an [S, ...] output: every slot split over devices
    (each device keeps its own, the last stage's taken out by an all-reduce:
    LastStageOutputs), the last slot alone [1, ...] on a whole stage dim."""
    return x if self._place.splits_stage_dim else x[-1:]

  def _KeptOfInputGradient(self, x):
    """What is kept of an [S, ...] input gradient: as _KeptOfOutput, stage
    0's slot alone on a whole stage dim."""
    return x if self._place.splits_stage_dim else x[:1]

  # -- The reverse schedule's loop (gpipe.pipeline.pipeline_loop, via
  # recurrent).

  def ReverseLoopParts(self, held, filler):
    """(what the loop reads as theta, the state entries it carries, how to
    undo an iteration's changes to them): here the microbatches, read one
    an iteration, and no state; the outputs leave as the loop's kept
    outputs."""
    del filler
    return held, NestedMap(reading=[], writing=[]), None

  def ReverseLoopOutputs(self, writing, row, outputs):
    """(writing, unchanged: there is none, the last stage's outputs kept
    as extras: recurrent.Kept keeps those of the iterations that finish a
    microbatch, which ReverseHeldOutputs hands on)."""
    del row
    return writing, [self._KeptOfOutput(o) for o in outputs]

  def ReverseHeldOutputs(self, kept, writing):
    del writing
    return kept

  # -- The forward loop (the 1f1b pass and its gradient's forward wave).

  def StartReading(self, held):
    del held
    return []

  def Read(self, held, reading, row):
    """(stage 0's fresh input per leaf, reading) at the row's iteration."""
    return [self._place.ReplicateOverStages(
        StageZeroInput(x, row, self._place.splits_stage_dim))
            for x in held], reading

  def StartWriting(self, like):
    """Kept outputs [M + 1, S, ...] per leaf (entry M: iterations that
    finish none; [M + 1, 1, ...] on a whole stage dim), as TensorLists."""
    return [tensor_lists.Reserve(self._KeptOfOutput(x),
                                 self._spec.schedule.num_microbatches + 1)
            for x in like]

  def Write(self, writing, row, outputs):
    num_mb = self._spec.schedule.num_microbatches
    m = tf.where(row.last_layer[-1], row.microbatch[-1], num_mb)  # M: none
    return [tensor_lists.SetEntry(l, m, self._KeptOfOutput(o))
            for l, o in zip(writing, outputs)]

  def FinishWriting(self, writing, like):
    num_mb = self._spec.schedule.num_microbatches
    return [self._place.SplitStages(
        tensor_lists.Stack(l, self._KeptOfOutput(x), num_mb + 1)[:num_mb], 1)
            for l, x in zip(writing, like)]

  # -- The 1f1b backward wave.

  def StartReadingGradients(self, d_held):
    return [self._place.SplitStages(d, 1) for d in d_held]

  def ReadGradient(self, reading, row):
    """(d outputs per leaf [S, ...] or, on a whole stage dim, [1, ...],
    reading): the last stage's entry is the output gradient of the
    microbatch it differentiates, if its layer is the last."""
    m = row.microbatch[-1]
    return [self._place.SplitStages(tf.gather(d, m)) for d in reading], reading

  def StartWritingGradients(self, like):
    return [tensor_lists.Reserve(self._KeptOfInputGradient(x),
                                 self._spec.schedule.num_microbatches + 1)
            for x in like]

  def WriteGradient(self, writing, row, d_inputs):
    """Stage 0's input gradient, where its layer is the first."""
    num_mb = self._spec.schedule.num_microbatches
    m = tf.where(row.first_layer[0], row.microbatch[0], num_mb)
    return [tensor_lists.SetEntry(l, m, self._KeptOfInputGradient(d))
            for l, d in zip(writing, d_inputs)]

  def FinishWritingGradients(self, writing, like):
    """The [M, ...] input gradients (stage 0's slot, on every device)."""
    num_mb = self._spec.schedule.num_microbatches
    return [
        self._place.ReplicateLoopDim(
            self._place.SplitStages(
                tensor_lists.Stack(l, self._KeptOfInputGradient(x), num_mb + 1),
                1)[:num_mb, 0])
        for l, x in zip(writing, like)
    ]


class MadeAtStageZero(LoopInputs):
  """With a FirstStageInput (gpipe.pipeline.stage_ends): stage 0 makes each
  microbatch's inputs inside the loop's cell, from per-example inputs the
  cell reads by microbatch, so nothing is read here, no input gradient is
  written (it goes into the first stage's weights) and, with a
  LastStageLoss, no output is written either. `held` is one
  microbatch's inputs [1, ...] per leaf, as the first stage makes them:
  the buffer's first value (real data) and stage 0's stand-in read, which
  the cell replaces."""

  def StageInputs(self, reads, buffer, fresh):
    """buffer [S, mb, ...], stage 0 taking its stand-in zeros (fresh
    [S, mb, ...]) where reads: the cell makes the real ones."""
    return WithFreshColumn(reads, buffer, fresh)

  def Hold(self, mb_leaves):
    return [tf.stop_gradient(x) for x in mb_leaves]

  def Filler(self, held):
    spec = self._spec
    return stage_ends.FirstStageFiller(spec.first_stage, held, spec.runner,
                                       self._place, spec.schedule.num_stages)

  def StartReading(self, held):
    del held
    return []

  def Read(self, held, reading, row):
    """Zeros, each stage's [S, ...] (the cell makes stage 0's input where
    it reads one; a constant needs no collective)."""
    del row
    num_stages = self._spec.schedule.num_stages
    return [self._place.SplitStages(
        tf.zeros([num_stages] + x.shape.as_list()[1:], x.dtype))
            for x in held], reading

  def StartWritingGradients(self, like):
    del like
    return []

  def WriteGradient(self, writing, row, d_inputs):
    del row, d_inputs
    return writing

  def FinishWritingGradients(self, writing, like):
    del writing
    return [None for _ in like]


# -- Stage 0's input and the first buffer (WholeIo's): real data, read
# inside the loop.


def StageZeroInput(x, row, split=True):
  """[M, ...] -> [...]: what stage 0 reads at the iteration of `row` (the
  schedule's row, [S] per field): microbatch row.microbatch[0] where stage
  0 runs its first layer (row.first_layer[0]).

  Read inside the loop, so that no [T, ...] copy of the inputs is ever
  made. An iteration where stage 0 reads no fresh microbatch (bubbles, and
  the rotations of a circular schedule) gets a copy of microbatch 0, cut
  from the gradient: bubbles compute on real data and their results are
  dropped, so a body that is only finite on real data stays finite (not
  zeros, on which a body dividing by its input would make Inf and NaN
  gradients). `split`: whether the pipeline's stage dim is split over
  devices (the placement's splits_stage_dim; see _ReadMicrobatch).
  """
  if not nest.IsTensor(x):
    return x
  reads = row.first_layer[0]
  m = row.microbatch[0]
  return _ReadMicrobatch(x, tf.where(reads, m, 0), tf.where(reads, m, -1),
                         split)


def _ReadMicrobatch(x, m, grad_m, split):
  """x[m] of x [M, ...]; its gradient goes to microbatch `grad_m` of x
  (none if -1).

  Split over devices, the gradient is built as a product with a one-hot
  mask, not TensorFlow's scatter into zeros: XLA's lowering merges equal
  constants of a loop body, and zeros shaped like a microbatch would be
  shared with the stage body's own zeros inside its manual-sharding region,
  a mix the SPMD partitioner aborts on (e.g. a circular body's [R, d] bias
  gradient with 2-example microbatches of width d and R = 2). Unsplit there
  is no such region, and a scatter-add into zeros lets XLA add the
  microbatch into the loop's gradient sum in place, where the product
  writes all M every iteration.
  """

  @tf.custom_gradient
  def Read(x):

    def Grad(dy):
      if not split:
        real = tf.cast(grad_m >= 0, dy.dtype)
        return tf.tensor_scatter_nd_add(
            tf.zeros(py_utils.GetShape(x), dy.dtype),
            tf.reshape(tf.maximum(grad_m, 0), [1, 1]), (dy * real)[None])
      num_mb = py_utils.GetShape(x)[0]
      mask = tf.cast(tf.equal(tf.range(num_mb), grad_m), dy.dtype)
      return tf.reshape(mask, [num_mb] + [1] * dy.shape.rank) * dy[None]

    return tf.gather(x, m), Grad

  return Read(x)


def BubbleFiller(x, num_stages):
  """The initial buffer [S, ...]: microbatch 0 of x ([M, ...]) in every slot.

  What the stages work on before the first microbatch reaches them; their
  results are discarded, so any real data will do (zeros would not: see
  StageZeroInput).
  """
  return tf.stop_gradient(
      tf.broadcast_to(x[:1], [num_stages] + py_utils.GetShape(x)[1:]))


# The stages' inputs: the rotated buffer, stage 0 maybe a fresh input.
#
# The carried buffer is last iteration's outputs already rotated by one
# stage (see RotateStages): slot s holds what stage s - 1 produced, and slot
# 0 what the last stage produced. Stage 0 takes the fresh microbatch
# whenever the schedule says it reads one: always when linear (the wrapped
# slot is dropped), in the first S of a segment's R * S iterations when
# circular (otherwise it keeps the wrapped slot: the microbatch's next
# repeat). `reads` ([S] bools, each stage's StageWork.reads in the schedule's
# row) says where. The
# loop io says which of the two the fresh input is (its StageInputs).


def WithFreshColumn(reads, rotated, column):
  """rotated [S, mb, ...] with slot s replaced by column[s] where reads[s]:
  each stage has its own fresh entry (a stream's column, [S, mb, ...])."""
  mask = tf.reshape(reads, [-1] + [1] * (rotated.shape.rank - 1))
  return tf.where(mask, column, rotated)


def WithFreshMicrobatch(reads, rotated, microbatch, split):
  """rotated [S, mb, ...] with slot s replaced by `microbatch` [mb, ...]
  (every stage's the same) where reads[s]. `split`: whether the stage dim
  is split over devices (the placement's splits_stage_dim)."""
  return _SelectFresh(reads, microbatch, rotated, split)


def _SelectFresh(reads, fresh, rotated, split):
  """Slot s of `rotated` ([S, ...]) replaced by `fresh` where reads[s].

  Split over devices, the gradient is written with masks and a contraction
  over the stage dim (an all-reduce), not TensorFlow's: its sum over the
  broadcast stage dim is a reduce whose zero initial value XLA's lowering
  shares with the stage body's own reductions inside the manual-sharding
  region, and the SPMD partitioner then aborts resharding it (seen with
  1-example microbatches). With the stage dim whole that region does not exist
  and the sum is a plain reduce: XLA:CPU runs the contraction over a
  few stages as a dot, which is cheap
  (docs/benchmarks.md#measured-behind-the-codes-choices).
  """

  @tf.custom_gradient
  def Select(fresh, rotated):
    mask = tf.reshape(reads, [-1] + [1] * (rotated.shape.rank - 1))
    shape = py_utils.GetShape(rotated)

    def Grad(dy):
      kept = tf.cast(tf.logical_not(mask), dy.dtype)
      if split:
        taken = tf.tensordot(tf.cast(reads, dy.dtype), dy, axes=[[0], [0]])
      else:
        taken = tf.reduce_sum(tf.where(mask, dy, tf.zeros_like(dy)), 0)
      return taken, dy * kept

    return tf.where(mask, tf.broadcast_to(fresh[None], shape), rotated), Grad

  return Select(fresh, rotated)


def LastStageOutputs(finished, place):
  """[M, S, ...] stage outputs of the iterations that finish each
  microbatch -> [M, ...]: the last stage's slot.

  Taken as a sum over the stage dim of the slot masked (exact: the other
  slots add zeros), which partitions into one all-reduce from the devices'
  own slots; a slice of the last slot would first move it to device 0.
  The gradient is the slot's gradient placed in the last slot of zeros,
  split over the stages like the outputs: each device builds only its own
  [M, 1, ...] part (a plain slice's gradient, a pad of the replicated
  gradient, would be built whole, [M, S, ...], on every device).
  """
  finished = place.SplitStages(finished, 1)
  num_stages = finished.shape.as_list()[1]
  is_last = tf.reshape(tf.equal(tf.range(num_stages), num_stages - 1),
                       [1, num_stages] + [1] * (finished.shape.rank - 2))

  @tf.custom_gradient
  def LastSlot(x):

    def Grad(dy):
      return place.SplitStages(
          tf.where(is_last, dy[:, None], tf.zeros([], dy.dtype)), 1)

    return tf.reduce_sum(tf.where(is_last, x, tf.zeros([], x.dtype)),
                         axis=1), Grad

  return LastSlot(finished)


def IsStage(num_stages, stage, like):
  """[S, 1, ...] bools broadcasting against `like`: True at `stage`."""
  return tf.reshape(tf.equal(tf.range(num_stages), stage),
                    [num_stages] + [1] * (like.shape.rank - 1))
