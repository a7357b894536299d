"""gpipe.pipeline.repeats: all ways to pick a circular repeat, against NumPy."""

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe.pipeline import repeats
from lingvo.core import py_utils
from tests import sessions

R, S = 3, 4


def _Values():
  return np.random.RandomState(0).normal(size=[R, 5, 2]).astype(np.float32)


def test_linear_passes_everything_through():
  linear = repeats.RepeatsFor(1)
  assert isinstance(linear, repeats.Linear) and linear.count == 1
  x, new = tf.constant(1.0), tf.constant(2.0)
  assert linear.Take(x, 0) is x
  assert linear.Put(x, 0, new) is new
  assert linear.TakeByOneHot({'w': x}, 0)['w'] is x
  assert linear.TakeFromRS(x, tf.zeros([S], tf.int32)) is x
  with linear.VariablePrefix():
    assert py_utils.GetVariableShapePrefixes() == []


@pytest.mark.parametrize('repeat', [0, 2])
def test_circular_take_and_put(repeat):
  values = _Values()
  circ = repeats.RepeatsFor(R)
  np.testing.assert_array_equal(circ.Take(tf.constant(values), repeat),
                                values[repeat])
  np.testing.assert_array_equal(
      circ.Take(tf.constant(values), tf.constant(repeat)), values[repeat])
  new = np.full([5, 2], 7.0, np.float32)
  want = values.copy()
  want[repeat] = new
  np.testing.assert_array_equal(
      circ.Put(tf.constant(values), tf.constant(repeat), tf.constant(new)),
      want)


def test_take_by_one_hot_equals_take_and_its_gradient_is_one_hot():
  values = tf.constant(_Values())
  circ = repeats.RepeatsFor(R)
  with tf.GradientTape() as tape:
    tape.watch(values)
    picked = circ.TakeByOneHot({'w': values}, tf.constant(1))['w']
    loss = tf.reduce_sum(picked * 2.0)
  np.testing.assert_array_equal(picked, values[1])
  want = np.zeros([R, 5, 2], np.float32)
  want[1] = 2.0
  np.testing.assert_array_equal(tape.gradient(loss, values), want)


def test_take_per_stage_picks_each_stages_repeat():
  values = np.random.RandomState(1).normal(size=[R, S, 2]).astype(np.float32)
  ids = np.array([2, 0, 1, 2], np.int32)
  got = repeats.RepeatsFor(R).TakeFromRS(tf.constant(values), tf.constant(ids))
  np.testing.assert_array_equal(got, values[ids, np.arange(S)])


@pytest.mark.parametrize('mode', ['eager', 'graph', 'jit'])
def test_take_for_each_stage_and_its_gradient_against_numpy(mode):
  """Both builds (gather in graph mode, one-hot sum under XLA) pick
  value[s, ids[s]] and put the cotangent back there, zeros elsewhere."""
  rng = np.random.RandomState(2)
  values = rng.normal(size=[S, R, 3, 2]).astype(np.float32)
  ids = np.array([2, 0, 1, 2], np.int32)
  cotangent = rng.normal(size=[S, 3, 2]).astype(np.float32)

  def Step(v, i, dy):
    with tf.GradientTape() as tape:
      tape.watch(v)
      picked = repeats.RepeatsFor(R).TakeFromSR(v, i)
    return picked, tape.gradient(picked, v, output_gradients=dy)

  args = [tf.constant(values), tf.constant(ids), tf.constant(cotangent)]
  if mode == 'eager':
    picked, grad = Step(*args)
  elif mode == 'jit':
    picked, grad = tf.function(Step, jit_compile=True)(*args)
  else:
    with tf.Graph().as_default():
      fetch = Step(*[tf.constant(a.numpy()) for a in args])
      with sessions.AsBuilt() as sess:
        picked, grad = sess.run(fetch)
  np.testing.assert_array_equal(picked, values[np.arange(S), ids])
  want = np.zeros_like(values)
  want[np.arange(S), ids] = cotangent
  np.testing.assert_array_equal(grad, want)


def test_circular_variable_prefix_adds_the_repeat_dim():
  with repeats.RepeatsFor(R).VariablePrefix():
    assert py_utils.GetVariableShapePrefixes() == [R]
  assert py_utils.GetVariableShapePrefixes() == []
