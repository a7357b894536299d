"""Depth on real text: the text LM at 4, 8 and 16 blocks, pipelined and plain.

    python -m benchmarks.text_depth [--steps 400] [--minutes 3] [--out docs]
                                    [--parts steps,minutes,speed,recipe]

The text LM of `make demo` (lm.TextLMSmall: width 64, windows of 128
bytes of the standard library's source, 16 a step, its recipe) with its
stack at each depth of `STACKS` (4 stages x R = 1, 2, 4; the 8 blocks also
as 8 stages and as 2 blocks a stage), every run from the same seeds:

  steps    each stack for --steps steps, the learning rate decaying over
           them, pipelined (the schedule a pod runs, layer_by_layer off)
           and plain (unroll='always'): the mean training bits per byte of
           the last 50 steps and the held-out bits per byte;
  minutes  each stack for --minutes of training layer by layer (the
           one-device path the demo trains on), its learning rate decaying
           over the steps its measured step time allows: held-out bits
           per byte;
  speed    the step of every shipped text model (`MODELS`) layer by layer,
           plain and on the schedule, timed in rotation;
  context  what a window's length costs: the demo's model on windows of
           64, 128 and 256 bytes, the same bytes a step;
  recipe   the recipe's parts added one at a time, each at 4 and 8 blocks
           for --steps steps (plain): what made depth help.

Keeps every part's figures in <out>/text-depth.json (a run of some
--parts replaces those, keeps the others), writes <out>/text-depth.md
(tables) and <out>/text_depth.png (curves) from all of them, and exits 1
when a check fails: at --steps, 8 blocks (R = 2) below 4 blocks
and 16 (R = 4) no higher than 8 in training loss; pipelined equal to plain
within 1 % at every depth (training loss and held-out); layer by layer
within 1.25x the plain stack's step on every shipped model. About 45
minutes on 2 cores.
"""

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time

import numpy as np

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
import tensorflow as tf
from benchmarks import text_depth_report
from gpipe import quiet
from gpipe.apps import held_out_text
from gpipe.apps import trainer
from gpipe.lingvo_support import registered_models
from gpipe.pipeline import layer_by_layer
import params.lm  # pylint: disable=unused-import  (registers the models)
from params import lm_params
from params import text_lm

LAST = 50  # steps the training loss is averaged over
PARITY = 0.01  # pipelined vs plain, relative
SPEED_TARGET = 1.25  # layer by layer / plain
MODELS = ('lm.TextLMSmall', 'lm.TextLM30Min')


@dataclasses.dataclass(frozen=True)
class Stack:
  name: str
  stages: int
  repeat: int
  blocks: int  # a stage's

  @property
  def depth(self):
    return self.stages * self.repeat * self.blocks


STACKS = (
    Stack('4 blocks: 4 stages x R 1', 4, 1, 1),
    Stack('8 blocks: 4 stages x R 2', 4, 2, 1),
    Stack('8 blocks: 8 stages x R 1', 8, 1, 1),
    Stack('8 blocks: 4 stages x 2 a stage', 4, 1, 2),
    Stack('16 blocks: 4 stages x R 4', 4, 4, 1),
)
SHALLOW, DEEP, DEEPEST = STACKS[0], STACKS[1], STACKS[4]


@dataclasses.dataclass
class Run:
  """One training run's figures."""
  stack: str
  path: str  # pipelined | plain | layer by layer | a recipe's name
  steps: int
  losses: np.ndarray  # training bits per byte, one a step
  step_seconds: float  # median
  held_out: float
  gzip: float

  @property
  def last_loss(self):
    return float(self.losses[-LAST:].mean())

  def AsDict(self):
    d = dataclasses.asdict(self)
    d['losses'] = [round(float(x), 4) for x in self.losses]
    return d

  @classmethod
  def FromDict(cls, d):
    return cls(**dict(d, losses=np.array(d['losses'])))


def ModelCfg(stack, steps, model='lm.TextLMSmall', **attributes):
  """The registered text model with `stack`, its learning rate decaying
  over `steps` (the registered class's recipe, another depth; `attributes`:
  more of its class attributes changed)."""
  depth = type('Depth', (registered_models.GetClass(model),), dict(
      NUM_STAGES=stack.stages, CIRCULAR_REPEAT=stack.repeat,
      BLOCKS_PER_STAGE=stack.blocks, MAX_STEPS=steps, **attributes))
  cfg = depth().Model()
  cfg.input = depth().Train()
  return cfg


def Train(cfg, path, steps, stack, workdir, seconds=None, recipe=None):
  """A Run of cfg on `path`: 'pipelined', 'plain' or 'layer by layer'."""
  c = cfg.Copy()
  c.task.stack.unroll = 'always' if path == 'plain' else 'never'
  layer_by_layer.SetProgramDefault(path == 'layer by layer')
  logdir = tempfile.mkdtemp(dir=workdir)
  try:
    history = trainer.Train(c, steps, logdir=logdir, seconds=seconds,
                            summary_every=10**9,
                            progress=trainer.Progress(every=100))
  finally:
    layer_by_layer.SetProgramDefault(False)
  held = c.Copy()
  held.input = text_lm.HeldOut(c.input)
  held.task.stack.unroll = 'always'
  report = held_out_text.EvaluateHeldOut(held, logdir, text_lm.Text,
                                         sample=False)
  return Run(stack=stack.name, path=recipe or path, steps=len(history),
             losses=np.array([r.loss for r in history]) / math.log(2),
             step_seconds=float(np.median([r.seconds for r in history][5:])),
             held_out=report.bits_per_byte,
             gzip=report.compressors['gzip -9'])


def SameSteps(steps, workdir):
  runs = []
  for stack in STACKS:
    cfg = ModelCfg(stack, steps)
    for path in ('pipelined', 'plain'):
      runs.append(Train(cfg, path, steps, stack, workdir))
      _Say(runs[-1])
  return runs


def SameMinutes(minutes, workdir):
  """Each stack layer by layer for `minutes`, its learning rate decaying
  over the steps its step time, timed first, allows."""
  runs = []
  for stack in STACKS:
    seconds = StepSeconds(ModelCfg(stack, 1000),
                          ['layer by layer'])['layer by layer']
    steps = max(100, int(60 * minutes / seconds))
    runs.append(Train(ModelCfg(stack, steps), 'layer by layer', steps, stack,
                      workdir, seconds=60 * minutes))
    _Say(runs[-1])
  return runs


def StepSeconds(cfg, paths, steps=20, rounds=3):
  """{path: median seconds of a training step}, the paths timed in
  rotation (a round of `steps` steps of each) in one process."""
  sessions = {}
  for path in paths:
    c = cfg.Copy()
    c.task.stack.unroll = 'always' if path == 'plain' else 'never'
    layer_by_layer.SetProgramDefault(path == 'layer by layer')
    tg = trainer.BuildTrainGraph(c)
    layer_by_layer.SetProgramDefault(False)
    with tg.graph.as_default():
      sess = tf.compat.v1.Session(graph=tg.graph)
      sess.run(tf.compat.v1.global_variables_initializer())
      for _ in range(3):  # compiling and warming up
        sess.run(tg.train_op)
    sessions[path] = (sess, tg.train_op)
  times = {path: [] for path in paths}
  for _ in range(rounds):
    for path, (sess, op) in sessions.items():
      for _ in range(steps):
        began = time.perf_counter()
        sess.run(op)
        times[path].append(time.perf_counter() - began)
  for sess, _ in sessions.values():
    sess.close()
  return {path: float(np.median(t)) for path, t in times.items()}


def ContextCosts():
  """{window: {path: step seconds}}: the demo's model on windows of 64,
  128 and 256 bytes, 2048 bytes a step."""
  costs = {}
  for seq_len in (64, 128, 256):
    stack = Stack('', SHALLOW.stages, DEEP.repeat, 1)
    cfg = ModelCfg(stack, 1000, SEQ_LEN=seq_len, BATCH_SIZE=2048 // seq_len)
    costs[seq_len] = StepSeconds(cfg, ['layer by layer', 'plain'])
    print(f'windows of {seq_len}: ' + ', '.join(
        f'{k} {1e3 * v:.0f} ms' for k, v in costs[seq_len].items()),
          flush=True)
  return costs


def Speeds():
  """{model: {path: step seconds}} of the shipped text models."""
  speeds = {}
  for model in MODELS:
    cfg = registered_models.GetParams(model, 'Train')
    speeds[model] = StepSeconds(cfg, ['layer by layer', 'plain',
                                      'pipelined'])
    print(f'{model}: ' + ', '.join(f'{k} {1e3 * v:.0f} ms'
                                   for k, v in speeds[model].items()),
          flush=True)
  return speeds


# -- What made depth help: the recipe's parts, one at a time. ----------------

@dataclasses.dataclass(frozen=True)
class Part:
  """One step of the recipe: the text LM's params with these changes."""
  name: str
  body: dict  # CopyLMParams' arguments
  atten: dict = dataclasses.field(default_factory=dict)  # tr_atten_tpl's
  task: dict = dataclasses.field(default_factory=dict)  # the task's
  warmup: int = 50


RECIPE = (
    Part("Lingvo's time-major TransformerLayer as it comes (its attention "
         'adds to the normalized input)', dict(batch_major=False),
         atten=dict(add_unnormalized_input=False)),
    Part('pre-LN, x + f(LN(x)) (the batch-major block)',
         dict(batch_major=True)),
    Part('+ rotary positions', dict(batch_major=True, rotary=True)),
    Part('+ output projections scaled by 1/sqrt(2 x blocks)',
         dict(batch_major=True, rotary=True),
         task=dict(depth_scaled_init=True)),
    Part('+ warmup 100 steps (the recipe)', dict(batch_major=True,
                                                rotary=True),
         task=dict(depth_scaled_init=True), warmup=100),
)


def RecipeCfg(stack, steps, part):
  """lm.TextLMSmall's model and input with one step of RECIPE."""
  cfg = ModelCfg(stack, steps)
  model = registered_models.GetClass('lm.TextLMSmall')
  p = lm_params.CopyLMParams(
      name='text_lm', vocab_size=cfg.task.vocab_size,
      model_dim=model.MODEL_DIM, num_heads=model.NUM_HEADS,
      hidden_dim=4 * model.MODEL_DIM, blocks_per_stage=stack.blocks,
      num_stages=stack.stages, circular_repeat=stack.repeat,
      num_microbatches=model.NUM_MICROBATCHES, dropout_prob=0.0,
      shard_stages_1d=False, learning_rate=model.LEARNING_RATE,
      max_steps=steps, max_seq_len=model.SEQ_LEN,
      task_cls=text_lm.TextLMTask, **part.body)
  p.stack.single_stage_body.block_tpl.tr_atten_tpl.Set(**part.atten)
  p.Set(**part.task)
  p.train.lr_schedule = cfg.task.train.lr_schedule.Copy().Set(
      warmup=part.warmup, decay_start=part.warmup + 1)
  cfg.task = p
  return cfg


def Recipe(steps, workdir):
  runs = []
  for part in RECIPE:
    for stack in (SHALLOW, DEEP):
      runs.append(Train(RecipeCfg(stack, steps, part), 'plain', steps, stack,
                        workdir, recipe=part.name))
      _Say(runs[-1])
  return runs


# -- Checks. -----------------------------------------------------------------


def Problems(steps_runs, speeds):
  """What the runs fail of the targets (module docstring), as lines."""
  problems = []
  by = {(r.stack, r.path): r for r in steps_runs}
  if steps_runs:
    for path in ('pipelined', 'plain'):
      shallow, deep, deepest = (by[s.name, path].last_loss
                                for s in (SHALLOW, DEEP, DEEPEST))
      if not deep < shallow:
        problems.append(f'{path}: 8 blocks {deep:.4f} not below 4 blocks '
                        f'{shallow:.4f}')
      if not deepest <= deep:
        problems.append(f'{path}: 16 blocks {deepest:.4f} above 8 blocks '
                        f'{deep:.4f}')
    for stack in STACKS:
      a, b = by[stack.name, 'pipelined'], by[stack.name, 'plain']
      for what, x, y in (('training loss', a.last_loss, b.last_loss),
                         ('held-out', a.held_out, b.held_out)):
        if abs(x - y) > PARITY * y:
          problems.append(f'{stack.name}: pipelined {what} {x:.4f} vs plain '
                          f'{y:.4f}, more than {100 * PARITY:.0f} % apart')
  for model, s in speeds.items():
    ratio = s['layer by layer'] / s['plain']
    if ratio > SPEED_TARGET:
      problems.append(f'{model}: layer by layer {ratio:.2f}x the plain '
                      f'stack\'s step (target {SPEED_TARGET}x)')
  return problems


def _Say(run):
  print(f'  {run.stack} [{run.path}] {run.steps} steps: training '
        f'{run.last_loss:.4f} (last {LAST}), held-out {run.held_out:.4f} '
        f'(gzip -9 {run.gzip:.3f}), {1e3 * run.step_seconds:.0f} ms a step',
        flush=True)


PARTS = ('speed', 'context', 'steps', 'minutes', 'recipe')


def _Json(results):
  """results as JSON, a line per run (a part's runs: one line each)."""
  def Value(v):
    if isinstance(v, list):
      return '[\n  ' + ',\n  '.join(json.dumps(x) for x in v) + '\n ]'
    return json.dumps(v)
  return '{\n' + ',\n'.join(f' {json.dumps(k)}: {Value(v)}'
                             for k, v in results.items()) + '\n}\n'


def RunParts(parts, args, workdir):
  """{part: its figures (JSON-able)} of the parts asked for."""
  runs = lambda rs: [r.AsDict() for r in rs]
  do = dict(
      speed=Speeds,
      context=lambda: {str(k): v for k, v in ContextCosts().items()},
      steps=lambda: runs(SameSteps(args.steps, workdir)),
      minutes=lambda: runs(SameMinutes(args.minutes, workdir)),
      recipe=lambda: runs(Recipe(args.steps, workdir)))
  results = {}
  for part in PARTS:
    if part in parts:
      began = time.time()
      results[part] = do[part]()
      results[f'{part}_measured'] = dict(
          date=datetime.date.today().isoformat(),
          minutes=round((time.time() - began) / 60, 1),
          steps=args.steps, budget=args.minutes)
  return results


def main(argv=None):
  parser = argparse.ArgumentParser(prog='python -m benchmarks.text_depth',
                                   description=__doc__.split('\n\n')[0])
  parser.add_argument('--steps', type=int, default=400)
  parser.add_argument('--minutes', type=float, default=3.0)
  parser.add_argument('--parts', default=','.join(PARTS),
                      help='the parts to run (empty: only write the page '
                      'again from the JSON)')
  parser.add_argument('--out', default='docs')
  args = parser.parse_args(argv)
  parts = [part for part in args.parts.split(',') if part]
  unknown = set(parts) - set(PARTS)
  if unknown:
    parser.error(f'--parts: unknown {sorted(unknown)}; pick from '
                 f'{", ".join(PARTS)}.')
  if args.steps <= LAST:
    parser.error(f'--steps must exceed {LAST}, got {args.steps}.')
  quiet.UnlessVerbose([])
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, 'text-depth.json')
  results = {}
  if os.path.exists(path):
    with open(path) as f:
      results = json.load(f)
  results.update(RunParts(parts, args, tempfile.mkdtemp(prefix='text_depth_')))
  with open(path, 'w') as f:
    f.write(_Json(results))
  steps_runs = [Run.FromDict(r) for r in results.get('steps', [])]
  minutes_runs = [Run.FromDict(r) for r in results.get('minutes', [])]
  problems = Problems(steps_runs, results.get('speed', {}))
  page = text_depth_report.Page(
      machine=platform.machine(), tf_version=tf.__version__, last=LAST,
      results=results, steps_runs=steps_runs, minutes_runs=minutes_runs,
      recipe_runs=[Run.FromDict(r) for r in results.get('recipe', [])],
      problems=problems)
  with open(os.path.join(args.out, 'text-depth.md'), 'w') as f:
    f.write(page)
  if steps_runs:
    text_depth_report.Plot(os.path.join(args.out, 'text_depth.png'),
                           steps_runs, minutes_runs)
  print('\n'.join(['FAILED: ' + p for p in problems] or ['all checks met']))
  return 1 if problems else 0


if __name__ == '__main__':
  sys.exit(main())
