"""Nested structures of tensors, as the pipeline passes them around.

Inputs, outputs, kwargs and states are tensors, tuples, lists or NestedMaps
with None entries allowed; these helpers act on the tensor leaves and leave
everything else in place.
"""

from typing import Mapping, Sequence, Union

import tensorflow as tf

# A tensor, None, or a tuple, list, dict or NestedMap of those.
Structure = Union[tf.Tensor, None, Sequence['Structure'],
                  Mapping[str, 'Structure']]


def IsTensor(x):
  return isinstance(x, (tf.Tensor, tf.Variable)) or tf.is_tensor(x)


def MapTensors(fn, tree):
  """fn applied to every tensor leaf of tree; other leaves kept."""
  return tf.nest.map_structure(lambda x: fn(x) if IsTensor(x) else x, tree)


def Unstack(tree, num):
  """[num, ...] tensor leaves -> num trees of [...] leaves (None kept)."""
  leaves = tf.nest.flatten(tree)
  parts = [
      tf.unstack(x, num=num) if IsTensor(x) else [x] * num for x in leaves
  ]
  return [tf.nest.pack_sequence_as(tree, [p[i] for p in parts])
          for i in range(num)]


def Stack(trees):
  """Trees of [...] leaves -> one tree of [len(trees), ...] (None kept)."""
  return tf.nest.map_structure(
      lambda *xs: None if xs[0] is None else tf.stack(xs), *trees)


def AsTuple(out, num_inputs):
  """A body's outputs as a tuple: one input's output is not wrapped."""
  if num_inputs == 1:
    return (out,)
  if isinstance(out, list):
    return tuple(out)
  return out


def StructureMismatch(inputs, outputs):
  """How `outputs` differ from `inputs` in structure, dtype or shape, or ''."""
  if not isinstance(outputs, tuple) or len(outputs) != len(inputs):
    return (f'expected {len(inputs)} outputs, got '
            f'{type(outputs).__name__}'
            f'{f" of {len(outputs)}" if isinstance(outputs, tuple) else ""}')
  try:
    tf.nest.assert_same_structure(inputs, outputs, check_types=False)
  except (ValueError, TypeError):
    return (f'nesting differs: inputs {Outline(inputs)}, outputs '
            f'{Outline(outputs)}')
  for x, y in zip(tf.nest.flatten(inputs), tf.nest.flatten(outputs)):
    if (x is None) != (y is None):
      return f'input {x} but output {y}'
    if x is None:
      continue
    if not IsTensor(y):
      return f'output {y!r} is not a tensor'
    if x.dtype != y.dtype:
      return f'input dtype {x.dtype.name}, output dtype {y.dtype.name}'
    if not x.shape.is_compatible_with(y.shape):
      return f'input shape {x.shape}, output shape {y.shape}'
  return ''


def Outline(tree):
  """A structure with leaves drawn as T (tensor), None, or their type."""

  def Leaf(x):
    if x is None:
      return 'None'
    return 'T' if IsTensor(x) else type(x).__name__

  return str(tf.nest.map_structure(Leaf, tree)).replace("'", '')


class TensorLeaves:
  """The tensor leaves of a structure, and how to put leaves back into it.

  The pipeline's buffer carries only tensors; None entries (and any other
  non-tensor leaves) of the inputs stay where they are and come back in
  the outputs' structure.
  """

  def __init__(self, tree):
    self._tree = tree
    self._flat = tf.nest.flatten(tree)
    self._slots = [i for i, x in enumerate(self._flat) if IsTensor(x)]

  @property
  def leaves(self):
    return [self._flat[i] for i in self._slots]

  def Of(self, tree):
    """The leaves of another tree of the same structure, in the same slots."""
    flat = tf.nest.flatten(tree)
    return [flat[i] for i in self._slots]

  def Rebuild(self, leaves):
    """The structure again, as a tuple, with `leaves` in the tensor slots."""
    full = list(self._flat)
    for i, leaf in zip(self._slots, leaves):
      full[i] = leaf
    return tuple(tf.nest.pack_sequence_as(self._tree, full))
