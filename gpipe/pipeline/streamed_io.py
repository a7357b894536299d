"""stream_io=True: the loop's inputs, outputs and their gradients split over
the stages, as [K, S, mb, ...] streams (gpipe.schedule.streams.Streams).

Stage s keeps the K = ceil(M / S) microbatches s K .. s K + K - 1. Stage 0
reads a column's entry, then the column [S, mb, ...] rotates one stage
towards stage 0; the last stage's output goes to a column's last entry
after its column rotates. Output gradients are read at the last stage after
a rotation, input gradients written at stage 0, then the column rotates. A
rotation is one collective-permute of one microbatch per iteration, and no
device holds the whole batch. (gpipe.pipeline.loop_io: the interface.)
"""

import tensorflow as tf

from gpipe.pipeline import loop_io
from gpipe.pipeline import rotation
from gpipe.schedule import streams as streams_lib
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap


class StreamedIo(loop_io.LoopIo):
  """stream_io=True: inputs, outputs and their gradients split over the
  stages, [K, S, ...] streams (the module docstring)."""

  def __init__(self, spec):
    super().__init__(spec)
    self._streams = streams_lib.Streams(spec.schedule)

  def StageInputs(self, reads, buffer, fresh):
    """buffer [S, mb, ...], stage s taking its column entry fresh[s]
    where reads[s] (only stage 0 ever does)."""
    return loop_io.WithFreshColumn(reads, buffer, fresh)

  @property
  def _num_stages(self):
    return self._spec.schedule.num_stages

  def _PlaceStream(self, x):
    return self._place.SplitStages(x, 1)

  def Hold(self, mb_leaves):
    """[M, ...] (split over the stages) -> [K, S, ...] streams, padded with
    copies of microbatch 0 (what bubbles compute on: real data)."""
    pad = (self._streams.padded_microbatches -
           self._spec.schedule.num_microbatches)
    out = []
    for x in mb_leaves:
      shape = x.shape.as_list()
      if pad:
        x = tf.concat([x, tf.broadcast_to(x[:1], [pad] + shape[1:])], 0)
      x = tf.reshape(x, [self._num_stages, self._streams.num_columns] +
                     shape[1:])
      perm = [1, 0] + list(range(2, x.shape.rank))
      out.append(self._PlaceStream(tf.transpose(x, perm)))
    return out

  def Filler(self, held):
    """The first buffer [S, ...] per leaf: each stage's first microbatch
    (real data, on its own device)."""
    return [self._place.SplitStages(tf.stop_gradient(x[0])) for x in held]

  def Outputs(self, held):
    """[K, S, ...] output streams (home layout) -> [M, ...] (split over
    the stages)."""
    return [self.FromStream(x) for x in held]

  def FromStream(self, stream):
    """[K, S, ...] streams in their home layout -> [M, ...]."""
    perm = [1, 0] + list(range(2, stream.shape.rank))
    x = tf.transpose(stream, perm)
    shape = x.shape.as_list()
    x = tf.reshape(x, [shape[0] * shape[1]] + shape[2:])
    return self._place.SpreadLoopDim(x[:self._spec.schedule.num_microbatches])

  def Home(self, stream):
    """A written stream with each column rotated home
    (Streams.FixupShifts): a column written n < S times sits S - n places
    short."""
    shifts = self._streams.FixupShifts()
    groups = {}
    for k, shift in enumerate(shifts):
      groups.setdefault(shift, []).append(k)
    if list(groups) == [0]:
      return stream
    parts, order = [], []
    for shift, columns in groups.items():
      part = tf.gather(stream, columns)
      parts.append(self._RotateColumns(part, -shift))
      order += columns
    whole = tf.concat(parts, 0)
    back = [order.index(k) for k in range(len(shifts))]
    return self._PlaceStream(tf.gather(whole, back))

  def _RotateColumns(self, columns, shift):
    """[k, S, ...] columns, each rotated by `shift` stages."""
    perm = [1, 0] + list(range(2, columns.shape.rank))
    rotated = rotation.RotateStages(
        tf.transpose(columns, perm), shift, self._place.splits_stage_dim)
    return tf.transpose(rotated, perm)

  # -- Column ops: column k's [S, ...] entries.

  def _Column(self, stream, k):
    return self._place.SplitStages(tf.gather(stream, tf.maximum(k, 0)))

  def _SetColumn(self, stream, k, column):
    index = tf.reshape(tf.maximum(k, 0), [1, 1])
    return self._PlaceStream(
        tf.tensor_scatter_nd_update(stream, index, column[None]))

  def _Toward0(self, column):
    return self._place.SplitStages(rotation.RotateStages(
        column, -1, self._place.splits_stage_dim))

  def _Away0(self, column):
    return self._place.SplitStages(rotation.RotateStages(
        column, 1, self._place.splits_stage_dim))

  def _ColumnWhere(self, row, stage, flag):
    """The column of the microbatch `stage` works on, -1 unless
    row.<flag>[stage] (int32 [])."""
    k = self._streams.num_columns
    return tf.where(getattr(row, flag)[stage], row.microbatch[stage] % k, -1)

  # -- The reverse schedule's loop (gpipe.pipeline.pipeline_loop, via
  # recurrent).

  def ReverseLoopParts(self, held, filler):
    """(what the loop reads as theta, the state entries it carries, how to
    undo an iteration's changes to them): the streams, which the loop
    carries but keeps no history of; its gradient undoes each iteration's
    rotations instead (recurrent.Undo)."""
    streams = NestedMap(
        reading=self.StartReading(held),  # [K, S, mb, ...] per leaf
        writing=self.StartWriting(filler))  # [K, S, mb, ...] per leaf

    def Undo(after, inputs):
      before = after.copy()
      before.reading = self.UndoRead(after.reading, inputs.row)
      before.writing = self.UndoWrite(after.writing, inputs.row)
      return before

    return [], streams, Undo

  def ReverseLoopOutputs(self, writing, row, outputs):
    """(the streams with the outputs written, nothing kept as extras)."""
    return self.Write(writing, row, outputs), []

  def ReverseHeldOutputs(self, kept, writing):
    del kept
    return self.FinishWriting(writing, None)

  # -- The forward loop.

  def StartReading(self, held):
    """The input streams, [K, S, mb, ...] per leaf."""
    return list(held)

  def Read(self, held, reading, row):
    """(each stage's entry of the column stage 0 reads [S, ...], reading
    with that column rotated towards stage 0)."""
    del held
    k = self._ColumnWhere(row, 0, 'first_layer')  # int32 [], -1: none
    fresh, new = [], []
    for stream in reading:
      column = self._Column(stream, k)
      fresh.append(column)
      advanced = tf.where(k >= 0, self._Toward0(column), column)
      new.append(self._SetColumn(stream, k, advanced))
    return fresh, new

  def UndoRead(self, reading, row):
    """The streams before Read at the row's iteration (the reverse loop's
    gradient recovers them instead of storing them)."""
    k = self._ColumnWhere(row, 0, 'first_layer')  # int32 [], -1: none
    out = []
    for stream in reading:
      column = self._Column(stream, k)
      back = tf.where(k >= 0, self._Away0(column), column)
      out.append(self._SetColumn(stream, k, back))
    return out

  def StartWriting(self, like):
    """Empty output streams, [K, S, mb, ...] per leaf of `like` [S, mb,
    ...]."""
    return [self._PlaceStream(tf.zeros(
        [self._streams.num_columns] + x.shape.as_list(), x.dtype))
            for x in like]

  def Write(self, writing, row, outputs):
    """The last stage's outputs into their column's last entry, the column
    rotated towards stage 0 first."""
    k = self._ColumnWhere(row, -1, 'last_layer')
    out = []
    for stream, o in zip(writing, outputs):
      column = self._Column(stream, k)
      last = loop_io.IsStage(self._num_stages, self._num_stages - 1, o)
      written = tf.where(last, o, self._Toward0(column))
      out.append(self._SetColumn(stream, k,
                                 tf.where(k >= 0, written, column)))
    return out

  def UndoWrite(self, writing, row):
    """The streams before Write at the row's iteration: the entry written
    was empty (zero) before, as every column's first entry is."""
    k = self._ColumnWhere(row, -1, 'last_layer')
    out = []
    for stream in writing:
      column = self._Column(stream, k)
      last = loop_io.IsStage(self._num_stages, self._num_stages - 1, column)
      back = self._Away0(tf.where(last, tf.zeros_like(column), column))
      out.append(self._SetColumn(stream, k,
                                 tf.where(k >= 0, back, column)))
    return out

  def FinishWriting(self, writing, like):
    """The written streams, each column rotated home."""
    del like
    return [self.Home(x) for x in writing]

  # -- The 1f1b backward wave.

  def StartReadingGradients(self, d_held):
    """The output gradients' streams, [K, S, mb, ...] per leaf."""
    return [self._PlaceStream(d) for d in d_held]

  def ReadGradient(self, reading, row):
    """(each leaf's [S, ...] column, the last stage's entry the output
    gradient it needs, reading with the column rotated first)."""
    k = self._ColumnWhere(row, -1, 'last_layer')
    d_out, new = [], []
    for stream in reading:
      column = self._Column(stream, k)
      advanced = tf.where(k >= 0, self._Toward0(column), column)
      d_out.append(advanced)
      new.append(self._SetColumn(stream, k, advanced))
    return d_out, new

  def StartWritingGradients(self, like):
    """Empty input-gradient streams, [K, S, mb, ...] per leaf."""
    return self.StartWriting(like)

  def WriteGradient(self, writing, row, d_inputs):
    """Stage 0's input gradient into its column's first entry, the column
    then rotated towards stage 0."""
    k = self._ColumnWhere(row, 0, 'first_layer')
    out = []
    for stream, d in zip(writing, d_inputs):
      column = self._Column(stream, k)
      first = loop_io.IsStage(self._num_stages, 0, d)
      written = self._Toward0(tf.where(first, d, column))
      out.append(self._SetColumn(stream, k,
                                 tf.where(k >= 0, written, column)))
    return out

  def FinishWritingGradients(self, writing, like):
    del like
    return [self.Home(x) for x in writing]
