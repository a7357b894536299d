"""Training parity on real text: the pipelined LM against the plain stack.

    python -m benchmarks.text_parity [--steps 1000] [--out docs]

Trains one byte-level LM (lm.TextLMSmall's model: `Config`) twice from
the same initial weights on the same batches (same seeds, the standard
library's source): its stack pipelined (the schedule a pod runs,
unroll='never', layer_by_layer off) and as the plain stack
(unroll='always': the layers one after another on the whole batch). Writes
both loss curves (every step) and both held-out bits per byte to
<out>/text-parity.md, with a plot, <out>/text_parity.png, and prints the
largest relative gap between the curves smoothed over 20 steps (target
2 %), the relative gap of the final held-out bits per byte (target 1 %),
and the steps per second of the pipeline, the plain stack and the layer by
layer path (a shorter run) on this CPU.
"""

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time

import numpy as np

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
import tensorflow as tf
from gpipe import quiet
from gpipe.apps import held_out_text
from gpipe.apps import trainer
from gpipe.lingvo_support import registered_models
from gpipe.pipeline import layer_by_layer
import params.lm  # pylint: disable=unused-import  (registers the models)
from params import text_lm

SMOOTH = 20  # steps in the moving average the curves are compared on
CURVE_TARGET = 0.02
HELD_OUT_TARGET = 0.01
LAYER_BY_LAYER_STEPS = 100


def Config(steps):
  """lm.TextLMSmall's model (4 stages x 2 circular repeats of 1 block of
  width 64, windows of 128 bytes, 16 a step in 4 microbatches), the
  learning rate decaying to a tenth over `steps`."""
  cfg = registered_models.GetParams('lm.TextLMSmall', 'Train')
  cfg.task.train.max_steps = steps
  cfg.task.train.lr_schedule.decay_end = steps
  return cfg


def Run(cfg, unroll, steps, logdir, lbl=False):
  """(losses [steps], step seconds [steps], held-out report or None)."""
  c = cfg.Copy()
  c.task.stack.unroll = unroll
  layer_by_layer.SetProgramDefault(lbl)
  history = trainer.Train(c, steps, logdir=logdir,
                          progress=trainer.Progress(every=100))
  layer_by_layer.SetProgramDefault(False)
  report = None
  if not lbl:
    held = c.Copy()
    held.input = text_lm.HeldOut(cfg.input)
    report = held_out_text.EvaluateHeldOut(held, logdir, text_lm.Text,
                                           sample=unroll == 'never')
  return (np.array([r.loss for r in history]),
          np.array([r.seconds for r in history]), report)


def Smoothed(values, window=SMOOTH):
  """The trailing mean over `window` steps, from the window-th step on."""
  cumulative = np.cumsum(np.concatenate([[0.0], values]))
  return (cumulative[window:] - cumulative[:-window]) / window


def StepsPerSecond(seconds, warmup=10):
  return 1.0 / float(np.median(seconds[warmup:]))


def _Plot(path, pipelined, plain, title):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  bits = 1 / np.log(2)
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                    gridspec_kw={'height_ratios': [3, 1]})
  steps = np.arange(SMOOTH, len(pipelined) + 1)
  top.plot(np.arange(1, len(plain) + 1), plain * bits, color='0.8', lw=0.5)
  top.plot(steps, Smoothed(plain) * bits, label='plain stack', lw=2)
  top.plot(steps, Smoothed(pipelined) * bits, label='pipelined', lw=1,
           ls='--')
  top.set_ylabel('training bits per byte')
  top.set_title(title)
  top.legend()
  bottom.plot(steps, 100 * _Gaps(pipelined, plain))
  bottom.set_ylabel('gap %')
  bottom.set_xlabel('step')
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


def _Gaps(pipelined, plain):
  """|smoothed pipelined - smoothed plain| / smoothed plain, per step."""
  a, b = Smoothed(pipelined), Smoothed(plain)
  return np.abs(a - b) / b


def Report(steps, pipe, plain, lbl_seconds, date, minutes):
  """The markdown page of a run's figures."""
  gaps = _Gaps(pipe[0], plain[0])
  held = (pipe[2].bits_per_byte, plain[2].bits_per_byte)
  held_gap = abs(held[0] - held[1]) / held[1]
  lines = [
      '# Training parity on real text',
      '',
      f'Measured {date} on {platform.machine()}, 2 CPU cores shared with '
      f'other work, Python {platform.python_version()}, TensorFlow '
      f'{tf.__version__}, one CPU device, by `python -m '
      f'benchmarks.text_parity --steps {steps}` (about {minutes:.0f} '
      f'minutes). The model: '
      f'{" ".join(Config.__doc__.split())} '
      f'Both runs start from the same weights and read the same batches of '
      f'the standard library\'s source; held-out: the packages email, json '
      f'and asyncio ({pipe[2].num_bytes:,} bytes).',
      '',
      '![Both training curves and their gap](text_parity.png)',
      '',
      f'- Largest relative gap between the curves smoothed over {SMOOTH} '
      f'steps: {100 * gaps.max():.3f} % (at step {SMOOTH + int(gaps.argmax())}; '
      f'target <= {100 * CURVE_TARGET:.0f} %: '
      f'{"met" if gaps.max() <= CURVE_TARGET else "MISSED"}).',
      f'- Held-out bits per byte after {steps} steps: pipelined '
      f'{held[0]:.4f}, plain stack {held[1]:.4f}: relative gap '
      f'{100 * held_gap:.3f} % (target <= {100 * HELD_OUT_TARGET:.0f} %: '
      f'{"met" if held_gap <= HELD_OUT_TARGET else "MISSED"}); on the same '
      f'bytes gzip -9 {pipe[2].compressors["gzip -9"]:.3f}, xz -9 '
      f'{pipe[2].compressors["xz -9"]:.3f}.',
      f'- Steps per second (median step): pipelined (the schedule) '
      f'{StepsPerSecond(pipe[1]):.2f}, plain stack '
      f'{StepsPerSecond(plain[1]):.2f}, layer by layer '
      f'{StepsPerSecond(lbl_seconds):.2f} ({LAYER_BY_LAYER_STEPS} steps).',
      '',
      f'| step | pipelined loss | plain loss | pipelined, smoothed bits per '
      f'byte | plain, smoothed bits per byte | gap % |',
      '|---|---|---|---|---|---|',
  ]
  smooth_a, smooth_b = Smoothed(pipe[0]), Smoothed(plain[0])
  shown = range(SMOOTH, steps + 1, max(steps // 20, 1))
  for step in sorted(set(shown) | {steps}):
    i = step - SMOOTH
    lines.append(f'| {step} | {pipe[0][step - 1]:.4f} | '
                 f'{plain[0][step - 1]:.4f} | {smooth_a[i] / np.log(2):.4f} | '
                 f'{smooth_b[i] / np.log(2):.4f} | {100 * gaps[i]:.3f} |')
  return '\n'.join(lines) + '\n', gaps.max(), held_gap


def main(argv=None):
  parser = argparse.ArgumentParser(prog='python -m benchmarks.text_parity',
                                   description=__doc__.split('\n\n')[0])
  parser.add_argument('--steps', type=int, default=1000)
  parser.add_argument('--out', default='docs',
                      help='directory of text-parity.md and text_parity.png')
  args = parser.parse_args(argv)
  quiet.UnlessVerbose([])
  if args.steps < 2 * SMOOTH:
    parser.error(f'--steps must be at least {2 * SMOOTH}, got {args.steps}.')
  cfg = Config(args.steps)
  work = tempfile.mkdtemp(prefix='text_parity_')
  began = time.time()
  pipe = Run(cfg, 'never', args.steps, os.path.join(work, 'pipelined'))
  plain = Run(cfg, 'always', args.steps, os.path.join(work, 'plain'))
  _, lbl_seconds, _ = Run(cfg, 'never', LAYER_BY_LAYER_STEPS,
                          os.path.join(work, 'lbl'), lbl=True)
  if abs(pipe[0][0] - plain[0][0]) > 1e-5 * abs(plain[0][0]):
    raise SystemExit(f'the runs did not start from the same weights: '
                     f'step-0 losses {pipe[0][0]} and {plain[0][0]}')
  page, curve_gap, held_gap = Report(
      args.steps, pipe, plain, lbl_seconds,
      datetime.date.today().isoformat(), (time.time() - began) / 60)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'text-parity.md'), 'w') as f:
    f.write(page)
  _Plot(os.path.join(args.out, 'text_parity.png'), pipe[0], plain[0],
        f'{args.steps} steps on the standard library\'s source')
  print(f'largest gap of the smoothed curves {100 * curve_gap:.3f} % '
        f'(target {100 * CURVE_TARGET:.0f} %), final held-out bits per byte '
        f'{pipe[2].bits_per_byte:.4f} vs {plain[2].bits_per_byte:.4f} '
        f'({100 * held_gap:.3f} %, target {100 * HELD_OUT_TARGET:.0f} %); '
        f'steps/s pipelined {StepsPerSecond(pipe[1]):.2f}, plain '
        f'{StepsPerSecond(plain[1]):.2f}, layer by layer '
        f'{StepsPerSecond(lbl_seconds):.2f}; wrote {args.out}/text-parity.md')
  return 0


if __name__ == '__main__':
  sys.exit(main())
