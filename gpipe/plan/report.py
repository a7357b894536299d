"""The plan: every candidate's report as a table or JSON, and the pick."""

import dataclasses

from gpipe import partitioning
from gpipe.plan import roofline
from gpipe.plan import train_step

GIB = 2**30


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
    return min(ok, key=lambda i: self.reports[i].prediction.step_seconds)

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
            'reason': reason
        } for c, reason in self.skipped],
        'recommended': self.recommended,
        'measured_by_xla': [
            'per_device_bytes', 'flops_per_device', 'flops_unpartitioned',
            'bytes_accessed_per_device', 'loops',
            'permute_bytes_per_iteration', 'collective_bytes_per_step'
        ],
        'from_the_schedule': ['iterations', 'bubble_fraction'],
        'predicted_by_the_roofline_model': [
            'predicted_step_seconds', 'predicted', 'recommended'
        ],
    }

  def Render(self):
    lines = [f'Partitioned for {self.num_devices} virtual devices; compiled, '
             'not run.']
    if self.reports:
      total = self.reports[0].TotalBytes(train_step.WEIGHT)
      lines.append(f'Weights: {total / GIB:.2f} GiB in all.')
    lines.append('')
    unit, scale = _ByteUnit(
        max([r.per_device_bytes['peak'] for r in self.reports] or [0]))
    header = (f'{"M":>4} {"R":>3} {"remat":>9} {"iters":>5} {"bubble":>6} | '
              f'{"weights":>8} {"optim":>8} {"temp":>8} {"peak":>8} '
              f'{"fits":>4} | {"FLOP/dev":>9} {"/(unp/N)":>8} '
              f'{"permute/it":>10} | {"pred step":>9}')
    lines += [header, '-' * len(header)]
    for i, r in enumerate(self.reports):
      b = {k: f'{v / scale:>8.3f}' for k, v in r.per_device_bytes.items()}
      j = r.ToJson()
      mark = ' <- recommended' if i == self.recommended else ''
      lines.append(
          f'{r.candidate.num_microbatches:>4} {r.candidate.circular_repeat:>3}'
          f' {r.candidate.remat_policy:>9}'
          f' {r.schedule.num_iterations:>5} {r.schedule.bubble_fraction:>6.3f}'
          f' | {b["weights"]} {b["optimizer"]} {b["temp"]} {b["peak"]} '
          f'{"yes" if r.fits else "NO":>4} | {r.flops_per_device:>9.3g} '
          f'{j["flops_ratio"]:>8.3f} '
          f'{r.permute_bytes_per_iteration / scale:>10.4g} | '
          f'{_Seconds(r.prediction.step_seconds):>9}{mark}')
    lines.append(f'(bytes per device in {unit}; permute/it: {unit} sent by '
                 'collective-permutes per forward iteration; /(unp/N): FLOPs '
                 'per device over the unpartitioned step\'s FLOPs / N)')
    for c, reason in self.skipped:
      lines.append(f'skipped {c.Describe()}: {reason}')
    for r in self.reports:
      lines.append('')
      lines.append(f'{r.candidate.Describe()} (compiled in '
                   f'{r.seconds:.0f} s):')
      for i, loop in enumerate(r.LoopSummaries()):
        kinds = ', '.join(
            f'{c["count"]} {k} ({c["bytes"] / 2**20:.2f} MiB)'
            for k, c in loop['collectives'].items()) or 'no collectives'
        lines.append(f'  loop {i} ({loop["iterations"]} iterations), per '
                     f'iteration: {kinds}')
      outside = {}
      for c in r.compiled.LoopCollectives(-1):
        outside[c.kind] = outside.get(c.kind, 0) + c.bytes
      lines.append('  outside the loops: ' + (', '.join(
          f'{k} {v / 2**20:.2f} MiB' for k, v in sorted(outside.items())) or
                                               'no collectives'))
      lines.append('  largest buffers: ' + '; '.join(
          f'{b / scale:.3g} {unit} {t} ({op[-60:] or "?"})'
          for b, t, op in partitioning.LargestBuffers(r.compiled.hlo, 3)))
      for problem in r.Problems():
        lines.append(f'  PROBLEM: {problem}')
    lines.append('')
    lines.append('Measured by XLA: bytes per device (parameter shardings and '
                 'buffer assignment), FLOPs (cost analysis, loops counted '
                 'per iteration; /(unp/N) is about 1 when each device does '
                 'only its share), collectives. From the schedule: iters, '
                 'bubble.')
    lines.append('Predicted by a roofline model of '
                 f'{self.chip.Describe()}: "pred step", and so the '
                 'recommendation.')
    lines.append(f'Fits: peak <= {self.hbm_bytes / GIB:.1f} GiB of HBM.')
    rec = self.recommended
    if rec is None:
      lines.append('Recommendation: none of the candidates fits and splits '
                   'as intended.')
    else:
      c = self.reports[rec].candidate
      lines.append(f'Recommendation: num_microbatches={c.num_microbatches}, '
                   f'circular_repeat={c.circular_repeat}, '
                   f'remat_policy={c.remat_policy!r}.')
    return '\n'.join(lines)


def _ByteUnit(largest):
  """('GiB', 2**30), ('MiB', 2**20) or ('KiB', 2**10) to show `largest`."""
  for unit, scale in (('GiB', 2**30), ('MiB', 2**20)):
    if largest >= scale:
      return unit, scale
  return 'KiB', 2**10


def _Seconds(seconds):
  if seconds >= 1:
    return f'{seconds:.3g} s'
  if seconds >= 1e-3:
    return f'{seconds * 1e3:.3g} ms'
  return f'{seconds * 1e6:.3g} us'

