"""Plans the two 6B flagships on their pods and prints the evidence as Markdown.

    python -m benchmarks.flagships [--quick] > flagships.md

For each flagship (lm.CopyLMPod8x2 with Adam on 8 chips of 32 GiB, TPU v6e;
lm.CopyLMPod8x2Adafactor on 8 chips of 16 GiB, TPU v5e) it runs
`python -m gpipe.plan --json` over a few candidates and prints each
candidate's bytes per chip, FLOPs ratio, bubble and predicted step, the
recommended candidate's largest buffers, then the same model built with
Lingvo's own pipelined layer (`--pipeline_layer lingvo`): its figures, or
the first line of why it cannot be planned. Each candidate compiles a 6B
model's step from shapes alone: about 80 s and 2 GB of host memory;
--quick plans each model's own candidate only.

Every byte and FLOP figure is XLA's for the partitioned module compiled
for CPU devices; the step time and MFU are the planner's roofline model
(the calibrated one: gpipe.plan.calibration), modelled, not measured.
"""

import argparse
import json
import subprocess
import sys
import time

FLAGSHIPS = (
    # (model, TPU generation, HBM per chip in GiB, candidates: M, R)
    ('lm.CopyLMPod8x2', 'v6e', 32, ('16,32', '1,2')),
    ('lm.CopyLMPod8x2Adafactor', 'v5e', 16, ('16,32', '1,2')),
)
GIB = 2**30


def Plan(model, tpu, hbm_gib, candidates=None, layer='gpipe',
          num_devices=8, extra=()):
  """(the plan's JSON or None, the error's last line, wall seconds);
  `extra`: more gpipe.plan arguments."""
  argv = [sys.executable, '-m', 'gpipe.plan', '--model', model,
          '--num_devices', str(num_devices), '--tpu', tpu,
          '--hbm_gib', str(hbm_gib),
          '--pipeline_layer', layer, '--json', *extra]
  if candidates:
    argv += ['--num_microbatches', candidates[0],
             '--circular_repeat', candidates[1]]
  start = time.time()
  run = subprocess.run(argv, capture_output=True, text=True, check=False)
  seconds = time.time() - start
  if run.returncode == 0:
    return json.loads(run.stdout), '', seconds
  errors = [l.removeprefix('plan: error: ') for l in run.stderr.splitlines()
            if l.startswith('plan: error:')]
  return None, (errors or run.stderr.splitlines() or ['?'])[-1], seconds


HEADER = ('| M | R | bubble | weights GiB | optim GiB | temp GiB | peak GiB | '
          'fits | FLOP/dev / (unp/8) | calibrated step s | MFU calibrated | '
          'ceiling | no overlap | overlapped |\n' + '|---' * 14 + '|')


def Row(c):
  """A candidate's HEADER row: the step and MFU the planner's calibrated
  roofline predicts, and beside them the MFU at peak: the ceiling (every
  collective hidden), with no collective hidden, and as a schedule hides
  them."""
  b = c['per_device_bytes']
  p = c['predicted']
  return (f"| {c['num_microbatches']} | {c['circular_repeat']} | "
          f"{c['bubble_fraction']:.3f} | {b['weights'] / GIB:.2f} | "
          f"{b['optimizer'] / GIB:.3f} | {b['temp'] / GIB:.2f} | "
          f"{b['peak'] / GIB:.2f} | {'yes' if c['fits'] else 'NO'} | "
          f"{c['flops_ratio']:.3f} | {p['step_seconds_calibrated']:.2f} | "
          f"{100 * p['mfu_calibrated']:.1f} % | "
          f"{100 * p['mfu_ceiling']:.1f} % | {100 * p['mfu']:.1f} % | "
          f"{100 * p['mfu_overlapped']:.1f} % |")


def _Report(model, tpu, hbm_gib, candidates, quick):
  print(f'## {model} on 8 x {hbm_gib} GiB (TPU {tpu} roofline)\n')
  plan, error, seconds = Plan(model, tpu, hbm_gib,
                               None if quick else candidates)
  if plan is None:
    print(f'Not planned: {error}\n')
    return
  print(f"Weights {plan['total_weight_bytes'] / GIB:.1f} GiB in all; "
        f'planned in {seconds:.0f} s.\n')
  print(HEADER)
  for c in plan['candidates']:
    print(Row(c))
  best = plan['recommended']
  if best is None:
    print('\nNothing recommended.\n')
    return
  c = plan['candidates'][best]
  print(f"\nRecommended: M={c['num_microbatches']} "
        f"R={c['circular_repeat']}, peak {c['per_device_bytes']['peak'] / GIB:.2f}"
        f" GiB = {c['per_device_bytes']['peak'] / (hbm_gib * GIB):.0%} of the "
        f"chip; problems: {c['problems'] or 'none'}. Largest buffers:\n")
  for b in c['largest_buffers']:
    print(f"- {b['bytes'] / GIB:.2f} GiB `{b['type']}` ({b['op']})")
  lingvo, error, seconds = Plan(model, tpu, hbm_gib, layer='lingvo')
  print(f"\nLingvo's LayerwiseShardablePipelinedLayer, same model "
        f'({seconds:.0f} s): ', end='')
  if lingvo is None:
    print(f'not planned: {error}\n')
  else:
    print('\n\n' + HEADER)
    for c in lingvo['candidates']:
      print(Row(c))
    print()


def main(argv=None):
  parser = argparse.ArgumentParser(prog='python -m benchmarks.flagships',
                                   description=__doc__.split('\n\n')[0])
  parser.add_argument('--quick', action='store_true',
                      help="plan each model's own candidate only")
  args = parser.parse_args(argv)
  for model, tpu, hbm_gib, candidates in FLAGSHIPS:
    _Report(model, tpu, hbm_gib, candidates, args.quick)
    sys.stdout.flush()
  return 0


if __name__ == '__main__':
  sys.exit(main())
