"""--plot FILE.png: each candidate's bytes per chip, stacked, against HBM.

One bar per candidate, its segments summing to XLA's peak per device:

    weights             the weights' per-device shapes (XLA's shardings)
    optimizer slots     the same for the slots
    stored activations  what the forward loop stores for the backward loop:
                        its per-iteration stacks that the backward loop
                        takes in, read off the partitioned module
                        (CandidateReport.stored_activations); part of temp
    other temporaries   the rest of XLA's temp (buffer assignment: each
                        iteration's workspace, gradients, the loss, ...)
    inputs and outputs  the rest of the peak: the input batch and what the
                        step returns besides the weights and slots it
                        updates in place

and a horizontal line at the HBM per chip the plan fits against (named in
a corner instead when it is more than 4 x the largest peak: a line that
high would flatten every bar).
"""

from gpipe.plan import report as report_lib

SEGMENTS = ('weights', 'optimizer slots', 'stored activations',
            'other temporaries', 'inputs and outputs')
_COLORS = ('#4c72b0', '#8172b2', '#dd8452', '#ccb974', '#8c8c8c')
_HBM_ON_SCALE = 4  # HBM drawn as a line when at most this x the largest peak


def Segments(candidate_report):
  """{segment: bytes per device} of one candidate; they sum to its peak."""
  b = candidate_report.per_device_bytes
  stored = candidate_report.stored_activation_bytes
  return {
      'weights': b['weights'],
      'optimizer slots': b['optimizer'],
      'stored activations': stored,
      'other temporaries': b['temp'] - stored,
      'inputs and outputs': (b['peak'] - b['weights'] - b['optimizer'] -
                             b['temp']),
  }


def WritePlot(plan, path):
  """Draws the plan's candidates as stacked bars into `path` (a PNG)."""
  # pylint: disable=g-import-not-at-top
  import matplotlib
  matplotlib.use('Agg')
  from matplotlib import pyplot
  # pylint: enable=g-import-not-at-top
  segments = [Segments(r) for r in plan.reports]
  peak = max(r.per_device_bytes['peak'] for r in plan.reports)
  # HBM far above every bar would flatten the bars: then it is named, not
  # drawn to scale.
  hbm_on_scale = plan.hbm_bytes <= _HBM_ON_SCALE * peak
  unit, scale = _Unit(max(peak, plan.hbm_bytes) if hbm_on_scale else peak)
  labels = [r.candidate.Describe().replace(' ', '\n', 2)
            for r in plan.reports]
  figure, axes = pyplot.subplots(figsize=(1.2 * len(labels) + 2, 4.5))
  bottoms = [0.0] * len(labels)
  for name, color in zip(SEGMENTS, _COLORS):
    heights = [s[name] / scale for s in segments]
    axes.bar(labels, heights, bottom=bottoms, color=color, label=name)
    bottoms = [b + h for b, h in zip(bottoms, heights)]
  hbm = f'HBM per chip ({report_lib.Bytes(plan.hbm_bytes)})'
  if hbm_on_scale:
    axes.axhline(plan.hbm_bytes / scale, color='#c44e52', linestyle='--',
                 label=hbm)
  else:
    axes.plot([], [], linestyle='none', marker='^', color='#c44e52',
              label=f'{hbm}: {plan.hbm_bytes / peak:.3g} x the largest '
              'peak, above the chart')
  axes.set_ylabel(f'{unit} per chip')
  axes.set_title(f'Bytes per chip, {plan.num_devices} devices')
  axes.legend(fontsize='small', loc='upper left', bbox_to_anchor=(1, 1))
  figure.savefig(path, format='png', dpi=100, bbox_inches='tight')
  pyplot.close(figure)


def _Unit(largest):
  for unit, scale in (('GiB', 2**30), ('MiB', 2**20), ('KiB', 2**10)):
    if largest >= scale:
      return unit, scale
  return 'bytes', 1
