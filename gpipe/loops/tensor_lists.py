"""The TensorLists the loops fill entry by entry: one shape and dtype a list.

A while loop that writes entry t of a [T, ...] result each iteration keeps a
TensorList in its loop state (XLA compiles it to an in-place buffer);
`Reserve` makes one, `SetEntry` writes an entry, `Stack` reads the [T, ...]
tensor back after the loop. `like` is anything with `shape` and `dtype` (a
tensor or a tf.TensorSpec): the shape of one entry.
"""

# pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import list_ops
# pylint: enable=g-direct-tensorflow-import


def Reserve(like, num_entries):
  """An empty TensorList of num_entries entries shaped like `like`."""
  return list_ops.tensor_list_reserve(element_shape=like.shape,
                                      num_elements=num_entries,
                                      element_dtype=like.dtype)


def SetEntry(tensor_list, index, value):
  return list_ops.tensor_list_set_item(tensor_list, index, value)


def Stack(tensor_list, like, num_entries):
  """The [num_entries, ...] tensor of the list's entries.

  A list made from a [num_entries, ...] tensor (a compiled loop returns its
  lists so: gpipe.loops.compiled_loops) is that tensor, not a copy.
  """
  if tensor_list.op.type == 'TensorListFromTensor':
    stacked = tensor_list.op.inputs[0]
    if stacked.shape[:1] == [num_entries] and stacked.dtype == like.dtype:
      return stacked
  return list_ops.tensor_list_stack(tensor_list, like.dtype,
                                    num_elements=num_entries,
                                    element_shape=like.shape)
