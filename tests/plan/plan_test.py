"""The planner's numbers: XLA's own, checked against independent expectations.

A whole training step (forward, loss, backward, Adam with its two slots)
of a small pipelined layer is lowered from shapes alone, partitioned for N
virtual devices and compiled without running (gpipe.plan). Checked:
  * the Adam update equals TensorFlow's own AdamOptimizer (two steps);
  * the per-device memory XLA reports for the shapes-only compile equals
    what the same step reports when lowered from values, partitioned and
    run (gpipe.xla.partitioning.RunPartitioned), and the run equals the
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
    --num_devices that does not match the stages;
  * what the forward loop stores for the backward loop (found in the
    partitioned module) against the buffer history; each loop's FLOPs;
  * the predicted parts against arithmetic on the shapes and the chip's
    constants: compute, bubble, the fused step's memory traffic,
    collectives, the step and the MFU; the text report's units; the
    per-chip bytes plot;
  * the planner's edges: every candidate skipped (non-zero exit, each
    reason), nonsensical numbers and unwritable plot paths refused before
    anything is built, the model's own error reported as an error.
"""

import dataclasses
import json
import re

import numpy as np
import pytest
import tensorflow as tf

import gpipe  # pylint: disable=unused-import
from gpipe import layers
from gpipe import lingvo_compat
from gpipe.lingvo_support import tpu_build
from gpipe import plan
from gpipe.plan import candidate as candidate_lib
from gpipe.plan import optimizers
from gpipe.plan import plot
from gpipe.plan import report as report_lib
from gpipe.plan import roofline
from gpipe.plan import train_step
from gpipe import sharding
from gpipe.xla import partitioning
import params.lm  # pylint: disable=unused-import  (the registered lm.* models)
from tests import docs_test
from tests import reference_bodies
from tensorflow.python.compiler.xla.experimental import xla_sharding

DIM = 64
NUM_STAGES = 4
NUM_MICROBATCHES = 8
BATCH = 24


def LayerParams(shard=True, circular_repeat=1):
  return layers.PipelinedLayer.Params().Set(
      name='stack', num_stages=NUM_STAGES,
      single_stage_body=reference_bodies.DenseBody.Params().Set(dim=DIM),
      num_microbatches=NUM_MICROBATCHES, shard_stages_1d=shard,
      circular_repeat=circular_repeat, unroll='never')


def UnshardedLayerParams():
  return LayerParams(shard=False)


class _TypeErrorBody(reference_bodies.DenseBody):
  """A body with a bug of its own."""

  def FProp(self, theta, x):
    raise TypeError('the body got a wrong argument')


class _ShapeErrorBody(reference_bodies.DenseBody):
  """A body multiplying by a weight of the wrong height: TensorFlow's shape
  error, a ValueError like the ones gpipe's param checks raise."""

  def FProp(self, theta, x):
    return tf.matmul(x, theta.w[:DIM // 2])


def TypeErrorLayerParams():
  return LayerParams().Set(
      single_stage_body=_TypeErrorBody.Params().Set(dim=DIM))


def ShapeErrorLayerParams():
  return LayerParams().Set(
      single_stage_body=_ShapeErrorBody.Params().Set(dim=DIM))


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


def _Peak(report):
  return report.chip.peak_flops


def test_stored_activations_are_the_buffer_history(reports):
  for report in reports:
    # Under 'recompute' the forward loop stores one buffer slot (a
    # microbatch's [rows, DIM] activations) per iteration, nothing else.
    history = report.schedule.num_iterations * _Rows(report) * DIM * 4
    assert report.stored_activation_bytes == history, (
        report.stored_activations)
    assert report.stored_activation_bytes <= report.per_device_bytes['temp']


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


def test_loop_flops_split_the_step(reports):
  for report in reports:
    # Forward loop: one matmul per iteration; backward: the recomputed
    # forward and two gradient matmuls (see the FLOPs test above).
    matmul = 2 * _Rows(report) * DIM * DIM
    iterations = report.schedule.num_iterations
    margin = 0.1 if report.schedule.circular_repeat == 1 else 0.2
    forward, backward = report.loop_flops
    assert 1 <= forward / (iterations * matmul) < 1 + margin, forward
    assert 1 <= backward / (3 * iterations * matmul) < 1 + margin, backward
    assert forward + backward < report.flops_per_device


def test_predicted_parts_against_arithmetic(reports):
  v5e = roofline.CHIPS['v5e']
  for report in reports:
    p = report.prediction
    sched = report.schedule
    t, r = sched.num_iterations, sched.circular_repeat
    slot = _Rows(report) * DIM * 4  # one microbatch's activations
    weights = r * (DIM * DIM + DIM) * 4  # per device: R repeats of a stage
    assert p.compute_seconds == report.flops_per_device / 197e12
    # The bubbles: T - M R idle iterations of 4 matmuls (see above).
    idle = 4 * (t - sched.num_microbatches * r) * 2 * _Rows(report) * DIM**2
    margin = 0.1 if r == 1 else 0.2
    assert 1 <= p.bubble_seconds * 197e12 / idle < 1 + margin
    # Each iteration reads its repeat's weights 3 times (forward,
    # recomputed forward, input gradient), reads and writes its gradient;
    # Adam reads weights, gradients, m, v and writes weights, m, v; the
    # stored history is written and read; the buffer slot is read and
    # written per iteration, forward and backward; the input batch (on
    # every device) is read once.
    assert p.memory_traffic_bytes == {
        'loop_weight_reads': 3 * t * weights / r,
        'gradient_accumulation': 2 * t * weights / r,
        'update': 3 * weights + 2 * 2 * weights,
        'stored_activations': 2 * t * slot,
        'buffer': 4 * t * slot,
        'other_weights_and_inputs': BATCH * DIM * 4,
    }
    traffic = (5 * t * weights / r + 7 * weights + 6 * t * slot +
               BATCH * DIM * 4)
    assert p.memory_seconds == pytest.approx(traffic / 819e9)
    # A permute of the slot per iteration, forward and backward; the
    # outputs' all-reduce (a ring: twice its bytes) over 50 GB/s links;
    # b's update waits for w's: the all-reduce of a float32 scalar.
    collectives = 2 * t * slot + 2 * BATCH * DIM * 4 + 2 * 4
    assert p.collective_seconds == pytest.approx(collectives / 50e9)
    assert p.step_seconds == pytest.approx(
        max(p.compute_seconds, p.memory_seconds) + p.collective_seconds)
    assert p.memory_traffic_bytes['loop_weight_reads'] > 0
    assert p.bound == 'memory'  # a toy: 3 rows per microbatch
    # Model FLOPs: the stack's 3 matmuls per layer and row, plus the
    # elementwise rest (tanh, bias, loss, Adam): at most a quarter more.
    matmuls = 6 * NUM_STAGES * r * BATCH * DIM * DIM
    assert 1 <= p.model_flops / matmuls < 1.25, p.model_flops / matmuls
    assert p.mfu == pytest.approx(
        p.model_flops / (NUM_STAGES * v5e.peak_flops * p.step_seconds))


def test_prediction_step_and_mfu_by_hand():
  chip = roofline.Chip('test', peak_flops=100.0, hbm_bytes=1.0,
                       hbm_bandwidth=10.0, ici_bandwidth=16.0, ici_ports=4)
  step_bytes = roofline.StepBytes(
      loop_weights=8, loop_trainable=8, other_weights=2, other_trainable=1,
      slots=18, inputs=5, stored=6, buffer=1, iterations=4,
      circular_repeat=2, recomputes_forward=False, clips_gradients=True)
  p = roofline.Predict(chip, flops=1000, loop_flops=800,
                       bubble_fraction=0.25, step_bytes=step_bytes,
                       collective_bytes={'all-reduce': 3,
                                         'collective-permute': 4},
                       model_flops=2000, num_devices=4)
  # Loop weights: 4 iterations x 4 bytes (one repeat) x (1 + 1); gradient
  # accumulators 4 x 2 x 4 + 1 written; update (4 with the clip norm) x 9
  # + 2 x 18; stored 2 x 6; buffer 4 x 4 x 1; other 2 x 2 + 5.
  assert p.memory_traffic_bytes == {
      'loop_weight_reads': 32, 'gradient_accumulation': 33, 'update': 72,
      'stored_activations': 12, 'buffer': 16, 'other_weights_and_inputs': 9}
  assert p.compute_seconds == 10 and p.bubble_seconds == 2
  assert p.memory_seconds == 17.4
  assert p.collective_seconds == (2 * 3 + 4) / 2  # links: 16 / (2 x 4)
  assert p.step_seconds == 17.4 + 5 and p.bound == 'memory'
  assert p.mfu == pytest.approx(2000 / (4 * 100 * 22.4))
  # Model FLOPs: counted once (min of 1200 and 4 x 350), less 4 x (bubbles
  # 0.25 x 100 + the unbubbled recomputed forward 0.75 x 20).
  assert roofline.ModelFlops(1200, 350, 4, 100, 0.25, 20) == 1200 - 4 * 40
  assert roofline.ModelFlops(1600, 350, 4, 100, 0.25, 20) == 1400 - 4 * 40


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
  # What the forward loop stores for the backward loop: the buffer history,
  # and with save_all each iteration's tanh output as well.
  assert rec.stored_activation_bytes == stored
  assert saved.stored_activation_bytes == 2 * stored
  # Nothing recomputed: the backward loop reads the weights once less.
  assert saved.recomputed_flops == 0
  assert rec.recomputed_flops == rec.loop_flops[0]
  assert (rec.prediction.memory_traffic_bytes['loop_weight_reads'] ==
          1.5 * saved.prediction.memory_traffic_bytes['loop_weight_reads'])


def test_backward_schedules_and_stream_io_as_candidates(capsys):
  """--backward_schedule reverse,1f1b and --stream_io false,true plan the
  four combinations: 1f1b's stored activations are its rings, 2 R S - 1
  stage inputs per device (reverse's the T-row history), its gradient
  runs in three loops with one forward more, and stream_io's inputs,
  outputs and their gradients are 1/S per device, so temp falls."""
  status = plan.main([
      '--params', 'tests.plan.plan_test.LayerParams', '--input_shape',
      f'{BATCH},{DIM}', '--num_devices', str(NUM_STAGES), '--tpu', 'v5e',
      '--hbm_gib', '16', '--num_microbatches', '8', '--backward_schedule',
      'reverse,1f1b', '--stream_io', 'false,true', '--json'])
  assert status == 0
  report = json.loads(capsys.readouterr().out)
  got = {(c['backward_schedule'], c['stream_io']): c
         for c in report['candidates']}
  assert set(got) == {('reverse', False), ('reverse', True),
                      ('1f1b', False), ('1f1b', True)}
  t = NUM_MICROBATCHES + NUM_STAGES - 1
  slot = BATCH // NUM_MICROBATCHES * DIM * 4  # one microbatch's activations
  ring = 2 * NUM_STAGES - 1
  for (schedule, stream_io), c in got.items():
    stored = c['stored_activation_bytes']
    (forward,) = [loop for loop in c['loops'] if loop['role'] == 'forward']
    backward = sorted(loop['iterations'] for loop in c['loops']
                      if loop['role'] == 'backward')
    assert forward['iterations'] == t
    if schedule == 'reverse':
      assert stored == t * slot, (schedule, stream_io, stored)
      assert backward == [t]
    else:
      assert stored == ring * slot, (schedule, stream_io, stored)
      delay = NUM_STAGES - 1
      assert backward == sorted([delay, t - delay, delay])
    # The forward loop's permutes: the buffer, and with stream_io one
    # column of the input stream and one of the output stream.
    assert forward['collectives'] == {'collective-permute': {
        'count': 3 if stream_io else 1, 'bytes': (3 if stream_io else 1) *
        slot}}, forward
    assert c['flops_ratio'] == pytest.approx(1.0, abs=0.02)
  # 1f1b runs the forward once more: 2 of the 4 matmuls of a layer's step
  # (see test_flops_match_a_count_of_the_matmuls) again, 5 / 4.
  ratio = (got[('1f1b', False)]['flops_per_device'] /
           got[('reverse', False)]['flops_per_device'])
  assert 1.15 < ratio < 1.3, ratio
  temp = {k: c['per_device_bytes']['temp'] for k, c in got.items()}
  assert temp[('1f1b', True)] < temp[('reverse', True)] < temp[
      ('reverse', False)], temp
  assert temp[('1f1b', True)] < temp[('1f1b', False)], temp


def test_stream_io_alone_means_true_and_lingvo_clients_plan_defaults_only():
  from gpipe.plan import flags  # pylint: disable=g-import-not-at-top
  _, args = flags.Parse(['--params', 'x.P', '--stream_io'])
  assert args.stream_io == [True]
  _, args = flags.Parse(['--params', 'x.P', '--stream_io', 'false,true'])
  assert args.stream_io == [False, True]
  with pytest.raises(SystemExit):
    flags.Parse(['--params', 'x.P', '--backward_schedule', 'forward'])
  from gpipe.plan import stacks  # pylint: disable=g-import-not-at-top
  with pytest.raises(stacks.StackError, match=r"plan only those"):
    stacks._OnlyTheDefaultPolicy(  # pylint: disable=protected-access
        plan.Candidate(8, 1, backward_schedule='1f1b'), 'AClient')


def test_recommends_the_fastest_fitting_candidate(linear_plan):
  reports = linear_plan.reports
  assert all(r.fits for r in reports)
  best = min(range(len(reports)),
             key=lambda i: reports[i].prediction.step_seconds)
  assert linear_plan.recommended == best


def _WithHbm(a_plan, hbm_bytes):
  """The same compiled candidates, judged against another HBM size."""
  return dataclasses.replace(
      a_plan, hbm_bytes=hbm_bytes,
      reports=[dataclasses.replace(r, hbm_bytes=hbm_bytes)
               for r in a_plan.reports])


def test_fits_compares_everything_a_chip_holds_with_hbm(linear_plan):
  for report in linear_plan.reports:
    b = report.per_device_bytes
    m = report.compiled.memory
    # Everything a device holds at once: the arguments (weights, slots and
    # the input batch, which every device holds whole), the temporaries.
    held = (b['weights'] + b['optimizer'] + BATCH * DIM * 4 + b['temp'])
    assert held <= b['peak'] <= held + m['output_size_in_bytes'] + 1024
    judged = _WithHbm(linear_plan, b['peak']).reports
    assert judged[linear_plan.reports.index(report)].fits
    judged = _WithHbm(linear_plan, held - 1).reports
    assert not judged[linear_plan.reports.index(report)].fits
    judged = _WithHbm(linear_plan, b['peak'] - 1).reports
    assert not judged[linear_plan.reports.index(report)].fits


def test_recommends_a_slower_candidate_when_the_fastest_does_not_fit(
    linear_plan):
  (m8, m4) = linear_plan.reports
  assert [r.candidate.num_microbatches for r in (m8, m4)] == [8, 4]
  peak8, peak4 = (r.per_device_bytes['peak'] for r in (m8, m4))
  # More microbatches, smaller ones: a smaller peak (the buffers are
  # microbatch-sized) but more iterations, each paying the loop's fixed
  # costs: M=4 is predicted faster on these tiny shapes.
  assert peak8 < peak4, (peak8, peak4)
  assert m4.prediction.step_seconds < m8.prediction.step_seconds
  assert _WithHbm(linear_plan, peak4).recommended == 1
  only_m8 = _WithHbm(linear_plan, peak4 - 1)
  assert [r.fits for r in only_m8.reports] == [True, False]
  assert only_m8.recommended == 0
  assert 'Recommendation: num_microbatches=8,' in only_m8.Render()
  neither = _WithHbm(linear_plan, peak8 - 1)
  assert [r.fits for r in neither.reports] == [False, False]
  assert neither.recommended is None
  text = neither.Render()
  assert 'Recommendation: none of the candidates fits' in text, text
  _, rows = _TableCells(text)[0]
  for cells in rows:
    assert cells[2].endswith('NO') and '*' not in cells[3], cells
  _, rows = _TableCells(only_m8.Render())[0]
  fits, starred = zip(*[(cells[2].split()[-1], '*' in cells[3])
                        for cells in rows])
  assert fits == ('yes', 'NO') and starred == (True, False), rows


def _TableCells(text):
  """[(group header line, [cells of each row])] of each table in a plan's
  text: a row's cells are its groups, split at '|'."""
  lines = text.splitlines()
  tables = []
  for i, line in enumerate(lines):
    if line and set(line) == {'-'}:
      rows = []
      for row in lines[i + 1:]:
        if '|' not in row:
          break
        rows.append([c.strip() for c in row.split('|')])
      tables.append((lines[i - 2], rows))
  return tables


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
  assert report_lib.Percent(0.52) == '52 %'
  assert report_lib.Percent(0.0018) == '0.18 %'


def test_text_report_labels_sources_and_units(linear_plan):
  text = linear_plan.Render()
  total = NUM_STAGES * (DIM * DIM + DIM) * 4  # 66560 B
  assert f'Weights: {total / 1024:.1f} KiB in all.' in text
  # No figure rounds away to zero in a unit too large for it.
  assert not re.search(r'\b0\.0+ [KMGT]?i?B\b', text), text
  (groups, rows), (measured_groups, measured) = _TableCells(text)
  assert [g.strip() for g in groups.split('|')] == [
      'candidate', 'schedule', 'XLA: per device', 'predicted: v5e model'
  ], groups
  assert [g.strip() for g in measured_groups.split('|')] == [
      'candidate', 'XLA: bytes per device', 'XLA: per device'
  ], measured_groups
  best = linear_plan.recommended
  for i, report in enumerate(linear_plan.reports):
    slot = _Rows(report) * DIM * 4
    cells = rows[i]
    assert cells[0].split() == [str(report.candidate.num_microbatches), '1',
                                'recompute'], cells
    assert cells[2].split()[-1] == 'yes', cells
    assert ('*' in cells[3]) == (i == best), cells
    cells = measured[i]
    assert cells[0] == rows[i][0], (cells, rows[i])
    assert cells[1].split()[:4] == ['16.2', 'KiB', '32.5', 'KiB'], cells
    assert cells[2].endswith(report_lib.Bytes(slot)), cells
  # M=8: 3 x 64 floats, on the (only) stage axis.
  assert '1 collective-permute over stage (768 B)' in text
  assert 'memory traffic (fused step, per device)' in text
  assert "XLA:CPU's unfused bytes accessed (not used)" in text
  assert 'Predicted by a roofline model' in text


def test_every_line_of_the_report_fits_100_columns(linear_plan,
                                                    monkeypatch):
  """The text report fits a terminal of 100 columns: the table of what a
  choice rests on, XLA's other figures in tables beside the candidate
  (split where they would not fit), the wrapped details and sources, also
  with the widest candidate columns (mesh and backward schedule shown)."""
  text = linear_plan.Render()
  assert len(_TableCells(text)) == 2, text
  widest = dataclasses.replace(linear_plan, reports=[
      dataclasses.replace(r, stream_io=True) for r in linear_plan.reports])
  monkeypatch.setattr(report_lib.Plan, 'MeshesVary', lambda self: True)
  widest_text = widest.Render()
  assert 'reverse+io' in widest_text
  # The candidate's columns and XLA's bytes fill a line: its FLOPs and
  # permutes go in a third table.
  assert len(_TableCells(widest_text)) == 3, widest_text
  for one in (text, widest_text):
    long_lines = [line for line in one.splitlines() if len(line) > 100]
    assert not long_lines, long_lines
    lines = one.splitlines()
    headers = ' '.join(lines[i + 1] for i, line in enumerate(lines)
                       if line.startswith(' candidate'))
    for column in ('M', 'R', 'remat', 'iters', 'bubble', 'peak', 'fits',
                   'step', 'MFU', 'weights', 'optim', 'temp', 'stored',
                   'FLOP/dev', '/(unp/N)', 'permute/it'):
      assert column in headers.split(), (column, headers)
  # The predicted step's parts are in each candidate's lines.
  for r in linear_plan.reports:
    p = r.prediction
    for part in (f'compute {report_lib.Seconds(p.compute_seconds)} [of it '
                 f'bubble {report_lib.Seconds(p.bubble_seconds)}]',
                 f'memory traffic {report_lib.Seconds(p.memory_seconds)}',
                 f'collectives {report_lib.Seconds(p.collective_seconds)}'):
      assert part in ' '.join(text.split()), part


def test_plot_segments_add_up_to_the_peak(linear_plan, tmp_path):
  for report in linear_plan.reports:
    segments = plot.Segments(report)
    assert list(segments) == list(plot.SEGMENTS)
    b = report.per_device_bytes
    assert sum(segments.values()) == b['peak']
    weights = (DIM * DIM + DIM) * 4
    assert segments['weights'] == weights
    assert segments['optimizer slots'] == 2 * weights
    history = report.schedule.num_iterations * _Rows(report) * DIM * 4
    assert segments['stored activations'] == history
    assert segments['other temporaries'] == b['temp'] - history > 0
    # The input batch (every device holds it), the scalars, the loss.
    assert BATCH * DIM * 4 <= segments['inputs and outputs'] < (
        BATCH * DIM * 4 + 1024)
  path = tmp_path / 'plan.png'
  plot.WritePlot(linear_plan, str(path))
  assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


@pytest.mark.parametrize('clip_norm', [0.0, 0.05])
def test_the_planned_update_is_tensorflows_clipped_adam(clip_norm):
  """The step's new weights and Adam slots (updated one weight after
  another, the clip's factor inside each update) against TensorFlow's
  tf.clip_by_global_norm and AdamOptimizer applied to the step's own
  gradients (its Gradients, which the update does not touch)."""
  layer = LayerParams().Instantiate()
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


def test_plan_command_json(capsys, tmp_path):
  status = plan.main([
      '--params', 'tests.plan.plan_test.LayerParams', '--input_shape',
      f'{BATCH},{DIM}', '--num_devices', str(NUM_STAGES), '--tpu', 'v5e',
      '--hbm_gib', '16', '--num_microbatches', '8,5', '--json', '--plot',
      str(tmp_path / 'plan.png')
  ])
  assert status == 0
  assert (tmp_path / 'plan.png').read_bytes()[:4] == b'\x89PNG'
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
  predicted = candidate['predicted']
  for key in ('compute_seconds', 'bubble_seconds', 'memory_traffic_seconds',
              'memory_traffic_bytes', 'collective_seconds', 'model_flops',
              'mfu', 'overlap'):
    assert key in predicted, key
  assert predicted['step_seconds'] == candidate['predicted_step_seconds']
  for key in ('xla_cpu_unfused_bytes_accessed_per_device',
              'stored_activation_bytes', 'loop_flops_per_device'):
    assert key in candidate and key in report['measured_by_xla'], key
  assert 'predicted' in report['predicted_by_the_roofline_model']
  # M=5 does not divide the batch of 24: skipped, with the reason.
  (skipped,) = report['skipped']
  assert skipped['num_microbatches'] == 5
  assert '24' in skipped['reason'], skipped
  assert report['tpu']['name'] == 'v5e'


def test_plan_command_rejects_a_device_count_before_compiling(capsys):
  status = plan.main([
      '--params', 'tests.plan.plan_test.LayerParams', '--input_shape',
      f'{BATCH},{DIM}', '--num_devices', '8'
  ])
  err = capsys.readouterr().err
  assert status == 2
  assert '--num_devices 8' in err and 'num_stages=4' in err, err


def test_plan_command_lists_the_registered_models_for_an_unknown_one(capsys):
  assert plan.main(['--model', 'CopyLMSmall', '--num_devices', '4']) == 2
  err = capsys.readouterr().err
  assert ("--model CopyLMSmall: Unknown model 'CopyLMSmall'. Did you mean "
          'lm.CopyLMSmall? Registered: ') in err, err
  assert 'lm.CopyLMPod8x2, ' in err and 'lm.CopyLMSmall' in err


def test_plan_command_rejects_a_circular_repeat_that_changes_depth(capsys):
  status = plan.main([
      '--params', 'tests.plan.plan_test.LayerParams', '--input_shape',
      f'{BATCH},{DIM}', '--circular_repeat', '2', '--json'
  ])
  assert status == 2  # nothing could be planned
  report = json.loads(capsys.readouterr().out)
  assert report['candidates'] == [] and report['recommended'] is None
  assert 'num_blocks' in report['skipped'][0]['reason']


def _Command(*extra):
  return ['--params', 'tests.plan.plan_test.LayerParams', '--input_shape',
          f'{BATCH},{DIM}', *extra]


@pytest.fixture
def nothing_compiled(monkeypatch):
  """Fails whatever tries to build and compile a candidate."""

  def Refuse(*args, **kwargs):
    raise AssertionError('a candidate was built')

  monkeypatch.setattr(candidate_lib, 'PlanCandidate', Refuse)


def test_plan_command_when_every_candidate_is_skipped(capsys,
                                                      nothing_compiled):
  status = plan.main(_Command('--num_microbatches', '5,7'))
  err = capsys.readouterr().err
  assert status == 2
  assert 'every candidate was skipped' in err, err
  for m in (5, 7):
    assert re.search(rf'M={m} R=1 recompute: Batch size 24 .*'
                     rf'num_microbatches={m}', err), err
  assert 'none of the candidates fits' not in err


def test_a_candidate_skipped_while_building_is_never_said_to_compile(
    monkeypatch):
  """A candidate the target refuses while building (e.g. a mesh that would
  split a block) is listed as skipped, with no 'Compiling' line."""

  class _Refusing:

    def Build(self, candidate, depth_param):
      raise plan.PlanError('half a block per stage body')

  monkeypatch.setattr(candidate_lib, 'CheckCandidate', lambda t, c: None)
  said = []
  result = candidate_lib.MakePlan(
      _Refusing(), [plan.Candidate(8, 2)], NUM_STAGES,
      roofline.CHIPS['v5e'], 16 * 2**30, log=said.append)
  assert said == [] and not result.reports
  [(candidate, reason)] = result.skipped
  assert candidate.circular_repeat == 2
  assert reason == 'half a block per stage body'


@pytest.mark.parametrize('flag, value', [
    ('--hbm_gib', '0'), ('--hbm_gib', '-16'), ('--hbm_gib', 'nan'),
    ('--num_devices', '0'), ('--num_devices', '-4'),
])
def test_plan_command_refuses_nonsense_numbers(flag, value, capsys,
                                               nothing_compiled):
  with pytest.raises(SystemExit) as exit_info:
    plan.main(_Command(flag, value))
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert f'argument {flag}: expected' in err and 'above 0' in err, err


@pytest.mark.parametrize('name, why', [
    ('missing/plan.png', 'does not exist'), ('plan.jpg', 'expected a .png'),
])
def test_plan_command_refuses_an_unwritable_plot(name, why, tmp_path, capsys,
                                                 nothing_compiled):
  with pytest.raises(SystemExit) as exit_info:
    plan.main(_Command('--plot', str(tmp_path / name)))
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert 'argument --plot' in err and why in err, err


@pytest.mark.parametrize('params, error', [
    ('TypeErrorLayerParams', 'TypeError: the layer cannot run on inputs of '
     f'shape [{BATCH}, {DIM}]: the body got a wrong argument'),
    ('ShapeErrorLayerParams', 'ValueError: the layer cannot run on inputs of '
     f'shape [{BATCH}, {DIM}]: Dimensions must be equal'),
])
def test_a_model_error_is_an_error_not_a_skipped_candidate(params, error,
                                                           capsys):
  status = plan.main([
      '--params', f'tests.plan.plan_test.{params}', '--input_shape',
      f'{BATCH},{DIM}', '--json'
  ])
  captured = capsys.readouterr()
  assert status == 1
  assert 'M=8 R=1 recompute' in captured.err and error in captured.err, (
      captured.err)
  assert captured.out == ''  # no plan, and not a skipped candidate


def test_an_input_of_the_wrong_shape_is_named_in_one_line(capsys):
  status = plan.main(['--params', 'tests.plan.plan_test.LayerParams',
                      '--input_shape', f'{BATCH},{DIM // 2}'])
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 1
  assert err[-2] == (
      'plan: error: building or compiling M=8 R=1 recompute: ValueError: input 0 '
      f'has shape [{BATCH}, {DIM // 2}]; the stage body takes {DIM} features '
      f'in the last dim, not {DIM // 2} (the layer runs on [{BATCH}, {DIM}])'
  ), err


def test_lingvos_own_layer_is_built_for_the_same_step():
  """--pipeline_layer lingvo builds Lingvo's layer from the same Params,
  its stage weights annotated as on a TPU (the planner lowers as for one)."""
  target = plan.LayerTarget(LayerParams(), [(BATCH, DIM)],
                            lingvos_layer=True)
  with tpu_build.AsOnTpu():
    step = target.Build(plan.Candidate(NUM_MICROBATCHES, 1), 'num_blocks')
  (_, stack), = train_step.FindPipelinedLayers(step.root)
  assert type(stack) is lingvo_compat.LingvosOwnLayer()
  assert stack.params.num_stages == NUM_STAGES
  for var in stack.vars.Flatten():
    sharding = xla_sharding.get_op_sharding(var.op)
    assert sharding is not None, var.name


def test_lingvos_own_layer_failing_xla_is_said_in_one_line(capsys):
  """Lingvo's layer does not get through XLA's SPMD partitioner here: the
  plan stops with the abort's own line, not a stack trace."""
  status = plan.main(_Command('--pipeline_layer', 'lingvo', '--json'))
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 1
  assert err[-2].startswith('plan: error: building or compiling M=8 R=1'), err
  assert 'XLA stopped at Check failed' in err[-2], err


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))


def test_the_planning_page_shows_this_plan(linear_plan):
  """docs/planning.md shows this plan as a command and its output: the
  command is the fixture's (the layer, its input, the devices, the chip,
  the candidates), and the page's output is the report's text."""
  page = (docs_test.ROOT / 'docs' / 'planning.md').read_text()
  shown = [c for c in docs_test.Commands(page)
           if 'tests.plan.plan_test.LayerParams' in c.text]
  assert len(shown) == 1 and shown[0].shown, shown
  assert shown[0].text.split() == [
      '.venv/bin/python', '-m', 'gpipe.plan', '--params',
      'tests.plan.plan_test.LayerParams', '--input_shape', f'{BATCH},{DIM}',
      '--num_devices', str(NUM_STAGES), '--tpu', 'v5e',
      '--num_microbatches', '8,4']
  text = linear_plan.Render()
  assert docs_test.ShownOutputMatches(shown[0].shown, text.splitlines()), text
