"""The planner's optimizer updates against Lingvo's own optimizers.

Each Lingvo optimizer the planner models (SGD, Momentum, Adam,
XLAShardingAdafactor in several configurations) is built from its Params
and applied by Lingvo to tf variables in a graph, several steps with a
changing learning rate, the global step incremented after each update as
Lingvo's train op does; gpipe.model_step.optimizers' update for the same Params
runs from the same weights and gradients, jit-compiled as the planner
compiles it. Weights and every slot must agree to float32 rounding, and
the slots must have Lingvo's names and shapes (Adafactor's factored row
and column moments, its unfactored ones, its first moment).

The weights: a matrix, a stage-stacked-like [S, a, b], a [7, 3, 5] whose
two largest dims are not the last two (the factored moments and the mean
over vr's last dim then follow Lingvo's quirks exactly), a vector and a
scalar (never factored; a scalar's "rms" is its value).

Also: any other optimizer is refused in one line naming it and the
modelled ones, and one planned pipelined layer with Adafactor keeps its
factored slots split over the stage devices like their weights.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.compiler.xla import xla_data_pb2  # pylint: disable=g-direct-tensorflow-import

import gpipe  # pylint: disable=unused-import
from gpipe import layers
from gpipe.model_step import optimizers
from gpipe.model_step import train_step
from gpipe import plan
from gpipe.plan import roofline
from tests import close
from gpipe import sharding
from gpipe.xla import partitioning
from lingvo.core import hyperparams
from lingvo.core import learner as lingvo_learner
from lingvo.core import optimizer
from lingvo.core import py_utils
from tests import reference_bodies

SHAPES = [(6, 5), (3, 8, 6), (7, 3, 5), (5,), ()]
LEARNING_RATES = [0.1, 0.05, 0.02, 0.01]
RTOL = 1e-6
_OF_LARGEST = close.Tolerance(rtol=RTOL, atol=0.0, atol_of_largest=RTOL)


def _Values(seed, num_steps=len(LEARNING_RATES)):
  """Initial weights, and a gradient per weight for each step."""
  rng = np.random.RandomState(seed)
  draw = lambda s: np.asarray(rng.randn(*s), np.float32)
  return [draw(s) for s in SHAPES], [[draw(s) for s in SHAPES]
                                     for _ in range(num_steps)]


def _RunLingvo(opt_params, weights, grads):
  """Lingvo's optimizer on tf variables: (weights, [{slot name: value}])."""
  with tf.Graph().as_default():
    global_step = py_utils.GetOrCreateGlobalStepVar()
    variables = [
        tf.compat.v1.get_variable(f'w{i}', initializer=w, use_resource=True)
        for i, w in enumerate(weights)
    ]
    fed = [tf.compat.v1.placeholder(tf.float32, w.shape) for w in weights]
    lr = tf.compat.v1.placeholder(tf.float32, [])
    opt = opt_params.Instantiate()
    update = opt.Apply(
        lr, py_utils.NestedMap({
            f'w{i}': py_utils.VarGrad(v, g)
            for i, (v, g) in enumerate(zip(variables, fed))
        }))
    with tf.control_dependencies([update]):
      step = tf.compat.v1.assign_add(global_step, 1)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      for g, rate in zip(grads, LEARNING_RATES):
        sess.run(step, {**dict(zip(fed, g)), lr: rate})
      tf_opt = opt._optimizer  # pylint: disable=protected-access
      slots = [{
          name: sess.run(tf_opt.get_slot(v, name))
          for name in tf_opt.get_slot_names()
          if tf_opt.get_slot(v, name) is not None
      } for v in variables]
      return sess.run(variables), slots


def _RunOurs(update, weights, grads, scales=None):
  """Our update, jit-compiled: (weights, [{slot name: value}]); with
  `scales`, step k's gradients are grads[k] x scales[k] (grad_scale)."""
  specs = [tf.TensorSpec(w.shape, tf.float32) for w in weights]
  slot_specs = [update.Slots(s) for s in specs]

  @tf.function(jit_compile=True, autograph=False)
  def Step(w, g, s, lr, global_step, scale=None):
    return update.Update(w, g, s, lr, global_step, grad_scale=scale)

  ws = [tf.constant(w) for w in weights]
  slots = [[tf.zeros(s.spec.shape, s.spec.dtype) for s in ss]
           for ss in slot_specs]
  for step, (g, rate) in enumerate(zip(grads, LEARNING_RATES)):
    for i in range(len(ws)):
      ws[i], slots[i] = Step(
          ws[i], tf.constant(g[i]), slots[i], tf.constant(rate),
          tf.constant(step, tf.int64),
          None if scales is None else tf.constant(scales[step]))
  return [w.numpy() for w in ws], [{
      s.name: v.numpy() for s, v in zip(ss, values)
  } for ss, values in zip(slot_specs, slots)]


def _Compare(opt_params, seed=0, grads=None, scales=None):
  """Ours against Lingvo's; returns the largest relative differences.

  With `scales` (one per step), ours gets the gradients and the scale
  (grad_scale), Lingvo's the gradients scaled in NumPy.
  """
  weights, drawn = _Values(seed)
  grads = grads or drawn
  scaled = grads if scales is None else [
      [g * np.float32(c) for g in step] for step, c in zip(grads, scales)]
  want_w, want_slots = _RunLingvo(opt_params, weights, scaled)
  got_w, got_slots = _RunOurs(
      optimizers.FromLingvoParams(opt_params), weights, grads, scales)
  largest = 0.0
  for shape, gw, ww, gs, ws in zip(SHAPES, got_w, want_w, got_slots,
                                   want_slots):
    assert gw.shape == shape
    assert sorted(gs) == sorted(ws), (shape, sorted(gs), sorted(ws))
    pairs = [('weight', gw, ww)] + [(n, gs[n], ws[n]) for n in sorted(ws)]
    for name, got, want in pairs:
      assert got.shape == want.shape, (shape, name, got.shape, want.shape)
      # Relative to the tensor's largest value: an element that the update
      # moved near zero has no relative precision of its own.
      close.AssertClose(got, want, _OF_LARGEST, f'{shape} {name}')
      scale = max(np.abs(want).max(), 1e-30)
      largest = max(largest, np.abs(got - want).max() / scale)
  return largest


def _SlotShapes(update, shape):
  return {s.name: tuple(s.spec.shape) for s in update.Slots(
      tf.TensorSpec(shape, tf.float32))}


def test_sgd():
  _Compare(optimizer.SGD.Params())


@pytest.mark.parametrize('nesterov', [False, True])
def test_momentum(nesterov):
  _Compare(optimizer.Momentum.Params().Set(alpha=0.8, use_nesterov=nesterov))


def test_adam():
  _Compare(optimizer.Adam.Params().Set(beta1=0.8, beta2=0.95, epsilon=1e-6))


# Small weights: a minimum factored size of 4 factors them as Lingvo's
# default of 128 factors a model's matrices.
ADAFACTOR = optimizer.XLAShardingAdafactor.Params().Set(
    min_dim_size_to_factor=4)


@pytest.mark.parametrize('config', [
    dict(),  # Lingvo's defaults: beta1 0, Adam-like decay, no clipping
    dict(beta1=0.9, beta2=0.99, decay_exponent_pow=0.8,
         clipping_threshold=1.0),  # as params/lm.py's Adafactor LM
    dict(beta1=0.5, decay_exponent_pow=0.5, decay_exponent_offset=1,
         clipping_threshold=1.5, multiply_by_parameter_scale=False),
    dict(factored=False, clipping_threshold=1.0),
], ids=['defaults', 'lm', 'no_parameter_scale', 'not_factored'])
def test_adafactor(config):
  _Compare(ADAFACTOR.Copy().Set(**config), seed=1)


_SCALES = [0.5, 1.0, 0.03, 2.5]  # per step, as a global-norm clip gives


@pytest.mark.parametrize('opt_params', [
    optimizer.SGD.Params(),
    optimizer.Momentum.Params().Set(alpha=0.8, use_nesterov=True),
    optimizer.Adam.Params().Set(beta1=0.8, beta2=0.95, epsilon=1e-6),
    ADAFACTOR.Copy(),
    ADAFACTOR.Copy().Set(beta1=0.9, beta2=0.99, decay_exponent_pow=0.8,
                         clipping_threshold=1.0),
    ADAFACTOR.Copy().Set(factored=False, clipping_threshold=1.0),
], ids=['sgd', 'momentum', 'adam', 'adafactor', 'adafactor-lm',
        'adafactor-not_factored'])
def test_a_gradient_scale_is_the_update_of_the_scaled_gradient(opt_params):
  """grad_scale (where a clip's factor enters the update) against Lingvo's
  optimizer on the gradients scaled beforehand."""
  _Compare(opt_params, seed=3, scales=_SCALES)


@pytest.mark.parametrize('norm_over_clip', [0.5, 3.0, np.inf, np.nan])
def test_the_clip_scale_is_tensorflows_global_norm_clip(norm_over_clip):
  rng = np.random.RandomState(4)
  grads = [np.asarray(rng.randn(*s), np.float32) for s in [(6, 5), (3,), ()]]
  clip = 2.0
  norm = np.sqrt(sum(np.sum(g.astype(np.float64)**2) for g in grads))
  grads = [g * np.float32(norm_over_clip * clip / norm) for g in grads]
  tensors = [tf.constant(g) for g in grads]
  scale = train_step._ClipScale(tensors, clip)  # pylint: disable=protected-access
  want, _ = tf.clip_by_global_norm(tensors, clip)
  for g, w in zip(tensors, want):
    np.testing.assert_allclose((g * scale).numpy(), w.numpy(), rtol=1e-6,
                               atol=0)
  if norm_over_clip < 1:
    assert scale.numpy() == 1.0
  if not np.isfinite(norm_over_clip):
    assert np.isnan(scale.numpy())


def test_adafactor_slots_are_lingvos():
  update = optimizers.FromLingvoParams(ADAFACTOR.Copy().Set(beta1=0.9))
  # The two largest dims are factored: vr averages the largest away, vc
  # the second (on a tie, the earlier dim counts as the larger).
  assert _SlotShapes(update, (3, 8, 6)) == {
      'm': (3, 8, 6), 'vr': (3, 6), 'vc': (3, 8)}
  assert _SlotShapes(update, (4, 4, 8)) == {
      'm': (4, 4, 8), 'vr': (4, 4), 'vc': (4, 8)}
  assert _SlotShapes(update, (5,)) == {'m': (5,), 'v': (5,)}
  # Lingvo's default minimum (128): the small matrix is not factored.
  default = optimizers.FromLingvoParams(optimizer.XLAShardingAdafactor.Params())
  assert _SlotShapes(default, (6, 5)) == {'v': (6, 5)}
  assert _SlotShapes(default, (4, 256, 128)) == {
      'vr': (4, 128), 'vc': (4, 256)}


def test_adafactor_skips_a_non_finite_step_as_lingvo_does():
  """The second step's gradients are not finite: with cond_is_finite,
  Lingvo leaves every weight and slot as it was."""
  _, grads = _Values(2)
  grads[1] = [g.copy() for g in grads[1]]
  for g in grads[1]:
    g.reshape(-1)[0] = np.inf
  _Compare(ADAFACTOR.Copy().Set(cond_is_finite=True, beta1=0.9),
           seed=2, grads=grads)


@pytest.mark.parametrize('params', [
    optimizer.RMSProp.Params(),
    optimizer.XLAShardingAdafactorAccuGrad.Params(),
])
def test_other_optimizers_are_refused_in_one_line(params):
  tp = hyperparams.Params()
  tp.Define('train', hyperparams.Params(), '')
  tp.train.Define('learner', lingvo_learner.Learner.Params().Set(
      optimizer=params), '')
  with pytest.raises(ValueError) as error:
    train_step.LearnerOf(tp)
  message = str(error.value)
  assert '\n' not in message
  assert f'The optimizer is {params.cls.__name__},' in message, message
  for name in ('SGD', 'Momentum', 'Adam', 'XLAShardingAdafactor'):
    assert name in message, message


def test_learner_of_a_task_with_adafactor():
  tp = hyperparams.Params()
  tp.Define('train', hyperparams.Params(), '')
  tp.train.Define('learner', lingvo_learner.Learner.Params().Set(
      optimizer=ADAFACTOR.Copy().Set(beta1=0.9, decay_exponent_pow=0.8),
      clip_gradient_norm_to_value=2.0), '')
  update, clip_norm = train_step.LearnerOf(tp)
  assert isinstance(update, optimizers.Adafactor)
  assert (update.beta1, update.decay_exponent_pow, update.factored,
          update.min_dim_size_to_factor) == (0.9, 0.8, True, 4)
  assert clip_norm == 2.0


DIM, NUM_STAGES, REPEATS, BATCH = 64, 4, 2, 24


def _CircularStack():
  return layers.PipelinedLayer.Params().Set(
      name='stack', num_stages=NUM_STAGES,
      single_stage_body=reference_bodies.DenseBody.Params().Set(dim=DIM),
      num_microbatches=8, shard_stages_1d=True, circular_repeat=REPEATS,
      unroll='never')


def _Tiles(t):
  """Devices per dim of the sharding annotating t; None if not annotated."""
  if t.op.type == 'Identity':  # a function's output
    t = t.op.inputs[0]
  if t.op.type != 'XlaSharding':
    return None
  proto = xla_data_pb2.OpSharding.FromString(t.op.get_attr('sharding'))
  return tuple(proto.tile_assignment_dimensions)


def test_new_slots_keeping_the_stage_dim_are_split_on_it():
  """In the traced step: m and the factored moments that keep dim 0 of
  w [S, R, DIM, DIM] and b [S, R, DIM] are annotated split on it; b's vc
  (its largest dims are DIM and S: vc averages S away) is left alone and
  not counted as stage-stacked."""
  adafactor = optimizers.Adafactor(beta1=0.5, min_dim_size_to_factor=4)
  target = plan.LayerTarget(_CircularStack(), [(BATCH, DIM)],
                            optimizer=adafactor)
  step = target.Build(plan.Candidate(8, REPEATS), 'num_blocks')

  def Partitioned(*args):
    with sharding.SpmdPartitioning():
      return step(*args)

  outputs = tf.function(Partitioned, autograph=False).get_concrete_function(
      *step.specs).structured_outputs
  new_slots = outputs[len(outputs) - len(step.slot_args):]
  got = {a.name: (tuple(a.spec.shape), a.on_stages, _Tiles(t))
         for a, t in zip(step.slot_args, new_slots)}
  s, r = NUM_STAGES, REPEATS
  assert got == {
      'body.w/m': ((s, r, DIM, DIM), True, (s, 1, 1, 1)),
      'body.w/vr': ((s, r, DIM), True, (s, 1, 1)),
      'body.w/vc': ((s, r, DIM), True, (s, 1, 1)),
      'body.b/m': ((s, r, DIM), True, (s, 1, 1)),
      'body.b/vr': ((s, r), True, (s, 1)),
      'body.b/vc': ((r, DIM), False, None),
  }


def test_a_slot_follows_its_weight_only_with_its_stage_dim_in_place():
  follows = lambda dims, shape, stages=4: train_step._FollowsWeight(  # pylint: disable=protected-access
      optimizers.Slot('v', None, dims), shape, stages)
  assert follows((0, 1, 2), [4, 8, 6])
  assert follows((0, 2), [4, 8, 6])  # d averaged away: [S, f]
  assert follows((0, 1), [4, 2, 8, 6])  # [S, R, d] of [S, R, d, f]
  assert follows((0, 2, 3), [2, 3, 8, 6])  # [R, S, ...] with S=4: not dim 1
  assert not follows((0, 2, 3), [2, 4, 8, 6])  # dim 1 may be the stage dim
  assert not follows((1, 2), [4, 8, 6])  # the stage dim averaged away
  assert not follows((1, 0), [4, 8])  # transposed


def test_planned_adafactor_slots_live_split_like_their_weights():
  """A circular stack: w [S, R, DIM, DIM] gets vr and vc [S, R, DIM], b
  [S, R, DIM] one v of its shape (its second largest dim, S, is below the
  minimum of 32); every slot keeps dim 0 = S, split over the S devices."""
  if not partitioning.IsAvailable():
    pytest.fail('jax and jaxlib are needed (they are in the test extra).')
  params = _CircularStack()
  adafactor = optimizers.Adafactor(min_dim_size_to_factor=32,
                                   decay_exponent_pow=0.8)
  target = plan.LayerTarget(params, [(BATCH, DIM)], optimizer=adafactor)
  (report,) = plan.MakePlan(target, [plan.Candidate(8, REPEATS)], NUM_STAGES,
                            roofline.CHIPS['v5e'], 16 * 2**30).reports
  slots = {a.name: a for a in report.step.args if a.kind == train_step.SLOT}
  row = (NUM_STAGES, REPEATS, DIM)
  assert {n: tuple(a.spec.shape) for n, a in slots.items()} == {
      'body.w/vr': row, 'body.w/vc': row, 'body.b/v': row}
  total = sum(a.spec.shape.num_elements() * 4 for a in slots.values())
  assert total == 3 * NUM_STAGES * REPEATS * DIM * 4
  assert report.per_device_bytes['optimizer'] == total // NUM_STAGES
  for arg, shard in zip(report.step.args, report.compiled.param_shard_shapes):
    if arg.kind == train_step.SLOT:
      assert arg.on_stages, arg.name
      assert shard == (1,) + row[1:], (arg.name, shard)
  assert not report.Problems(), report.Problems()
