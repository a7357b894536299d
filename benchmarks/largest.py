"""Plans the largest registered LMs on their chips and prints the evidence.

    python -m benchmarks.largest > largest.md

For lm.LargestOn8x16GiB (8 chips) and lm.LargestOn32x16GiB (32 chips), each
of 16 GiB, TPU v5e roofline, it runs `python -m gpipe.plan --json` with the
model's own candidate and prints, beside GPipe's largest Transformer on as
many accelerators of 16 GB (Huang et al., 2019, Table 1), the bytes per
chip, the FLOPs ratio, the bubble and the predicted step, then checks what
a fit means here: recommended, peak at most 90 % of 16 GiB, weights per
chip at most 1.1 x total / N, FLOPs per chip at most 1.1 x the
unpartitioned step's / N, bubble at most 0.1. Exits 1 if a check fails.

Each plan compiles the model's whole training step from shapes alone: about
4 minutes and 7 GB of host memory for the 8-chip model, more for the
32-chip one.
"""

import argparse
import sys

from benchmarks import flagships

GIB = 2**30
HBM_GIB = 16
MODELS = (
    # (model, chips, GPipe's parameters on as many 16 GB accelerators)
    ('lm.LargestOn8x16GiB', 8, 5.3e9),
    ('lm.LargestOn32x16GiB', 32, 21.0e9),
)


def _Checks(plan, num_devices):
  """[(what, value, bound, ok)] for the recommended candidate."""
  best = plan['recommended']
  if best is None:
    return [('recommended', 'none', 'one', False)]
  c = plan['candidates'][best]
  b = c['per_device_bytes']
  weights_share = b['weights'] / (plan['total_weight_bytes'] / num_devices)
  return [
      ('peak / 16 GiB', b['peak'] / (HBM_GIB * GIB), 0.9,
       b['peak'] <= 0.9 * HBM_GIB * GIB),
      ('weights per chip / (total / N)', weights_share, 1.1,
       weights_share <= 1.1),
      ('FLOPs per chip / (unpartitioned / N)', c['flops_ratio'], 1.1,
       c['flops_ratio'] <= 1.1),
      ('bubble', c['bubble_fraction'], 0.1, c['bubble_fraction'] <= 0.1),
  ]


def _Report(model, num_devices, gpipe_params):
  """Prints one model's section; returns whether every check holds."""
  print(f'## {model} on {num_devices} x {HBM_GIB} GiB (TPU v5e roofline)\n')
  plan, error, seconds = flagships.Plan(model, 'v5e', HBM_GIB,
                                        num_devices=num_devices)
  if plan is None:
    print(f'Not planned: {error}\n')
    return False
  params = plan['total_weight_bytes'] / 4  # float32 weights
  print(f'{params / 1e9:.1f} B parameters ({params / gpipe_params:.2f} x '
        f"GPipe's {gpipe_params / 1e9:.1f} B on {num_devices} accelerators "
        f'of 16 GB); planned in {seconds:.0f} s.\n')
  print('| M | R | bubble | weights GiB | optim GiB | temp GiB | peak GiB | '
        f'fits | FLOP/dev / (unp/{num_devices}) | pred. step s | pred. MFU |')
  print('|---|---|---|---|---|---|---|---|---|---|---|')
  for c in plan['candidates']:
    print(flagships.Row(c))
  print('\n| check | value | bound | holds |\n|---|---|---|---|')
  checks = _Checks(plan, num_devices)
  for what, value, bound, ok in checks:
    shown = value if isinstance(value, str) else f'{value:.3f}'
    print(f"| {what} | {shown} | {bound} | {'yes' if ok else 'NO'} |")
  best = plan['recommended']
  if best is not None:
    print('\nLargest buffers of the recommended candidate:\n')
    for b in plan['candidates'][best]['largest_buffers']:
      print(f"- {b['bytes'] / GIB:.2f} GiB `{b['type']}` ({b['op']})")
  print()
  return all(ok for *_, ok in checks)


def main(argv=None):
  parser = argparse.ArgumentParser(prog='python -m benchmarks.largest',
                                   description=__doc__.split('\n\n')[0])
  parser.add_argument('--only', choices=[m for m, _, _ in MODELS],
                      help='plan this model only')
  args = parser.parse_args(argv)
  ok = True
  for model, num_devices, gpipe_params in MODELS:
    if args.only in (None, model):
      ok &= _Report(model, num_devices, gpipe_params)
      sys.stdout.flush()
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
