"""Lingvo's PipelinedTransformerLayers, unchanged, on gpipe.

With `UseGpipeInLingvo()` Lingvo's own client builds gpipe's layer. Its
pipelined FProp (outputs and the gradients of every variable and the input)
must equal Lingvo's own layer with unroll='always' — Lingvo's code running
the layers one after another, independent of gpipe — on the same weights.
"""

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import layers
from gpipe import lingvo_compat
from lingvo.core import batch_major_attention
from lingvo.core import gshard_layers
from tests import close
from tests import reference_bodies
from tests import sessions

DIM, HEADS, TIME = 8, 2, 4


def _Params(num_stages, num_microbatches, circular_repeat, unroll,
            shard_stages_1d=False):
  stage = batch_major_attention.StackedTransformerLayers.Params().Set(
      num_layers=1, mdl_dim=DIM, hidden_dim=2 * DIM, num_atten_heads=HEADS,
      dropout_prob=0.0, mask_self_atten=True)
  return batch_major_attention.PipelinedTransformerLayers.Params().Set(
      name='pipelined', pipeline_stage=stage,
      num_pipeline_stages=num_stages,
      num_pipeline_microbatches=num_microbatches,
      circular_repeat=circular_repeat, unroll=unroll,
      shard_stages_1d=shard_stages_1d, random_seed=1)


def test_the_switch_applies_and_undoes():
  lingvos = gshard_layers.LayerwiseShardablePipelinedLayer
  assert lingvos is lingvo_compat.LingvosOwnLayer()
  assert not lingvo_compat.LingvoBuildsGpipe()
  with lingvo_compat.UseGpipeInLingvo():
    assert lingvo_compat.LingvoBuildsGpipe()
    with tf.Graph().as_default():
      layer = _Params(2, 2, 1, 'never').Instantiate()
    assert type(layer.pipeline) is layers.PipelinedLayer  # pylint: disable=unidiomatic-typecheck
  assert gshard_layers.LayerwiseShardablePipelinedLayer is lingvos


def test_the_splitting_switch_places_only_unplaced_stages():
  """split_unplaced_stages: a client that places its stages nowhere gets
  shard_stages_1d; one that places them keeps its placement."""
  with lingvo_compat.UseGpipeInLingvo(split_unplaced_stages=True):
    assert lingvo_compat.LingvoBuildsGpipe()
    with tf.Graph().as_default():
      unplaced = _Params(2, 2, 1, 'never', shard_stages_1d=False)
      unplaced = unplaced.Instantiate().pipeline
      mesh = gshard_layers.LayerwiseShardablePipelinedLayer.Params().Set(
          name='mesh', num_stages=2,
          single_stage_body=reference_bodies.DenseBody.Params().Set(dim=DIM),
          device_mesh=np.arange(4).reshape(2, 2), pipeline_stage_mesh_dim=0)
      mesh = mesh.Instantiate()
  assert isinstance(unplaced, lingvo_compat.StagesOverDevicesLayer)
  assert unplaced.params.shard_stages_1d
  assert not mesh.params.shard_stages_1d
  assert mesh.params.pipeline_stage_mesh_dim == 0
  assert not lingvo_compat.LingvoBuildsGpipe()


def _Step(layer, x, paddings):
  out, _ = layer.FProp(layer.theta, x, paddings)
  loss = tf.reduce_sum(out * tf.sin(out))
  variables = layer.vars.Flatten()
  grads = tf.gradients(loss, variables + [x])
  return out, [tf.convert_to_tensor(g) for g in grads], variables


def _Inputs(batch):
  rng = np.random.RandomState(0)
  x = rng.normal(size=[batch, TIME, DIM]).astype(np.float32)
  paddings = np.zeros([batch, TIME], np.float32)
  paddings[:, -1] = rng.randint(0, 2, [batch])
  return x, paddings


def _Layers(s, m, r, shard):
  """gpipe's layer, built by Lingvo's client under the switch, and Lingvo's
  own layer running the layers one after another (the reference)."""
  with lingvo_compat.UseGpipeInLingvo():
    ours = _Params(s, m, r, 'never', shard).Instantiate()
  assert isinstance(ours.pipeline, layers.PipelinedLayer)
  theirs = _Params(s, m, r, 'always').Set(name='reference').Instantiate()
  assert not isinstance(theirs.pipeline, layers.PipelinedLayer)
  # Same variables: Lingvo's names (under each layer's own name) and shapes.
  names = [v.name.replace('pipelined', '<name>') for v in ours.vars.Flatten()]
  assert names == [v.name.replace('reference', '<name>')
                   for v in theirs.vars.Flatten()]
  assert ([v.shape for v in ours.vars.Flatten()] ==
          [v.shape for v in theirs.vars.Flatten()])
  return ours, theirs, names


def _AssertEqualSteps(got, want, names):
  """Outputs at FLOAT32; gradients at FLOAT32_AT_SCALE (close.py says
  why): ours sums each weight's gradient over microbatches and may run the
  stages as one batch, the reference adds the same terms in another
  order, and an entry can be a small difference of large terms."""
  close.AssertClose(got[0], want[0], close.FLOAT32, 'output')
  for name, g, w in zip(names + ['input'], got[1], want[1]):
    close.AssertClose(g, w, close.FLOAT32_AT_SCALE, name)
    assert np.abs(w).max() > 0, name


@pytest.mark.parametrize('s,m,r,shard', [
    (2, 2, 1, False), (2, 4, 2, False), (4, 2, 1, True), (2, 3, 2, True)])
def test_pipelined_transformer_layers_equal_lingvos_unrolled(s, m, r, shard):
  x_np, pad_np = _Inputs(2 * m)
  with tf.Graph().as_default():
    ours, theirs, names = _Layers(s, m, r, shard)
    x = tf.constant(x_np)
    paddings = tf.constant(pad_np)
    out, grads, variables = _Step(ours, x, paddings)
    ref_out, ref_grads, ref_vars = _Step(theirs, x, paddings)
    copy = [r.assign(v) for r, v in zip(ref_vars, variables)]
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      sess.run(copy)
      got, want = sess.run(((out, grads), (ref_out, ref_grads)))
  _AssertEqualSteps(got, want, names)


@pytest.mark.runs_long
def test_pipelined_transformer_layers_under_jit():
  """The same comparison in TF2, tf.function(jit_compile=True): circular,
  shard_stages_1d (Lingvo's own layer runs neither on one CPU device)."""
  s, m, r = 2, 4, 2
  x_np, pad_np = _Inputs(2 * m)
  ours, theirs, names = _Layers(s, m, r, True)
  for ref, v in zip(theirs.vars.Flatten(), ours.vars.Flatten()):
    ref.assign(v)

  @tf.function(jit_compile=True, autograph=False)
  def Steps(x, paddings):
    return [_Step(layer, x, paddings)[:2] for layer in (ours, theirs)]

  got, want = tf.nest.map_structure(lambda t: t.numpy(),
                                    Steps(tf.constant(x_np),
                                          tf.constant(pad_np)))
  _AssertEqualSteps(got, want, names)


@pytest.mark.parametrize('s,m,r', [(2, 2, 1), (2, 4, 2)])
def test_decoding_step_by_step_equals_the_causal_fprop(s, m, r):
  batch = 2 * m
  x_np = np.random.RandomState(1).normal(size=[batch, TIME, DIM]).astype(
      np.float32)
  with tf.Graph().as_default():
    with lingvo_compat.UseGpipeInLingvo():
      layer = _Params(s, m, r, 'never').Instantiate()
    full, _ = layer.FProp(layer.theta, tf.constant(x_np),
                          tf.zeros([batch, TIME]))
    states0 = layer.InitStates(layer.theta, batch, TIME)
    # One decoding step, run position by position with the states fed back.
    holders = [tf.compat.v1.placeholder(s.dtype, s.shape)
               for s in tf.nest.flatten(states0)]
    x_t = tf.compat.v1.placeholder(tf.float32, [batch, 1, DIM])
    t = tf.compat.v1.placeholder(tf.int32, [])
    # Lingvo's client passes use_short_seq_opt=False, a flag, as a kwarg.
    y, states = layer.ExtendStep(
        layer.theta, x_t, None, None,
        tf.nest.pack_sequence_as(states0, holders), t)
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      want, flat = sess.run((full, tf.nest.flatten(states0)))
      steps = []
      for position in range(TIME):
        feed = dict(zip(holders, flat))
        feed.update({x_t: x_np[:, position:position + 1], t: position})
        y_t, flat = sess.run((y, tf.nest.flatten(states)), feed)
        steps.append(y_t)
  got = np.concatenate(steps, axis=1)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
