"""Demo: train a pipelined Transformer LM on CPU, then show its schedule.

    python -m gpipe.demo [--model lm.TextLMSmall] [--steps N] [--minutes 3]
                         [--logdir DIR] [--out schedule.png]

1. Checks the registered model params (fails fast, before building).
2. Builds Lingvo's training graph; before the first step, checks that the
   loss and gradients of the pipelined model equal those of the same model
   run unpipelined (unroll='always', dropout off) and prints the largest
   difference.
3. Trains to global step --steps (default: the model's train.max_steps),
   or for --minutes, whichever comes first, with a progress bar (loss,
   accuracy, step time), then prints the loss curve, and saves a
   checkpoint in --logdir (a new temporary directory by default);
   rerunning with the same --logdir and more --steps resumes. TensorBoard
   events go to --logdir too: loss, accuracy, step time, the pipeline's
   per-stage summaries and the schedule as an image.
4. The default model, lm.TextLMSmall, learns bytes of text (the standard
   library's Python source): prints its held-out bits per byte beside
   gzip -9's and xz -9's on the same bytes, and a held-out prompt's
   continuation sampled through the pipeline, one byte per step with
   per-stage caches, checked against full-sequence decoding. The copy
   model (--model lm.CopyLMSmall) greedily decodes held-out copy prompts
   the same way and prints the copy accuracy.
5. Prints the schedule (iterations, bubble fraction, useful work per stage)
   and draws it to --out (default: <logdir>/schedule.png).
"""

import argparse
import os
import sys


# Spellings from before the commands spoke one dialect (Lingvo's).
_OLD_SPELLINGS = {'--skip-check': '--skip_check',
                  '--skip-decode': '--skip_decode'}


# The check's float32 tolerance under the kernels the user's TensorFlow
# runs: oneDNN's (on by default on x86) block the whole batch's and a
# microbatch's matmuls differently, and on some CPUs the pipelined and
# unrolled gradients then differ beyond 1e-5 (docs/testing.md, "oneDNN",
# has the figures). The suite checks the same equality at 1e-5 with
# oneDNN off (tests/conftest.py).
_CHECK_RTOL = 1e-4


def _Args(argv=None):
  from gpipe import flag_spellings  # pylint: disable=g-import-not-at-top
  from gpipe import quiet  # pylint: disable=g-import-not-at-top
  from gpipe.schedule import plot as schedule_plot  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(
      prog='python -m gpipe.demo', description=__doc__.split('\n\n')[0],
      epilog=__doc__.split('\n\n', 2)[2].rstrip(),
      formatter_class=quiet.HelpFormatter)
  parser.add_argument('--model', default='lm.TextLMSmall',
                      help='registered model params')
  parser.add_argument('--steps', type=int, default=None,
                      help="train until this global step (default: the "
                      "model's train.max_steps)")
  parser.add_argument('--minutes', type=float, default=3.0,
                      help='or stop training after this many minutes')
  parser.add_argument('--logdir', default=None,
                      help='checkpoint and TensorBoard directory, resumed '
                      'from (default: a new temporary directory)')
  parser.add_argument('--out', default=None,
                      help='schedule diagram, a .png path (default: '
                      '<logdir>/schedule.png)')
  parser.add_argument('--nolayer_by_layer', dest='layer_by_layer',
                      action='store_false',
                      help='train on the pipeline schedule a pod runs, not '
                      'layer by layer (the same results, slower on one '
                      'device; the check and the decoding run the '
                      'schedule either way)')
  parser.add_argument('--verbose', action='store_true',
                      help='also show TensorFlow, XLA and Lingvo logs')
  parser.add_argument('--skip_check', action='store_true',
                      help='skip the pipelined-vs-unrolled check')
  parser.add_argument('--skip_decode', action='store_true',
                      help='skip evaluating and decoding held-out data '
                      'after training')
  argv = sys.argv[1:] if argv is None else argv
  args = parser.parse_args(flag_spellings.Respell(argv, _OLD_SPELLINGS,
                                                  parser.prog))
  if args.minutes <= 0:
    parser.error(f'--minutes must be > 0, got {args.minutes}.')
  if args.steps is not None and args.steps < 1:
    parser.error(f'--steps must be >= 1 (the global step to train to), got '
                 f'{args.steps}.')
  problem = args.out and schedule_plot.OutPathProblem(args.out)
  if problem:
    parser.error(f'--out {args.out}: {problem}')
  for flag, path in (('--logdir', args.logdir),
                     ('--out', args.out and os.path.dirname(
                         os.path.abspath(args.out)))):
    problem = path and _NotWritable(path)
    if problem:
      parser.error(f'{flag} {path}: {problem}')
  return parser, args


def _NotWritable(directory):
  """Why files cannot be written in directory (created if missing), or ''."""
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:
    return f'cannot create it ({e.strerror}).'
  if not os.access(directory, os.W_OK):
    return 'is not writable.'
  return ''


# The arguments are read before TensorFlow loads (--help and usage errors
# answer at once), and the libraries are quieted before they load.
if __name__ == '__main__':
  _Args()
  from gpipe import quiet  # pylint: disable=g-import-not-at-top
  quiet.UnlessVerbose()

# pylint: disable=g-import-not-at-top,g-bad-import-order
import math
import tempfile
import time

from gpipe.apps import held_out_text
from gpipe.apps import trainer
from gpipe.lingvo_support import registered_models
from gpipe.pipeline import layer_by_layer
from gpipe.schedule import plot as schedule_plot
from gpipe.schedule import text as schedule_text
import params.lm
import params.text_lm
# pylint: enable=g-import-not-at-top,g-bad-import-order


def ModelParams(name, dataset='Train'):
  """Registered model params, validated before anything is built."""
  try:
    cfg = registered_models.GetParams(name, dataset)
  except LookupError as e:
    raise ValueError(str(e)) from None
  validate = getattr(cfg.task.cls, 'ValidateParams', None)
  if validate:
    validate(cfg.task, cfg.input)
  return cfg


def main(argv=None):
  parser, args = _Args(argv)
  try:
    cfg = ModelParams(args.model)
  except ValueError as e:
    parser.error(str(e))
  steps = args.steps or cfg.task.train.max_steps
  logdir = args.logdir or tempfile.mkdtemp(prefix='gpipe_demo_')
  out = args.out or f'{logdir}/schedule.png'
  sched = trainer.StackSchedule(cfg)
  sp = cfg.task.stack
  print(f'{args.model}: {sp.num_stages} stages x {sp.circular_repeat} '
        f'repeat(s) of {sp.single_stage_body.num_blocks} Transformer '
        f'block(s), width {cfg.task.model_dim}; batch {cfg.input.batch_size} '
        f'in {sched.num_microbatches} microbatches.', flush=True)

  checks = []

  def CheckBeforeTraining(sess, tg):
    total, per_device = params.lm.ParameterBytes(tg.task)
    print(f'{total // 4:,} parameters ({total / 2**20:.2f} MiB; '
          f'{per_device / 2**20:.2f} MiB per device when partitioned)',
          flush=True)
    if args.skip_check:
      return
    began = time.time()
    layer_by_layer.SetProgramDefault(False)  # the check runs the schedule
    comparison = trainer.CompareWithUnrolled(
        cfg, trainer.InitialValues(sess, tg.task))
    step = int(sess.run(tg.global_step))
    print(f'pipelined vs unrolled at step {step}: {comparison.Describe()} '
          f'[{time.time() - began:.1f} s]', flush=True)
    checks.append(comparison)
    if not comparison.Matches(rtol=_CHECK_RTOL):
      raise SystemExit('MISMATCH: the pipelined model differs from the '
                       'unrolled one.')

  began = time.time()
  is_text = hasattr(cfg.task.cls, 'FullSequencePicks')
  # One device: train layer by layer (lingvo_trainer's default too).
  layer_by_layer.SetProgramDefault(args.layer_by_layer)
  history = trainer.Train(cfg, steps, logdir=logdir,
                          progress=trainer.Progress(),
                          on_start=CheckBeforeTraining,
                          seconds=60 * args.minutes)
  elapsed = time.time() - began
  layer_by_layer.SetProgramDefault(False)  # decoding runs the schedule
  if history:
    first, last = history[0], history[-1]
    steps_seconds = sum(r.seconds for r in history)
    print(f'trained steps {first.step}..{last.step} in {steps_seconds:.1f} s '
          f'({elapsed:.1f} s with building and checking): loss '
          f'{first.loss:.4f} -> {last.loss:.4f}, accuracy '
          f'{first.accuracy:.3f} -> {last.accuracy:.3f}')
    print(LossCurve(history, bits=is_text))
  else:
    print(f'nothing to train: {logdir} is already at step '
          f'{trainer.CheckpointStep(logdir)} >= --steps {steps}.')
  reached = trainer.CheckpointStep(logdir)
  print(f'checkpoint in {logdir} at step {reached} (continue with --logdir '
        f'{logdir} --steps {reached + steps})')
  if not args.skip_decode:
    _EvaluateHeldOut(args.model, logdir, is_text)
  print(schedule_text.Summary(sched))
  print(schedule_text.Render(sched))
  schedule_plot.Draw(sched, out)
  print(f'wrote {out}')
  print(f'loss, accuracy, step time, per-stage summaries and the schedule: '
        f'{_TensorBoard()} --logdir {logdir}')
  return 0


def _EvaluateHeldOut(model, logdir, is_text):
  """Prints the held-out figures; exits if incremental decoding through the
  pipeline picked other tokens than full-sequence decoding."""
  cfg = ModelParams(model, 'Test')
  if is_text:
    result = held_out_text.EvaluateHeldOut(cfg, logdir, params.text_lm.Text)
  else:
    result = trainer.DecodeHeldOut(cfg, logdir)
  print(result.Describe(), flush=True)
  if not result.Agrees():
    raise SystemExit(
        'MISMATCH: decoding through the pipeline step by step picked other '
        'tokens than full-sequence decoding (margin '
        f'{result.largest_margin_where_different:.2e}).')


def LossCurve(history, bits, points=10, width=40):
  """The training loss at about `points` steps, as a bar chart (bits: the
  loss in bits per byte, loss / ln 2, for a loss in nats per byte)."""
  scale = 1 / math.log(2) if bits else 1.0
  unit = 'bits per byte' if bits else 'loss'
  picked = sorted({round(i * (len(history) - 1) / max(points - 1, 1))
                   for i in range(points)})
  values = [history[i].loss * scale for i in picked]
  top = max(values) or 1.0
  lines = [f'training curve ({unit}, one batch a step):']
  for i, value in zip(picked, values):
    bar = '#' * max(1, round(width * value / top))
    lines.append(f'  step {history[i].step + 1:>6}  {value:7.3f}  {bar}')
  return '\n'.join(lines)


def _TensorBoard():
  """The tensorboard command beside this Python (in its venv, which need
  not be activated), relative to the working directory when inside it."""
  beside = os.path.join(os.path.dirname(sys.executable), 'tensorboard')
  if not os.path.exists(beside):
    return 'tensorboard'
  relative = os.path.relpath(beside)
  return beside if relative.startswith('..') else relative


if __name__ == '__main__':
  from gpipe.apps import prompt_exit  # pylint: disable=g-import-not-at-top
  prompt_exit.Exit(main())
