"""Small Lingvo body layers the tests pipeline, and NumPy versions of them.

The `*Fn` functions are the independent references: the same math as the
layers, written over NumPy or TensorFlow, applied layer by layer in a plain
loop by the tests.
"""

import types

import numpy as np

import gpipe  # pylint: disable=unused-import
from lingvo import compat as tf
from lingvo.core import base_layer
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap

# The math of each body written once over an array namespace, so the NumPy
# reference (forward) and the TensorFlow plain-loop reference (gradients) are
# the same formula, independent of the layer code under test.
NP = types.SimpleNamespace(
    einsum=np.einsum, tanh=np.tanh, sin=np.sin, sum=np.sum)
TF = types.SimpleNamespace(
    einsum=tf.einsum, tanh=tf.tanh, sin=tf.sin, sum=tf.reduce_sum)


def DenseFn(xp, w, b, x, scale=None, shift=None):
  """tanh(x @ w + b) [* scale] [+ shift]."""
  y = xp.tanh(xp.einsum('...d,de->...e', x, w) + b)
  if scale is not None:
    y = y * scale
  if shift is not None:
    y = y + shift
  return y


def MultiInputFn(xp, w, v, x, nested):
  """(x, nested) -> (x', nested'); see MultiInputBody."""
  x1 = xp.tanh(xp.einsum('...d,de->...e', x, w) + nested['a'])
  a1 = xp.sin(nested['a'] * v) + 0.5 * x
  b1 = nested['b'] * 0.9 + xp.sum(x1, axis=-1)
  return x1, {'a': a1, 'b': b1}


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
