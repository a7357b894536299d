"""The planner's step and XLA's figures, each checked on a step of its own.

The planned training step (gpipe.model_step.train_step) of the small pipelined
layer of plan_test.py, and XLA's compiled figures gpipe.plan reads:
  * the Adam update equals TensorFlow's own AdamOptimizer (two steps), and
    the planned update, with and without a gradient clip, TensorFlow's
    tf.clip_by_global_norm and AdamOptimizer on the step's own gradients;
  * the per-device memory XLA reports for the shapes-only compile equals
    what the same step reports when lowered from values, partitioned and
    run (gpipe.xla.partitioning.RunPartitioned), and the run equals the
    unpartitioned step;
  * the loop-aware cost counts a while loop's body once per iteration, and
    a loop of unknown trip count leaves the memory and says why no cost;
  * negative controls: replicated weights, and replicated optimizer slots,
    are reported as not split;
  * what a forward loop stores for the backward loop, read from HLO; the
    remat policies' trade of memory for FLOPs; the prediction's step and
    MFU by hand; the report's units.
"""

import numpy as np
import pytest
import tensorflow as tf

import gpipe  # pylint: disable=unused-import
from gpipe.model_step import optimizers
from gpipe.model_step import train_step
from gpipe import plan
from gpipe.plan import report as report_lib
from gpipe.plan import roofline
from gpipe import sharding
from gpipe.xla import partitioning
from tests.plan import plan_test

DIM, BATCH, NUM_STAGES = plan_test.DIM, plan_test.BATCH, plan_test.NUM_STAGES


def test_adam_update_equals_tensorflow_adam():
  rng = np.random.RandomState(0)
  w0 = rng.randn(3, 5).astype(np.float32)
  grads = [rng.randn(3, 5).astype(np.float32) for _ in range(2)]
  adam = optimizers.Adam(beta1=0.9, beta2=0.98, epsilon=1e-9)
  ours, slots = tf.constant(w0), [tf.zeros_like(w0), tf.zeros_like(w0)]
  var = tf.Variable(w0)
  reference = tf.compat.v1.train.AdamOptimizer(
      1e-2, beta1=0.9, beta2=0.98, epsilon=1e-9)
  for step, g in enumerate(grads):
    ours, slots = adam.Update(ours, tf.constant(g), slots, 1e-2,
                              tf.constant(step, tf.int64))
    reference.apply_gradients([(tf.constant(g), var)])
  np.testing.assert_allclose(ours.numpy(), var.numpy(), rtol=1e-5, atol=1e-6)


_STORED_HLO = """
ENTRY %main (p: bf16[2]) -> f32[] {
  %init.1 = (s32[], bf16[3,2]{1,0}, bf16[3,2]{1,0}, f32[3,4]{1,0}) tuple(%a, %b, %c, %d)
  %while.1 = (s32[], bf16[3,2]{1,0}, bf16[3,2]{1,0}, f32[3,4]{1,0}) while(%init.1), condition=%cond.1, body=%forward, backend_config={"known_trip_count":{"n":"3"}}
  %gte.1 = bf16[3,2]{1,0} get-tuple-element(%while.1), index=1
  %gte.2 = bf16[3,2]{1,0} get-tuple-element(%while.1), index=2
  %gte.3 = f32[3,4]{1,0} get-tuple-element(%while.1), index=3
  %convert.1 = f32[3,2]{1,0} fusion(%gte.2), kind=kLoop, calls=%wrapped_convert
  %reshape.1 = f32[3,2,2]{2,1,0} reshape(%gte.3)
  %init.2 = (s32[], bf16[3,2]{1,0}, f32[3,2]{1,0}, f32[3,2,2]{2,1,0}) tuple(%e, %gte.1, %convert.1, %reshape.1)
  %while.2 = (s32[], bf16[3,2]{1,0}, f32[3,2]{1,0}, f32[3,2,2]{2,1,0}) while(%init.2), condition=%cond.2, body=%backward
}
"""


def test_stored_activations_reach_the_backward_loop_as_is_or_converted():
  """A stack the backward loop takes in as is, or converted whole
  (XLA:CPU widens a bfloat16 stack so), counts in the forward loop's type;
  one reshaped into other dims on its way does not."""
  from gpipe.plan import loops  # pylint: disable=g-import-not-at-top
  assert loops.StoredActivations(_STORED_HLO, 'forward') == [
      (12, 'bf16[3,2]{1,0}'), (12, 'bf16[3,2]{1,0}')]


def test_prediction_step_and_mfu_by_hand():
  chip = roofline.Chip('test', peak_flops=100.0, hbm_bytes=1.0,
                       hbm_bandwidth=10.0, ici_bandwidth=16.0, ici_ports=4)
  step_bytes = roofline.StepBytes(
      loop_weights=8, loop_trainable=8, other_weights=2, other_trainable=1,
      slots=18, inputs=5, stored=6, buffer=1, iterations=4,
      circular_repeat=2, recomputes_forward=False, clips_gradients=True)
  p = roofline.Predict(chip, flops=1000, loop_flops=800,
                       bubble_fraction=0.25, step_bytes=step_bytes,
                       collective_seconds=5, model_flops=2000,
                       num_devices=4)
  # Loop weights: 4 iterations x 4 bytes (one repeat) x (1 + 1); gradient
  # accumulators 4 x 2 x 4 + 1 written; update (4 with the clip norm) x 9
  # + 2 x 18; stored 2 x 6; buffer 4 x 4 x 1; other 2 x 2 + 5.
  assert p.memory_traffic_bytes == {
      'loop_weight_reads': 32, 'gradient_accumulation': 33, 'update': 72,
      'stored_activations': 12, 'buffer': 16, 'other_weights_and_inputs': 9}
  assert p.compute_seconds == 10 and p.bubble_seconds == 2
  # Of compute: the model's share of a device (2000 / 4 / 100), the rest.
  assert p.model_seconds == 5 and p.other_compute_seconds == 10 - 5 - 2
  assert p.memory_seconds == 17.4
  assert p.collective_seconds == 5
  assert p.step_seconds == 17.4 + 5 and p.bound == 'memory'
  assert p.mfu == pytest.approx(2000 / (4 * 100 * 22.4))


def test_remat_policies_trade_memory_for_flops():
  """save_all stores each stage's tanh output per iteration and runs no
  forward again: one matmul less per iteration (of 4, see the FLOPs test
  above), at most one more [rows, DIM] float32 per device per iteration,
  split as intended."""
  target = plan.LayerTarget(plan_test.LayerParams(), [(BATCH, DIM)])
  rec, saved = plan.MakePlan(
      target, [plan.Candidate(8, 1, 'recompute'),
               plan.Candidate(8, 1, 'save_all')],
      NUM_STAGES, roofline.CHIPS['v5e'], 16 * 2**30).reports
  assert saved.candidate.remat_policy == 'save_all'
  assert saved.ToJson()['remat_policy'] == 'save_all'
  iterations = rec.schedule.num_iterations
  matmul = 2 * plan_test.Rows(rec) * DIM * DIM
  # The difference is the recomputed forward: a matmul per iteration (its
  # bias add and tanh are few FLOPs: 2 x rows x DIM of 2 x rows x DIM^2),
  # less what storing adds (a select per stored element).
  saved_flops = rec.flops_per_device - saved.flops_per_device
  assert 0.95 <= saved_flops / (iterations * matmul) < 1.05, saved_flops
  # Memory: at most one [rows, DIM] activation more per device and
  # iteration (XLA may reuse other buffers, so it may be less); a stored
  # copy of the [DIM, DIM] weights per iteration would be 21 times that.
  stored = iterations * plan_test.Rows(rec) * DIM * 4
  extra = saved.per_device_bytes['temp'] - rec.per_device_bytes['temp']
  assert extra <= stored, (extra, stored)
  assert not saved.Problems(), saved.Problems()
  # What the forward loop stores for the backward loop: the buffer history,
  # and with save_all each iteration's tanh output as well.
  assert rec.stored_activation_bytes == stored
  assert saved.stored_activation_bytes == 2 * stored
  # The model's work is the same; what recompute does more is in the
  # rest of its compute: about one matmul per useful iteration (the
  # bubbles' share of it counts as bubble).
  assert rec.model_flops == saved.model_flops
  other = (rec.prediction.other_compute_seconds -
           saved.prediction.other_compute_seconds) * rec.chip.peak_flops
  useful = rec.schedule.num_microbatches * rec.schedule.circular_repeat
  assert 0.95 <= other / (useful * matmul) < 1.05, other
  # Nothing recomputed: the backward loop reads the weights once less.
  assert (rec.prediction.memory_traffic_bytes['loop_weight_reads'] ==
          1.5 * saved.prediction.memory_traffic_bytes['loop_weight_reads'])


def test_report_units_show_each_figure():
  assert report_lib.Bytes(768) == '768 B'
  assert report_lib.Bytes(1023) == '1023 B'
  assert report_lib.Bytes(16640) == '16.2 KiB'
  assert report_lib.Bytes(25 * 2**30) == '25.0 GiB'
  assert report_lib.Bytes(3 * 2**20 + 2**19) == '3.50 MiB'
  assert report_lib.Seconds(17.3) == '17.3 s'
  assert report_lib.Seconds(2.85e-6) == '2.85 us'
  assert report_lib.Seconds(5.92e-9) == '5.92 ns'
  assert report_lib.Seconds(0.25) == '250 ms'
  assert report_lib.Percent(0.52) == '52.0 %'
  assert report_lib.Percent(0.6110) == '61.1 %'
  assert report_lib.Percent(0.0018) == '0.18 %'
  assert report_lib.Percent(0.000084) == '<0.01 %'
  assert report_lib.Percent(0) == '0 %'


def test_the_calibrated_step_and_the_ceiling_by_hand():
  """compute 10 s of which 8 s matrix work at peak, memory 6 s,
  collectives 5 s; at an efficiency of 0.5 the matrix work takes 16 s:
  compute 18 s, and a schedule at that speed hiding 4 s leaves 1 s of
  collectives: 19 s. At peak, 2 s hidden: overlapped 13 s, no overlap 15
  s, ceiling 10 s."""
  step_bytes = roofline.StepBytes(
      loop_weights=0, loop_trainable=0, other_weights=0, other_trainable=0,
      slots=0, inputs=6, stored=0, buffer=0, iterations=1)
  chip = roofline.Chip('test', peak_flops=1.0, hbm_bytes=1.0,
                       hbm_bandwidth=1.0, ici_bandwidth=8.0, ici_ports=4)
  p = roofline.Predict(chip, flops=10, loop_flops=0, bubble_fraction=0.0,
                       step_bytes=step_bytes, collective_seconds=5,
                       model_flops=40, num_devices=2, hidden_seconds=2,
                       matmul_flops=8, calibration=(0.5, 4))
  assert p.memory_seconds == 6 and p.matmul_seconds == 8
  assert p.compute_seconds_calibrated == 18
  assert p.step_seconds_calibrated == 19
  assert p.step_seconds_overlapped == 13 and p.step_seconds == 15
  assert p.step_seconds_ceiling == 10
  assert p.mfu_calibrated == pytest.approx(40 / (2 * 19))
  assert p.mfu_ceiling == pytest.approx(40 / (2 * 10))
  # Every collective hidden by the schedule: no step below the compute.
  all_hidden = roofline.Predict(
      chip, flops=10, loop_flops=0, bubble_fraction=0.0,
      step_bytes=step_bytes, collective_seconds=5, model_flops=40,
      num_devices=2, matmul_flops=8, calibration=(0.5, 9))
  assert all_hidden.step_seconds_calibrated == 18


def test_the_fit_finds_the_efficiency_of_a_measured_mfu():
  """mfu(e) = 0.75 e (a step of 8 units of matrix work where the model
  counts 6): a measured 61.1 % is e = 0.8147; out of reach, an error."""
  from gpipe.plan import calibration  # pylint: disable=g-import-not-at-top
  assert calibration.Fit(lambda e: 0.75 * e, 0.611) == pytest.approx(
      0.611 / 0.75, abs=1e-4)
  with pytest.raises(ValueError, match='out of reach'):
    calibration.Fit(lambda e: 0.75 * e, 0.9)


@pytest.mark.parametrize('clip_norm', [0.0, 0.05])
def test_the_planned_update_is_tensorflows_clipped_adam(clip_norm):
  """The step's new weights and Adam slots (updated one weight after
  another, the clip's factor inside each update) against TensorFlow's
  tf.clip_by_global_norm and AdamOptimizer applied to the step's own
  gradients (its Gradients, which the update does not touch)."""
  layer = plan_test.LayerParams().Instantiate()
  step = train_step.LayerStep(layer, [(BATCH, DIM)])
  step.clip_norm = clip_norm
  rng = np.random.RandomState(3)
  weights = [rng.normal(0, 0.3, a.spec.shape).astype(np.float32)
             for a in step.weight_args]
  x = rng.normal(size=[BATCH, DIM]).astype(np.float32)
  slots = [np.zeros(a.spec.shape, np.float32) for a in step.slot_args]
  run = tf.function(step, jit_compile=True)
  _, *new = run(*[tf.constant(v) for v in weights + slots + [x]],
                tf.constant(0, tf.int64), tf.constant(1e-2))
  _, *grads = tf.function(step.Gradients, jit_compile=True)(
      *[tf.constant(v) for v in weights + [x]])
  norm = np.sqrt(sum(np.sum(np.square(g.numpy())) for g in grads))
  if clip_norm:
    assert norm > 2 * clip_norm, norm  # the clip scales every gradient
    grads, _ = tf.clip_by_global_norm(grads, clip_norm)
  variables = [tf.Variable(w) for w in weights]
  adam = tf.compat.v1.train.AdamOptimizer(1e-2)
  adam.apply_gradients(zip(grads, variables))
  n = len(weights)
  for i, var in enumerate(variables):
    np.testing.assert_allclose(new[i].numpy(), var.numpy(), rtol=1e-5,
                               atol=1e-6)
    m, v = new[n + 2 * i:n + 2 * i + 2]
    np.testing.assert_allclose(m.numpy(), adam.get_slot(var, 'm').numpy(),
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(v.numpy(), adam.get_slot(var, 'v').numpy(),
                               rtol=1e-5, atol=1e-9)


def test_shapes_only_memory_equals_the_partitioned_run():
  layer = plan_test.LayerParams().Instantiate()
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
  result = plan_test.MakePlan(plan_test.UnshardedLayerParams())
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
  (report,) = plan_test.MakePlan(plan_test.LayerParams()).reports
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


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))


def test_input_specs_of_a_generator_that_reads_the_global_step():
  """examples/my_task.py's input is a function of the global step, as
  Lingvo's programs have one: the planner's scratch graph has it too, and
  the specs are the batch's static shapes."""
  from examples import my_task  # pylint: disable=g-import-not-at-top
  specs = train_step.InputSpecs(my_task.MyRegression().Train())
  assert sorted(specs.keys()) == ['x', 'y']
  for spec in (specs.x, specs.y):
    assert spec.shape.as_list() == [32, my_task.DIM]
    assert spec.dtype == tf.float32
