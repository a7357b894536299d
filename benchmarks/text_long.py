"""The long text run: lm.TextLM30Min against the compressors.

    python -m benchmarks.text_long [--model lm.TextLM30Min] [--minutes 30]
                                   [--out docs]

Trains the model layer by layer (as `python -m gpipe.demo --model
lm.TextLM30Min --minutes 30` does) for its train.max_steps or --minutes,
whichever comes first, then scores the held-out bytes and prints, beside
the model's bits per byte on them, three compressors' on the same bytes:
`gzip -9` and `xz -9` on the held-out bytes alone, and `xz -9` given the
training files (8 x (|xz(train + held-out)| - |xz(train)|) / |held-out|:
what xz adds to code the held-out bytes once it has read every training
file, the fair figure for a model that has read them too). Writes
<out>/text-long.md, and exits 1 when the model's held-out bits per byte
are above --target (default 1.5).
"""

import argparse
import datetime
import lzma
import os
import platform
import sys
import tempfile
import time

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
import tensorflow as tf
from gpipe import demo
from gpipe import quiet
from gpipe.apps import held_out_text
from gpipe.apps import trainer
from gpipe.lingvo_support import registered_models
from gpipe.pipeline import layer_by_layer
import params.lm  # pylint: disable=unused-import  (registers the models)
from params import text_lm


def XzGivenTraining(train_paths, held_out):
  """Bits per byte xz -9 spends on held_out (bytes) after the training
  files (their bytes in order, as `cat` gives them)."""
  train = b''.join(_Read(path) for path in train_paths)
  alone = len(lzma.compress(train, preset=9))
  both = len(lzma.compress(train + held_out, preset=9))
  return 8 * (both - alone) / len(held_out)


def _Read(path):
  with open(path, 'rb') as f:
    return f.read()


def Page(model, cfg, history, report, given, target, command, date,
         minutes):
  seconds = sum(r.seconds for r in history)
  sp = cfg.task.stack
  rows = [('the model', report.bits_per_byte)] + [
      (f'`{name}`, held-out bytes alone', bpb)
      for name, bpb in report.compressors.items()] + [
          ('`xz -9` given the training files', given)]
  lines = [
      '# The long text run', '',
      f'Measured {date} on {platform.machine()}, 2 CPU cores, TensorFlow '
      f'{tf.__version__}, by `{command}` ({minutes:.0f} minutes in all). '
      f'`{model}`: {sp.num_stages} stages x {sp.circular_repeat} repeats x '
      f'{sp.single_stage_body.num_blocks} block(s) of width '
      f'{cfg.task.model_dim}, windows of {cfg.input.seq_len} bytes, '
      f'{cfg.input.batch_size} a step, trained layer by layer: '
      f'{len(history)} steps in {seconds / 60:.1f} minutes.', '',
      f'Held-out: {report.num_bytes:,} bytes of the packages email, json and '
      'asyncio, never trained on. Bits per byte (all measured):', '',
      '| coder | bits per byte |', '|---|---|',
  ] + [f'| {name} | {bpb:.3f} |' for name, bpb in rows] + [
      '', f'The target, <= {target} bits per byte on the held-out bytes, '
      f'is {"met" if report.bits_per_byte <= target else "not met"}.',
      '', '```', demo.LossCurve(history, bits=True), '```', '',
      'Its sample, through the pipeline byte by byte, from a held-out '
      'prompt:', '', '```', report.prompt + report.sample, '```', '']
  return '\n'.join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(prog='python -m benchmarks.text_long',
                                   description=__doc__.split('\n\n')[0])
  parser.add_argument('--model', default='lm.TextLM30Min')
  parser.add_argument('--minutes', type=float, default=30.0)
  parser.add_argument('--target', type=float, default=1.5)
  parser.add_argument('--out', default='docs')
  args = parser.parse_args(argv)
  quiet.UnlessVerbose([])
  began = time.time()
  cfg = registered_models.GetParams(args.model, 'Train')
  logdir = tempfile.mkdtemp(prefix='text_long_')
  layer_by_layer.SetProgramDefault(True)
  history = trainer.Train(cfg, cfg.task.train.max_steps, logdir=logdir,
                          progress=trainer.Progress(every=100),
                          seconds=60 * args.minutes)
  layer_by_layer.SetProgramDefault(False)
  test = registered_models.GetParams(args.model, 'Test')
  report = held_out_text.EvaluateHeldOut(test, logdir, text_lm.Text)
  print(report.Describe(), flush=True)
  generator = test.input.Instantiate()
  given = XzGivenTraining(generator.train_files, generator.HeldOutBytes())
  print(f'xz -9 given the training files: {given:.3f} bits per byte',
        flush=True)
  command = ' '.join(['python -m benchmarks.text_long'] +
                     (sys.argv[1:] if argv is None else argv))
  page = Page(args.model, cfg, history, report, given, args.target, command,
              datetime.date.today().isoformat(), (time.time() - began) / 60)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'text-long.md'), 'w') as f:
    f.write(page)
  met = report.bits_per_byte <= args.target
  print(f'held-out {report.bits_per_byte:.3f} bits per byte: target '
        f'<= {args.target} {"met" if met else "MISSED"}')
  return 0 if met else 1


if __name__ == '__main__':
  sys.exit(main())
