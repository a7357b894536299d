"""Small Lingvo body layers the tests pipeline, and NumPy versions of them.

The `*Fn` functions are the independent references: the same math as the
layers, written over NumPy or TensorFlow, applied layer by layer in a plain
loop by the tests.
"""

import types

import numpy as np

import gpipe  # pylint: disable=unused-import
from gpipe import sharding
from lingvo import compat as tf
from lingvo.core import base_layer
from lingvo.core import layers as lingvo_layers
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap

# The math of each body written once over an array namespace, so the NumPy
# reference (forward) and the TensorFlow plain-loop reference (gradients) are
# the same formula, independent of the layer code under test.
NP = types.SimpleNamespace(
    einsum=np.einsum, tanh=np.tanh, sin=np.sin, sum=np.sum,
    mean_rows=lambda x: x.reshape(-1, x.shape[-1]).mean(0))
TF = types.SimpleNamespace(
    einsum=tf.einsum, tanh=tf.tanh, sin=tf.sin, sum=tf.reduce_sum,
    mean_rows=lambda x: tf.reduce_mean(tf.reshape(x, [-1, x.shape[-1]]), 0))


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


class RowsDenseBody(DenseBody):
  """DenseBody (the same DenseFn) computed on its input's rows [n, dim] by
  an einsum without ellipses: the form whose weight gradient
  gpipe.loops.deferred_dots sums once after the backward loop."""

  def FProp(self, theta, x, scale=None, shift=None):
    assert scale is None and shift is None
    rows = tf.reshape(x, [-1, self.params.dim])
    y = tf.tanh(tf.einsum('rd,de->re', rows, theta.w) + theta.b)
    return tf.reshape(y, tf.shape(x))


class MeshDenseBody(DenseBody):
  """DenseBody whose activations carry their own mesh annotation.

  The batch dim of its input and output is split over `batch_mesh_dim` of
  `device_mesh` (written without the stage dim, as a user's layer would be):
  inside a pipeline that splits stages over another mesh axis, the
  annotation must keep working on this one.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('batch_mesh_dim', 1, 'Mesh axis that splits the batch dim.')
    return p

  def _Annotate(self, x):
    p = self.params
    mapping = [p.batch_mesh_dim] + [-1] * (x.shape.rank - 1)
    return sharding.MeshSplit(x, p.device_mesh, mapping)

  def FProp(self, theta, x, scale=None, shift=None):
    y = super().FProp(theta, self._Annotate(x), scale, shift)
    return self._Annotate(y)


class TrainingBody(base_layer.BaseLayer):
  """y = tanh(x @ w + b) [* x / x] [dropout]; aux loss and summary mean(y^2)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 4, 'Feature dim.')
    p.Define('keep_prob', 1.0, 'Dropout keep probability (1: none).')
    p.Define('divide_by_input', False, 'Multiply by x / x (NaN at 0).')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    init = py_utils.WeightInit.Gaussian(0.5)
    self.CreateVariable('w', py_utils.WeightParams([p.dim, p.dim], init))
    self.CreateVariable('b', py_utils.WeightParams([p.dim], init))
    if p.keep_prob < 1.0:
      self.CreateChild(
          'dropout',
          lingvo_layers.DeterministicDropoutLayer.Params().Set(
              keep_prob=p.keep_prob, random_seed=11))

  def FProp(self, theta, x):
    p = self.params
    y = tf.tanh(tf.einsum('...d,de->...e', x, theta.w) + theta.b)
    if p.divide_by_input:
      # x / x is 1 on real data and NaN at 0, in the forward pass and, via
      # d(y * c)/dy = c, in the gradient of y and the weights. The factor is
      # cut from the gradient: its derivative, 0 in exact arithmetic, is
      # rounding noise amplified by 1 / x, which two correct implementations
      # summing in different orders need not agree on.
      y *= tf.stop_gradient(x / x)
    if p.keep_prob < 1.0:
      y = self.dropout.FProp(theta.dropout, y)
    score = tf.reduce_mean(tf.square(y))
    py_utils.AuxLossContext.Current().AddLoss(score)
    py_utils.AddTpuSummaryTensor(
        'mean_sq', score, weight=tf.cast(tf.shape(x)[0], tf.float32))
    return y


class StatefulBody(base_layer.BaseLayer):
  """tanh(x @ w + b + moving), then moving <- 0.8 moving + 0.2 mean(x).

  Non-trainable state that the forward pass reads and updates, the way batch
  norm keeps moving statistics, plus a step counter.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 4, 'Feature dim.')
    p.Define('with_counter', True, 'Also keep an int32 step counter.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateVariable('w', py_utils.WeightParams([p.dim, p.dim], _Init()))
    self.CreateVariable('b', py_utils.WeightParams([p.dim], _Init(0.1)))
    self.CreateVariable(
        'moving',
        py_utils.WeightParams([p.dim], py_utils.WeightInit.Constant(0.1)),
        trainable=False)
    if p.with_counter:
      self.CreateVariable(
          'count',
          py_utils.WeightParams([], py_utils.WeightInit.Constant(0), tf.int32),
          trainable=False)

  def FProp(self, theta, x):
    y = tf.tanh(tf.einsum('...d,de->...e', x, theta.w) + theta.b +
                theta.moving)
    batch_mean = tf.reduce_mean(x, axis=list(range(x.shape.rank - 1)))
    py_utils.UpdateBatchNormVars(self.vars.moving, batch_mean, 0.8)
    if self.params.with_counter:
      tf.assign_add(self.vars.count, 1)
    return y


def StatefulFn(xp, w, b, moving, x):
  """StatefulBody's math: (y, new moving)."""
  y = xp.tanh(xp.einsum('...d,de->...e', x, w) + b + moving)
  return y, 0.8 * moving + 0.2 * xp.mean_rows(x)


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
