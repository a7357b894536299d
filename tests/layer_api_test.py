"""PipelinedLayer's user-facing contract beyond numerics: its Params, inputs.

Clear errors for bad params (naming the parameter, the values and the fix),
what ValidateParams checked and resolved, clear errors for inputs of the
wrong batch or none, NumPy inputs, eager calls, and the README's TF2
training step against the same step unpipelined. Params and FProp build
the small layer the layer_api_*_test.py modules share. What a body may do
and must not is in layer_api_bodies_test.py; layer_theta, the variable
layout, the unrolled modes, Lingvo's layer API and TF1 behaviour in
layer_api_lingvo_test.py.
"""

import dataclasses
import pathlib

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import layers
from gpipe import schedule as schedule_lib
from lingvo.core import py_utils
from tests import reference_bodies

NestedMap = py_utils.NestedMap
_ROOT = pathlib.Path(__file__).resolve().parent.parent


def Params(**overrides):
  """A PipelinedLayer of 2 DenseBody stages of width 4, 2 microbatches."""
  p = layers.PipelinedLayer.Params().Set(
      name='pipe',
      num_stages=2,
      num_microbatches=2,
      single_stage_body=reference_bodies.DenseBody.Params().Set(dim=4),
      unroll='never')
  return p.Set(**overrides)


def FProp(p, batch=4, **kwargs):
  """The layer of `p` on zeros of [batch, 4], built in a graph of its own."""
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
    (dict(num_stages=1, circular_repeat=2, pipeline_stage_mesh_dim=0,
          device_mesh=np.arange(4).reshape(1, 4)),
     r'device_mesh axis 0 \(the stages\) has 1 device, so there is no '
     r'pipeline, but circular_repeat=2; set circular_repeat=1 and give the '
     r'one stage 2 x its blocks'),
    # Types: a string 'False' is truthy, True counts as the integer 1.
    (dict(per_stage_vars='False'),
     r"per_stage_vars must be True or False, got 'False' \(str\)"),
    (dict(shard_stages_1d=1),
     r'shard_stages_1d must be True or False, got 1 \(int\)'),
    (dict(store_body_intermediates=None),
     r'store_body_intermediates must be True or False, got None'),
    (dict(skip_bubbles='auto'),
     r"skip_bubbles must be True, False or None \(where it pays\), got "
     r"'auto' \(str\)"),
    (dict(layer_by_layer=1),
     r"layer_by_layer must be True, False or None \(the program.s default\), "
     r"got 1 \(int\)"),
    (dict(remat_policy='dots'),
     r"remat_policy must be one of \('recompute', 'save_checkpoints', "
     r"'save_dots', 'save_all', None\), got 'dots'"),
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
    (dict(ring_split_mesh_dim=1.0),
     r'ring_split_mesh_dim must be None or an integer, got 1.0 \(float\)'),
    (dict(ring_split_mesh_dim=1, pipeline_stage_mesh_dim=0,
          device_mesh=np.arange(4).reshape(2, 2)),
     r"ring_split_mesh_dim=1 splits the rings of backward_schedule='1f1b' "
     r".*got backward_schedule='reverse' and pipeline_stage_mesh_dim=0\. "
     r'Set both'),
    (dict(ring_split_mesh_dim=1, backward_schedule='1f1b'),
     r'got backward_schedule=.1f1b. and pipeline_stage_mesh_dim=None'),
    (dict(ring_split_mesh_dim=0, pipeline_stage_mesh_dim=0,
          backward_schedule='1f1b', device_mesh=np.arange(4).reshape(2, 2)),
     r'ring_split_mesh_dim=0 must be an axis of device_mesh \(shape \(2, 2\)\) '
     r'other than pipeline_stage_mesh_dim=0'),
    (dict(ring_split_mesh_dim=2, pipeline_stage_mesh_dim=0,
          backward_schedule='1f1b', device_mesh=np.arange(4).reshape(2, 2)),
     r'ring_split_mesh_dim=2 must be an axis of device_mesh'),
])
def test_bad_params_raise_at_construction(overrides, pattern):
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match=pattern):
      Params(**overrides).Instantiate()


def test_numpy_integers_and_bools_are_accepted_as_plain_values():
  p = Params(num_stages=np.int64(2), circular_repeat=np.int32(2),
             num_microbatches=np.int64(2), shard_stages_1d=np.bool_(True),
             skip_bubbles=np.bool_(False))
  with tf.Graph().as_default():
    layer = p.Instantiate()
    assert type(layer.params.num_stages) is int  # pylint: disable=unidiomatic-typecheck
    assert layer.params.shard_stages_1d is True
    assert layer.params.skip_bubbles is False
    assert layer.vars.body.w.shape.as_list() == [2, 2, 4, 4]
    out = layer.FProp(layer.theta, tf.zeros([4, 4]))
  assert out.shape.as_list() == [4, 4]


def test_mesh_axis_must_match_num_stages():
  with tf.Graph().as_default():
    with pytest.raises(ValueError,
                       match=r'device_mesh axis 1 has 4 devices but '
                       r'num_stages=2'):
      Params(pipeline_stage_mesh_dim=1,
             device_mesh=np.arange(8).reshape(2, 4)).Instantiate()


def test_per_stage_vars_with_stage_parallel_body():
  p = Params(
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
    FProp(Params(num_microbatches=3), batch=4)


def test_batch_not_divisible_by_microbatch_size():
  with pytest.raises(ValueError,
                     match=r'Batch size 6 is not divisible by '
                     r'microbatch_size=4'):
    FProp(Params(num_microbatches=None, microbatch_size=4), batch=6)


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
  checked = layers.ValidateParams(Params(**overrides), batch_size)
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
        Params(num_stages=s, circular_repeat=r, num_microbatches=m), 4 * m)
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
    layers.ValidateParams(Params(**overrides), batch_size)


def test_readme_shows_what_validate_params_says():
  checked = layers.ValidateParams(
      Params(num_stages=4, circular_repeat=2, num_microbatches=16), 64)
  readme = ' '.join((_ROOT / 'README.md').read_text().split())
  assert f'`{checked}`' in readme, str(checked)


def test_kwarg_batch_not_divisible_by_num_microbatches():
  with pytest.raises(ValueError, match=r"kwarg 'scale' has shape \(3, 1\): "
                     r'its leading \(batch\) dim 3 must be divisible by '
                     r'num_microbatches=2.*kwargs_no_batch'):
    FProp(Params(), batch=4, scale=tf.ones([3, 1]))


def test_args_with_other_batch_sizes():
  with tf.Graph().as_default():
    layer = Params(single_stage_body=(
        reference_bodies.MultiInputBody.Params())).Instantiate()
    with pytest.raises(ValueError, match=r'All args must have the batch size '
                       r'4 as leading dim; got a tensor of shape \(2, 4\)'):
      layer.FProp(layer.theta, tf.zeros([4, 4]), None,
                  NestedMap(a=tf.zeros([2, 4]), b=tf.zeros([4])))


def test_premicrobatched_kwargs_must_be_microbatched_too():
  with pytest.raises(ValueError, match=r"kwarg 'scale' has shape \(4, 1\); "
                     r'the inputs are already microbatched, \[2, \.\.\.\]'):
    FProp(Params(num_microbatches=None), batch=2, scale=tf.ones([4, 1]))


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
    layer = Params().Instantiate()
    with pytest.raises(ValueError, match=pattern + r'.*kwargs_no_batch'):
      layer.FProp(layer.theta, *args, **kwargs)


def test_numpy_inputs_are_converted_like_tensorflow_does():
  x = np.random.RandomState(0).uniform(-1, 1, [4, 4]).astype(np.float32)
  with tf.Graph().as_default():
    layer = Params().Instantiate()
    from_numpy = layer.FProp(layer.theta, x)
    from_tensor = layer.FProp(layer.theta, tf.constant(x))
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      a, b = sess.run((from_numpy, from_tensor))
  np.testing.assert_array_equal(a, b)


def test_eager_fprop_says_what_to_do_and_unroll_runs_eagerly():
  layer = Params().Instantiate()
  with pytest.raises(RuntimeError, match=r'needs a graph.*tf.function'):
    layer.FProp(layer.theta, tf.zeros([4, 4]))
  unrolled = Params(unroll='always').Instantiate()
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
  p = Params(num_microbatches=4, circular_repeat=2)
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


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
