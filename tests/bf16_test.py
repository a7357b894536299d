"""bfloat16 activations (Lingvo's fprop_dtype) through the pipeline.

With fprop_dtype=tf.bfloat16 the variables stay float32 and the body
computes in bfloat16. The same layer runs pipelined (training) and as the
plain stack (eval, unroll='eval_only'), on the same weights: outputs must be
equal exactly (each row meets the same ops in both), gradients must reach
the float32 variables, and the pipeline's aux loss and summaries must be
accumulated in float32.
"""

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import layers
from lingvo.core import cluster_factory
from lingvo.core import py_utils
from tests import reference_bodies

DIM, ROWS = 4, 2


def _Run(is_eval, layer, x):
  with cluster_factory.SetEval(is_eval):
    with py_utils.AuxLossContext() as aux_ctx:
      with py_utils.TpuSummaryTensorContext():
        y = layer.FProp(layer.theta, x)
        summaries = py_utils.GetTpuSummaryTensors()
  aux = tf.add_n([tf.cast(a, tf.float32) for a in aux_ctx.aux_losses])
  loss = tf.reduce_sum(tf.cast(y, tf.float32) * 0.5) + aux
  grads = tf.gradients(loss, layer.vars.Flatten())
  return dict(y=y, aux=aux, grads=grads, aux_losses=aux_ctx.aux_losses,
              summaries=summaries)


@pytest.mark.parametrize('s,m,r,schedule', [
    (2, 4, 1, 'reverse'), (2, 3, 2, 'reverse'), (3, 4, 2, 'reverse'),
    (3, 4, 2, '1f1b'), (2, 3, 2, '1f1b+stream_io')])
def test_bfloat16_pipeline_equals_the_plain_stack(s, m, r, schedule):
  x_np = np.random.RandomState(0).uniform(-1, 1, [ROWS * m, DIM])
  with tf.Graph().as_default():
    layer = layers.PipelinedLayer.Params().Set(
        name='pipe', num_stages=s, num_microbatches=m, circular_repeat=r,
        backward_schedule=schedule.split('+')[0],
        stream_io=schedule.endswith('stream_io'),
        unroll='eval_only', fprop_dtype=tf.bfloat16,
        single_stage_body=reference_bodies.TrainingBody.Params().Set(dim=DIM)
    ).Instantiate()
    x = tf.constant(x_np, tf.bfloat16)
    piped, plain = _Run(False, layer, x), _Run(True, layer, x)
    assert piped['y'].dtype == tf.bfloat16
    # The pipeline accumulates in float32: one aux loss, float32 summaries.
    assert [a.dtype for a in piped['aux_losses']] == [tf.float32]
    assert len(plain['aux_losses']) == s * r
    assert {v.dtype for v, _ in piped['summaries'].values()} == {tf.float32}
    assert len(piped['summaries']) == s
    variables = layer.vars.Flatten()
    assert {v.dtype.base_dtype for v in variables} == {tf.float32}
    for g in piped['grads']:
      assert g is not None and g.dtype == tf.float32
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      fetch = {k: {n: v[n] for n in ('y', 'aux', 'grads')}
               for k, v in (('piped', piped), ('plain', plain))}
      got = sess.run(fetch)
  np.testing.assert_array_equal(got['piped']['y'].astype(np.float32),
                                got['plain']['y'].astype(np.float32))
  # Sums in a different order, in bfloat16 inside the body: ~3 digits.
  np.testing.assert_allclose(got['piped']['aux'], got['plain']['aux'],
                             rtol=2e-2)
  for g, w in zip(got['piped']['grads'], got['plain']['grads']):
    assert np.all(np.isfinite(g)) and np.abs(g).max() > 0
    np.testing.assert_allclose(g, w, rtol=3e-2, atol=2e-2)
