"""Small Lingvo body layers the tests pipeline, and NumPy versions of them.

Each layer's NumPy twin (`Np*`) is the independent reference: the tests run
the pipelined layer in TensorFlow and the plain sequential stack in NumPy,
with the same weights.
"""

import numpy as np

import gpipe  # pylint: disable=unused-import
from lingvo import compat as tf
from lingvo.core import base_layer
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap


def _Init(scale=0.5):
  return py_utils.WeightInit.Gaussian(scale)


class DenseBody(base_layer.BaseLayer):
  """x -> tanh(x @ w + b) on the last dim; optional per-example `scale`."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 4, 'Feature dim.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateVariable('w', py_utils.WeightParams([p.dim, p.dim], _Init()))
    self.CreateVariable('b', py_utils.WeightParams([p.dim], _Init(0.1)))

  def FProp(self, theta, x, scale=None, shift=None):
    y = tf.tanh(tf.einsum('...d,de->...e', x, theta.w) + theta.b)
    if scale is not None:
      y *= scale
    if shift is not None:
      y += shift
    return y


def NpDense(w, b, x, scale=None, shift=None):
  y = np.tanh(np.einsum('...d,de->...e', x, w) + b)
  if scale is not None:
    y = y * scale
  if shift is not None:
    y = y + shift
  return y


class MultiInputBody(base_layer.BaseLayer):
  """FProp(x, unused_none, nested) -> (x', None, NestedMap(a', b')).

  Mixes the inputs so that a wrong routing of any of them shows.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 4, 'Feature dim.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateVariable('w', py_utils.WeightParams([p.dim, p.dim], _Init()))
    self.CreateVariable('v', py_utils.WeightParams([p.dim], _Init()))

  def FProp(self, theta, x, none_arg, nested):
    assert none_arg is None
    x1 = tf.tanh(tf.einsum('...d,de->...e', x, theta.w) + nested.a)
    a1 = tf.sin(nested.a * theta.v) + 0.5 * x
    b1 = nested.b * 0.9 + tf.reduce_sum(x1, axis=-1)
    return x1, None, NestedMap(a=a1, b=b1)


def NpMultiInput(w, v, x, nested):
  x1 = np.tanh(np.einsum('...d,de->...e', x, w) + nested['a'])
  a1 = np.sin(nested['a'] * v) + 0.5 * x
  b1 = nested['b'] * 0.9 + np.sum(x1, axis=-1)
  return x1, {'a': a1, 'b': b1}


class StageParallelDenseBody(base_layer.BaseLayer):
  """All stages at once: x [S, ..., d] -> tanh(x @ w[s] + b[s]) per stage."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 4, 'Feature dim.')
    p.Define('num_stages', 1, 'Leading stage dim of weights and inputs.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateVariable(
        'w', py_utils.WeightParams([p.num_stages, p.dim, p.dim], _Init()))
    self.CreateVariable('b',
                        py_utils.WeightParams([p.num_stages, p.dim], _Init(0.1)))

  def FProp(self, theta, x, scale=None, shift=None):
    b = tf.reshape(theta.b, [self.params.num_stages] + [1] *
                   (x.shape.rank - 2) + [self.params.dim])
    y = tf.tanh(tf.einsum('s...d,sde->s...e', x, theta.w) + b)
    if scale is not None:
      y *= scale
    if shift is not None:
      y += shift
    return y
