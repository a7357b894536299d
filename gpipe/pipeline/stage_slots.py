"""Rows each stage reads or writes on its own: [S, N, ...] tensors and rings.

The 1f1b gradient loop (gpipe.pipeline.one_f_one_b) has every stage read a row
of its own at an index of its own (the stage input its backward wave needs,
the per-stage state of the call it differentiates):

    x [S, N, ...]   stage s reads x[s, index[s]]   -> [S, ...]

`StageRows` does it two ways. On one device, a gather (scatter) with the
index pairs (s, index[s]). Partitioned, in a manual region: each device
takes its own [N, ...] part of x and its own index, slices one row, and
the rows leave as [S, ...] split over the stages again; nothing crosses
devices (a gather over the split stage dim is local only where the
partitioner sees through its indices, which it does not always). Under
XLA a scatter into a loop-carried tensor updates it in place;
TensorFlow's own kernel copies the whole tensor, so the ring of stage
inputs, written every iteration, is a TensorList outside XLA (`Ring`).
"""

import numpy as np
import tensorflow as tf
# pylint: disable=g-direct-tensorflow-import
from tensorflow.compiler.tf2xla.python import xla as xla_ops
from tensorflow.python.ops import list_ops
# pylint: enable=g-direct-tensorflow-import

from gpipe.loops import compiled_loops
from gpipe import sharding


def For(placement, manual_mesh):
  """The StageRows of a pipeline: in a manual region over `manual_mesh`
  ((device_mesh, mesh_dim)) when partitioned, else on one device."""
  if manual_mesh is None:
    return StageRows(placement)
  return ManualStageRows(placement, manual_mesh)


class StageRows:
  """Per-stage rows of [S, N, ...] tensors, on one device."""

  def __init__(self, placement):
    self._place = placement

  def _Pairs(self, index):
    """[S] per-stage indices -> [S, 2] (stage, index) pairs, each stage's
    on its device."""
    num_stages = index.shape.as_list()[0]
    return self._place.SplitStages(tf.stack(
        [tf.range(num_stages, dtype=index.dtype),
         self._place.SplitStages(index)], -1))

  def Read(self, x, index):
    """[S, N, ...] -> [S, ...]: stage s's row index[s]."""
    return self._place.SplitStages(tf.gather_nd(x, self._Pairs(index)))

  def Write(self, x, index, rows):
    """x with row index[s] of stage s set to rows[s] ([S, ...])."""
    return self._place.SplitStages(
        tf.tensor_scatter_nd_update(x, self._Pairs(index), rows))

  def Add(self, x, index, rows):
    """x with rows[s] added to row index[s] of stage s."""
    return self._place.SplitStages(
        tf.tensor_scatter_nd_add(x, self._Pairs(index), rows))


class ManualStageRows(StageRows):
  """Per-stage rows in a manual region: each device its own stage's."""

  def __init__(self, placement, manual_mesh):
    super().__init__(placement)
    self._mesh = manual_mesh

  def _In(self, x):
    return sharding.ToManualStage(x, *self._mesh)

  def _Out(self, x):
    return sharding.FromManualStage(x, *self._mesh)

  def Read(self, x, index):
    return self._Out(tf.gather(self._In(x), self._In(index)))

  def _Update(self, update, x, index, rows):
    local = self._In(x)
    at = tf.reshape(self._In(index), [1, 1])
    return self._Out(update(local, at, self._In(rows)[None]))

  def Write(self, x, index, rows):
    return self._Update(tf.tensor_scatter_nd_update, x, index, rows)

  def Add(self, x, index, rows):
    return self._Update(tf.tensor_scatter_nd_add, x, index, rows)


class Ring:
  """A ring of `size` [S, ...] entries: written at one slot for every stage,
  read at a slot of each stage's own.

  Under XLA a [S, size, ...] tensor: a write is one dynamic-update-slice
  at a slot all stages share (in place, each device its own part), a read
  each stage's entry picked by a mask and summed over the slots: each
  device reads its own part of the ring. (XLA:CPU builds the masked ring
  before summing it, one ring-sized temporary, which a TPU's fusion of the
  select into the reduction does not; a batched matmul with a one-hot
  mask made XLA:CPU copy the ring into the dot's layout, a larger
  temporary; a gather at per-stage slots is kept local by XLA's
  partitioner only where it sees through the indices.) Otherwise a TensorList of `size` [S, ...] entries
  (a write stores a reference, a read copies S rows).

  Under XLA, 16-bit float entries are kept as their 16-bit patterns
  (uint16; the masked sum picks one entry exactly): XLA:CPU computes no
  bfloat16, and would keep a bfloat16 ring, and the temporary of its read,
  in float32, twice what a TPU holds.
  """

  def __init__(self, spec, size, placement, split_mesh_dim=None):
    self.spec = spec  # a tf.TensorSpec of one entry, [S, ...]
    self.size = size
    self._place = placement
    self._layout = RingLayout.For(spec, placement, split_mesh_dim)
    self.xla = compiled_loops.UnderXla()
    self._bits = (tf.uint16 if self.xla and spec.dtype in (tf.bfloat16,
                                                             tf.float16)
                  else None)

  @property
  def num_stages(self):
    return self.spec.shape.as_list()[0]

  def _Placed(self, ring):
    return self._layout.PlaceRing(ring)

  def Empty(self):
    """The ring before its first write (entries zero)."""
    if self.xla:
      shape = self.spec.shape.as_list()
      return self._Placed(tf.zeros(shape[:1] + [self.size] + shape[1:],
                                   self._bits or self.spec.dtype))
    return list_ops.tensor_list_reserve(
        element_shape=self.spec.shape, num_elements=self.size,
        element_dtype=self.spec.dtype)

  def Write(self, ring, slot, entry):
    """Every stage's entry [S, ...] into slot `slot` (a scalar)."""
    if self.xla:
      start = [0, slot] + [0] * (self.spec.shape.rank - 1)
      entry = self._layout.PlaceEntry(entry)
      if self._bits:
        entry = tf.bitcast(entry, self._bits)
      return self._Placed(xla_ops.dynamic_update_slice(
          ring, entry[:, None], tf.stack(start)))
    return list_ops.tensor_list_set_item(ring, slot, entry)

  def Read(self, ring, slots):
    """[S, ...]: stage s's entry in slot slots[s]."""
    if self.xla:
      hit = tf.equal(slots[:, None], tf.range(self.size)[None, :])  # [S, size]
      hit = tf.reshape(hit, [self.num_stages, self.size] +
                       [1] * (self.spec.shape.rank - 1))
      picked = tf.where(hit, ring, tf.zeros([], ring.dtype))
      entry = tf.reduce_sum(picked, axis=1)
      if self._bits:
        entry = tf.bitcast(entry, self.spec.dtype)
      return self._layout.PlaceEntry(entry)
    rows = [
        list_ops.tensor_list_get_item(ring, slots[s], self.spec.dtype,
                                      element_shape=self.spec.shape)[s]
        for s in range(self.num_stages)
    ]
    return tf.stack(rows)


class RingLayout:
  """Where a ring [S, size, ...] and its entries [S, ...] live: the stage
  dim split over the stage devices, the rest as the partitioner decides
  (each device holds its own stages' entries, whole)."""

  def __init__(self, placement):
    self._place = placement

  @staticmethod
  def For(spec, placement, split_mesh_dim):
    """The layout of a ring of `spec` entries: split over `split_mesh_dim`
    of the placement's mesh too where that is asked for and an entry dim
    divides over it (ring_split_mesh_dim), else the stage dim only."""
    if split_mesh_dim is None or placement.mesh is None:
      return RingLayout(placement)
    device_mesh, stage_axis = placement.mesh
    n = np.shape(device_mesh)[split_mesh_dim]
    shape = spec.shape.as_list()[1:]
    dims = [d for d, size in enumerate(shape, 1) if size % n == 0]
    if n == 1 or not dims:
      return RingLayout(placement)
    return SplitRingLayout(placement, device_mesh, stage_axis,
                           split_mesh_dim, max(dims, key=lambda d: shape[d - 1]))

  def PlaceRing(self, ring):
    return self._place.SplitStages(ring, 0)

  def PlaceEntry(self, entry):
    return self._place.SplitStages(entry)


class SplitRingLayout(RingLayout):
  """ring_split_mesh_dim: each device keeps 1/n of its stage's entries.

  The ring's entry dim `dim` (the largest that divides) is split over mesh
  axis `split_mesh_dim` (n devices, over which the entries are whole: a
  model axis), so what the 1f1b rings store shrinks n-fold:

      entry [S, mb, t, d] whole    --write: each device slices its 1/n-->
      ring  [S, size, mb, t, d/n]  --read: all-gather over the axis-->
      entry [S, mb, t, d] whole

  A write costs nothing; a read is one all-gather of an entry over the
  axis, once per entry and backward iteration. Entries are pinned whole on
  that dim where they are written and read, so that the split does not
  spread into the stage's own activations.
  """

  def __init__(self, placement, device_mesh, stage_axis, split_mesh_dim,
               dim):
    super().__init__(placement)
    self._mesh = device_mesh
    self._axes = (stage_axis, split_mesh_dim)
    self._dim = dim  # in the entry [S, ...]

  def PlaceRing(self, ring):
    return self._Annotated(ring, {0: self._axes[0], 1: -1,
                                  self._dim + 1: self._axes[1]})

  def PlaceEntry(self, entry):
    return self._Annotated(entry, {0: self._axes[0], self._dim: -1})

  def _Annotated(self, x, mapped):
    """x with the dims of `mapped` ({dim: mesh axis, or -1 for whole}) so,
    the others left to the partitioner."""
    rank = x.shape.rank
    mapping = [mapped.get(d, -1) for d in range(rank)]
    return sharding.MeshSplit(
        x, self._mesh, mapping,
        unspecified_dims=[d for d in range(rank) if d not in mapped])
