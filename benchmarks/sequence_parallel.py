"""A largest LM with and without sequence-parallel blocks, planned side by side.

    python -m benchmarks.sequence_parallel [--model lm.LargestOn8x16GiB]

Plans the model's own candidate (its mesh, microbatches, remat policy) and
the same model with sequence-parallel blocks (params/sequence_parallel.py,
registered as the model's name + 'SequenceParallel'), each in a process of
its own (lm.LargestOn8x16GiB: about a minute each, 4 minutes in all on 2
shared CPU cores), and prints per chip: the bytes (peak, temporaries,
what the step stores for its backward pass), what is sent over each mesh
axis, and the planner's predicted step (TPU v5e roofline, 16 GiB chips).

XLA's SPMD partitioner spells a reduce-scatter as an all-reduce each
device slices (gpipe.xla.reduce_scatters.ScatteredElements); XLA's TPU compiler
turns the pair into a reduce-scatter, XLA:CPU, which compiles the plan,
keeps it. The bytes sent are given both ways: as compiled (each such
all-reduce sending 2(n-1)/n of its bytes) and with those reductions sent
as the reduce-scatters a TPU runs ((n-1)/n); the planner's step charges
the second (gpipe.xla.reduce_scatters.AsTpuRuns).
"""

import argparse
import json
import subprocess
import sys

GIB = 2**30
HBM_GIB = 16


def _Plan(model):
  """The model's own candidate planned (a CandidateReport)."""
  # pylint: disable=g-import-not-at-top
  from gpipe.lingvo_support import flags_and_seeds
  from gpipe.plan import candidate as candidate_lib
  from gpipe.plan import roofline
  from gpipe.plan import targets
  import params.lm as lm
  # pylint: enable=g-import-not-at-top
  flags_and_seeds.EnsureFlagsParsed()
  cls = lm.model_registry.GetClass(model)
  plan = candidate_lib.MakePlan(
      targets.ModelTarget(model),
      [targets.Candidate(cls.NUM_MICROBATCHES, 1, 'save_checkpoints')],
      cls.MESH.num_devices, roofline.CHIPS['v5e'], HBM_GIB * GIB)
  (report,) = plan.reports
  return report


def _Figures(model):
  """The figures of the model's plan, as a dict (for JSON)."""
  # pylint: disable=g-import-not-at-top
  from gpipe.plan import collectives
  from gpipe.plan import roofline
  from gpipe.xla import hlo_text
  from gpipe.xla import reduce_scatters
  # pylint: enable=g-import-not-at-top
  report = _Plan(model)
  as_tpu = collectives.PerAxis(
      reduce_scatters.AsTpuRuns(report.compiled),
      hlo_text.LoopTripCounts(report.compiled.hlo),
      report.mesh_shape, report.axis_names)

  def Predicted(sent):
    p = roofline.Predict(
        report.chip, report.flops_per_device, sum(report.loop_flops),
        report.schedule.bubble_fraction, report.step_bytes,
        collectives.Total(sent) / report.chip.link_bandwidth,
        report.model_flops, report.compiled.num_devices)
    return {'step': p.step_seconds, 'mfu': p.mfu,
            'collectives': p.collective_seconds}

  return {
      'model': model,
      'mesh': list(report.mesh_shape),
      'bytes': report.per_device_bytes,
      'stored': report.stored_activation_bytes,
      'sent_as_compiled': report.sent_per_axis,
      'sent_as_tpu': as_tpu,
      'predicted_as_compiled': Predicted(report.sent_per_axis),
      'predicted_as_tpu': Predicted(as_tpu),
      'largest_buffers': hlo_text.LargestBuffers(report.compiled.hlo, 3),
      'seconds': report.seconds,
  }


def _Table(figures):
  """Markdown rows: one column per plan."""
  head = '| | ' + ' | '.join(f"`{f['model']}`" for f in figures) + ' |'
  rows = [head, '|---' * (len(figures) + 1) + '|']

  def Row(what, value):
    rows.append(f'| {what} | ' + ' | '.join(value(f) for f in figures) + ' |')

  gib = _Bytes
  Row('mesh', lambda f: 'x'.join(map(str, f['mesh'])))
  for key in ('peak', 'temp', 'weights'):
    Row(f'{key} per chip', lambda f, key=key: gib(f['bytes'][key]))
  Row('stored for the backward', lambda f: gib(f['stored']))
  axes = sorted({a for f in figures for a in f['sent_as_compiled']})
  for way in ('compiled', 'tpu'):
    for axis in axes:
      Row(f'sent over {axis} ({way})',
          lambda f, a=axis, w=way: _Sent(f[f'sent_as_{w}'].get(a, {})))
    Row(f'predicted step ({way})', lambda f, w=way: (
        f"{f[f'predicted_as_{w}']['step']:.3f} s (collectives "
        f"{f[f'predicted_as_{w}']['collectives']:.3f} s), "
        f"{100 * f[f'predicted_as_{w}']['mfu']:.1f} % MFU"))
  Row('largest buffers', lambda f: '; '.join(
      f'{gib(b)} {t}' for b, t, _ in f['largest_buffers']))
  Row('planned in', lambda f: f"{f['seconds']:.0f} s")
  return rows


def _Bytes(b):
  for unit, size in (('GiB', GIB), ('MiB', 2**20), ('KiB', 2**10)):
    if b >= size or unit == 'KiB':
      return f'{b / size:.2f} {unit}'


def _Sent(kinds):
  """'1.20 GiB (all-gather 0.60 GiB, ...)': a set of axes' bytes by kind."""
  if not kinds:
    return '-'
  parts = ', '.join(f'{kind} {_Bytes(b)}' for kind, b in kinds.items())
  return f'{_Bytes(sum(kinds.values()))} ({parts})'


def main(argv=None):
  parser = argparse.ArgumentParser(
      prog='python -m benchmarks.sequence_parallel',
      description=__doc__.split('\n\n')[0])
  parser.add_argument('--model', default='lm.LargestOn8x16GiB',
                      help='a model of the largest LMs\' family, '
                      'registered with a SequenceParallel twin')
  parser.add_argument('--one', help=argparse.SUPPRESS)  # a child's plan
  args = parser.parse_args(argv)
  if args.one:
    print(json.dumps(_Figures(args.one)))
    return 0
  figures = []
  for model in (args.model, args.model + 'SequenceParallel'):
    done = subprocess.run(
        [sys.executable, '-m', 'benchmarks.sequence_parallel', '--one',
         model], capture_output=True, text=True, check=False)
    if done.returncode:
      print(f'{model}: not planned: {done.stderr.strip().splitlines()[-1:]}')
      return 1
    figures.append(json.loads(done.stdout.strip().splitlines()[-1]))
  print('\n'.join(_Table(figures)))
  return 0


if __name__ == '__main__':
  sys.exit(main())
