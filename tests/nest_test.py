"""gpipe.nest: tensor structures with None and other leaves kept."""

import numpy as np

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import nest
from lingvo.core import py_utils


def test_map_tensors_keeps_other_leaves():
  tree = (tf.constant(1.0), None, [tf.constant(2.0), 'text'])
  out = nest.MapTensors(lambda t: t * 10, tree)
  assert out[1] is None and out[2][1] == 'text'
  assert float(out[0]) == 10.0 and float(out[2][0]) == 20.0


def test_unstack_and_stack_are_inverse():
  x = tf.reshape(tf.range(12.0), [3, 4])
  tree = py_utils.NestedMap(a=x, b=None)
  parts = nest.Unstack(tree, 3)
  assert len(parts) == 3 and parts[1].b is None
  np.testing.assert_array_equal(parts[2].a, [8, 9, 10, 11])
  back = nest.Stack(parts)
  assert back.b is None
  np.testing.assert_array_equal(back.a, x)


def test_as_tuple():
  x = tf.constant(1.0)
  assert nest.AsTuple(x, 1) == (x,)
  assert nest.AsTuple([x, x], 2) == (x, x)
  assert nest.AsTuple((x, x), 2) == (x, x)


def test_structure_mismatch_says_what_differs():
  x = tf.zeros([2, 3])
  assert nest.StructureMismatch((x,), (x,)) == ''
  assert 'expected 2 outputs, got tuple of 1' in nest.StructureMismatch(
      (x, x), (x,))
  assert 'nesting differs' in nest.StructureMismatch(((x, x),), (x,))
  assert 'input None' in nest.StructureMismatch((x, None), (x, x))
  assert 'dtype float32, output dtype int32' in nest.StructureMismatch(
      (x,), (tf.zeros([2, 3], tf.int32),))
  assert 'output shape (2, 4)' in nest.StructureMismatch((x,),
                                                         (tf.zeros([2, 4]),))
  assert 'is not a tensor' in nest.StructureMismatch((x,), (3,))


def test_tensor_leaves_round_trip():
  a, b = tf.constant(1.0), tf.constant(2.0)
  args = (a, (None, b))
  leaves = nest.TensorLeaves(args)
  assert leaves.leaves == [a, b]
  c, d = tf.constant(3.0), tf.constant(4.0)
  rebuilt = leaves.Rebuild([c, d])
  assert rebuilt[0] is c and rebuilt[1][0] is None and rebuilt[1][1] is d
  assert leaves.Of(rebuilt) == [c, d]
