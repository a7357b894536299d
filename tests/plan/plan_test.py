"""The planner's numbers for compiled plans: XLA's own, checked against
independent expectations.

A whole training step (forward, loss, backward, Adam with its two slots)
of a small pipelined layer is lowered from shapes alone, partitioned for N
virtual devices and compiled without running (gpipe.plan). The plans here
(linear M=8 and M=4, circular R=2 with M=8) are compiled once, by this
module's fixtures, for all the checks that read them:
  * per-device bytes against arithmetic on the variables' shapes: weights
    = total / S, Adam slots = 2 x weights / S; temporaries between one and
    a few times the pipeline's history (buffer x iterations);
  * FLOPs per device against a count of the body's matmuls (forward,
    recomputed forward, two gradient matmuls per iteration) within 10 %,
    and against the unpartitioned step's FLOPs / N;
  * the collectives per iteration; what the forward loop stores for the
    backward loop (found in the partitioned module) against the buffer
    history; each loop's FLOPs;
  * the predicted parts against arithmetic on the shapes and the chip's
    constants: compute, bubble, the fused step's memory traffic,
    collectives, the step and the MFU;
  * the fit (everything a chip holds against its HBM) and the
    recommendation (the fastest candidate that fits);
  * the text report's tables, sources and widths, the per-chip bytes plot,
    and the plan docs/planning.md shows.

LayerParams and the Params beside it are the planner's --params on the
command line too (tests.plan.plan_test.LayerParams). The step's own checks
(its update, memory and cost, each on a step of its own) are in
plan_step_test.py; the command line and the planner's edges in
plan_command_test.py.
"""

import dataclasses
import re

import pytest
import tensorflow as tf

import gpipe  # pylint: disable=unused-import
from gpipe import layers
from gpipe.model_step import train_step
from gpipe import plan
from gpipe.plan import plot
from gpipe.plan import report as report_lib
from gpipe.plan import roofline
from gpipe.xla import partitioning
from tests import docs_test
from tests import reference_bodies

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


# Models with an error of their own, for plan_command_test.py's command lines
# (--params tests.plan.plan_test.TypeErrorLayerParams, ...).


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


def MakePlan(params, candidates=((NUM_MICROBATCHES, 1),)):
  """The candidates' plan for `params` on NUM_STAGES v5e chips of 16 GiB."""
  target = plan.LayerTarget(params, [(BATCH, DIM)])
  return plan.MakePlan(target, [plan.Candidate(m, r) for m, r in candidates],
                       NUM_STAGES, roofline.CHIPS['v5e'], 16 * 2**30)


@pytest.fixture(scope='module')
def linear_plan():
  if not partitioning.IsAvailable():
    pytest.fail('jax and jaxlib are needed (they are in the test extra).')
  return MakePlan(LayerParams(), candidates=((8, 1), (4, 1)))


@pytest.fixture(scope='module')
def reports(linear_plan):
  """Linear M=8, M=4, and circular (R=2) M=8."""
  circular = MakePlan(LayerParams(circular_repeat=2), candidates=((8, 2),))
  return linear_plan.reports + circular.reports


def Rows(report):
  """Rows of one microbatch."""
  return BATCH // report.candidate.num_microbatches


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
    history = report.schedule.num_iterations * Rows(report) * DIM * 4
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
    matmul = 2 * Rows(report) * DIM * DIM
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
    slot_bytes = Rows(report) * DIM * 4
    forward, backward = loops
    assert forward['iterations'] == report.schedule.num_iterations
    assert forward['collectives'] == {
        'collective-permute': {'count': 1, 'bytes': slot_bytes}}
    assert backward['collectives']['collective-permute'] == {
        'count': 1, 'bytes': slot_bytes}
    assert report.permute_bytes_per_iteration == slot_bytes
    assert not report.Gathered()


def test_stage_axis_sends_against_its_floor_by_hand(reports):
  """What a chip sends over the stage axis in a step (a permute of the
  slot per iteration, forward and backward; the loss's all-reduce and one
  scalar's over the 4 devices, a ring: 2 x 3/4 of their bytes) and the
  floor: each of M x R stage calls sends its output once and its input
  gradient once (gpipe.plan.traffic_floor)."""
  for report in reports:
    sched = report.schedule
    slot = Rows(report) * DIM * 4
    assert report.sent_per_axis == {'stage': {
        'all-reduce': 1.5 * (BATCH * DIM * 4 + 4),
        'collective-permute': 2 * sched.num_iterations * slot}}
    (floor,) = report.traffic_floors
    assert floor.axes == 'stage'
    assert floor.bytes == 2 * sched.num_microbatches * (
        sched.circular_repeat * slot)
    ratios = report.ToJson()['collective_sent_over_floor']
    assert ratios['stage'] == pytest.approx(
        sum(report.sent_per_axis['stage'].values()) / floor.bytes)


def _Peak(report):
  return report.chip.peak_flops


def test_stored_activations_are_the_buffer_history(reports):
  for report in reports:
    # Under 'recompute' the forward loop stores one buffer slot (a
    # microbatch's [rows, DIM] activations) per iteration, nothing else.
    history = report.schedule.num_iterations * Rows(report) * DIM * 4
    assert report.stored_activation_bytes == history, (
        report.stored_activations)
    assert report.stored_activation_bytes <= report.per_device_bytes['temp']


def test_loop_flops_split_the_step(reports):
  for report in reports:
    # Forward loop: one matmul per iteration; backward: the recomputed
    # forward and two gradient matmuls (see the FLOPs test above).
    matmul = 2 * Rows(report) * DIM * DIM
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
    slot = Rows(report) * DIM * 4  # one microbatch's activations
    weights = r * (DIM * DIM + DIM) * 4  # per device: R repeats of a stage
    assert p.compute_seconds == report.flops_per_device / 197e12
    # The bubbles: T - M R idle iterations of 4 matmuls (see above).
    idle = 4 * (t - sched.num_microbatches * r) * 2 * Rows(report) * DIM**2
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
    # outputs' all-reduce over the 4 devices (a ring: each sends 2 x 3/4
    # of its bytes) over 50 GB/s links; b's update waits for w's: the
    # all-reduce of a float32 scalar. Each pays an ICI hop (1 us) a ring
    # step (a permute 1, an all-reduce over 4 devices 6) and its result's
    # bytes read and written in HBM.
    collectives = 2 * t * slot + 1.5 * (BATCH * DIM * 4 + 4)
    hops = 2 * t * 1 + 2 * 6
    results = 2 * t * slot + BATCH * DIM * 4 + 4
    assert p.collective_seconds == pytest.approx(
        collectives / 50e9 + hops * 1e-6 + 2 * results / 819e9)
    assert p.step_seconds == pytest.approx(
        max(p.compute_seconds, p.memory_seconds) + p.collective_seconds)
    assert p.memory_traffic_bytes['loop_weight_reads'] > 0
    assert p.bound == 'memory'  # a toy: 3 rows per microbatch
    # Model FLOPs: 3 x the forward pass's, the stack's 3 matmuls per layer
    # and row, plus the elementwise rest (tanh, bias, loss): at most a
    # quarter more, and no bubble or recomputed forward.
    matmuls = 6 * NUM_STAGES * r * BATCH * DIM * DIM
    assert 1 <= p.model_flops / matmuls < 1.25, p.model_flops / matmuls
    assert p.mfu == pytest.approx(
        p.model_flops / (NUM_STAGES * v5e.peak_flops * p.step_seconds))
    # Overlapped: at most the collectives hidden, never below the larger
    # of compute and memory traffic.
    assert 0 <= p.hidden_collective_seconds <= p.collective_seconds * 1.001
    assert p.step_seconds_overlapped == pytest.approx(max(
        p.compute_seconds, p.memory_seconds,
        p.step_seconds - p.hidden_collective_seconds))


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
    assert cells[1].endswith('NO') and '*' not in cells[2], cells
  _, rows = _TableCells(only_m8.Render())[0]
  fits, starred = zip(*[(cells[1].split()[-1], '*' in cells[2])
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


def test_text_report_labels_sources_and_units(linear_plan):
  text = linear_plan.Render()
  total = NUM_STAGES * (DIM * DIM + DIM) * 4  # 66560 B
  assert f'Weights: {total / 1024:.1f} KiB in all.' in text
  # No figure rounds away to zero in a unit too large for it.
  assert not re.search(r'\b0\.0+ [KMGT]?i?B\b', text), text
  (groups, rows), (measured_groups, measured), (_, per_device) = (
      _TableCells(text))
  assert [g.strip() for g in groups.split('|')] == [
      'candidate', 'XLA: per device', 'predicted: v5e model'
  ], groups
  assert [g.strip() for g in measured_groups.split('|')] == [
      'candidate', 'schedule', 'XLA: bytes per device'
  ], measured_groups
  best = linear_plan.recommended
  for i, report in enumerate(linear_plan.reports):
    slot = Rows(report) * DIM * 4
    cells = rows[i]
    assert cells[0].split() == [str(report.candidate.num_microbatches), '1',
                                'recompute'], cells
    assert cells[1].split()[-1] == 'yes', cells
    assert ('*' in cells[2]) == (i == best), cells
    cells = measured[i]
    assert cells[0] == rows[i][0], (cells, rows[i])
    assert cells[1].split() == [str(report.schedule.num_iterations),
                                f'{report.schedule.bubble_fraction:.3f}']
    assert cells[2].split()[:4] == ['16.2', 'KiB', '32.5', 'KiB'], cells
    # The permute per iteration: one microbatch's slot.
    assert per_device[i][1].endswith(report_lib.Bytes(slot)), per_device[i]
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
  # The candidate's columns and what the pick rests on; XLA's bytes beside
  # the schedule's figures; its FLOPs and permutes.
  assert len(_TableCells(text)) == 3, text
  widest = dataclasses.replace(linear_plan, reports=[
      dataclasses.replace(r, stream_io=True) for r in linear_plan.reports])
  monkeypatch.setattr(report_lib.Plan, 'MeshesVary', lambda self: True)
  widest_text = widest.Render()
  assert 'reverse+io' in widest_text
  # The widest candidate columns still take the schedule beside XLA's
  # bytes, its FLOPs and permutes in a table of their own.
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
    for part in (f'compute {report_lib.Seconds(p.compute_seconds)} [model '
                 f'{report_lib.Seconds(p.model_seconds)}, bubble '
                 f'{report_lib.Seconds(p.bubble_seconds)}, recomputation and '
                 f'other {report_lib.Seconds(p.other_compute_seconds)}]',
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
    history = report.schedule.num_iterations * Rows(report) * DIM * 4
    assert segments['stored activations'] == history
    assert segments['other temporaries'] == b['temp'] - history > 0
    # The input batch (every device holds it), the scalars, the loss.
    assert BATCH * DIM * 4 <= segments['inputs and outputs'] < (
        BATCH * DIM * 4 + 1024)
  path = tmp_path / 'plan.png'
  plot.WritePlot(linear_plan, str(path))
  assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


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


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
