"""gpipe.pipeline.stage_runners: one iteration's stages, each on its own slot.

The one-device runner (DenseBody, weights [S, R, ...]) and the stage-
parallel runner (StageParallelDenseBody, weights [R, S, ...]) compute the
same per-stage math; both are checked against NumPy: stage s applies
repeat repeat_ids[s]'s weights to its slot and scales by its microbatch's
per-example kwarg.
"""

import types

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe.pipeline import layer_by_layer
from gpipe.pipeline import repeats
from gpipe.pipeline import stage_call
from gpipe.pipeline import stage_runners
from gpipe.pipeline import vectorized_stages
from gpipe import schedule as schedule_lib
from gpipe import sharding
from tests import reference_bodies
from tests import sessions

S, M, R, ROWS, D = 3, 4, 2, 2, 4


def _Data():
  rng = np.random.RandomState(0)
  f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
  return dict(x=f32(S, ROWS, D), w=f32(S, R, D, D), b=f32(S, R, D),
              scale=f32(M, ROWS, D), mb_ids=np.array([3, 0, 2], np.int32),
              repeat_ids=np.array([1, 0, 1], np.int32))


def _Want(d):
  out = []
  for s in range(S):
    r, m = d['repeat_ids'][s], d['mb_ids'][s]
    y = np.tanh(d['x'][s] @ d['w'][s, r] + d['b'][s, r]) * d['scale'][m]
    out.append(y)
  return np.stack(out)


@pytest.mark.parametrize('stage_parallel', [False, True])
def test_each_stage_gets_its_slot_repeat_and_microbatch(stage_parallel):
  d = _Data()
  with tf.Graph().as_default():
    if stage_parallel:
      layer = reference_bodies.StageParallelDenseBody.Params().Set(
          name='body', dim=D, num_stages=S).Instantiate()
      theta = dict(w=np.swapaxes(d['w'], 0, 1), b=np.swapaxes(d['b'], 0, 1))
      param = 'stage_parallel_body'
    else:
      layer = reference_bodies.DenseBody.Params().Set(
          name='body', dim=D).Instantiate()
      theta = dict(w=d['w'], b=d['b'])
      param = 'single_stage_body'
    theta = layer.theta.Pack([tf.constant(theta[k]) for k in ('b', 'w')])
    spec = types.SimpleNamespace(
        schedule=schedule_lib.Schedule(S, M, R),
        body=stage_call.Body(layer, param, 'pipe'), fn_name='FProp',
        repeats=repeats.RepeatsFor(R), mb_kwargs={'scale': tf.constant(d['scale'])},
        kwargs_no_batch={}, var_names=(), global_step=None)
    it = stage_runners.IterationStages(
        args=(tf.constant(d['x']),), mb_ids=tf.constant(d['mb_ids']),
        repeat_ids=tf.constant(d['repeat_ids']),
        seeds=tf.constant([1, 2, 3], tf.int64), var_values=[])
    runner = stage_runners.RunTogether if stage_parallel else (
        stage_runners.RunOneByOne)
    res = runner(spec, theta, it)
    assert res.aux is None and res.summaries == [] and res.vars == []
    with sessions.AsBuilt() as sess:
      (got,) = sess.run(res.outputs)
  np.testing.assert_allclose(got, _Want(d), rtol=1e-5, atol=1e-6)


def test_stage_parallel_aux_losses_must_be_per_stage():
  with pytest.raises(ValueError, match=r'aux losses of shape \[num_stages\]'):
    with tf.Graph().as_default():
      stage_runners.StageParallelAuxLoss([tf.constant(1.0)], S)


def test_the_runner_a_layer_gets_says_what_it_can_do():
  """stage_runners.RunnerFor: one runner object per layout and placement, whose
  attributes the loop and layer_by_layer read (no closures, no isinstance)."""
  placed = sharding.StagePlacement(4, shard_stages_1d=True)
  unplaced = sharding.StagePlacement(4)
  vectorizing = vectorized_stages.Vectorizing('auto', 'stack')
  together = stage_runners.RunnerFor(True, placed, vectorizing)
  assert isinstance(together, stage_runners.Together)
  assert together.stage_parallel and not together.any_stage_range
  assert together.manual_mesh is None
  one_device = stage_runners.RunnerFor(False, placed, vectorizing)
  assert one_device is vectorizing and one_device.any_stage_range
  assert one_device.vectorizes and one_device.manual_mesh is None
  assert not one_device.stage_dim_inside  # until a call has run vectorized
  assert isinstance(stage_runners.RunnerFor(False, placed), stage_runners.OneByOne)
  with sharding.SpmdPartitioning():
    partitioned = stage_runners.RunnerFor(False, placed, vectorizing)
    assert isinstance(stage_runners.RunnerFor(False, unplaced),
                      stage_runners.OneByOne)
  assert isinstance(partitioned, stage_runners.InManualRegion)
  assert np.array_equal(partitioned.manual_mesh[0], placed.mesh[0])
  assert partitioned.manual_mesh[1] == placed.mesh[1]
  assert not partitioned.any_stage_range and partitioned.stage_dim_inside
  assert not vectorized_stages.Vectorizing('never', 'stack').vectorizes


@pytest.mark.parametrize('runner, reason', [
    (stage_runners.Together(), 'stage-parallel body'),
    (stage_runners.InManualRegion((np.arange(4), 0)), 'partitioned'),
    (vectorized_stages.Vectorizing('never', 'stack'),
     "vectorize_stages='never'"),
    (vectorized_stages.Vectorizing('auto', 'stack'), None),
])
def test_layer_by_layer_reads_why_not_off_the_runner(runner, reason):
  spec = types.SimpleNamespace(runner=runner, var_names=(), states=[],
                               first_stage=None)
  why = layer_by_layer.WhyNot(spec)
  assert (why is None) if reason is None else (reason in why), why
