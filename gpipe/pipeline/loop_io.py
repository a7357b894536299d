"""How the pipeline loop takes its inputs and hands back its outputs.

Stage 0 reads each microbatch once, in order; the last stage finishes each
once, in order. Where the [M, ...] microbatches live between is the
`stream_io` param's choice:

    WholeIo (stream_io=False)          StreamedIo (stream_io=True)
    inputs   [M, ...] on every device  [K, S, ...]: stage s keeps the K =
                                       ceil(M / S) microbatches s K .. s K + K
                                       - 1 (gpipe.schedule.Streams)
    read     row i, stage 0 takes it   a slot's column [S, ...] rotates one
                                       stage towards stage 0 after stage 0
                                       read its entry
    outputs  [M, S, ...]: the last     [K, S, ...] like the inputs: a slot's
             stage's slot of the       column rotates, the last stage's
             iterations that finish    output goes to its last entry
             a microbatch

so no device of a streamed pipeline holds the whole batch: each holds
1/S of the inputs, outputs and (in the 1f1b gradient loop) their
gradients, which stream the same way (output gradients read at the last
stage, input gradients written at stage 0). A rotation is one
collective-permute of one microbatch per iteration.
"""

import tensorflow as tf

from gpipe.loops import tensor_lists
from gpipe import microbatch
from gpipe.pipeline import rotating_buffer
from gpipe.pipeline import stage_ends
from gpipe import schedule as schedule_lib
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap


def For(spec):
  if spec.first_stage is not None:
    return MadeAtStageZero(spec)
  return StreamedIo(spec) if spec.stream_io else WholeIo(spec)


def _Constant(table):
  return tf.constant(table, tf.int32)


def _IsStage(num_stages, stage, like):
  """[S, 1, ...] bools broadcasting against `like`: True at `stage`."""
  return tf.reshape(tf.equal(tf.range(num_stages), stage),
                    [num_stages] + [1] * (like.shape.rank - 1))


class WholeIo:
  """stream_io=False: the [M, ...] inputs and outputs on every device."""

  def __init__(self, spec):
    self._spec = spec
    self._place = spec.placement

  @property
  def placement(self):
    return self._place

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

  def KeptRows(self, outputs):
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
    row = tf.gather(_Constant([num_mb if r < 0 else r for r in rows]),
                    iteration)
    return [tensor_lists.SetRow(l, row, self._LastSlot(o))
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
    return [tensor_lists.SetRow(l, row, self._FirstSlot(d))
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


class StreamedIo:
  """stream_io=True: inputs, outputs and their gradients split over the
  stages, [K, S, ...] streams (the module docstring)."""

  def __init__(self, spec):
    self._spec = spec
    self._place = spec.placement
    self._streams = schedule_lib.Streams(spec.schedule)

  @property
  def placement(self):
    return self._place

  def StageInputs(self, reads, buffer, fresh):
    """buffer [S, mb, ...], stage s taking its column entry fresh[s]
    where reads[s] (only stage 0 ever does)."""
    return rotating_buffer.WithFreshColumn(reads, buffer, fresh)

  @property
  def _num_stages(self):
    return self._spec.schedule.num_stages

  def _PlaceStream(self, x):
    return self._place.SplitStages(x, 1)

  def ToNative(self, mb_leaves):
    """[M, ...] (split over the stages) -> [K, S, ...] streams, padded with
    copies of microbatch 0 (what bubbles compute on: real data)."""
    pad = self._streams.padded_microbatches - self._spec.schedule.num_microbatches
    out = []
    for x in mb_leaves:
      shape = x.shape.as_list()
      if pad:
        x = tf.concat([x, tf.broadcast_to(x[:1], [pad] + shape[1:])], 0)
      x = tf.reshape(x, [self._num_stages, self._streams.num_slots] + shape[1:])
      perm = [1, 0] + list(range(2, x.shape.rank))
      out.append(self._PlaceStream(tf.transpose(x, perm)))
    return out

  def Filler(self, native):
    """The first buffer [S, ...] per leaf: each stage's first microbatch
    (real data, on its own device)."""
    return [self._place.SplitStages(tf.stop_gradient(x[0])) for x in native]

  def Outputs(self, native):
    """[K, S, ...] output streams (home layout) -> [M, ...] (split over
    the stages)."""
    return [self.FromStream(x) for x in native]

  def FromStream(self, stream):
    """[K, S, ...] streams in their home layout -> [M, ...]."""
    perm = [1, 0] + list(range(2, stream.shape.rank))
    x = tf.transpose(stream, perm)
    shape = x.shape.as_list()
    x = tf.reshape(x, [shape[0] * shape[1]] + shape[2:])
    return self._place.SpreadLoopDim(x[:self._spec.schedule.num_microbatches])

  def Home(self, stream):
    """A written stream with each slot rotated home (Streams.FixupShifts):
    a slot written n < S times sits S - n places short."""
    shifts = self._streams.FixupShifts()
    groups = {}
    for slot, shift in enumerate(shifts):
      groups.setdefault(shift, []).append(slot)
    if list(groups) == [0]:
      return stream
    parts, order = [], []
    for shift, slots in groups.items():
      part = tf.gather(stream, slots)
      parts.append(self._RotateSlots(part, -shift))
      order += slots
    whole = tf.concat(parts, 0)
    back = [order.index(k) for k in range(len(shifts))]
    return self._PlaceStream(tf.gather(whole, back))

  def _RotateSlots(self, columns, shift):
    """[k, S, ...] columns, each rotated by `shift` stages."""
    perm = [1, 0] + list(range(2, columns.shape.rank))
    rotated = rotating_buffer.RotateStages(
        tf.transpose(columns, perm), shift, self._place.splits_stage_dim)
    return tf.transpose(rotated, perm)

  # -- Column ops: slot `slot`'s [S, ...] entries.

  def _Column(self, stream, slot):
    return self._place.SplitStages(tf.gather(stream, tf.maximum(slot, 0)))

  def _SetColumn(self, stream, slot, column):
    index = tf.reshape(tf.maximum(slot, 0), [1, 1])
    return self._PlaceStream(
        tf.tensor_scatter_nd_update(stream, index, column[None]))

  def _Toward0(self, column):
    return self._place.SplitStages(rotating_buffer.RotateStages(
        column, -1, self._place.splits_stage_dim))

  def _Away0(self, column):
    return self._place.SplitStages(rotating_buffer.RotateStages(
        column, 1, self._place.splits_stage_dim))

  def _At(self, table, iteration):
    return tf.gather(_Constant(table), iteration)

  # -- The reverse schedule's loop (gpipe.pipeline.pipeline_loop, via
  # recurrent).

  def ReverseLoopParts(self, native, filler):
    """(what the loop reads as theta, the state entries it carries, how to
    undo an iteration's changes to them): the streams, which the loop
    carries but keeps no history of; its gradient undoes each iteration's
    rotations instead (recurrent.Undo)."""
    streams = NestedMap(reading=self.StartReading(native),
                        writing=self.StartWriting(filler))

    def Undo(after, inputs):
      before = after.copy()
      before.reading = self.UndoRead(after.reading, inputs.iteration)
      before.writing = self.UndoWrite(after.writing, inputs.iteration)
      return before

    return [], streams, Undo

  def KeptRows(self, outputs):
    del outputs
    return []

  def ReverseNativeOutputs(self, kept_rows, writing):
    del kept_rows
    return self.FinishWriting(writing, None)

  # -- The forward loop.

  def StartReading(self, native):
    return list(native)

  def Read(self, native, reading, iteration):
    """(each stage's entry of the slot stage 0 reads [S, ...], reading
    with that slot's column rotated towards stage 0)."""
    del native
    slot = self._At(self._streams.ReadSlots(), iteration)
    fresh, new = [], []
    for stream in reading:
      column = self._Column(stream, slot)
      fresh.append(column)
      advanced = tf.where(slot >= 0, self._Toward0(column), column)
      new.append(self._SetColumn(stream, slot, advanced))
    return fresh, new

  def UndoRead(self, reading, iteration):
    """The streams before Read at `iteration` (the reverse loop's
    gradient recovers them instead of storing them)."""
    slot = self._At(self._streams.ReadSlots(), iteration)
    out = []
    for stream in reading:
      column = self._Column(stream, slot)
      back = tf.where(slot >= 0, self._Away0(column), column)
      out.append(self._SetColumn(stream, slot, back))
    return out

  def StartWriting(self, like):
    return [self._PlaceStream(tf.zeros(
        [self._streams.num_slots] + x.shape.as_list(), x.dtype)) for x in like]

  def Write(self, writing, iteration, outputs):
    """The last stage's outputs into their slot's last entry, the column
    rotated towards stage 0 first."""
    slot = self._At(self._streams.WriteSlots(), iteration)
    out = []
    for stream, o in zip(writing, outputs):
      column = self._Column(stream, slot)
      last = _IsStage(self._num_stages, self._num_stages - 1, o)
      written = tf.where(last, o, self._Toward0(column))
      out.append(self._SetColumn(stream, slot,
                                 tf.where(slot >= 0, written, column)))
    return out

  def UndoWrite(self, writing, iteration):
    """The streams before Write at `iteration`: the entry written was
    empty (zero) before, as every slot's first entry is."""
    slot = self._At(self._streams.WriteSlots(), iteration)
    out = []
    for stream in writing:
      column = self._Column(stream, slot)
      last = _IsStage(self._num_stages, self._num_stages - 1, column)
      back = self._Away0(tf.where(last, tf.zeros_like(column), column))
      out.append(self._SetColumn(stream, slot,
                                 tf.where(slot >= 0, back, column)))
    return out

  def FinishWriting(self, writing, like):
    """The written streams, each slot rotated home."""
    del like
    return [self.Home(x) for x in writing]

  # -- The 1f1b backward wave.

  def _GradientSlot(self, rows, stage, flag):
    """The slot of the microbatch `stage` differentiates, -1 unless
    rows.<flag>[stage]."""
    k = self._streams.num_slots
    return tf.where(getattr(rows, flag)[stage], rows.microbatch[stage] % k, -1)

  def StartReadingGradients(self, d_native):
    return [self._PlaceStream(d) for d in d_native]

  def ReadGradient(self, reading, rows):
    """(each leaf's [S, ...] column, the last stage's entry the output
    gradient it needs, reading with the column rotated first)."""
    slot = self._GradientSlot(rows, -1, 'last_layer')
    d_out, new = [], []
    for stream in reading:
      column = self._Column(stream, slot)
      advanced = tf.where(slot >= 0, self._Toward0(column), column)
      d_out.append(advanced)
      new.append(self._SetColumn(stream, slot, advanced))
    return d_out, new

  def StartWritingGradients(self, like):
    return self.StartWriting(like)

  def WriteGradient(self, writing, rows, d_inputs):
    """Stage 0's input gradient into its slot's first entry, the column
    then rotated towards stage 0."""
    slot = self._GradientSlot(rows, 0, 'first_layer')
    out = []
    for stream, d in zip(writing, d_inputs):
      column = self._Column(stream, slot)
      first = _IsStage(self._num_stages, 0, d)
      written = self._Toward0(tf.where(first, d, column))
      out.append(self._SetColumn(stream, slot,
                                 tf.where(slot >= 0, written, column)))
    return out

  def FinishWritingGradients(self, writing, like):
    del like
    return [self.Home(x) for x in writing]


class MadeAtStageZero:
  """With a FirstStageInput (gpipe.pipeline.stage_ends): stage 0 makes each
  microbatch's inputs inside the loop's cell, from per-example inputs the
  cell reads by microbatch, so nothing is read here, no input gradient is
  written (it goes into the first stage's weights) and, with a
  LastStageLoss, no output is written either. `native` is one
  microbatch's inputs [1, ...] per leaf, as the first stage makes them:
  the buffer's first value (real data) and stage 0's stand-in read, which
  the cell replaces."""

  def __init__(self, spec):
    self._spec = spec
    self._place = spec.placement

  @property
  def placement(self):
    return self._place

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
