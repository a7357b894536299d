"""Rows each stage reads or writes on its own: [S, N, ...] tensors and rings.

The 1f1b gradient loop (gpipe.one_f_one_b) has every stage read a row of
its own at an index of its own (the stage input its backward wave needs,
the per-stage state of the call it differentiates):

    x [S, N, ...]   stage s reads x[s, index[s]]   -> [S, ...]

Written as a gather (scatter) with the index pairs (s, index[s]), XLA's SPMD
partitioner keeps each stage's part on its device: no collective, inside a
loop too (a slice per stage would not be seen as local). Under XLA a
scatter into a loop-carried tensor updates it in place; TensorFlow's own
kernel copies the whole tensor, so the ring of stage inputs, written every
iteration, is a TensorList outside XLA (`Ring`).
"""

import tensorflow as tf
# pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import list_ops
from tensorflow.python.ops.parallel_for import control_flow_ops as pfor_ops
# pylint: enable=g-direct-tensorflow-import


def _Pairs(index):
  """[S] per-stage indices -> [S, 2] (stage, index) pairs."""
  num_stages = index.shape.as_list()[0]
  return tf.stack([tf.range(num_stages, dtype=index.dtype), index], axis=-1)


def ReadRows(x, index):
  """[S, N, ...] -> [S, ...]: stage s's row index[s]."""
  return tf.gather_nd(x, _Pairs(index))


def WriteRows(x, index, rows):
  """x with row index[s] of stage s set to rows[s] ([S, ...])."""
  return tf.tensor_scatter_nd_update(x, _Pairs(index), rows)


def AddRows(x, index, rows):
  """x with rows[s] added to row index[s] of stage s."""
  return tf.tensor_scatter_nd_add(x, _Pairs(index), rows)


def UnderXla():
  """Whether the graph being built is compiled by XLA."""
  return pfor_ops._is_under_xla_context()  # pylint: disable=protected-access


class Ring:
  """A ring of `size` [S, ...] entries: written at one slot for every stage,
  read at a slot of each stage's own.

  Under XLA a [S, size, ...] tensor (WriteRows/ReadRows, in place and
  partitioned without collectives); otherwise a TensorList of `size`
  [S, ...] entries (a write stores a reference, a read copies S rows).
  """

  def __init__(self, spec, size, place):
    self.spec = spec  # a tf.TensorSpec of one entry, [S, ...]
    self.size = size
    self._place = place  # splits a tensor's stage dim (0 or 1)
    self.xla = UnderXla()

  @property
  def num_stages(self):
    return self.spec.shape.as_list()[0]

  def Empty(self):
    """The ring before its first write (entries zero)."""
    if self.xla:
      shape = [self.num_stages, self.size] + self.spec.shape.as_list()[1:]
      return self._place(tf.zeros(shape, self.spec.dtype), 0)
    return list_ops.tensor_list_reserve(
        element_shape=self.spec.shape, num_elements=self.size,
        element_dtype=self.spec.dtype)

  def Write(self, ring, slot, entry):
    """Every stage's entry [S, ...] into slot `slot` (a scalar)."""
    if self.xla:
      index = tf.fill([self.num_stages], slot)
      return self._place(WriteRows(ring, index, entry), 0)
    return list_ops.tensor_list_set_item(ring, slot, entry)

  def Read(self, ring, slots):
    """[S, ...]: stage s's entry in slot slots[s]."""
    if self.xla:
      return self._place(ReadRows(ring, slots), 0)
    rows = [
        list_ops.tensor_list_get_item(ring, slots[s], self.spec.dtype,
                                      element_shape=self.spec.shape)[s]
        for s in range(self.num_stages)
    ]
    return tf.stack(rows)
