"""The plan: every candidate's report as a table or JSON, and the pick.

Every figure says where it comes from: measured by XLA (the compiled,
partitioned module), from the schedule (gpipe.schedule), or predicted by
the roofline model (gpipe.plan.roofline) — in the table's group headers,
the JSON's `measured_by_xla` / `from_the_schedule` /
`predicted_by_the_roofline_model` lists, and the text's closing lines.
"""

import dataclasses

from gpipe.model_step import train_step
from gpipe.plan import calibration
from gpipe.plan import roofline
from gpipe.plan import targets
from gpipe.plan import text_lines
from gpipe.plan import traffic_floor
from gpipe.xla import hlo_text

GIB = 2**30
_WIDTH = text_lines.WIDTH
_Wrap = text_lines.Wrap
_Listed = text_lines.Listed

_MEASURED_BY_XLA = [
    'per_device_bytes', 'flops_per_device', 'flops_unpartitioned',
    'flops_ratio', 'loop_flops_per_device', 'stored_activation_bytes',
    'xla_cpu_unfused_bytes_accessed_per_device', 'loops',
    'permute_bytes_per_iteration', 'collective_bytes_sent_per_step',
    'largest_buffers'
]
_NOTES = {
    'stored_activation_bytes':
        'read off the partitioned module: the forward loop\'s per-iteration '
        'stacks that the backward loop takes in',
    'xla_cpu_unfused_bytes_accessed_per_device':
        'XLA:CPU\'s count of every unfused instruction\'s operands and '
        'results; a TPU\'s fusions do not pay it, so the prediction does '
        'not use it',
    'predicted.memory_traffic_bytes':
        'what a fused step must read and write in HBM, by part (a lower '
        'bound: the body\'s intermediates between fusions are left out); '
        'see gpipe.plan.roofline.StepBytes',
    'predicted.model_flops':
        '3 x the FLOPs of the step\'s forward pass with its pipelined '
        'stacks run as the plain stack, compiled for one device: no '
        'bubble and nothing recomputed counts; see '
        'gpipe.plan.model_flops.ForwardFlops',
    'collective_bytes_sent_per_step':
        '{mesh axes: {kind: bytes one chip sends in the step}}, each '
        'collective in the dtype XLA\'s SPMD partitioner gave it, by the '
        'ring algorithm of its kind; see gpipe.plan.collectives',
    'collective_floor_per_step':
        'the least each set of mesh axes must carry, derived from the '
        'model\'s shapes and dtypes (gpipe.plan.traffic_floor), by part; '
        'bytes_without_recompute leaves out the recomputed forward\'s part '
        '(what the remat policy costs); measured / floor is '
        f'collective_sent_over_floor (under {traffic_floor.LEAST_RATIO}: a '
        'problem, the planner\'s error), measured / bytes_without_recompute '
        'collective_sent_over_floor_without_recompute',
    'predicted.mfu': 'model_flops / (num_devices x peak x step_seconds): '
                     'the no-overlap step, everything at peak',
    'predicted.step_seconds_overlapped':
        'step_seconds less hidden_collective_seconds, the collective time '
        'a list schedule of each computation runs beside its matrix work '
        'at peak (gpipe.plan.overlap); mfu_overlapped is its MFU',
    'predicted.step_seconds_calibrated':
        'the prediction (what recommended uses): max(compute with the '
        'matrix work at matmul_efficiency of peak, memory traffic) + the '
        'collective time a schedule at that speed leaves '
        '(hidden_calibrated_seconds hidden); matmul_efficiency is fitted '
        'on a published measured run (gpipe.plan.calibration); '
        'mfu_calibrated is its MFU',
    'predicted.step_seconds_ceiling':
        'max(compute, memory traffic) at peak, every collective hidden: a '
        'bound, not a prediction; mfu_ceiling is its MFU',
}


@dataclasses.dataclass
class Plan:
  num_devices: int
  chip: roofline.Chip
  hbm_bytes: float
  reports: list  # of CandidateReport
  skipped: list  # of (Candidate, reason)

  @property
  def recommended(self):
    """Index of the fitting, correctly split, fastest-predicted candidate."""
    ok = [
        i for i, r in enumerate(self.reports) if r.fits and not r.Problems()
    ]
    if not ok:
      return None
    return min(ok, key=lambda i:
               self.reports[i].prediction.step_seconds_calibrated)

  def MeshesVary(self):
    """Whether the candidates' device meshes differ (--mesh)."""
    return len({r.mesh_shape for r in self.reports} |
               {c.mesh for c, _ in self.skipped if c.mesh}) > 1

  def SchedulesShown(self):
    """Whether a candidate runs backward_schedule='1f1b' or stream_io
    (the table then says which each runs)."""
    return any(r.one_f_one_b or r.stream_io for r in self.reports) or any(
        c.backward_schedule == '1f1b' or c.stream_io for c, _ in self.skipped)

  def SkippedReasons(self):
    """One line per skipped candidate: what and why."""
    return [f'{c.Describe()}: {reason}' for c, reason in self.skipped]

  def ToJson(self):
    weights = self.reports[0].TotalBytes(train_step.WEIGHT) if (
        self.reports) else None
    return {
        'num_devices': self.num_devices,
        'total_weight_bytes': weights,
        'hbm_bytes': self.hbm_bytes,
        'tpu': dataclasses.asdict(self.chip),
        'candidates': [r.ToJson() for r in self.reports],
        'skipped': [{
            'num_microbatches': c.num_microbatches,
            'circular_repeat': c.circular_repeat,
            'remat_policy': c.remat_policy,
            'backward_schedule': c.backward_schedule,
            'stream_io': c.stream_io,
            'mesh_shape': list(c.mesh) if c.mesh else None,
            'reason': reason
        } for c, reason in self.skipped],
        'recommended': self.recommended,
        'measured_by_xla': _MEASURED_BY_XLA,
        'from_the_schedule': ['iterations', 'bubble_fraction'],
        'predicted_by_the_roofline_model': [
            'predicted_step_seconds', 'predicted', 'recommended'
        ],
        'notes': _NOTES,
    }

  def Render(self):
    lines = [f'Partitioned for {self.num_devices} virtual devices; compiled, '
             'not run.']
    if self.reports:
      total = self.reports[0].TotalBytes(train_step.WEIGHT)
      lines.append(f'Weights: {Bytes(total)} in all.')
    lines.append('')
    lines += _Tables(self)
    for reason in self.SkippedReasons():
      lines += _Wrap(f'skipped {reason}', subsequent_indent='    ')
    for r in self.reports:
      lines.append('')
      lines += _Details(r)
    lines.append('')
    lines += _Sources(self)
    return '\n'.join(lines)


def _KeyColumns(plan):
  """(group, header, width, cell(report, index)): which candidate a row is."""
  meshes = [] if not plan.MeshesVary() else [
      ('candidate', 'mesh', 7, lambda r, i: targets.MeshName(r.mesh_shape))]
  backward = [] if not plan.SchedulesShown() else [
      ('candidate', 'backward', 10, lambda r, i: BackwardName(r))]
  fsdp = [] if len({r.gathered_over for r in plan.reports}) < 2 else [
      ('candidate', 'fsdp', 4,
       lambda r, i: ','.join(map(str, r.gathered_over)) or '-')]
  return meshes + fsdp + backward + [
      ('candidate', 'M', 4, lambda r, i: r.candidate.num_microbatches),
      ('candidate', 'R', 3, lambda r, i: r.candidate.circular_repeat),
      ('candidate', 'remat', max([9] + [len(c.remat_policy) for c in (
          [r.candidate for r in plan.reports] +
          [c for c, _ in plan.skipped])]),
       lambda r, i: r.candidate.remat_policy),
  ]


def _MainColumns(plan):
  """The columns a choice rests on: schedule, peak, fit, predicted step."""
  rec = plan.recommended
  predicted = f'predicted: {plan.chip.name} model'
  return [
      ('XLA: per device', 'peak', 8,
       lambda r, i: Bytes(r.per_device_bytes['peak'])),
      ('XLA: per device', 'fits', 4, lambda r, i: 'yes' if r.fits else 'NO'),
      (predicted, 'step', 8,
       lambda r, i: Seconds(r.prediction.step_seconds_calibrated) +
       ('*' if i == rec else '')),
      (predicted, 'MFU', 7, lambda r, i: Percent(r.prediction.mfu_calibrated)),
      (predicted, 'ceiling', 7,
       lambda r, i: Percent(r.prediction.mfu_ceiling)),
      (predicted, 'no ovl', 7, lambda r, i: Percent(r.prediction.mfu)),
      (predicted, 'ovl', 7, lambda r, i: Percent(r.prediction.mfu_overlapped)),
  ]


def _MeasuredColumns():
  """XLA's other figures, one group each (the predicted step's parts are
  in each candidate's details)."""
  return [[
      ('schedule', 'iters', 5, lambda r, i: r.schedule.num_iterations),
      ('schedule', 'bubble', 6,
       lambda r, i: f'{r.schedule.bubble_fraction:.3f}'),
  ], [
      ('XLA: bytes per device', 'weights', 8,
       lambda r, i: Bytes(r.per_device_bytes['weights'])),
      ('XLA: bytes per device', 'optim', 8,
       lambda r, i: Bytes(r.per_device_bytes['optimizer'])),
      ('XLA: bytes per device', 'temp', 8,
       lambda r, i: Bytes(r.per_device_bytes['temp'])),
      ('XLA: bytes per device', 'stored', 8,
       lambda r, i: Bytes(r.stored_activation_bytes)),
  ], [
      ('XLA: per device', 'FLOP/dev', 9,
       lambda r, i: f'{r.flops_per_device:.3g}'),
      ('XLA: per device', '/(unp/N)', 8,
       lambda r, i: f'{r.ToJson()["flops_ratio"]:.3f}'),
      ('XLA: per device', 'permute/it', 10,
       lambda r, i: Bytes(r.permute_bytes_per_iteration)),
  ]]


def _Tables(plan):
  """The main table (the candidates and what a choice rests on), then
  XLA's other figures: each as many groups as fit _WIDTH, beside the
  candidate's columns; then what the columns mean."""
  key = _KeyColumns(plan)
  lines = _Table(plan, key + _MainColumns(plan))
  tables = []
  for group in _MeasuredColumns():
    if tables and _TableWidth(tables[-1] + group) <= _WIDTH:
      tables[-1] += group
    else:
      tables.append(key + group)
  for columns in tables:
    lines += [''] + _Table(plan, columns)
  if plan.reports:
    lines += _Wrap(
        '(each figure in its own unit; * recommended; peak = arguments + '
        'outputs + temp - what the outputs update in place; stored: what '
        'the forward pass stores for the backward pass (1f1b: the rings), '
        'part of temp; permute/it: sent by collective-permutes per forward '
        'iteration; step, MFU: calibrated, the prediction the pick uses; '
        'ceiling: at peak, every collective hidden (a bound); no ovl: at '
        'peak, none hidden; ovl: at peak, what a schedule hides hidden; '
        'the predicted steps\' parts are in each candidate\'s lines '
        'below)')
  return lines


def _Widened(columns):
  """The columns, the first of each group widened where the group's name
  is wider than the group's cells."""
  columns = list(columns)
  for k, (group, header, width, cell) in enumerate(columns):
    if k and group == columns[k - 1][0]:
      continue
    members = [c for c in columns[k:] if c[0] == group]
    span = sum(c[2] for c in members) + len(members) - 1
    columns[k] = (group, header, width + max(0, len(group) - span), cell)
  return columns


def _TableWidth(columns):
  """Characters a table of these columns takes (each group after the
  first behind ' | ')."""
  columns = _Widened(columns)
  groups = len({c[0] for c in columns})
  return sum(c[2] for c in columns) + len(columns) + 2 * (groups - 1)


def _Table(plan, columns):
  """The table's lines: group headers, column headers, one row each."""
  columns = _Widened(columns)
  seps = [' | ' if k and group != columns[k - 1][0] else ' '
          for k, (group, _, _, _) in enumerate(columns)]

  def Row(cells):
    return ''.join(f'{sep}{str(cell):>{width}}' for sep, cell, (_, _, width, _)
                   in zip(seps, cells, columns))

  group_line, position = '', 0
  for k, (group, _, width, _) in enumerate(columns):
    if seps[k] == ' | ' or k == 0:
      group_line = group_line.ljust(position) + seps[k] + group
    position += len(seps[k]) + width
  lines = [group_line, Row([header for _, header, _, _ in columns])]
  lines.append('-' * len(lines[1]))
  lines += [
      Row([cell(r, i) for _, _, _, cell in columns])
      for i, r in enumerate(plan.reports)
  ]
  return lines


def _Details(r):
  """A candidate's collectives, buffers, problems and predicted parts."""
  lines = _Wrap(f'{r.candidate.Describe()} (compiled in {r.seconds:.0f} s):',
                subsequent_indent='    ')
  if len(r.mesh_shape) > 1:
    lines.append(f'  device mesh {list(r.mesh_shape)}, stages on axis '
                 f'{r.stage_axis}')
  for i, loop in enumerate(r.LoopSummaries()):
    lines += _Listed(f'loop {i}, {loop["role"]} ({loop["iterations"]} '
                     'iterations), per iteration: ',
                     _Collectives(loop['by_mesh_axes']))
  lines += _Listed('outside the loops: ', _Collectives(r.outside_by_mesh_axes))
  lines += _Listed('sent per step, against the floor: ', _SentAndFloor(r))
  stored = ', '.join(t.split('{')[0] for _, t in r.stored_activations)
  lines += _Listed('stored activations: ', [
      f'{Bytes(r.stored_activation_bytes)} ({stored or "none found"})'])
  lines += _Listed('largest buffers: ', [
      f'{Bytes(b)} {t} ({op[-60:] or "?"})'
      for b, t, op in hlo_text.LargestBuffers(r.compiled.hlo, 3)], '; ')
  for problem in r.Problems():
    lines += _Wrap(f'PROBLEM: {problem}', initial_indent='  ',
                   subsequent_indent='    ')
  p = r.prediction
  traffic = p.memory_traffic_bytes
  for paragraph in _StepParagraphs(p) + (
      'memory traffic (fused step, per device): '
      f'{Bytes(sum(traffic.values()))} = ' + ' + '.join(
          f'{k.replace("_", " ")} {Bytes(v)}' for k, v in traffic.items()),
      'XLA:CPU\'s unfused bytes accessed (not used): '
      f'{Bytes(r.compiled.Cost("bytes accessed"))}'):
    lines += _Wrap(paragraph, initial_indent='  ',
                   subsequent_indent='    ')
  return lines


def _StepParagraphs(p):
  """The predicted step's lines: the calibrated one (the prediction), then
  at peak the ceiling, no-overlap and overlapped steps with the parts."""
  return (
      f'predicted step {Seconds(p.step_seconds_calibrated)}, MFU '
      f'{Percent(p.mfu_calibrated)} (calibrated: the matrix work '
      f'{Seconds(p.matmul_seconds / p.matmul_efficiency)} at '
      f'{p.matmul_efficiency:.3g} of peak, gpipe.plan.calibration) = '
      f'max(compute {Seconds(p.compute_seconds_calibrated)}, memory traffic '
      f'{Seconds(p.memory_seconds)}) + collectives '
      f'{Seconds(p.collective_seconds)} less '
      f'{Seconds(p.hidden_calibrated_seconds)} a schedule hides',
      f'at peak: ceiling {Seconds(p.step_seconds_ceiling)}, MFU '
      f'{Percent(p.mfu_ceiling)} (every collective hidden: a bound); no '
      f'overlap {Seconds(p.step_seconds)} = max(compute '
      f'{Seconds(p.compute_seconds)} [model {Seconds(p.model_seconds)}, '
      f'bubble {Seconds(p.bubble_seconds)}, recomputation and other '
      f'{Seconds(p.other_compute_seconds)}], memory traffic '
      f'{Seconds(p.memory_seconds)}) + collectives '
      f'{Seconds(p.collective_seconds)}: {p.bound}-bound, MFU '
      f'{Percent(p.mfu)}; overlapped {Seconds(p.step_seconds_overlapped)}, '
      f'MFU {Percent(p.mfu_overlapped)} ('
      f'{Seconds(p.hidden_collective_seconds)} of the collectives hidden '
      f'by a schedule); model FLOPs {p.model_flops:.3g}',
  )


def _SentAndFloor(r):
  """['model 1.2 GiB / floor 0.8 GiB = 1.50 (a recomputed forward\'s
  reductions counted as needed: floor 1.0 GiB, 1.20)', 'stage 3 MiB (no
  floor)']: the headline floor is what the model needs without
  recomputation (a remat policy's choice), the other beside it."""
  items = []
  for axes, (sent, floor) in traffic_floor.Ratios(
      r.sent_per_axis, r.traffic_floors).items():
    if floor and floor.without_recompute:
      item = (f'{axes} {Bytes(sent)} / floor {Bytes(floor.without_recompute)}'
              f' = {sent / floor.without_recompute:.2f}')
      if floor.layout:
        item += f' [assumes {floor.layout}]'
      if floor.without_recompute != floor.bytes:
        item += (' (a recomputed forward\'s reductions counted as needed: '
                 f'floor {Bytes(floor.bytes)}, {sent / floor.bytes:.2f})')
      items.append(item)
    else:
      items.append(f'{axes} {Bytes(sent)} (no floor)')
  return items or ['nothing']


def _Collectives(by_axes):
  """['2 all-reduce over axis 2 (1.0 MiB)', ...] or ['no collectives']."""
  return [f'{c["count"]} {k} ({Bytes(c["bytes"])})'
          for k, c in by_axes.items()] or ['no collectives']


def _Sources(plan):
  """Where each figure comes from, the fit criterion and the pick."""
  paragraphs = [
      'Measured by XLA: bytes per device (parameter shardings and buffer '
      'assignment; stored: the forward loop\'s per-iteration stacks in the '
      'partitioned module), FLOPs (cost analysis, loops counted per '
      'iteration; /(unp/N) is about 1 when each device does only its '
      'share), collectives. From the schedule: iters, bubble.',
      f'Predicted by a roofline model of {plan.chip.Describe()}, not '
      'measured: compute = FLOP/dev / peak, of it bubble = the bubble '
      'fraction of the loops\' FLOPs / peak; memory traffic = what a fused '
      'step must read and write in HBM (weights read per iteration, '
      'gradients accumulated, the optimizer update, stored activations, '
      'the loop\'s buffer; not XLA:CPU\'s unfused count) / HBM bandwidth; '
      'collectives = each collective\'s bytes a chip sends (in the '
      'partitioner\'s dtype, by its ring algorithm) / ICI link bandwidth, '
      'plus an ICI hop a ring step and its own HBM traffic. step and MFU: '
      'calibrated, the prediction (the matrix work at '
      f'{calibration.MATMUL_EFFICIENCY:.3g} of peak, fitted on '
      f'{calibration.FITTED_ON}; the collectives less what a list schedule '
      'of the partitioned module hides); ceiling: at peak, every collective '
      'hidden (a bound); no ovl: at peak, no collective hidden; ovl: at '
      'peak, less what the schedule hides. MFU = model FLOPs (3 x the '
      'forward pass, the stacks unpipelined: no bubble, nothing '
      'recomputed) / (N x peak x step). The recommendation follows the '
      'calibrated step.',
      f'Fits: peak <= {Bytes(plan.hbm_bytes)} of HBM.',
  ]
  lines = [line for p in paragraphs for line in _Wrap(p)]
  rec = plan.recommended
  if rec is not None:
    r = plan.reports[rec]
    c = r.candidate
    lines += _Wrap(f'Recommendation: num_microbatches={c.num_microbatches}, '
                   f'circular_repeat={c.circular_repeat}, '
                   f'remat_policy={c.remat_policy!r}, '
                   f'backward_schedule={r.backward_schedule!r}, '
                   f'stream_io={r.stream_io}.', subsequent_indent='    ')
  elif plan.reports:
    lines.append('Recommendation: none of the candidates fits and splits '
                 'as intended.')
  else:
    lines.append('Recommendation: none: every candidate was skipped.')
  return lines


def BackwardName(report):
  """'reverse', '1f1b', with '+io' for stream_io: the table's short name."""
  return report.backward_schedule + ('+io' if report.stream_io else '')


def Bytes(nbytes):
  """'768 B', '16.2 KiB', '3.74 GiB': three significant digits or more."""
  value, unit = float(nbytes), 'B'
  for next_unit in ('KiB', 'MiB', 'GiB', 'TiB'):
    if abs(value) < 1024:
      break
    value, unit = value / 1024, next_unit
  return f'{_Digits(value)} {unit}'


def Seconds(seconds):
  """'17.3 s', '2.85 us', '512 ns'."""
  for unit, scale in (('s', 1), ('ms', 1e-3), ('us', 1e-6)):
    if abs(seconds) >= scale:
      return f'{_Digits(seconds / scale)} {unit}'
  return f'{_Digits(seconds / 1e-9)} ns'


def Percent(fraction):
  """'43.2 %', '1.2 %', '0.031 %', '<0.01 %': a tenth of a percent where it
  is 10 or more (MFU figures are compared so), else two significant
  digits; at most 7 columns."""
  value = 100 * fraction
  if value == 0:
    return f'{0:d} %'
  if abs(value) >= 10:
    return f'{value:.1f} %'
  if abs(value) < 0.01:
    return f'<{0.01:g} %'
  return f'{value:.2g} %'


def _Digits(value):
  if value == 0 or abs(value) >= 100:
    return f'{value:.0f}'
  if abs(value) >= 10:
    return f'{value:.1f}'
  return f'{value:.2f}'
