"""The planner's numbers: XLA's own, checked against independent expectations.

A whole training step (forward, loss, backward, Adam with its two slots)
of a small pipelined layer is lowered from shapes alone, partitioned for N
virtual devices and compiled without running (gpipe.plan). Checked:
  * the Adam update equals TensorFlow's own AdamOptimizer (two steps);
  * the per-device memory XLA reports for the shapes-only compile equals
    what the same step reports when lowered from values, partitioned and
    run (gpipe.partitioning.RunPartitioned), and the run equals the
    unpartitioned step;
  * per-device bytes against arithmetic on the variables' shapes: weights
    = total / S, Adam slots = 2 x weights / S; temporaries between one and
    a few times the pipeline's history (buffer x iterations);
  * FLOPs per device against a count of the body's matmuls (forward,
    recomputed forward, two gradient matmuls per iteration) within 10 %,
    and against the unpartitioned step's FLOPs / N;
  * the loop-aware cost counts a while loop's body once per iteration;
  * negative controls: replicated weights, and replicated optimizer slots,
    are reported as not split;
  * the command line: JSON fields, the recommendation, a clear error for a
    --num_devices that does not match the stages.
"""

import json

import numpy as np
import pytest
import tensorflow as tf

import gpipe  # pylint: disable=unused-import
from gpipe import layers
from gpipe import partitioning
from gpipe import plan
from gpipe import sharding
from gpipe.plan import roofline
from gpipe.plan import train_step
from tests import bodies

DIM = 64
NUM_STAGES = 4
NUM_MICROBATCHES = 8
BATCH = 24


def LayerParams(shard=True, circular_repeat=1):
  return layers.PipelinedLayer.Params().Set(
      name='stack', num_stages=NUM_STAGES,
      single_stage_body=bodies.DenseBody.Params().Set(dim=DIM),
      num_microbatches=NUM_MICROBATCHES, shard_stages_1d=shard,
      circular_repeat=circular_repeat, unroll='never')


def UnshardedLayerParams():
  return LayerParams(shard=False)


def _Plan(params, candidates=((NUM_MICROBATCHES, 1),)):
  target = plan.LayerTarget(params, [(BATCH, DIM)])
  return plan.MakePlan(target, [plan.Candidate(m, r) for m, r in candidates],
                       NUM_STAGES, roofline.CHIPS['v5e'], 16 * 2**30)


@pytest.fixture(scope='module')
def linear_plan():
  if not partitioning.IsAvailable():
    pytest.fail('jax and jaxlib are needed (they are in the test extra).')
  return _Plan(LayerParams(), candidates=((8, 1), (4, 1)))


@pytest.fixture(scope='module')
def reports(linear_plan):
  """Linear M=8, M=4, and circular (R=2) M=8."""
  circular = _Plan(LayerParams(circular_repeat=2), candidates=((8, 2),))
  return linear_plan.reports + circular.reports


def _Rows(report):
  """Rows of one microbatch."""
  return BATCH // report.candidate.num_microbatches


def test_adam_update_equals_tensorflow_adam():
  rng = np.random.RandomState(0)
  w0 = rng.randn(3, 5).astype(np.float32)
  grads = [rng.randn(3, 5).astype(np.float32) for _ in range(2)]
  adam = train_step.Adam(beta1=0.9, beta2=0.98, epsilon=1e-9)
  ours, slots = tf.constant(w0), [tf.zeros_like(w0), tf.zeros_like(w0)]
  var = tf.Variable(w0)
  reference = tf.compat.v1.train.AdamOptimizer(
      1e-2, beta1=0.9, beta2=0.98, epsilon=1e-9)
  for step, g in enumerate(grads):
    ours, slots = adam.Update(ours, tf.constant(g), slots, 1e-2,
                              tf.constant(step, tf.int64))
    reference.apply_gradients([(tf.constant(g), var)])
  np.testing.assert_allclose(ours.numpy(), var.numpy(), rtol=1e-5, atol=1e-6)


def test_weights_and_slots_live_split_like_the_weights(reports):
  assert len(reports) == 3
  for report in reports:
    r = report.candidate.circular_repeat
    total_weights = NUM_STAGES * r * (DIM * DIM + DIM) * 4
    assert report.TotalBytes(train_step.WEIGHT) == total_weights
    b = report.per_device_bytes
    # Every variable is a stage-stacked weight: 1/S of each per device.
    assert b['weights'] == total_weights // NUM_STAGES
    # Adam: m and v, each split like its weight.
    assert b['optimizer'] == 2 * total_weights // NUM_STAGES
    for arg, shard in zip(report.step.args,
                          report.compiled.param_shard_shapes):
      if arg.kind in (train_step.WEIGHT, train_step.SLOT):
        assert shard == (1,) + tuple(arg.spec.shape)[1:], (arg.name, shard)
    assert not report.Problems(), report.Problems()


def test_temporaries_scale_with_the_pipeline_history(reports):
  for report in reports:
    # The forward loop keeps one stage's buffer slot per iteration on each
    # device; the backward loop stacks as much again (the stage-0 input
    # gradients); the rest is one iteration's workspace.
    history = report.schedule.num_iterations * _Rows(report) * DIM * 4
    temp = report.per_device_bytes['temp']
    assert history <= temp <= 8 * history + 64 * 1024, (temp, history)
    peak = report.per_device_bytes['peak']
    m = report.compiled.memory
    assert peak == (m['argument_size_in_bytes'] + m['output_size_in_bytes'] +
                    temp - m['alias_size_in_bytes'])
    # The new weights and slots update the old ones in place.
    assert m['alias_size_in_bytes'] == 3 * report.per_device_bytes['weights']


def test_flops_match_a_count_of_the_matmuls(reports):
  for report in reports:
    sched = report.schedule
    # Per iteration each device runs its stage once forward and, in the
    # backward loop, once more (recompute) plus two gradient matmuls. The
    # rest is elementwise: tanh, bias, masks, Adam, and with circular
    # repeats the one-hot pick of the repeat's weights (R x DIM x DIM per
    # pick, a few per iteration): at most 10 % linear, 20 % circular.
    matmul = 2 * _Rows(report) * DIM * DIM
    expected = sched.num_iterations * 4 * matmul
    margin = 0.1 if sched.circular_repeat == 1 else 0.2
    assert 1 <= report.flops_per_device / expected < 1 + margin, (
        report.flops_per_device, expected)
    # No device computes another stage's work: per-device FLOPs are about
    # the unpartitioned step's / N. With circular repeats the one-device
    # step picks every stage's repeat weights each iteration (and their
    # gradients), which a device does for its own stage only: lower.
    ratio = report.ToJson()['flops_ratio']
    low = 0.9 if sched.circular_repeat == 1 else 0.6
    assert low < ratio < 1.1, ratio


def test_collectives_per_iteration(reports):
  for report in reports:
    loops = report.LoopSummaries()
    assert len(loops) == 2
    slot_bytes = _Rows(report) * DIM * 4
    forward, backward = loops
    assert forward['iterations'] == report.schedule.num_iterations
    assert forward['collectives'] == {
        'collective-permute': {'count': 1, 'bytes': slot_bytes}}
    assert backward['collectives']['collective-permute'] == {
        'count': 1, 'bytes': slot_bytes}
    assert report.permute_bytes_per_iteration == slot_bytes
    assert not report.Gathered()


def test_remat_policies_trade_memory_for_flops():
  """save_all stores each stage's tanh output per iteration and runs no
  forward again: one matmul less per iteration (of 4, see the FLOPs test
  above), at most one more [rows, DIM] float32 per device per iteration,
  split as intended."""
  target = plan.LayerTarget(LayerParams(), [(BATCH, DIM)])
  rec, saved = plan.MakePlan(
      target, [plan.Candidate(8, 1, 'recompute'),
               plan.Candidate(8, 1, 'save_all')],
      NUM_STAGES, roofline.CHIPS['v5e'], 16 * 2**30).reports
  assert saved.candidate.remat_policy == 'save_all'
  assert saved.ToJson()['remat_policy'] == 'save_all'
  iterations = rec.schedule.num_iterations
  matmul = 2 * _Rows(rec) * DIM * DIM
  # The difference is the recomputed forward: a matmul per iteration (its
  # bias add and tanh are few FLOPs: 2 x rows x DIM of 2 x rows x DIM^2),
  # less what storing adds (a select per stored element).
  saved_flops = rec.flops_per_device - saved.flops_per_device
  assert 0.95 <= saved_flops / (iterations * matmul) < 1.05, saved_flops
  # Memory: at most one [rows, DIM] activation more per device and
  # iteration (XLA may reuse other buffers, so it may be less); a stored
  # copy of the [DIM, DIM] weights per iteration would be 21 times that.
  stored = iterations * _Rows(rec) * DIM * 4
  extra = saved.per_device_bytes['temp'] - rec.per_device_bytes['temp']
  assert extra <= stored, (extra, stored)
  assert not saved.Problems(), saved.Problems()


def test_recommends_the_fastest_fitting_candidate(linear_plan):
  reports = linear_plan.reports
  assert all(r.fits for r in reports)
  best = min(range(len(reports)),
             key=lambda i: reports[i].prediction.step_seconds)
  assert linear_plan.recommended == best


def test_shapes_only_memory_equals_the_partitioned_run():
  layer = LayerParams().Instantiate()
  step = train_step.LayerStep(layer, [(BATCH, DIM)])
  rng = np.random.RandomState(1)
  values = [
      rng.uniform(-1, 1, a.spec.shape).astype(a.spec.dtype.as_numpy_dtype)
      if a.kind != train_step.SCALAR else np.asarray(
          1, a.spec.dtype.as_numpy_dtype) for a in step.args
  ]

  def Partitioned(*args):
    with sharding.SpmdPartitioning():
      return step(*args)

  compiled = partitioning.CompileFromShapes(
      partitioning.LowerFromShapes(Partitioned, step.specs), NUM_STAGES)
  run = partitioning.RunPartitioned(Partitioned, values, NUM_STAGES)
  for key in ('temp_size_in_bytes', 'argument_size_in_bytes',
              'output_size_in_bytes'):
    assert compiled.memory[key] == run.memory[key], key
  assert compiled.param_shard_shapes == run.param_shard_shapes
  unpartitioned = tf.function(step, jit_compile=True)(
      *[tf.constant(v) for v in values])
  for got, want in zip(run.outputs, unpartitioned):
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)


def test_replicated_weights_are_flagged():
  result = _Plan(UnshardedLayerParams())
  (report,) = result.reports
  b = report.per_device_bytes
  assert b['weights'] == report.TotalBytes(train_step.WEIGHT)
  assert len(report.Unsplit()) == 2 * 3  # w and b, and their two slots
  assert 'shard_stages_1d' in report.Problems()[0]
  assert result.recommended is None


class _ReplicatedSlotsStep(train_step.TrainStep):
  """A wrong placement: the new optimizer slots marked replicated."""

  def _PlaceSlots(self, values):
    return [sharding.Replicate(v) for v in values]


def test_replicated_slots_are_flagged(monkeypatch):
  monkeypatch.setattr(train_step, 'TrainStep', _ReplicatedSlotsStep)
  (report,) = _Plan(LayerParams()).reports
  unsplit = report.Unsplit()
  assert unsplit and all('/' in name for name in unsplit), unsplit
  assert report.per_device_bytes['optimizer'] == report.TotalBytes(
      train_step.SLOT)


def test_loop_aware_cost_counts_each_iteration():

  def Fn(w, x):
    def Body(i, x):
      return i + 1, tf.matmul(x, w)
    _, y = tf.while_loop(lambda i, x: i < 10, Body, [0, x])
    return tf.reduce_sum(tf.matmul(y, w))

  compiled = partitioning.CompileFromShapes(
      partitioning.LowerFromShapes(
          Fn, [tf.TensorSpec([128, 128]), tf.TensorSpec([32, 128])]), 1)
  matmul = 2 * 32 * 128 * 128
  assert abs(compiled.cost['flops'] / (11 * matmul) - 1) < 0.01


def test_a_loop_of_unknown_trip_count_leaves_memory_and_says_why_no_cost():

  def Fn(x):
    # Runs until the values are large: XLA cannot know how often.
    _, y = tf.while_loop(lambda i, x: tf.reduce_max(x) < 100.0,
                         lambda i, x: (i + 1, x * 2.0), [0, x])
    return y

  memory = partitioning.CompiledMemory(Fn, [np.ones([64, 64], np.float32)])
  assert memory['argument_size_in_bytes'] == 64 * 64 * 4
  compiled = partitioning.CompileFromShapes(
      partitioning.LowerFromShapes(Fn, [tf.TensorSpec([64, 64])]), 1)
  assert compiled.cost is None
  with pytest.raises(RuntimeError, match='did not find the trip count'):
    compiled.Cost('flops')


def test_plan_command_json(capsys):
  status = plan.main([
      '--params', 'tests.plan_test.LayerParams', '--input_shape',
      f'{BATCH},{DIM}', '--num_devices', str(NUM_STAGES), '--tpu', 'v5e',
      '--hbm_gib', '16', '--num_microbatches', '8,5', '--json'
  ])
  assert status == 0
  report = json.loads(capsys.readouterr().out)
  assert report['num_devices'] == NUM_STAGES
  assert report['total_weight_bytes'] == NUM_STAGES * (DIM * DIM + DIM) * 4
  (candidate,) = report['candidates']
  for key in ('num_microbatches', 'circular_repeat', 'iterations',
              'bubble_fraction', 'per_device_bytes', 'fits',
              'flops_per_device', 'flops_unpartitioned',
              'permute_bytes_per_iteration', 'predicted_step_seconds'):
    assert key in candidate, key
  assert set(candidate['per_device_bytes']) == {'weights', 'optimizer',
                                                'temp', 'peak'}
  assert candidate['iterations'] == NUM_MICROBATCHES + NUM_STAGES - 1
  sizes = [b['bytes'] for b in candidate['largest_buffers']]
  assert sizes and sizes == sorted(sizes, reverse=True)
  assert report['recommended'] == 0
  # M=5 does not divide the batch of 24: skipped, with the reason.
  (skipped,) = report['skipped']
  assert skipped['num_microbatches'] == 5
  assert '24' in skipped['reason'], skipped
  assert report['tpu']['name'] == 'v5e'


def test_plan_command_rejects_a_device_count_before_compiling(capsys):
  status = plan.main([
      '--params', 'tests.plan_test.LayerParams', '--input_shape',
      f'{BATCH},{DIM}', '--num_devices', '8'
  ])
  err = capsys.readouterr().err
  assert status == 2
  assert '--num_devices 8' in err and 'num_stages=4' in err, err


def test_plan_command_rejects_a_circular_repeat_that_changes_depth(capsys):
  status = plan.main([
      '--params', 'tests.plan_test.LayerParams', '--input_shape',
      f'{BATCH},{DIM}', '--circular_repeat', '2', '--json'
  ])
  assert status == 0
  report = json.loads(capsys.readouterr().out)
  assert report['candidates'] == [] and report['recommended'] is None
  assert 'num_blocks' in report['skipped'][0]['reason']


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
