"""Rows each stage reads or writes on its own, of [S, N, ...] tensors.

The 1f1b gradient loop has every stage read (or add to) a row of its own
at an index of its own (the per-stage state of the call it
differentiates, and that state's gradient):

    x [S, N, ...]   stage s reads x[s, index[s]]   -> [S, ...]

`PerStageRows` does it on one device with a gather (scatter) at the index
pairs (s, index[s]). `ManualPerStageRows`, partitioned, in a manual region:
each device takes its own [N, ...] part of x and its own index, slices one
row, and the rows leave as [S, ...] split over the stages again; nothing
crosses devices (a gather over the split stage dim is local only where
the partitioner sees through its indices, which it does not always).
"""

import tensorflow as tf

from gpipe import sharding


def For(placement, manual_mesh):
  """The PerStageRows of a pipeline: in a manual region over `manual_mesh`
  ((device_mesh, mesh_dim)) when partitioned, else on one device."""
  if manual_mesh is None:
    return PerStageRows(placement)
  return ManualPerStageRows(placement, manual_mesh)


class PerStageRows:
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


class ManualPerStageRows(PerStageRows):
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
