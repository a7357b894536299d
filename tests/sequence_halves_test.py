"""Pod blocks run on the sequence's two halves (params/sequence_halves.py).

The halved stage equals the stage it halves (values and every gradient) on
one device, its blocks recomputed in the backward pass or not; partitioned
on a model axis of 4 (each block recomputed, as the largest LMs run it)
it equals the whole stage on one device, every all-reduce of an
activation but the forward's last has matrix work beside it (the whole
stage's forward reductions have none), and the wire carries what the
whole stage's reductions carry: the recomputation computes no reduction
it does not read.
"""

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import sharding
from gpipe.lingvo_support import flags_and_seeds
from gpipe.lingvo_support import tpu_build
from gpipe.xla import dependencies
from gpipe.xla import hlo_text
from gpipe.xla import partitioning
from lingvo.core import py_utils
import params.lm as lm
from params import pod_blocks
from params import sequence_halves
from tests import close
from tests import sessions

flags_and_seeds.EnsureFlagsParsed()

BATCH, TIME, DIM, HEADS, HIDDEN, BLOCKS = 2, 8, 16, 4, 24, 2
MESH = pod_blocks.PodMesh(stages=1, data=1, model=4)


def _StageParams(halves, remat):
  """Two fused-qkv blocks split over MESH's model axis as on a pod; with
  `halves`, run on the sequence's two halves."""
  block = pod_blocks.SplitBlockOverMesh(pod_blocks.PodBlockParams(
      DIM, HEADS, HIDDEN, 0.0, fused_qkv=True))
  p = pod_blocks.PodStageParams(BLOCKS, block, remat_blocks=remat).Set(
      name='stage', device_mesh=MESH.device_mesh)
  return sequence_halves.SequenceHalves(p) if halves else p


def _Inputs():
  rng = np.random.RandomState(0)
  x = rng.normal(size=[BATCH, TIME, DIM]).astype(np.float32)
  paddings = np.zeros([BATCH, TIME], np.float32)
  paddings[0, -3:] = 1.0
  return x, paddings


def _StepFn(stage, paddings):
  """fn(*weights, x) -> [y, dx, dweights...] of a loss of the stage's y."""

  def Step(*args):
    weights, x = list(args[:-1]), args[-1]
    with tf.GradientTape() as tape:
      tape.watch([x] + weights)
      y, _ = stage.FProp(stage.theta.Pack(weights), x, tf.constant(paddings))
      loss = tf.reduce_sum(y * tf.sin(y))
    return [y] + tape.gradient(loss, [x] + weights)

  return Step


def _Build(halves, remat):
  """The stage and its initial weights as arrays."""
  stage = _StageParams(halves, remat).Instantiate()
  with sessions.AsBuilt() as sess:
    sess.run(tf.compat.v1.global_variables_initializer())
    return stage, sess.run(stage.vars.Flatten())


def _OnOneDevice(halves, remat, weights=None):
  """(the stage's step at `weights` (None: its own initial ones), those
  weights), in a graph of its own."""
  x, paddings = _Inputs()
  with tf.Graph().as_default():
    py_utils.GetOrCreateGlobalStepVar()
    stage, initial = _Build(halves, remat)
    weights = initial if weights is None else weights
    result = _StepFn(stage, paddings)(*[tf.constant(w) for w in weights],
                                      tf.constant(x))
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      return sess.run(result), weights


@pytest.mark.parametrize('remat', [False, True])
def test_the_halves_equal_the_whole_block_on_one_device(remat):
  want, weights = _OnOneDevice(False, remat)
  got, _ = _OnOneDevice(True, remat, weights)
  assert all(np.abs(w).max() > 0 for w in want)
  close.AssertClose(got, want, close.FLOAT32, 'halved stage')


def test_partitioned_each_halfs_reduction_runs_beside_the_other_half():
  """[1, 1, 4], blocks recomputed: the step equals the whole stage's on one
  device; of the model axis's all-reduces of activations (forward,
  recomputed, backward) only the forward's last has no matmul beside it,
  and they carry 5 activations a block, as the whole stage's do (2
  forward, 1 recomputed, 2 backward)."""
  if not partitioning.IsAvailable():
    pytest.skip('needs jax')
  x, paddings = _Inputs()
  with tf.Graph().as_default(), tpu_build.AsOnTpu():
    whole, weights = _Build(False, remat=True)
  with tf.Graph().as_default(), tpu_build.AsOnTpu():
    halves, _ = _Build(True, remat=True)

  def Partitioned(*args):
    with tpu_build.AsOnTpu(), sharding.SpmdPartitioning():
      return _StepFn(halves, paddings)(*args)

  run = partitioning.RunPartitioned(Partitioned, weights + [x],
                                    MESH.num_devices)
  with tpu_build.AsOnTpu():
    expected = tf.function(_StepFn(whole, paddings), jit_compile=True,
                           autograph=False)(
                               *[tf.constant(a) for a in weights + [x]])
  for i, (got, want) in enumerate(zip(run.outputs, expected)):
    close.AssertClose(got, want.numpy(), close.FLOAT32_AT_SCALE, f'output {i}')
  module = dependencies.Module(run.hlo)
  alone, elements = [], 0
  for c in run.collectives:
    shapes = hlo_text.ShapesOf(c.shape)
    if c.kind != 'all-reduce' or any(s[-1] != DIM for s in shapes):
      continue  # (the weights' gradients', over no axis here)
    elements += sum(int(np.prod(s)) for s in shapes)
    work = module.Work(c.computation)
    if not any(name in work for name in module.Beside(c.computation,
                                                      c.name)):
      alone.append(c.op_name)
  assert len(alone) == 1, alone
  assert elements == 5 * BLOCKS * BATCH * TIME * DIM


def test_halves_refuse_what_they_cannot_split():
  block = pod_blocks.PodBlockParams(DIM, HEADS, HIDDEN, 0.1, rotary=True)
  stage = sequence_halves.SequenceHalves(
      pod_blocks.PodStageParams(1, block).Set(name='stage'))
  with tf.Graph().as_default(), pytest.raises(
      ValueError, match='dropout, rotary embeddings'):
    stage.Instantiate()
  with pytest.raises(ValueError, match='sequence_parallel'):
    lm.CopyLMParams(
        vocab_size=8, model_dim=8, num_heads=2, hidden_dim=8,
        blocks_per_stage=1, num_stages=2, circular_repeat=1,
        num_microbatches=2, dropout_prob=0.0, shard_stages_1d=False,
        learning_rate=1e-3, max_steps=1, batch_major=True,
        mesh=pod_blocks.PodMesh(stages=2, model=2),
        sequence_parallel=True, sequence_halves=True)


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
