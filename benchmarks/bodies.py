"""What the benchmarks run: bodies, the plain stack, a naive pipeline."""

import numpy as np

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
import tensorflow as tf
from gpipe import layers
from gpipe import schedule
from lingvo.core import base_layer
from lingvo.core import py_utils


class MlpBody(base_layer.BaseLayer):
  """x + tanh(x @ w1) @ w2: its activations are [rows, hidden] internally."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 64, 'Model (buffer) width.')
    p.Define('hidden', 256, 'Internal width.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    init = py_utils.WeightInit.Gaussian(1.0 / np.sqrt(p.dim))
    self.CreateVariable('w1', py_utils.WeightParams([p.dim, p.hidden], init))
    self.CreateVariable('w2', py_utils.WeightParams([p.hidden, p.dim], init))

  def FProp(self, theta, x):
    return x + tf.einsum('bh,hd->bd', tf.tanh(
        tf.einsum('bd,dh->bh', x, theta.w1)), theta.w2) * 0.5


class WideBody(base_layer.BaseLayer):
  """Internal activations [rows, expansion, dim], weights fixed at [dim, dim].

  x + mean_k(sin(tanh(x @ w1) * f_k)) @ w2: its internals grow with
  `expansion` while its weights and its input/output (the buffer) do not.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 64, 'Model (buffer) width.')
    p.Define('expansion', 4, 'Internal width / dim.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    init = py_utils.WeightInit.Gaussian(1.0 / np.sqrt(p.dim))
    self.CreateVariable('w1', py_utils.WeightParams([p.dim, p.dim], init))
    self.CreateVariable('w2', py_utils.WeightParams([p.dim, p.dim], init))

  def FProp(self, theta, x):
    p = self.params
    h = tf.tanh(tf.einsum('bd,de->be', x, theta.w1))
    freqs = tf.constant(np.linspace(0.5, 2.0, p.expansion), tf.float32)
    wide = tf.sin(h[:, None, :] * freqs[None, :, None])  # [b, k, d]
    return x + tf.einsum('bd,de->be', tf.reduce_mean(wide, axis=1),
                         theta.w2) * 0.5


def Params(num_stages, num_microbatches, circular_repeat, dim, hidden,
            cls=layers.PipelinedLayer, body=None, **kwargs):
  body = body or MlpBody.Params().Set(dim=dim, hidden=hidden)
  return cls.Params().Set(
      name='pipe', num_stages=num_stages, num_microbatches=num_microbatches,
      circular_repeat=circular_repeat, unroll='never', random_seed=1,
      single_stage_body=body).Set(**kwargs)


def _LayerThetas(layer, theta):
  """Every logical layer's weights, in order (sliced once)."""
  p = layer.params
  return [layer.layer_theta(theta, r, s)
          for r in range(p.circular_repeat) for s in range(p.num_stages)]


def PlainStack(layer, theta, x):
  """The unpipelined reference: every logical layer after the other."""
  for layer_theta in _LayerThetas(layer, theta):
    x = layer.body.FProp(layer_theta, x)
  return x


def PlainStackPerMicrobatch(layer, theta, x):
  """The plain stack on one microbatch after the other (gradient
  accumulation): the pipeline's matmul sizes, without its schedule.

  Each layer's weights are sliced once for all microbatches: TensorFlow
  then sums their gradients before writing them into the stacked
  gradient, as a gradient-accumulation loop over one model would.
  """
  thetas = _LayerThetas(layer, theta)
  outputs = []
  for part in tf.split(x, layer.params.num_microbatches, axis=0):
    for layer_theta in thetas:
      part = layer.body.FProp(layer_theta, part)
    outputs.append(part)
  return tf.concat(outputs, axis=0)


def NaiveWhileLoopPipeline(layer, theta, x):
  """A plain pipeline: tf.while_loop over a shifting [S, ...] buffer, each
  stage's body called on its slot, differentiated by TF, which keeps every
  iteration's intermediates for the backward pass."""
  p = layer.params
  s_count = p.num_stages
  m = p.num_microbatches
  mb = tf.reshape(x, [m, -1, x.shape[-1]])
  iterations = schedule.Schedule(s_count, m, 1).num_iterations
  padded = tf.concat([mb, tf.zeros([s_count - 1] + mb.shape.as_list()[1:])],
                     axis=0)

  def Body(i, buf, outs):
    shifted = tf.concat([padded[i][None], buf[:-1]], axis=0)
    new = tf.stack([
        layer.body.FProp(layer.layer_theta(theta, 0, s), shifted[s])
        for s in range(s_count)
    ])
    outs = outs.write(i, new[-1])
    return i + 1, new, outs

  buf0 = tf.zeros([s_count] + mb.shape.as_list()[1:])
  outs0 = tf.TensorArray(tf.float32, size=iterations)
  _, _, outs = tf.while_loop(lambda i, *_: i < iterations, Body,
                             [tf.constant(0), buf0, outs0],
                             maximum_iterations=iterations)
  y = outs.stack()[s_count - 1:]
  return tf.reshape(y, x.shape)


