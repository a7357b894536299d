"""The pod configs' stage body (params/pod_blocks.py) in the Lingvo LM.

The pipelined LM with the pod body equals the unrolled one at init (split
as on a pod), and in bfloat16 within its precision; the stage computes in
bfloat16 on float32 weights; its weight gradients build nothing larger than
the activations (the copy LM's time-major layer does). The model is
lm_params_test.py's TinyCfg.
"""

import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe.apps import trainer
import params.lm as lm
from params import pod_blocks
from tests import lm_params_test

_TinyCfg = lm_params_test.TinyCfg


# -- The pod configs' stage body (params/pod_blocks.py). ----------------------


def test_pod_body_pipelined_lm_equals_unrolled_at_init():
  """Circular, with the stages, embeddings and loss split as on a pod (the
  sharding annotations run as identities on one CPU)."""
  cfg = _TinyCfg(circular_repeat=2, dropout_prob=0.1, shard_stages_1d=True,
                 batch_major=True)
  comparison = trainer.CompareWithUnrolled(cfg)
  assert comparison.num_variables > 0
  assert comparison.Matches(), comparison.Describe()


def test_pod_body_in_bfloat16_equals_unrolled_within_its_precision():
  """bfloat16 activations, between the stages too: the pipelined model's
  loss equals the unrolled one's, the weight gradients (float32, summed
  over microbatches instead of once) to bfloat16's precision."""
  cfg = _TinyCfg(batch_major=True, fprop_dtype=tf.bfloat16,
                 stack_dtype=tf.bfloat16)
  comparison = trainer.CompareWithUnrolled(cfg)
  assert comparison.Matches(atol=1e-5, rtol=1e-2), comparison.Describe()


def test_pod_stage_computes_in_bfloat16_on_float32_weights():
  """The blocks' matmuls run in bfloat16; the stage's theta, the weight
  gradients and what it returns (for float32 inputs) stay float32."""
  block = pod_blocks.PodBlockParams(16, 2, 24, 0.0, tf.bfloat16)
  with tf.Graph().as_default() as graph:
    stage = pod_blocks.PodStageParams(2, block, tf.bfloat16).Set(
        name='stage').Instantiate()
    theta = stage.theta
    y, _ = stage.FProp(theta, tf.ones([3, 5, 16]), tf.zeros([3, 5]))
    grads = tf.gradients(tf.reduce_sum(y), theta.Flatten())
    einsums = [op.outputs[0].dtype for op in graph.get_operations()
               if op.type in ('Einsum', 'MatMul')]
  assert y.dtype == tf.float32
  assert {t.dtype for t in theta.Flatten()} == {tf.float32}
  assert {g.dtype for g in grads} == {tf.float32}
  assert einsums and set(einsums) == {tf.bfloat16}, einsums


def _LargestGradientTensor(stage_params, batch, time, dim):
  """Elements of the largest tensor the stage's weight gradients make."""
  with tf.Graph().as_default() as graph:
    stage = stage_params.Set(name='stage').Instantiate()
    x = tf.ones([batch, time, dim])
    y, _ = stage.FProp(stage.theta, x, tf.zeros([batch, time]))
    variables = stage.vars.Flatten()
    before = set(graph.get_operations())
    tf.gradients(tf.reduce_sum(tf.square(y)), variables)
    sizes = [t.shape.num_elements() or 0
             for op in graph.get_operations() if op not in before
             for t in op.outputs if t.shape.is_fully_defined()]
  return max(sizes), max(v.shape.num_elements() for v in variables)


def test_pod_body_weight_gradients_build_nothing_larger_than_activations():
  """Einsum projections over [b, t, d]: each weight gradient contracts
  batch and time at once. The copy LM's time-major layer projects with a
  broadcasting matmul whose gradient makes a [t, d, d] product first."""
  batch, time, dim, hidden = 3, 7, 16, 24
  bound = batch * time * hidden  # the largest activation, [b, t, hidden]
  block = pod_blocks.PodBlockParams(dim, 2, hidden, 0.0)
  largest, weight = _LargestGradientTensor(
      pod_blocks.PodStageParams(2, block), batch, time, dim)
  assert largest <= max(bound, weight), (largest, bound, weight)
  time_major = lm.StageBlocks.Params().Set(
      num_blocks=1, block_tpl=lm.CausalBlockParams(dim, 2, hidden, 0.0))
  largest, _ = _LargestGradientTensor(time_major, batch, time, dim)
  assert largest >= time * dim * dim > bound


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
