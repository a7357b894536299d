"""The cells and inputs gpipe.recurrent.Recurrent refuses while it builds.

A cell whose new state differs from state0 (keys, nesting, dtype, shape or
rank), inputs of different or unknown leading dims, no inputs at all, and
extras of dynamic shape each raise a ValueError naming the problem, in graph
mode and under tf.function.
"""

import sys

import pytest
import tensorflow as tf

from gpipe import recurrent
from tests import recurrent_cases as cases

_B, _H, _T = cases.B, cases.H, cases.T


def _BadStateCell(kind):
  """A cell whose new state differs from state0 = {'h', 'c': (a, n)}."""

  def Cell(theta, state, x):
    h = tf.tanh(state['h'] @ theta + x)
    a, n = state['c']
    good = {'h': h, 'c': (a + 1.0, n + 1)}
    if kind == 'extra_key':
      return dict(good, z=h), ()
    if kind == 'missing_key':
      return {'h': h}, ()
    if kind == 'list_for_tuple':
      return {'h': h, 'c': [a, n]}, ()
    if kind == 'bare_tensor':
      return h, ()
    if kind == 'float_dtype':
      return dict(good, h=tf.cast(h, tf.float64)), ()
    if kind == 'int_dtype':
      return {'h': h, 'c': (a, tf.cast(n, tf.int64))}, ()
    if kind == 'shape':
      return dict(good, h=h[:, :-1]), ()
    if kind == 'rank':
      return dict(good, h=h[None]), ()
    raise ValueError(kind)

  return Cell


def _BadStateArgs():
  w = tf.zeros([_H, _H])
  state0 = {'h': tf.zeros([_B, _H]), 'c': (tf.zeros([_B]), tf.constant(0))}
  return w, state0, tf.zeros([_T, _B, _H])


@pytest.mark.parametrize('kind', [
    'extra_key', 'missing_key', 'list_for_tuple', 'bare_tensor', 'float_dtype',
    'int_dtype', 'shape', 'rank'
])
@cases.POLICY
@pytest.mark.parametrize('mode', ['graph', 'function'])
def test_cell_changing_the_state_raises(mode, remat_policy, kind):

  def Build():
    w, state0, xs = _BadStateArgs()
    recurrent.Recurrent(
        w,
        state0,
        xs,
        _BadStateCell(kind),
        remat_policy=remat_policy)

  with pytest.raises(ValueError, match='state0'):
    cases.CallInMode(mode, Build)


@pytest.mark.parametrize('mode', ['graph', 'function'])
def test_good_state_cell_builds(mode):
  # The control for the test above: a cell that keeps state0's structure.

  def Build():
    w, state0, xs = _BadStateArgs()

    def Cell(theta, state, x):
      a, n = state['c']
      return {'h': tf.tanh(state['h'] @ theta + x), 'c': (a + 1.0, n + 1)}, ()

    return recurrent.Recurrent(w, state0, xs, Cell)

  cases.CallInMode(mode, Build)


@pytest.mark.parametrize('inputs', [
    lambda: {'a': tf.zeros([_T, _B]), 'b': tf.zeros([_T - 1, _B])},
    lambda: (tf.zeros([_T, _B]), tf.zeros([_T + 1])),
    lambda: [tf.zeros([_T, _B]), tf.zeros([1, _B], tf.int32)],
], ids=['dict', 'tuple', 'list_with_int'])
@pytest.mark.parametrize('mode', ['graph', 'function'])
def test_inputs_with_different_leading_dims_raise(mode, inputs):

  def Build():

    def Cell(theta, h, unused_inp):
      return h * theta, ()

    recurrent.Recurrent(tf.ones([]), tf.zeros([_B]), inputs(), Cell)

  with pytest.raises(ValueError, match='leading dim'):
    cases.CallInMode(mode, Build)


def test_unknown_leading_dim_and_no_inputs_raise():
  cell = lambda theta, h, unused_inp: (h * theta, ())
  with tf.Graph().as_default():
    unknown = tf.compat.v1.placeholder(tf.float32, [None, _B])
    with pytest.raises(ValueError, match='leading dim'):
      recurrent.Recurrent(tf.ones([]), tf.zeros([_B]), unknown, cell)
    with pytest.raises(ValueError, match='at least one input'):
      recurrent.Recurrent(tf.ones([]), tf.zeros([_B]), {}, cell)


def test_dynamic_extras_shape_raises():

  def Cell(theta, h, x):
    new_h = tf.tanh(h * theta + x)
    return new_h, {'positive': tf.boolean_mask(new_h, new_h > 0)}

  with tf.Graph().as_default():
    with pytest.raises(ValueError, match='static shapes'):
      recurrent.Recurrent(
          tf.ones([_H]), tf.zeros([_B, _H]), tf.zeros([_T, _B, _H]), Cell)


if __name__ == '__main__':
  sys.exit(pytest.main([__file__]))
