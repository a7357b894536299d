"""The TensorLists the loops fill row by row: one shape and dtype a list.

A while loop that writes row t of a [T, ...] result each iteration keeps a
TensorList in its loop state (XLA compiles it to an in-place buffer);
`Reserve` makes one, `SetRow` writes a row, `Stack` reads the [T, ...]
tensor back after the loop. `like` is anything with `shape` and `dtype` (a
tensor or a tf.TensorSpec): the shape of one row.
"""

# pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import list_ops
# pylint: enable=g-direct-tensorflow-import


def Reserve(like, num_rows):
  """An empty TensorList of num_rows rows shaped like `like`."""
  return list_ops.tensor_list_reserve(element_shape=like.shape,
                                      num_elements=num_rows,
                                      element_dtype=like.dtype)


def SetRow(tensor_list, row, value):
  return list_ops.tensor_list_set_item(tensor_list, row, value)


def Stack(tensor_list, like, num_rows):
  """The [num_rows, ...] tensor of the list's rows.

  A list made from a [num_rows, ...] tensor (a compiled loop returns its
  lists so: gpipe.loops.compiled_loops) is that tensor, not a copy.
  """
  if tensor_list.op.type == 'TensorListFromTensor':
    stacked = tensor_list.op.inputs[0]
    if stacked.shape[:1] == [num_rows] and stacked.dtype == like.dtype:
      return stacked
  return list_ops.tensor_list_stack(tensor_list, like.dtype,
                                    num_elements=num_rows,
                                    element_shape=like.shape)
