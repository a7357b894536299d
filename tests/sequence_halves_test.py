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
from params import pod_blocks
from params import sequence_halves
from tests import close
from tests import pod_stages

flags_and_seeds.EnsureFlagsParsed()

BATCH = 2
DIM, HEADS, HIDDEN, BLOCKS = (pod_stages.DIM, pod_stages.HEADS,
                              pod_stages.HIDDEN, pod_stages.BLOCKS)
MESH = pod_blocks.PodMesh(stages=1, data=1, model=4)


def _StageParams(halves, remat):
  """pod_stages' stage on MESH; with `halves`, on the sequence's halves."""
  return pod_stages.StageParams(
      MESH, sequence_halves.SequenceHalves if halves else None, remat=remat)


@pytest.mark.parametrize('remat', [False, True])
def test_the_halves_equal_the_whole_block_on_one_device(remat):
  want, weights = pod_stages.OnOneDevice(_StageParams(False, remat), BATCH)
  got, _ = pod_stages.OnOneDevice(_StageParams(True, remat), BATCH,
                                  weights=weights)
  assert all(np.abs(w).max() > 0 for w in want)
  close.AssertClose(got, want, close.FLOAT32, 'halved stage')


def test_partitioned_each_halfs_reduction_runs_beside_the_other_half():
  """[1, 1, 4], blocks recomputed: the step equals the whole stage's on one
  device; of the model axis's all-reduces of activations (forward,
  recomputed, backward) only the forward's last has no matmul beside it,
  and they carry 5 activations a block, as the whole stage's do (2
  forward, 1 recomputed, 2 backward)."""
  if not partitioning.IsAvailable():
    pytest.fail('jax and jaxlib are needed (they are in the test extra).')
  x, paddings = pod_stages.Inputs(BATCH)
  with tf.Graph().as_default(), tpu_build.AsOnTpu():
    whole, weights = pod_stages.Build(_StageParams(False, remat=True))
  with tf.Graph().as_default(), tpu_build.AsOnTpu():
    halves, _ = pod_stages.Build(_StageParams(True, remat=True))

  def Partitioned(*args):
    with tpu_build.AsOnTpu(), sharding.SpmdPartitioning():
      return pod_stages.StepFn(halves, paddings)(*args)

  run = partitioning.RunPartitioned(Partitioned, weights + [x],
                                    MESH.num_devices)
  with tpu_build.AsOnTpu():
    expected = tf.function(pod_stages.StepFn(whole, paddings), jit_compile=True,
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
  assert elements == 5 * BLOCKS * BATCH * pod_stages.TIME * DIM


def test_halves_refuse_what_they_cannot_split():
  block = pod_blocks.PodBlockParams(DIM, HEADS, HIDDEN, 0.1, rotary=True)
  stage = sequence_halves.SequenceHalves(
      pod_blocks.PodStageParams(1, block).Set(name='stage'))
  with tf.Graph().as_default(), pytest.raises(
      ValueError, match='dropout, rotary embeddings'):
    stage.Instantiate()
  with pytest.raises(ValueError, match='sequence_parallel'):
    pod_stages.TinyCopyLMParams(mesh=pod_blocks.PodMesh(stages=2, model=2),
                                sequence_parallel=True, sequence_halves=True)


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
