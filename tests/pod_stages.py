"""A pod stage of two small blocks, its inputs and its training step: what
the tests of the pod blocks' variants (tests/sequence_parallel_test.py,
tests/sequence_halves_test.py) compare against the plain stage."""

import numpy as np

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from lingvo.core import py_utils
import params.lm as lm
from params import pod_blocks
from tests import sessions

TIME, DIM, HEADS, HIDDEN, BLOCKS = 8, 16, 4, 24, 2


def StageParams(mesh, variant=None, dropout=0.0, remat=False):
  """Two fused-qkv blocks split over `mesh`'s model axis as on a pod;
  `variant` (e.g. sequence_parallel.SequenceParallel) applied if given."""
  block = pod_blocks.SplitBlockOverMesh(pod_blocks.PodBlockParams(
      DIM, HEADS, HIDDEN, dropout, fused_qkv=True))
  p = pod_blocks.PodStageParams(BLOCKS, block, remat_blocks=remat).Set(
      name='stage', device_mesh=mesh.device_mesh)
  return variant(p) if variant else p


def Inputs(batch):
  """(x [batch, TIME, DIM], paddings [batch, TIME]: the first sequence's
  last 3 positions padded)."""
  rng = np.random.RandomState(0)
  x = rng.normal(size=[batch, TIME, DIM]).astype(np.float32)
  paddings = np.zeros([batch, TIME], np.float32)
  paddings[0, -3:] = 1.0
  return x, paddings


def StepFn(stage, paddings):
  """fn(*weights, x) -> [y, dx, dweights...] of a loss of the stage's y."""

  def Step(*args):
    weights, x = list(args[:-1]), args[-1]
    with tf.GradientTape() as tape:
      tape.watch([x] + weights)
      y, _ = stage.FProp(stage.theta.Pack(weights), x, tf.constant(paddings))
      loss = tf.reduce_sum(y * tf.sin(y))
    return [y] + tape.gradient(loss, [x] + weights)

  return Step


def Build(params):
  """The stage of `params` and its initial weights as arrays."""
  stage = params.Instantiate()
  with sessions.AsBuilt() as sess:
    sess.run(tf.compat.v1.global_variables_initializer())
    return stage, sess.run(stage.vars.Flatten())


def OnOneDevice(params, batch, mode='graph', weights=None):
  """(the stage's step at `weights` (None: its own initial ones), those
  weights), in a graph of its own: dropout's masks are seeded by the op
  names, the same in two stages' graphs."""
  x, paddings = Inputs(batch)
  with tf.Graph().as_default():
    py_utils.GetOrCreateGlobalStepVar()
    stage, initial = Build(params)
    weights = initial if weights is None else weights
    step = StepFn(stage, paddings)
    if mode == 'jit':
      step = tf.function(step, jit_compile=True, autograph=False)
    result = step(*[tf.constant(w) for w in weights], tf.constant(x))
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      return sess.run(result), weights


def TinyCopyLMParams(**options):
  """lm.CopyLMParams of a two-stage batch-major LM of one tiny block a
  stage, with `options`: what its option checks see."""
  return lm.CopyLMParams(
      vocab_size=8, model_dim=8, num_heads=2, hidden_dim=8,
      blocks_per_stage=1, num_stages=2, circular_repeat=1,
      num_microbatches=2, dropout_prob=0.0, shard_stages_1d=False,
      learning_rate=1e-3, max_steps=1, batch_major=True, **options)
