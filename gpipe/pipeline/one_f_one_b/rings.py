"""The 1f1b gradient loop's rings: per stage, `size` [S, ...] entries (the
stage inputs its backward wave reads back, what the remat policy keeps).

In iteration j every stage writes its entry at index j mod size, and each
reads the index of the call it differentiates (gpipe.schedule.OneFOneB):

    ring [S, size, ...]   write: ring[:, j mod size] = entry [S, ...]
                          read:  stage s takes ring[s, index[s]] -> [S, ...]

Under XLA a scatter into a loop-carried tensor updates it in place;
TensorFlow's own kernel copies the whole tensor, so outside XLA the ring
is a TensorList (`Ring`). Partitioned, an entry may also be split over
another mesh axis (SplitRingLayout: ring_split_mesh_dim).
"""

import numpy as np
import tensorflow as tf
# pylint: disable=g-direct-tensorflow-import
from tensorflow.compiler.tf2xla.python import xla as xla_ops
from tensorflow.python.ops import list_ops
# pylint: enable=g-direct-tensorflow-import

from gpipe.loops import compiled_loops
from gpipe import sharding


class Ring:
  """A ring of `size` [S, ...] entries: written at one index for every stage,
  read at an index of each stage's own.

  Under XLA a [S, size, ...] tensor: a write is one dynamic-update-slice
  at an index all stages share (in place, each device its own part), a read
  each stage's entry picked by a mask and summed over the indices: each
  device reads its own part of the ring. (XLA:CPU builds the masked ring
  before summing it, one ring-sized temporary, which a TPU's fusion of the
  select into the reduction does not; a batched matmul with a one-hot
  mask made XLA:CPU copy the ring into the dot's layout, a larger
  temporary; a gather at per-stage indices is kept local by XLA's
  partitioner only where it sees through the indices.) Otherwise a
  TensorList of `size` [S, ...] entries (a write stores a reference, a
  read copies S entries).

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

  def Write(self, ring, index, entry):
    """Every stage's entry [S, ...] at `index` (int32 [])."""
    if self.xla:
      start = [0, index] + [0] * (self.spec.shape.rank - 1)
      entry = self._layout.PlaceEntry(entry)
      if self._bits:
        entry = tf.bitcast(entry, self._bits)
      return self._Placed(xla_ops.dynamic_update_slice(
          ring, entry[:, None], tf.stack(start)))
    return list_ops.tensor_list_set_item(ring, index, entry)

  def Read(self, ring, indices):
    """[S, ...]: stage s's entry at indices[s] (indices [S])."""
    if self.xla:
      # [S, size]: where each stage's entry is.
      hit = tf.equal(indices[:, None], tf.range(self.size)[None, :])
      hit = tf.reshape(hit, [self.num_stages, self.size] +
                       [1] * (self.spec.shape.rank - 1))
      picked = tf.where(hit, ring, tf.zeros([], ring.dtype))
      entry = tf.reduce_sum(picked, axis=1)
      if self._bits:
        entry = tf.bitcast(entry, self.spec.dtype)
      return self._layout.PlaceEntry(entry)
    own = [  # stage s's entry [...] of the ring's [S, ...] at indices[s]
        list_ops.tensor_list_get_item(ring, indices[s], self.spec.dtype,
                                      element_shape=self.spec.shape)[s]
        for s in range(self.num_stages)
    ]
    return tf.stack(own)


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
