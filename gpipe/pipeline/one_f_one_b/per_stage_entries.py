"""Entries each stage reads or writes on its own, of [S, N, ...] tensors.

The 1f1b gradient loop has every stage read (or add to) an entry of its
own at an index of its own (the per-stage state of the call it
differentiates, and that state's gradient):

    x [S, N, ...]   stage s reads x[s, index[s]]   -> [S, ...]

`PerStageEntries` does it on one device with a gather (scatter) at the
index pairs (s, index[s]). `ManualPerStageEntries`, partitioned, in a
manual region: each device takes its own [N, ...] part of x and its own
index, slices one entry, and the entries leave as [S, ...] split over the
stages again; nothing crosses devices (a gather over the split stage dim
is local only where the partitioner sees through its indices, which it
does not always).
"""

import tensorflow as tf

from gpipe import sharding


def EntriesFor(placement, manual_mesh):
  """The PerStageEntries of a pipeline: in a manual region over `manual_mesh`
  ((device_mesh, mesh_dim)) when partitioned, else on one device."""
  if manual_mesh is None:
    return PerStageEntries(placement)
  return ManualPerStageEntries(placement, manual_mesh)


class PerStageEntries:
  """Per-stage entries of [S, N, ...] tensors, on one device."""

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
    """[S, N, ...] -> [S, ...]: stage s's entry index[s]."""
    return self._place.SplitStages(tf.gather_nd(x, self._Pairs(index)))

  def Write(self, x, index, entries):
    """x with entry index[s] of stage s set to entries[s] ([S, ...])."""
    return self._place.SplitStages(
        tf.tensor_scatter_nd_update(x, self._Pairs(index), entries))

  def Add(self, x, index, entries):
    """x with entries[s] added to entry index[s] of stage s."""
    return self._place.SplitStages(
        tf.tensor_scatter_nd_add(x, self._Pairs(index), entries))


class ManualPerStageEntries(PerStageEntries):
  """Per-stage entries in a manual region: each device its own stage's."""

  def __init__(self, placement, manual_mesh):
    super().__init__(placement)
    self._mesh = manual_mesh

  def _In(self, x):
    return sharding.ToManualStage(x, *self._mesh)

  def _Out(self, x):
    return sharding.FromManualStage(x, *self._mesh)

  def Read(self, x, index):
    return self._Out(tf.gather(self._In(x), self._In(index)))

  def _Update(self, update, x, index, entries):
    local = self._In(x)
    at = tf.reshape(self._In(index), [1, 1])
    return self._Out(update(local, at, self._In(entries)[None]))

  def Write(self, x, index, entries):
    return self._Update(tf.tensor_scatter_nd_update, x, index, entries)

  def Add(self, x, index, entries):
    return self._Update(tf.tensor_scatter_nd_add, x, index, entries)
