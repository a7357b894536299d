"""Lingvo's own trainer program, with gpipe's model params registered.

    python -m gpipe.lingvo_trainer --model=lm.CopyLMSmall --run_locally=cpu \\
        --mode=sync --logdir=/tmp/copy_lm
    python -m gpipe.lingvo_trainer --model=lm.CopyLMSmall --run_locally=cpu \\
        --mode=sync --logdir=/tmp/copy_lm --job=evaler_dev
    python -m gpipe.lingvo_trainer --model=lm.CopyLMSmall --run_locally=cpu \\
        --mode=sync --logdir=/tmp/copy_lm --job=decoder_dev

    python -m gpipe.lingvo_trainer --model_module=path/to/my_task.py \\
        --model=my_task.MyModel --run_locally=cpu --mode=sync --logdir=...

Every flag but three is Lingvo's (`lingvo.trainer`): jobs, cluster, TPU and
logdir flags work as they do there. What this adds: Lingvo made importable
on this system (gpipe's import hook), the models in `params/` registered,
so `--model=lm.<Name>` finds them, `--model_module` (repeatable): a module
of your own, by dotted name or as a path to its .py file, imported first,
so that its models are found from any directory (a file's models are
`<file name>.<Class>`), `--layer_by_layer` (with `--run_locally`, on by
default: pipelined layers run layer by layer, the fast path on one device,
unless their `layer_by_layer` Param says otherwise), and quiet logs: where
the events go, Lingvo's progress lines (steps, checkpoints, jobs done) and
errors, nothing else unless `--verbose`. The trainer stops at the model's
`train.max_steps`; the evaler and decoder jobs evaluate each new checkpoint
and stop after the one at `train.max_steps`. With `--run_locally`, the
trainer starts at once: Lingvo's runners otherwise sleep a fixed 30 s
before their first step, which is there for separate controller and trainer
jobs; in one local process Lingvo's retry on the global step covers the
start-up race. It also ends at once: the controller, which writes the last
checkpoint, otherwise notices that training finished at its next 10-second
tick.
"""

import logging
import re
import sys
import threading
import time


# absl's help flags print and exit 1; these print the trainer's flags and
# exit 0.
_HELP_FLAGS = ('-h', '-help', '--help', '--helpshort', '--helpfull', '-?')


def main(argv=None):
  argv = list(sys.argv if argv is None else argv)
  wants_help = [a for a in argv[1:] if a in _HELP_FLAGS]
  from gpipe import quiet  # pylint: disable=g-import-not-at-top
  is_quiet = quiet.UnlessVerbose(argv[1:])
  import params.lm  # pylint: disable=g-import-not-at-top,unused-import
  from lingvo import trainer  # pylint: disable=g-import-not-at-top
  from lingvo import compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo import model_imports  # pylint: disable=g-import-not-at-top
  from lingvo import model_registry  # pylint: disable=g-import-not-at-top

  flags = tf.flags.FLAGS
  if 'model_module' not in flags:
    tf.flags.DEFINE_multi_string(
        'model_module', [], 'A module of your own to import first, by '
        'dotted name or as a path to its .py file; repeatable.')
    tf.flags.DEFINE_bool(
        'verbose', False, 'Show every log line of TensorFlow, XLA and Lingvo '
        '(by default: the steps, checkpoints and where the events go).')
    tf.flags.DEFINE_bool(
        'layer_by_layer', True, 'With --run_locally (one CPU or GPU): run '
        'the pipelined layers whose layer_by_layer Param is unset layer by '
        'layer, the fast way to train on one device; --nolayer_by_layer '
        'runs the schedule a pod runs.')
  if wants_help:
    print(Help(flags, everything='--helpfull' in wants_help))
    return 0
  tf.flags.mark_flag_as_required('model')
  try:
    flags(argv, known_only=True)
  except tf.flags.Error as e:
    print(f'lingvo_trainer: error: {e} (--help lists the flags)',
          file=sys.stderr)
    return 2
  from gpipe.lingvo_support import registered_models  # pylint: disable=g-import-not-at-top
  try:
    registered_models.ImportModules(flags.model_module)
  except LookupError as e:
    print(f'lingvo_trainer: error: {e}', file=sys.stderr)
    return 2
  _SetUpAsLingvosTrainerDoes(flags)
  if is_quiet:
    _ShowProgressOnly(model_imports)
  try:
    model_imports.ImportParams(flags.model)
  except ValueError:  # Lingvo's 'Invalid model name': no module in it
    pass
  with quiet.LibraryPrints():  # the registry imports Lingvo's own tasks
    known = sorted(model_registry.GetAllRegisteredClasses())
  if flags.model not in known:
    print('lingvo_trainer: error: --model: ' +
          registered_models.UnknownModelMessage(flags.model, known),
          file=sys.stderr)
    return 2
  if flags.run_locally:
    _SkipFixedWaits()
  _ChooseOneDeviceRuns(flags)
  if _Trains(flags.job) and flags.logdir:
    _WriteScheduleImage(flags.model, flags.logdir)
  if flags.logdir:
    print(f'lingvo_trainer: {flags.model}, job {flags.job or "all"}: '
          f'checkpoints and TensorBoard events under {flags.logdir} '
          f'(tensorboard --logdir {flags.logdir}).', file=sys.stderr,
          flush=True)
  flags.unparse_flags()
  try:
    tf.app.run(trainer.main, argv=argv)
  except SystemExit as run:  # absl's run ends with sys.exit: its status
    return run.code
  return 0


# Lingvo's log lines shown without --verbose: its progress.
_PROGRESS = re.compile(r'(step: |Training finished|Save checkpoint done|'
                       r'Evaling|Decoding|\S+ summary on checkpoint@|'
                       r'Latest checkpoint was already|'
                       r'.*[Dd]one\.)')


class _ProgressOnly(logging.Filter):
  """Passes Lingvo's progress lines, and errors; nothing else. (Lingvo's
  retry of the global step while the model initializes logs its exception
  at INFO: an expected race, not shown. An evaler or decoder that finds its
  checkpoint done leaves an op of Lingvo's unused, which TensorFlow reports
  at ERROR with where it was made: not the user's to fix, not shown.)"""

  def filter(self, record):
    if record.levelno >= logging.ERROR:
      return 'Object was never used' not in record.getMessage()
    return (record.levelno == logging.INFO and
            _PROGRESS.match(record.getMessage()) is not None)


class _ProgressFormat(logging.Formatter):
  """A progress line as a user reads it: no log prefix, and a step's line
  cut to its number and the task's own metrics (Lingvo's bookkeeping, the
  gradient norms and the per-stage summaries are in TensorBoard).

      step    20  loss 1.3794497
  """

  def format(self, record):
    message = record.getMessage()
    if record.levelno >= logging.ERROR:
      return f'lingvo_trainer: error: {message}'
    step = _STEP_LINE.match(message)
    if not step:
      return message
    metrics = [m.split(':', 1) for m in (step.group(2) or '').split()]
    shown = [f'{name} {value}' for name, value in (m for m in metrics
                                                   if len(m) == 2)
             if '/' not in name and name not in _LINGVOS_OWN_METRICS]
    return '  '.join([f'step {int(step.group(1)):5d}'] + shown)


# Lingvo's step line: `step: N, steps/sec: x, examples/sec: y name:value ...`.
_STEP_LINE = re.compile(r'step:\s*(\d+)(?:,.*?examples/sec: \S+(.*))?$')
_LINGVOS_OWN_METRICS = ('num_samples_in_batch',)


def _ShowProgressOnly(model_imports):
  """Lingvo's progress lines only (quiet.UnlessVerbose silenced the rest
  of the libraries' logs), and its model registry's import prints
  swallowed."""
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  from gpipe import quiet  # pylint: disable=g-import-not-at-top
  for name in ('tensorflow', 'absl'):
    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    logger.addFilter(_ProgressOnly())
  absl_logging.get_absl_handler().setFormatter(_ProgressFormat())
  import_params = model_imports.ImportParams

  def ImportParamsQuietly(*args, **kwargs):
    with quiet.LibraryPrints():
      return import_params(*args, **kwargs)

  model_imports.ImportParams = ImportParamsQuietly


def Help(flags, everything=False):
  """Usage, then the flags of Lingvo's modules with their defaults (with
  `everything`, TensorFlow's and absl's flags too)."""
  lines = ['usage: python -m gpipe.lingvo_trainer --model=lm.<Name> '
           '[--model_module=my_task.py] [flags]', '', __doc__.strip(), '']
  if everything:
    lines.append(flags.get_help())
  else:
    modules = sorted((m != 'lingvo.trainer', m)
                     for m in flags.flags_by_module_dict()
                     if m.partition('.')[0] == 'lingvo')
    lines.append("Lingvo's trainer flags (--helpfull: TensorFlow's and "
                 "absl's too):")
    lines += ['', '\n\n'.join(flags.module_help(m).strip()
                                for _, m in modules)]
  return '\n'.join(lines)


def _ChooseOneDeviceRuns(flags):
  """On one local device, pipelined layers run layer by layer unless
  --nolayer_by_layer (or their own Param) says otherwise: a user training
  on a CPU gets the fast path without asking, while a test, which builds
  its layers itself, checks the schedule a pod runs."""
  if flags.run_locally:
    from gpipe.pipeline import layer_by_layer  # pylint: disable=g-import-not-at-top
    layer_by_layer.SetProgramDefault(flags.layer_by_layer)


def _SetUpAsLingvosTrainerDoes(flags):
  """What Lingvo's trainer program does with its flags before its main,
  in its order (TF1 behaviour, eager mode, eager functions, tf.data debug
  mode)."""
  from lingvo import compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
  if flags.disable_tf2:
    tf.disable_v2_behavior()
  py_utils.SetEagerMode(flags.use_eager)
  tf.config.run_functions_eagerly(flags.run_functions_eagerly)
  if flags.enable_tf_data_debug_mode:
    tf.data.experimental.enable_debug_mode()


class _LocalRunnersClock:
  """Stands in for the `time` module in lingvo.base_runner and
  lingvo.runners when one process runs the jobs side by side.

  A sleep in the thread of a runner waiting for the model to be initialized
  is skipped. Every other sleep (the controller's 10-second cadence, an
  evaler polling for checkpoints) ends early when some runner's loop ends,
  so that the controller sees at once that training finished and writes
  the last checkpoint, instead of at its next tick::

      trainer     |--- steps ---| done
      controller  |tick| sleep 10 s ....... |tick: finished, save|  (Lingvo)
      controller  |tick| sleep .. |woken: finished, save|           (here)
  """

  def __init__(self):
    self.waiting = threading.local()
    self._loop_ended = threading.Condition()
    self._loops_ended = 0

  def __getattr__(self, name):
    return getattr(time, name)

  def LoopEnded(self):
    """Wakes every sleeping runner."""
    with self._loop_ended:
      self._loops_ended += 1
      self._loop_ended.notify_all()

  def sleep(self, seconds):
    if getattr(self.waiting, 'active', False):
      return
    deadline = time.monotonic() + seconds
    with self._loop_ended:
      seen = self._loops_ended
      while self._loops_ended == seen:
        left = deadline - time.monotonic()
        if left <= 0:
          return
        self._loop_ended.wait(left)


def _SkipFixedWaits():
  """Lingvo's runners in one local process without their fixed sleeps
  (see the module docstring and _LocalRunnersClock): the retry loop on
  the global step and the controller's checks are unchanged."""
  from lingvo import base_runner  # pylint: disable=g-import-not-at-top
  from lingvo import runners  # pylint: disable=g-import-not-at-top
  clock = _LocalRunnersClock()
  base_runner.time = runners.time = clock
  runner = base_runner.BaseRunner
  wait_until_init, run_loop = runner._WaitUntilInit, runner._RunLoop  # pylint: disable=protected-access

  def WaitUntilInit(self, *args, **kwargs):
    clock.waiting.active = True
    try:
      return wait_until_init(self, *args, **kwargs)
    finally:
      clock.waiting.active = False

  def RunLoop(self, *args, **kwargs):
    try:
      return run_loop(self, *args, **kwargs)
    finally:
      clock.LoopEnded()

  runner._WaitUntilInit = WaitUntilInit  # pylint: disable=protected-access
  runner._RunLoop = RunLoop  # pylint: disable=protected-access


def _Trains(job):
  """Whether the job list runs training (Lingvo's default runs all)."""
  return not job or any(j.startswith(('controller', 'trainer', 'executor'))
                        for j in job.split(','))


def _WriteScheduleImage(model, logdir):
  """The pipeline schedule of a pipelined model, as an image in
  <logdir>/train, at the step training starts from.

  Lingvo's controller writes the graph's image summaries on its own
  10-second cadence, which a short run never reaches; this is written once,
  before training, from the params alone. Models whose task holds no
  pipelined `stack` (a multi-task model, say) get none.
  """
  import os  # pylint: disable=g-import-not-at-top
  from gpipe.apps import trainer as gpipe_trainer  # pylint: disable=g-import-not-at-top
  from gpipe import layers  # pylint: disable=g-import-not-at-top
  from lingvo import model_registry  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cfg = model_registry.GetParams(model, 'Train')
  task = cfg.Get('task') if 'task' in cfg else None  # None: multi-task
  stack = task.Get('stack') if task is not None and 'stack' in task else None
  if stack is None or not issubclass(stack.cls, layers.PipelinedLayer):
    return
  train_dir = os.path.join(logdir, 'train')
  with tf.Graph().as_default():  # the writer needs one with --use_eager too
    writer = tf.compat.v1.summary.FileWriter(train_dir)
    writer.add_summary(gpipe_trainer.ScheduleImage(cfg),
                       gpipe_trainer.CheckpointStep(train_dir))
    writer.close()


if __name__ == '__main__':
  from gpipe.apps import prompt_exit  # pylint: disable=g-import-not-at-top
  prompt_exit.Exit(main())
