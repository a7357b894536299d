"""What a PipelinedLayer's body may do, and what it must not.

A body's v1 summaries fail at build time; a body failing on inputs taken as
already microbatched names the forgotten microbatch params; rank-specific
bodies and per-microbatch scalars evaluate (unrolled) as they train
(pipelined); Lingvo bodies get their absl flags parsed; a body's outputs
must match its inputs, and per-stage states need a body method returning
them; aux losses equal the plain stack's, per microbatch; a body with
stateful dropout cannot be trained.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from lingvo.core import base_layer
from lingvo.core import cluster_factory
from lingvo.core import py_utils
from tests import layer_api_test
from tests import pipeline_harness as harness
from tests import reference_bodies
from tests import sessions

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_Params, _FProp = layer_api_test.Params, layer_api_test.FProp


class _V1SummaryBody(reference_bodies.DenseBody):

  def FProp(self, theta, x):
    y = super().FProp(theta, x)
    tf.compat.v1.summary.scalar('mean', tf.reduce_mean(y))
    return y


def test_v1_summaries_in_the_body_fail_at_build_time():
  with tf.Graph().as_default():
    layer = _Params(single_stage_body=_V1SummaryBody.Params()).Instantiate()
    with pytest.raises(ValueError, match=r'_V1SummaryBody.FProp.*'
                       r'tf.compat.v1.summary ops \(ScalarSummary\).*'
                       r'py_utils.AddTpuSummaryTensor'):
      layer.FProp(layer.theta, tf.zeros([4, 4]))


def test_forgotten_microbatch_params_are_named_when_the_body_fails():
  # Neither num_microbatches nor microbatch_size: [4, 4] is read as 4
  # microbatches of shape [4], which the body cannot multiply by [4, 4]...
  p = _Params(num_microbatches=None, single_stage_body=_RankTwoBody.Params())
  with tf.Graph().as_default():
    layer = p.Instantiate()
    with pytest.raises(ValueError, match='rank 2') as info:
      layer.FProp(layer.theta, tf.zeros([4, 4]))
  notes = ' '.join(getattr(info.value, '__notes__', []))
  assert ('taken as already microbatched: M=4 microbatches of shape [4]' in
          notes), notes
  assert 'set num_microbatches or microbatch_size' in notes


class _RankTwoBody(reference_bodies.DenseBody):

  def FProp(self, theta, x):
    if x.shape.rank != 2:
      raise ValueError(f'expects rank 2 inputs, got rank {x.shape.rank}')
    return super().FProp(theta, x)


def test_eval_of_premicrobatched_inputs_with_a_rank_specific_body():
  # The GShard builders' case: [M, mb, ...] inputs, a body that takes only
  # [mb, ...]; eval (unrolled) must equal training (pipelined).
  p = _Params(num_microbatches=None, unroll='eval_only', circular_repeat=2,
              single_stage_body=_RankTwoBody.Params().Set(dim=4))
  x = np.random.RandomState(2).uniform(-1, 1, [3, 2, 4]).astype(np.float32)
  with tf.Graph().as_default():
    layer = p.Instantiate()
    piped = layer.FProp(layer.theta, tf.constant(x))
    with cluster_factory.SetEval(True):
      unrolled = layer.FProp(layer.theta, tf.constant(x))
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      got, want = sess.run((unrolled, piped))
  assert got.shape == (3, 2, 4)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


class _LossCarryingBody(reference_bodies.DenseBody):
  """(x, loss) -> (y, loss + mean(y)), as the GShard builders carry their
  loss through the pipeline: one scalar per microbatch; adds an aux loss."""

  def FProp(self, theta, x, loss):
    if loss.shape.rank != 0:
      raise ValueError(f'loss must be a scalar, got shape {loss.shape}')
    y = super().FProp(theta, x)
    py_utils.AuxLossContext.Current().AddLoss(tf.reduce_mean(y * y))
    return y, loss + tf.reduce_mean(y)


@pytest.mark.parametrize('accumulation', ['mean', 'sum'])
def test_eval_of_premicrobatched_per_microbatch_scalars(accumulation):
  p = _Params(num_microbatches=None, unroll='eval_only', circular_repeat=2,
              aux_loss_microbatch_accumulation=accumulation,
              single_stage_body=_LossCarryingBody.Params().Set(dim=4))
  x_np = np.random.RandomState(4).uniform(-1, 1, [3, 2, 4]).astype(
      np.float32)

  def Run(layer):
    x = tf.constant(x_np)
    loss = tf.constant([0.5, -1.0, 2.0])  # [M]: a scalar per microbatch
    with py_utils.AuxLossContext() as aux_ctx:
      out = layer.FProp(layer.theta, x, loss)
    assert len(aux_ctx.aux_losses) == 1
    return out, aux_ctx.aux_losses[0]

  with tf.Graph().as_default():
    layer = p.Instantiate()
    piped = Run(layer)
    with cluster_factory.SetEval(True):
      unrolled = Run(layer)
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      got, want = sess.run((unrolled, piped))
  for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  assert got[0][1].shape == (3,)


def test_flags_are_parsed_for_lingvo_bodies_without_absl_app():
  script = (
      'import gpipe\n'
      'from absl import flags\n'
      'from gpipe import layers\n'
      'from tests import reference_bodies\n'
      'assert not flags.FLAGS.is_parsed()\n'
      "layers.PipelinedLayer.Params().Set(name='p', num_stages=2,\n"
      '    single_stage_body=reference_bodies.DenseBody.Params()\n'
      '    ).Instantiate()\n'
      'print(flags.FLAGS.xla_device)\n'
      'from gpipe.apps import prompt_exit\n'
      'prompt_exit.Exit(0)\n')
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  env['PYTHONPATH'] = str(_ROOT) + os.pathsep + env.get('PYTHONPATH', '')
  proc = subprocess.run([sys.executable, '-c', script], cwd=_ROOT, env=env,
                        capture_output=True, text=True, timeout=300,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]


class _TwoOutputBody(base_layer.BaseLayer):

  def FProp(self, theta, x):
    return x, x


class _DtypeChangingBody(base_layer.BaseLayer):

  def FProp(self, theta, x):
    return tf.cast(x, tf.float64)


class _ShapeChangingBody(base_layer.BaseLayer):

  def FProp(self, theta, x):
    return tf.concat([x, x], axis=-1)


@pytest.mark.parametrize('unroll', ['never', 'always'])
@pytest.mark.parametrize('body,pattern', [
    (_TwoOutputBody,
     r'nesting differs: inputs \(T,\), outputs \(\(T, T\),\)'),
    (_DtypeChangingBody, r'input dtype float32, output dtype float64'),
    (_ShapeChangingBody, r'input shape \(\d+, 4\), output shape \(\d+, 8\)'),
])
def test_body_outputs_must_match_inputs(body, pattern, unroll):
  p = _Params(single_stage_body=body.Params(), unroll=unroll)
  with pytest.raises(ValueError,
                     match=r'single_stage_body \(' + body.__name__ +
                     r'\) must return the same structure as its inputs.*' +
                     pattern):
    _FProp(p)


def test_per_stage_states_need_a_body_method_that_returns_them():
  # DenseBody.FProp takes one input and returns one output: given a state
  # too, it returns too few outputs, and the error says so.
  with tf.Graph().as_default():
    layer = _Params().Instantiate()
    sched = layer.Schedule(2)
    with pytest.raises(ValueError, match='expected 2 outputs'):
      layer.FPropFn(layer.theta, 'FProp', tf.zeros([4, 4]),
                    padded_per_stage_states=[
                        tf.zeros([sched.num_iterations, 2, 1])])


# -- Aux losses. -------------------------------------------------------------


class _AuxLossBody(reference_bodies.DenseBody):
  """DenseBody that adds mean(y^2) of its output as an aux loss."""

  def FProp(self, theta, x, scale=None, shift=None):
    y = super().FProp(theta, x, scale, shift)
    py_utils.AuxLossContext.Current().AddLoss(tf.reduce_mean(tf.square(y)))
    return y


@pytest.mark.parametrize('accumulation', ['mean', 'sum'])
@pytest.mark.parametrize('circular_repeat', [1, 2])
def test_aux_loss_equals_sequential_per_microbatch(accumulation,
                                                   circular_repeat):
  s_count, m_count, batch = 3, 4, 8
  p = _Params(
      num_stages=s_count,
      num_microbatches=m_count,
      circular_repeat=circular_repeat,
      aux_loss_microbatch_accumulation=accumulation,
      single_stage_body=_AuxLossBody.Params().Set(dim=4))
  x_np = np.random.RandomState(0).uniform(-1, 1, [batch, 4]).astype(np.float32)
  with tf.Graph().as_default():
    layer = p.Instantiate()
    with py_utils.AuxLossContext() as ctx:
      layer.FProp(layer.theta, tf.constant(x_np))
    assert len(ctx.aux_losses) == 1
    aux = ctx.aux_losses[0]
    grads = tf.gradients(aux, layer.vars.Flatten())
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      aux_v, grads_v, vars_v = sess.run([aux, grads, layer.vars])
  weights = harness.PerLayerWeights(
      harness.Case(num_stages=s_count, circular_repeat=circular_repeat),
      {k: dict(v) for k, v in vars_v.items()})
  # Microbatch m holds rows m, m + M, ... (see gpipe.microbatch).
  total = 0.0
  for m in range(m_count):
    h = x_np[m::m_count]
    for w in weights:
      h = reference_bodies.DenseFn(reference_bodies.NP, w['w'], w['b'], h)
      total += np.mean(np.square(h))
  if accumulation == 'mean':
    total /= m_count
  np.testing.assert_allclose(aux_v, total, rtol=1e-5)
  assert all(np.abs(g).max() > 0 for g in grads_v)


class _StatefulDropoutBody(reference_bodies.DenseBody):
  """Dropout from a stateful random op (as Lingvo's plain DropoutLayer)."""

  def FProp(self, theta, x):
    return tf.nn.dropout(super().FProp(theta, x), rate=0.5)


def test_a_body_with_stateful_dropout_cannot_be_trained():
  """Its recomputation would draw other masks: the gradient would be wrong.
  The forward pass alone (e.g. decoding) is allowed."""
  p = _Params(single_stage_body=_StatefulDropoutBody.Params().Set(dim=4))
  with tf.Graph().as_default():
    layer = p.Instantiate()
    y = layer.FProp(layer.theta, tf.ones([4, 4]))
    with pytest.raises(ValueError, match=r'its body\) draws random numbers '
                       r'with stateful ops \(RandomUniform.*gradients would '
                       r'be wrong.*DeterministicDropoutLayer'):
      tf.gradients(tf.reduce_sum(y), layer.vars.Flatten())
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      assert sess.run(y).shape == (4, 4)


if __name__ == '__main__':
  sys.exit(pytest.main([__file__]))
