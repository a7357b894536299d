"""PipelinedLayer's user-facing contract beyond numerics.

Clear errors for bad params and bad bodies, layer_theta's layout, the
unrolled modes, aux losses through AuxLossContext, and the whole layer under
TF1 behaviour (tf.compat.v1.disable_v2_behavior, Lingvo's trainer setting) in
a subprocess.
"""

import dataclasses
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import layers
from gpipe import schedule as schedule_lib
from lingvo.core import base_layer
from lingvo.core import cluster_factory
from lingvo.core import py_utils
from tests import pipeline_harness as harness
from tests import reference_bodies

NestedMap = py_utils.NestedMap
_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _Params(**overrides):
  p = layers.PipelinedLayer.Params().Set(
      name='pipe',
      num_stages=2,
      num_microbatches=2,
      single_stage_body=reference_bodies.DenseBody.Params().Set(dim=4),
      unroll='never')
  return p.Set(**overrides)


def _FProp(p, batch=4, **kwargs):
  with tf.Graph().as_default():
    layer = p.Instantiate()
    x = tf.zeros([batch, 4])
    return layer.FProp(layer.theta, x, **kwargs)


# -- Errors name the parameter, the values and the fix. ---------------------


@pytest.mark.parametrize('overrides,pattern', [
    (dict(num_stages=0), r'num_stages must be an integer >= 1, got 0'),
    (dict(circular_repeat=0), r'circular_repeat must be an integer >= 1, got 0'),
    (dict(unroll='sometimes'), r"unroll must be one of .*'sometimes'"),
    (dict(vectorize_stages='yes'), r"vectorize_stages must be one of "
     r"\('auto', 'always', 'never'\), got 'yes'"),
    (dict(aux_loss_microbatch_accumulation='max'),
     r"aux_loss_microbatch_accumulation must be one of .*'max'"),
    (dict(microbatch_size=2),
     r'Set only one of num_microbatches \(2\) and microbatch_size \(2\)'),
    (dict(num_microbatches=0), r'num_microbatches must be None or an integer'),
    (dict(stage_parallel_body=reference_bodies.StageParallelDenseBody.Params()),
     r'Set exactly one of single_stage_body and stage_parallel_body'),
    (dict(shard_stages_1d=True, pipeline_stage_mesh_dim=0,
          device_mesh=np.arange(2)),
     r'at most one of shard_stages_1d and pipeline_stage_mesh_dim'),
    (dict(pipeline_stage_mesh_dim=0), r'needs device_mesh'),
    (dict(pipeline_stage_mesh_dim=2, device_mesh=np.arange(4).reshape(2, 2)),
     r'pipeline_stage_mesh_dim=2 is not an axis of device_mesh'),
    # Types: a string 'False' is truthy, True counts as the integer 1.
    (dict(per_stage_vars='False'),
     r"per_stage_vars must be True or False, got 'False' \(str\)"),
    (dict(shard_stages_1d=1),
     r'shard_stages_1d must be True or False, got 1 \(int\)'),
    (dict(store_body_intermediates=None),
     r'store_body_intermediates must be True or False, got None'),
    (dict(skip_bubbles='auto'),
     r"skip_bubbles must be True or False, got 'auto' \(str\)"),
    (dict(layer_by_layer=1),
     r"layer_by_layer must be True or False, got 1 \(int\)"),
    (dict(remat_policy='dots'),
     r"remat_policy must be one of \('recompute', 'save_dots', 'save_all'\), "
     r"got 'dots'"),
    (dict(store_body_intermediates=True, remat_policy='save_dots'),
     r"store_body_intermediates=True means remat_policy='save_all'; it "
     r"contradicts remat_policy='save_dots'"),
    (dict(num_stages=True), r'num_stages must be an integer >= 1, got True '
     r'\(bool\)'),
    (dict(circular_repeat=2.0),
     r'circular_repeat must be an integer >= 1, got 2.0 \(float\)'),
    (dict(num_microbatches='2'),
     r"num_microbatches must be None or an integer >= 1, got '2' \(str\)"),
    (dict(num_microbatches=None, microbatch_size=True),
     r'microbatch_size must be None or an integer >= 1, got True \(bool\)'),
    (dict(pipeline_stage_mesh_dim='0', device_mesh=np.arange(2)),
     r"pipeline_stage_mesh_dim must be None or an integer, got '0'"),
])
def test_bad_params_raise_at_construction(overrides, pattern):
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match=pattern):
      _Params(**overrides).Instantiate()


def test_numpy_integers_and_bools_are_accepted_as_plain_values():
  p = _Params(num_stages=np.int64(2), circular_repeat=np.int32(2),
              num_microbatches=np.int64(2), shard_stages_1d=np.bool_(True))
  with tf.Graph().as_default():
    layer = p.Instantiate()
    assert type(layer.params.num_stages) is int  # pylint: disable=unidiomatic-typecheck
    assert layer.params.shard_stages_1d is True
    assert layer.vars.body.w.shape.as_list() == [2, 2, 4, 4]
    out = layer.FProp(layer.theta, tf.zeros([4, 4]))
  assert out.shape.as_list() == [4, 4]


def test_mesh_axis_must_match_num_stages():
  with tf.Graph().as_default():
    with pytest.raises(ValueError,
                       match=r'device_mesh axis 1 has 4 devices but '
                       r'num_stages=2'):
      _Params(pipeline_stage_mesh_dim=1,
              device_mesh=np.arange(8).reshape(2, 4)).Instantiate()


def test_per_stage_vars_with_stage_parallel_body():
  p = _Params(
      single_stage_body=None,
      stage_parallel_body=reference_bodies.StageParallelDenseBody.Params().Set(
          num_stages=2),
      per_stage_vars=True)
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match=r'per_stage_vars=True needs '
                       r'single_stage_body'):
      p.Instantiate()


def test_batch_not_divisible_by_num_microbatches():
  with pytest.raises(ValueError,
                     match=r'Batch size 4 is not divisible by '
                     r'num_microbatches=3.*\[1, 2, 4\]'):
    _FProp(_Params(num_microbatches=3), batch=4)


def test_batch_not_divisible_by_microbatch_size():
  with pytest.raises(ValueError,
                     match=r'Batch size 6 is not divisible by '
                     r'microbatch_size=4'):
    _FProp(_Params(num_microbatches=None, microbatch_size=4), batch=6)


# -- ValidateParams: what it checked, resolved. -----------------------------


@pytest.mark.parametrize('overrides, batch_size, want, text', [
    # S=2, M=2, R=1: M + S - 1 = 3 iterations, a third of them idle.
    (dict(), 8, (2, 1, 2, 4, 3, 1 / 3),
     '2 stages, 2 microbatches of 4: 3 iterations, bubble 0.333'),
    # S=4, M=16 (64 rows of 4), R=1: 16 + 4 - 1 = 19, bubble 3/19.
    (dict(num_stages=4, num_microbatches=None, microbatch_size=4), 64,
     (4, 1, 16, 4, 19, 3 / 19),
     '4 stages, 16 microbatches of 4: 19 iterations, bubble 0.158'),
    # S=4, M=16, R=2: 2 x 16 + 4 - 1 = 35, of the 35 x 4 slots 32 x 4 work.
    (dict(num_stages=4, circular_repeat=2, num_microbatches=16), 64,
     (4, 2, 16, 4, 35, 3 / 35),
     '4 stages x 2 repeats, 16 microbatches of 4: 35 iterations, bubble '
     '0.086'),
    # S=4, M=6 (padded to 8), R=2: 2 x 8 + 3 = 19; 12 x 4 of 19 x 4 work.
    (dict(num_stages=4, circular_repeat=2, num_microbatches=6), None,
     (4, 2, 6, None, 19, 1 - 12 / 19),
     '4 stages x 2 repeats, 6 microbatches: 19 iterations, bubble 0.368'),
    # Only microbatch_size and no batch: M is not known yet.
    (dict(num_microbatches=None, microbatch_size=4), None,
     (2, 1, None, 4, None, None), '2 stages, microbatches of 4 (their '
     'number, and so the schedule, comes with the batch size)'),
    # Neither: the inputs come as [M, ...], M their leading dim.
    (dict(num_microbatches=None), 5, (2, 1, 5, None, 6, 1 / 6),
     '2 stages, 5 microbatches: 6 iterations, bubble 0.167'),
    (dict(num_stages=1, num_microbatches=1), 3, (1, 1, 1, 3, 1, 0.0),
     '1 stage, 1 microbatch of 3: 1 iteration, bubble 0.000'),
])
def test_validate_params_returns_what_it_checked(overrides, batch_size, want,
                                                 text):
  checked = layers.ValidateParams(_Params(**overrides), batch_size)
  got = (checked.num_stages, checked.circular_repeat,
         checked.num_microbatches, checked.microbatch_size,
         checked.num_iterations, checked.bubble_fraction)
  assert got[:5] == want[:5], got
  if want[5] is None:
    assert got[5] is None
  else:
    assert got[5] == pytest.approx(want[5], abs=1e-12), got
  assert str(checked) == text
  with pytest.raises(dataclasses.FrozenInstanceError):
    checked.num_stages = 3


@pytest.mark.parametrize('s', [1, 2, 3, 4])
@pytest.mark.parametrize('r', [1, 2, 3])
def test_validate_params_schedule_is_gpipe_schedules(s, r):
  for m in (1, 2, 3, 5, 8):
    checked = layers.ValidateParams(
        _Params(num_stages=s, circular_repeat=r, num_microbatches=m), 4 * m)
    schedule = schedule_lib.Schedule(s, m, r)
    assert (checked.num_microbatches, checked.microbatch_size) == (m, 4)
    assert checked.num_iterations == schedule.num_iterations
    assert checked.bubble_fraction == schedule.bubble_fraction
    if r == 1:
      assert checked.num_iterations == m + s - 1


@pytest.mark.parametrize('overrides, batch_size, pattern', [
    (dict(num_microbatches=3), 4,
     r'Batch size 4 is not divisible by num_microbatches=3'),
    (dict(num_microbatches=None, microbatch_size=4), 6,
     r'Batch size 6 is not divisible by microbatch_size=4'),
    (dict(num_stages=0), 4, r'num_stages must be an integer >= 1, got 0'),
])
def test_validate_params_still_raises(overrides, batch_size, pattern):
  with pytest.raises(ValueError, match=pattern):
    layers.ValidateParams(_Params(**overrides), batch_size)


def test_readme_shows_what_validate_params_says():
  checked = layers.ValidateParams(
      _Params(num_stages=4, circular_repeat=2, num_microbatches=16), 64)
  readme = ' '.join((_ROOT / 'README.md').read_text().split())
  assert f'`{checked}`' in readme, str(checked)


def test_kwarg_batch_not_divisible_by_num_microbatches():
  with pytest.raises(ValueError, match=r"kwarg 'scale' has shape \(3, 1\): "
                     r'its leading \(batch\) dim 3 must be divisible by '
                     r'num_microbatches=2.*kwargs_no_batch'):
    _FProp(_Params(), batch=4, scale=tf.ones([3, 1]))


def test_args_with_other_batch_sizes():
  with tf.Graph().as_default():
    layer = _Params(single_stage_body=(
        reference_bodies.MultiInputBody.Params())).Instantiate()
    with pytest.raises(ValueError, match=r'All args must have the batch size '
                       r'4 as leading dim; got a tensor of shape \(2, 4\)'):
      layer.FProp(layer.theta, tf.zeros([4, 4]), None,
                  NestedMap(a=tf.zeros([2, 4]), b=tf.zeros([4])))


def test_premicrobatched_kwargs_must_be_microbatched_too():
  with pytest.raises(ValueError, match=r"kwarg 'scale' has shape \(4, 1\); "
                     r'the inputs are already microbatched, \[2, \.\.\.\]'):
    _FProp(_Params(num_microbatches=None), batch=2, scale=tf.ones([4, 1]))


@pytest.mark.parametrize('args, kwargs, pattern', [
    ((3.0,), {}, r'input args\[0\] is a float \(3.0\)'),
    (([1.0, 2.0],), {}, r'input args\[0\]\[0\] is a float \(1.0\).*lists are '
     r'read as structures'),
    ((tf.zeros([4, 4]), tf.constant(2.0)), {},
     r'input args\[1\] is a scalar tensor \(float32\)'),
    ((tf.zeros([4, 4]),), dict(scale=0.5),
     r"input kwargs\['scale'\] is a float \(0.5\)"),
])
def test_inputs_without_a_batch_dim_are_rejected(args, kwargs, pattern):
  with tf.Graph().as_default():
    layer = _Params().Instantiate()
    with pytest.raises(ValueError, match=pattern + r'.*kwargs_no_batch'):
      layer.FProp(layer.theta, *args, **kwargs)


def test_numpy_inputs_are_converted_like_tensorflow_does():
  x = np.random.RandomState(0).uniform(-1, 1, [4, 4]).astype(np.float32)
  with tf.Graph().as_default():
    layer = _Params().Instantiate()
    from_numpy = layer.FProp(layer.theta, x)
    from_tensor = layer.FProp(layer.theta, tf.constant(x))
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      a, b = sess.run((from_numpy, from_tensor))
  np.testing.assert_array_equal(a, b)


def test_eager_fprop_says_what_to_do_and_unroll_runs_eagerly():
  layer = _Params().Instantiate()
  with pytest.raises(RuntimeError, match=r'needs a graph.*tf.function'):
    layer.FProp(layer.theta, tf.zeros([4, 4]))
  unrolled = _Params(unroll='always').Instantiate()
  assert unrolled.FProp(unrolled.theta, tf.zeros([4, 4])).shape == [4, 4]


def _ReadmeTf2Steps(stack, x, target, num_steps):
  """The README's TF2 training step, run num_steps times: the losses."""
  variables = stack.vars.Flatten()

  @tf.function(jit_compile=True)
  def TrainStep(x, target):
    with tf.GradientTape() as tape:
      y = stack.FProp(stack.theta, x)
      loss = tf.reduce_mean(tf.square(y - target))
    for v, g in zip(variables, tape.gradient(loss, variables)):
      v.assign_sub(0.1 * g)
    return loss

  return [float(TrainStep(x, target)) for _ in range(num_steps)]


def test_readme_tf2_training_step_equals_the_unpipelined_step():
  rng = np.random.RandomState(3)
  x = tf.constant(rng.uniform(-1, 1, [8, 4]).astype(np.float32))
  target = tf.constant(rng.uniform(-1, 1, [8, 4]).astype(np.float32))
  p = _Params(num_microbatches=4, circular_repeat=2)
  piped = p.Instantiate()
  plain = p.Copy().Set(unroll='always').Instantiate()
  for mine, theirs in zip(plain.vars.Flatten(), piped.vars.Flatten()):
    mine.assign(theirs)
  piped_losses = _ReadmeTf2Steps(piped, x, target, 3)
  plain_losses = _ReadmeTf2Steps(plain, x, target, 3)
  np.testing.assert_allclose(piped_losses, plain_losses, rtol=1e-5)
  assert piped_losses[2] < piped_losses[0]
  for mine, theirs in zip(plain.vars.Flatten(), piped.vars.Flatten()):
    np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-5,
                               atol=1e-6)


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
    with tf.compat.v1.Session() as sess:
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
    with tf.compat.v1.Session() as sess:
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
      'print(flags.FLAGS.xla_device)\n')
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


# -- layer_theta and variable layout. ---------------------------------------


@pytest.mark.parametrize('per_stage_vars', [False, True])
@pytest.mark.parametrize('circular_repeat', [1, 3])
def test_layer_theta_is_repeat_major(per_stage_vars, circular_repeat):
  s_count = 3
  with tf.Graph().as_default():
    layer = _Params(num_stages=s_count, circular_repeat=circular_repeat,
                    per_stage_vars=per_stage_vars).Instantiate()
    theta = layer.theta
    picked = {(r, s): layer.layer_theta(theta, r, s)
              for r in range(circular_repeat) for s in range(s_count)}
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      picked_v, vars_v = sess.run([picked, layer.vars])
  values = {k: dict(v) for k, v in vars_v.items()}
  case = harness.Case(num_stages=s_count, circular_repeat=circular_repeat,
                      per_stage_vars=per_stage_vars)
  expected = harness.PerLayerWeights(case, values)
  for (r, s), got in picked_v.items():
    want = expected[r * s_count + s]
    for name in ('w', 'b'):
      np.testing.assert_array_equal(got[name], want[name])
  # Distinct layers really have distinct weights.
  assert not np.array_equal(expected[0]['w'], expected[-1]['w'])


def test_layer_theta_rejects_out_of_range_indices():
  with tf.Graph().as_default():
    layer = _Params(circular_repeat=2).Instantiate()
    with pytest.raises(ValueError, match=r'repeat_idx=2 is out of range'):
      layer.layer_theta(layer.theta, 2, 0)
    with pytest.raises(ValueError, match=r'stage_idx=-1 is out of range'):
      layer.layer_theta(layer.theta, 0, -1)


@pytest.mark.parametrize('circular_repeat', [1, 2])
def test_variable_shapes(circular_repeat):
  with tf.Graph().as_default():
    layer = _Params(num_stages=3, circular_repeat=circular_repeat).Instantiate()
    lead = [3, circular_repeat] if circular_repeat > 1 else [3]
    assert layer.vars.body.w.shape.as_list() == lead + [4, 4]
    assert layer.vars.body.b.shape.as_list() == lead + [4]
    layer = _Params(name='pipe2', num_stages=3, circular_repeat=circular_repeat,
                    per_stage_vars=True).Instantiate()
    lead = [circular_repeat] if circular_repeat > 1 else []
    for s in range(3):
      child = layer.vars['body_iter_%05d' % s]
      assert child.w.shape.as_list() == lead + [4, 4]
      assert child.w.name.startswith('pipe2/iter_%05d/' % s)


# -- Unrolled modes. ---------------------------------------------------------


def _OpTypes(graph):
  return {op.type for op in graph.get_operations()}


def test_unroll_eval_only_unrolls_in_eval_and_pipelines_in_training():
  for do_eval in (False, True):
    with tf.Graph().as_default() as graph:
      with cluster_factory.SetEval(do_eval):
        layer = _Params(unroll='eval_only').Instantiate()
        y = layer.FProp(layer.theta, tf.ones([4, 4]))
        y_ref = layer.FProp(layer.theta, tf.ones([4, 4]))  # same mode twice
      has_loop = any(t in _OpTypes(graph) for t in ('While', 'StatelessWhile'))
      assert has_loop == (not do_eval)
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        a, b = sess.run([y, y_ref])
      np.testing.assert_array_equal(a, b)


def test_unroll_always_builds_no_loop():
  with tf.Graph().as_default() as graph:
    layer = _Params(unroll='always', circular_repeat=2).Instantiate()
    layer.FProp(layer.theta, tf.ones([4, 4]))
    assert not {'While', 'StatelessWhile'} & _OpTypes(graph)


# -- Sharding annotations are always emitted. --------------------------------


def _ShardingOps(graph):
  """XlaSharding ops in the graph and in its functions (loop bodies)."""
  count = sum(op.type == 'XlaSharding' for op in graph.get_operations())
  for fdef in graph.as_graph_def().library.function:
    count += sum(node.op == 'XlaSharding' for node in fdef.node_def)
  return count


@pytest.mark.parametrize('overrides,expected', [
    (dict(), False),
    (dict(shard_stages_1d=True), True),
    (dict(pipeline_stage_mesh_dim=0, device_mesh=np.arange(4).reshape(2, 2)),
     True),
])
def test_sharding_annotations_on_cpu(overrides, expected):
  with tf.Graph().as_default() as graph:
    layer = _Params(**overrides).Instantiate()
    layer.FProp(layer.theta, tf.ones([4, 4]))
    assert (_ShardingOps(graph) > 0) == expected


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
    with tf.compat.v1.Session() as sess:
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


# -- Lingvo's layer API: BodyFProp, per-example kwargs of their own batch. ----


class _SourceBody(reference_bodies.DenseBody):
  """tanh(x @ w + b) + source, the source's rows tiled over x's rows.

  Lingvo's FProp order for several hypotheses per source ([multiplier,
  source_batch]): row t of x uses source row t mod source_batch.
  """

  def FProp(self, theta, x, source):
    y = super().FProp(theta, x)
    reps = py_utils.GetShape(x)[0] // py_utils.GetShape(source)[0]
    return y + tf.tile(source, [reps, 1])


@pytest.mark.parametrize('s,m,r,mode', [(2, 2, 1, 'graph'), (3, 4, 2, 'graph'),
                                        (2, 4, 2, 'jit'), (4, 2, 1, 'jit')])
def test_kwargs_with_a_batch_of_their_own(s, m, r, mode):
  """A source of 4 rows for 8 query rows: each microbatch keeps the tiling.

  Forward against NumPy on the whole batch; gradients (weights, query and
  source) against a plain loop over the layers' weights on the whole batch.
  """
  rng = np.random.RandomState(3)
  x_np = rng.uniform(-1, 1, [8, 4]).astype(np.float32)
  src_np = rng.uniform(-1, 1, [4, 4]).astype(np.float32)
  p = _Params(num_stages=s, num_microbatches=m, circular_repeat=r,
              single_stage_body=_SourceBody.Params())
  with tf.Graph().as_default():
    layer = p.Instantiate()
    x, src = tf.constant(x_np), tf.constant(src_np)
    wrt = layer.vars.Flatten() + [x, src]

    def Step():
      y = layer.FProp(layer.theta, x, source=src)
      return y, tf.gradients(tf.reduce_sum(y * tf.sin(y)), wrt)

    y, grads = (tf.function(Step, jit_compile=True, autograph=False)()
                if mode == 'jit' else Step())
    h = x
    for rep in range(r):
      for stage in range(s):
        h = layer.body.FProp(layer.layer_theta(layer.theta, rep, stage), h,
                             src)
    ref_grads = tf.gradients(tf.reduce_sum(h * tf.sin(h)), wrt)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      y_v, g_v, ref_g, vars_v = sess.run([y, grads, ref_grads, layer.vars])
  expected = x_np
  for w in harness.PerLayerWeights(
      harness.Case(num_stages=s, circular_repeat=r),
      {k: dict(v) for k, v in vars_v.items()}):
    expected = (reference_bodies.DenseFn(reference_bodies.NP, w['w'], w['b'],
                                         expected) +
                np.tile(src_np, [2, 1]))
  np.testing.assert_allclose(y_v, expected, rtol=1e-5, atol=1e-5)
  for got, want in zip(g_v, ref_g):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert np.abs(g_v[-1]).max() > 0  # the source's gradient flows


class _AuxScaleBody(reference_bodies.DenseBody):
  """DenseBody adding sum(y) as an aux loss."""

  def FProp(self, theta, x, scale=None, shift=None):
    y = super().FProp(theta, x, scale, shift)
    py_utils.AuxLossContext.Current().AddLoss(tf.reduce_sum(y))
    return y


@pytest.mark.parametrize('s,m,r', [(2, 3, 1), (3, 2, 2), (2, 4, 3)])
def test_body_fprop_runs_one_iteration_of_every_stage(s, m, r):
  """Stage j gets args[j], the weights of its repeat at the iteration and
  its microbatch's slice of the kwargs, per gpipe.schedule; its aux loss
  lands in a [num_stages] loss (bubbles included, as in Lingvo's layer)."""
  rng = np.random.RandomState(5)
  args_np = rng.uniform(-1, 1, [s, 2, 4]).astype(np.float32)
  scale_np = rng.uniform(0.5, 1.5, [m, 2, 1]).astype(np.float32)
  p = _Params(num_stages=s, num_microbatches=m, circular_repeat=r,
              single_stage_body=_AuxScaleBody.Params())
  with tf.Graph().as_default():
    layer = p.Instantiate()
    schedule = layer.Schedule(m)
    iteration = tf.compat.v1.placeholder(tf.int32, [])
    with py_utils.AuxLossContext() as ctx:
      out, _ = layer.BodyFProp(layer.theta.body, 'FProp', iteration, m,
                               tf.constant(args_np),
                               scale=tf.constant(scale_np))
    aux, = ctx.aux_losses
    assert aux.shape.as_list() == [s]
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      vars_v = sess.run(layer.vars)
      runs = [sess.run([out, aux], {iteration: i})
              for i in range(schedule.num_iterations)]
  weights = harness.PerLayerWeights(
      harness.Case(num_stages=s, circular_repeat=r),
      {k: dict(v) for k, v in vars_v.items()})
  for i, (out_v, aux_v) in enumerate(runs):
    for j in range(s):
      mb = min(max(schedule.MicrobatchId(i, j), 0), m - 1)
      w = weights[schedule.LayerId(i, j)]
      want = reference_bodies.DenseFn(reference_bodies.NP, w['w'], w['b'],
                                      args_np[j], scale=scale_np[mb])
      np.testing.assert_allclose(out_v[j], want, rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(aux_v[j], want.sum(), rtol=1e-5, atol=1e-5)


class _Wrapper(base_layer.BaseLayer):
  """A body whose only child is named `body` (as the pipeline's is)."""

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('body', reference_bodies.DenseBody.Params())

  def FProp(self, theta, x):
    return self.body.FProp(theta.body, x)

  def InitStates(self, theta, batch_size):
    return tf.fill([batch_size], tf.reduce_sum(theta.body.w))


def test_body_fprop_no_microbatching_takes_either_theta():
  with tf.Graph().as_default():
    tf.compat.v1.set_random_seed(0)
    layer = _Params(num_stages=3,
                    single_stage_body=_Wrapper.Params()).Instantiate()
    per_stage = [layer.BodyFPropNoMicrobatching(theta, 'InitStates', 2)[0]
                 for theta in (layer.theta, layer.theta.body)]
    with pytest.raises(ValueError, match=r"theta must be the layer's theta "
                       r'or its stage-stacked body weights'):
      layer.BodyFPropNoMicrobatching(layer.theta.body.body, 'InitStates', 2)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      (a, b), w = sess.run([per_stage, layer.vars.body.body.w])
  want = np.repeat(w.astype(np.float64).sum(axis=(1, 2))[:, None], 2, axis=1)
  # A float32 sum of 16 weights: its rounding is relative to the summands
  # (the sum itself may cancel to near 0).
  atol = 1e-6 * np.abs(w).sum(axis=(1, 2)).max()
  np.testing.assert_allclose(a, want, rtol=1e-6, atol=atol)
  np.testing.assert_allclose(b, want, rtol=1e-6, atol=atol)


def test_pad_microbatches_returns_non_tensors_unchanged():
  with tf.Graph().as_default():
    layer = _Params().Instantiate()
    assert layer.PadMicrobatches(None) is None
    assert layer.PadMicrobatches(3) == 3
    padded = layer.PadMicrobatches([None, tf.zeros([2, 2, 5])])
    assert padded[0] is None
    assert padded[1].shape.as_list() == [3, 2, 5]


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
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      assert sess.run(y).shape == (4, 4)


# -- TF1 behaviour, as Lingvo's trainer runs. --------------------------------

_TF1_SCRIPT = """
import tensorflow as tf
tf.compat.v1.disable_v2_behavior()
from tests import pipeline_harness as h
for case in [
    h.Case(num_stages=3, num_microbatches=4, batch=8, circular_repeat=2,
           kwargs=True, shard_stages_1d=True),
    h.Case(body='multi', num_stages=2, num_microbatches=3, batch=6,
           circular_repeat=3, per_stage_vars=True),
    h.Case(body='stage_parallel', num_stages=3, num_microbatches=2, batch=4,
           circular_repeat=2, store_body_intermediates=True),
]:
  h.CheckCase(case, 'graph')
assert not tf.executing_eagerly()
print('TF1 OK', h.LargestErrors()['checks'])
"""


def test_tf1_behaviour_subprocess():
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  env['PYTHONPATH'] = str(_ROOT) + os.pathsep + env.get('PYTHONPATH', '')
  proc = subprocess.run([sys.executable, '-c', _TF1_SCRIPT],
                        cwd=_ROOT,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=600,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert 'TF1 OK' in proc.stdout


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
