"""A largest LM with and without delayed sends, planned side by side.

    python -m benchmarks.delayed_sends [--model lm.LargestOn8x16GiB]

Plans the model (`python -m gpipe.plan --json`, its own candidate, TPU v5e
roofline, 16 GiB chips) and its twin registered as the model's name +
'DelayedSends' (delayed_sends=True: each stage's output handed on one
iteration after it is made), each in a process of its own (about 8
minutes each on 2 CPU cores for lm.LargestOn8x16GiB), and prints a table:
iterations and bubble, peak per chip, what the stage axis sends, the
collectives' seconds and how many of them the compute beside them hides
(gpipe.plan.overlap), and the predicted step and MFU without and with
that overlap. Delayed sends pay where the hidden stage permutes save
more than the extra bubble iterations cost.
"""

import argparse
import json
import subprocess
import sys

GIB = 2**30


def _Plan(model, num_devices):
  """The plan's JSON for the model's own candidate."""
  done = subprocess.run(
      [sys.executable, '-m', 'gpipe.plan', '--model', model, '--num_devices',
       str(num_devices), '--hbm_gib', '16', '--tpu', 'v5e', '--json'],
      capture_output=True, text=True, check=False)
  if done.returncode:
    raise SystemExit(f'{model}: not planned: '
                     f'{done.stderr.strip().splitlines()[-1:]}')
  (candidate,) = json.loads(done.stdout)['candidates']
  return candidate


def _SentOver(candidate, axes):
  """Bytes a chip sends per step over the mesh axes `axes`."""
  return sum(candidate['collective_bytes_sent_per_step'].get(axes,
                                                            {}).values())


def _Rows(models, plans):
  p = [c['predicted'] for c in plans]
  rows = [('', [f'`{m}`' for m in models]),
          ('iterations (bubble)', [
              f"{c['iterations']} ({c['bubble_fraction']:.3f})"
              for c in plans]),
          ('peak per chip', [
              f"{c['per_device_bytes']['peak'] / GIB:.2f} GiB"
              for c in plans]),
          ('sent over stage', [
              f'{_SentOver(c, "stage") / GIB:.2f} GiB' for c in plans]),
          ('collectives, hidden', [
              f"{x['collective_seconds']:.3f} s, "
              f"{x['hidden_collective_seconds']:.3f} s" for x in p]),
          ('step, MFU (no overlap)', [
              f"{x['step_seconds']:.3f} s, {100 * x['mfu']:.1f} %"
              for x in p]),
          ('step, MFU (overlapped)', [
              f"{x['step_seconds_overlapped']:.3f} s, "
              f"{100 * x['mfu_overlapped']:.1f} %" for x in p])]
  lines = []
  for i, (what, values) in enumerate(rows):
    lines.append(f'| {what} | ' + ' | '.join(values) + ' |')
    if i == 0:
      lines.append('|---' * (len(models) + 1) + '|')
  return lines


def main(argv=None):
  parser = argparse.ArgumentParser(
      prog='python -m benchmarks.delayed_sends',
      description=__doc__.split('\n\n')[0])
  parser.add_argument('--model', default='lm.LargestOn8x16GiB',
                      help='a largest LM registered with a DelayedSends twin')
  parser.add_argument('--num_devices', type=int, default=8)
  args = parser.parse_args(argv)
  models = [args.model, args.model + 'DelayedSends']
  plans = [_Plan(m, args.num_devices) for m in models]
  print('\n'.join(_Rows(models, plans)))
  return 0


if __name__ == '__main__':
  sys.exit(main())
