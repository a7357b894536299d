"""How the pipeline loop takes its inputs and hands back its outputs: the
interface every kind implements (LoopInputs, LoopIo), and the kinds that
keep the batch whole (WholeIo) or make it at stage 0 (MadeAtStageZero);
StreamedIo is gpipe.pipeline.streamed_io's, and gpipe.pipeline.loop_spec.Io
picks one.

Stage 0 reads each microbatch once, in order; the last stage finishes each
once, in order. Where the [M, ...] microbatches live between is the
`stream_io` param's choice:

    WholeIo (stream_io=False)          StreamedIo (stream_io=True)
    inputs   [M, mb, ...] on every     [K, S, mb, ...]: stage s keeps the
             device                    K = ceil(M / S) microbatches s K ..
                                       s K + K - 1 (gpipe.schedule.streams)
    read     row i [mb, ...], stage 0  a slot's column [S, mb, ...] rotates
             takes it                  one stage towards stage 0 after
                                       stage 0 read its entry
    outputs  [M, S, mb, ...]: the      [K, S, mb, ...] like the inputs: a
             last stage's slot of the  slot's column rotates, the last
             iterations that finish a  stage's output goes to its last
             microbatch ([M, 1, mb,    entry
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
from gpipe import microbatch
from gpipe.pipeline import rotating_buffer
from gpipe.pipeline import stage_ends
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap


def Constant(table):
  return tf.constant(table, tf.int32)


def IsStage(num_stages, stage, like):
  """[S, 1, ...] bools broadcasting against `like`: True at `stage`."""
  return tf.reshape(tf.equal(tf.range(num_stages), stage),
                    [num_stages] + [1] * (like.shape.rank - 1))


class LoopInputs(abc.ABC):
  """How a loop reads its inputs and writes their gradients: what the
  forward loops (gpipe.pipeline.rotating_buffer.Step) and the 1f1b
  gradient loop ask of every kind. `native` is the inputs as the kind keeps
  them; `reading` and `writing` its loop state ([] where it carries none).
  """

  def __init__(self, spec):
    self._spec = spec
    self._place = spec.placement

  @property
  def placement(self):
    return self._place

  @abc.abstractmethod
  def ToNative(self, mb_leaves):
    """The [M, mb, ...] input leaves as this kind keeps them."""

  @abc.abstractmethod
  def Filler(self, native):
    """The first buffer, [S, mb, ...] per leaf: real data in every slot."""

  @abc.abstractmethod
  def StageInputs(self, reads, buffer, fresh):
    """The stages' inputs [S, mb, ...]: buffer [S, mb, ...], stage 0
    taking what Read gave it where reads ([S] bools) says."""

  @abc.abstractmethod
  def StartReading(self, native):
    """The reading state before iteration 0."""

  @abc.abstractmethod
  def Read(self, native, reading, iteration):
    """(stage 0's fresh input per leaf, reading) at `iteration`."""

  @abc.abstractmethod
  def StartWritingGradients(self, like):
    """The input gradients' writing state (1f1b's gradient loop)."""

  @abc.abstractmethod
  def WriteGradient(self, writing, rows, d_inputs):
    """writing with stage 0's input gradient, where its layer is the first
    (rows: the backward table's row)."""

  @abc.abstractmethod
  def FinishWritingGradients(self, writing, like):
    """The [M, mb, ...] input gradients per leaf (None: none)."""


class LoopIo(LoopInputs):
  """LoopInputs, and how the loop writes its outputs and reads their
  gradients: the kinds that hand outputs back (WholeIo, StreamedIo)."""

  @abc.abstractmethod
  def Outputs(self, native):
    """The loop's written outputs -> [M, mb, ...] leaves."""

  @abc.abstractmethod
  def ReverseLoopParts(self, native, filler):
    """(what the reverse loop reads as theta, the state entries it
    carries, how to undo an iteration's changes to them, or None)."""

  @abc.abstractmethod
  def KeptOutputs(self, outputs):
    """What a reverse-loop iteration keeps as extras for the outputs."""

  @abc.abstractmethod
  def ReverseNativeOutputs(self, kept_rows, writing):
    """The reverse loop's outputs as Outputs takes them."""

  @abc.abstractmethod
  def StartWriting(self, like):
    """The outputs' writing state before iteration 0."""

  @abc.abstractmethod
  def Write(self, writing, iteration, outputs):
    """writing with the last stage's outputs [S, mb, ...] of `iteration`,
    where it finishes a microbatch."""

  @abc.abstractmethod
  def FinishWriting(self, writing, like):
    """The written outputs, as Outputs takes them."""

  @abc.abstractmethod
  def StartReadingGradients(self, d_native):
    """The output gradients' reading state (1f1b's gradient loop)."""

  @abc.abstractmethod
  def ReadGradient(self, reading, rows):
    """(each leaf's output gradient [S or 1, mb, ...] for the call the
    last stage differentiates, reading)."""


class WholeIo(LoopIo):
  """stream_io=False: the [M, ...] inputs and outputs on every device."""

  def StageInputs(self, reads, buffer, fresh):
    """buffer [S, mb, ...], stage 0 taking fresh [mb, ...] where reads."""
    return rotating_buffer.WithFreshMicrobatch(reads, buffer, fresh,
                                               self._place.splits_stage_dim)

  def ToNative(self, mb_leaves):
    """The [M, ...] input leaves as the loop reads them."""
    return [self._place.ReplicateLoopDim(x) for x in mb_leaves]

  def Filler(self, native):
    """The first buffer [S, ...] per leaf: real data in every slot."""
    return [self._place.SplitStages(
        microbatch.BubbleFiller(x, self._spec.schedule.num_stages))
            for x in native]

  def Outputs(self, native):
    """[M, S, ...] finished stage outputs ([M, 1, ...] on a whole stage
    dim: _LastSlot) -> [M, ...] leaves."""
    return [self._place.ReplicateLoopDim(
        rotating_buffer.LastStageOutputs(x, self._place)) for x in native]

  def _LastSlot(self, x):
    """What is kept of an [S, ...] output: every slot split over devices
    (each device keeps its own, the last stage's taken out by an all-reduce:
    LastStageOutputs), the last slot alone [1, ...] on a whole stage dim."""
    return x if self._place.splits_stage_dim else x[-1:]

  def _FirstSlot(self, x):
    """What is kept of an [S, ...] input gradient: as _LastSlot, stage
    0's slot alone on a whole stage dim."""
    return x if self._place.splits_stage_dim else x[:1]

  # -- The reverse schedule's loop (gpipe.pipeline.pipeline_loop, via
  # recurrent).

  def ReverseLoopParts(self, native, filler):
    """(what the loop reads as theta, the state entries it carries, how to
    undo an iteration's changes to them): here the microbatches, read by
    row, and no state; the outputs leave as the loop's kept rows."""
    del filler
    return native, NestedMap(reading=[], writing=[]), None

  def KeptOutputs(self, outputs):
    """What an iteration keeps as extras for the outputs."""
    return [self._LastSlot(o) for o in outputs]

  def ReverseNativeOutputs(self, kept_rows, writing):
    del writing
    return kept_rows

  # -- The forward loop (the 1f1b pass and its gradient's forward wave).

  def StartReading(self, native):
    del native
    return []

  def Read(self, native, reading, iteration):
    """(stage 0's fresh input per leaf, reading) at `iteration`."""
    sched = self._spec.schedule
    return [self._place.ReplicateOverStages(
        microbatch.StageZeroInput(x, sched, iteration,
                                  self._place.splits_stage_dim))
            for x in native], reading

  def StartWriting(self, like):
    """Kept rows [M + 1, S, ...] per leaf (row M: iterations that finish
    none; [M + 1, 1, ...] on a whole stage dim), as TensorLists."""
    return [tensor_lists.Reserve(self._LastSlot(x),
                                 self._spec.schedule.num_microbatches + 1)
            for x in like]

  def Write(self, writing, iteration, outputs):
    rows = self._spec.schedule.OutputIndexPerIteration()
    num_mb = self._spec.schedule.num_microbatches
    row = tf.gather(Constant([num_mb if r < 0 else r for r in rows]),
                    iteration)
    return [tensor_lists.SetEntry(l, row, self._LastSlot(o))
            for l, o in zip(writing, outputs)]

  def FinishWriting(self, writing, like):
    num_mb = self._spec.schedule.num_microbatches
    return [self._place.SplitStages(
                tensor_lists.Stack(l, self._LastSlot(x), num_mb + 1)[:num_mb],
                1)
            for l, x in zip(writing, like)]

  # -- The 1f1b backward wave.

  def StartReadingGradients(self, d_native):
    return [self._place.SplitStages(d, 1) for d in d_native]

  def ReadGradient(self, reading, rows):
    """(d outputs per leaf [S, ...] or, on a whole stage dim, [1, ...],
    reading): the last stage's entry is the output gradient of the
    microbatch it differentiates, if its layer is the last."""
    m = rows.microbatch[-1]
    return [self._place.SplitStages(tf.gather(d, m)) for d in reading], reading

  def StartWritingGradients(self, like):
    return [tensor_lists.Reserve(self._FirstSlot(x),
                                 self._spec.schedule.num_microbatches + 1)
            for x in like]

  def WriteGradient(self, writing, rows, d_inputs):
    """Stage 0's input gradient, where its layer is the first."""
    num_mb = self._spec.schedule.num_microbatches
    row = tf.where(rows.first_layer[0], rows.microbatch[0], num_mb)
    return [tensor_lists.SetEntry(l, row, self._FirstSlot(d))
            for l, d in zip(writing, d_inputs)]

  def FinishWritingGradients(self, writing, like):
    """The [M, ...] input gradients (stage 0's slot, on every device)."""
    num_mb = self._spec.schedule.num_microbatches
    return [
        self._place.ReplicateLoopDim(
            self._place.SplitStages(
                tensor_lists.Stack(l, self._FirstSlot(x), num_mb + 1),
                1)[:num_mb, 0])
        for l, x in zip(writing, like)
    ]


class MadeAtStageZero(LoopInputs):
  """With a FirstStageInput (gpipe.pipeline.stage_ends): stage 0 makes each
  microbatch's inputs inside the loop's cell, from per-example inputs the
  cell reads by microbatch, so nothing is read here, no input gradient is
  written (it goes into the first stage's weights) and, with a
  LastStageLoss, no output is written either. `native` is one
  microbatch's inputs [1, ...] per leaf, as the first stage makes them:
  the buffer's first value (real data) and stage 0's stand-in read, which
  the cell replaces."""

  def StageInputs(self, reads, buffer, fresh):
    """buffer [S, mb, ...], stage 0 taking its stand-in zeros (fresh
    [S, mb, ...]) where reads: the cell makes the real ones."""
    return rotating_buffer.WithFreshColumn(reads, buffer, fresh)

  def ToNative(self, mb_leaves):
    return [tf.stop_gradient(x) for x in mb_leaves]

  def Filler(self, native):
    spec = self._spec
    return stage_ends.FirstStageFiller(spec.first_stage, native, spec.runner,
                                       self._place, spec.schedule.num_stages)

  def StartReading(self, native):
    del native
    return []

  def Read(self, native, reading, iteration):
    """Zeros, each stage's [S, ...] (the cell makes stage 0's input where
    it reads one; a constant needs no collective)."""
    del iteration
    num_stages = self._spec.schedule.num_stages
    return [self._place.SplitStages(
        tf.zeros([num_stages] + x.shape.as_list()[1:], x.dtype))
            for x in native], reading

  def StartWritingGradients(self, like):
    del like
    return []

  def WriteGradient(self, writing, rows, d_inputs):
    del rows, d_inputs
    return writing

  def FinishWritingGradients(self, writing, like):
    del writing
    return [None for _ in like]
