"""Lingvo's own trainer, evaler and decoder jobs on the project's models.

Run as a user runs them: `python -m gpipe.lingvo_trainer` in a fresh
process per job, all on one logdir (training a user's own module, given by
its path, from another directory). What each job wrote is read back from
its TensorBoard events and checkpoints, not from its logs.
"""

import collections
import logging
import pathlib
import re
import subprocess
import sys
import threading
import time
import types

import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe.apps import trainer
from gpipe.lingvo_support import flags_and_seeds
from gpipe import lingvo_trainer
from gpipe.pipeline import layer_by_layer
from lingvo import model_registry
from lingvo.core import base_model
from lingvo.core import base_model_params
import params.lm  # pylint: disable=unused-import

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_MODEL = 'lm.CopyLMSmall'


def _Job(logdir, *flags, model=_MODEL, cwd=_ROOT):
  return subprocess.run(
      [sys.executable, '-m', 'gpipe.lingvo_trainer', f'--model={model}',
       '--run_locally=cpu', '--mode=sync', f'--logdir={logdir}', *flags],
      cwd=cwd, capture_output=True, text=True, timeout=600, check=False)


# A user's own module, in a directory of its own: the same model as _MODEL,
# registered under the module's name.
_USER_MODULE = """
from lingvo import model_registry
from params import lm


@model_registry.RegisterSingleTaskModel
class MyCopyLM(lm.CopyLMSmall):
  pass
"""


def _Events(directory):
  """{tag: {step: value}} (images: the encoded bytes), per events file."""
  files = []
  for path in sorted(pathlib.Path(directory).glob('events.out.tfevents.*')):
    tags = collections.defaultdict(dict)
    for event in tf.compat.v1.train.summary_iterator(str(path)):
      for value in event.summary.value:
        if value.HasField('simple_value'):
          tags[value.tag][event.step] = value.simple_value
        elif value.HasField('image'):
          tags[value.tag][event.step] = value.image.encoded_image_string
    files.append(tags)
  return files


def _Merged(files):
  merged = collections.defaultdict(dict)
  for tags in files:
    for tag, values in tags.items():
      merged[tag].update(values)
  return merged


def _Tagged(tags, prefix):
  return sorted(t for t in tags if t.startswith(prefix))


@pytest.mark.runs_long
def test_trainer_evaler_and_decoder_jobs(tmp_path):
  logdir = tmp_path / 'copy_lm'
  steps = 120
  # Every job of a run sees the same params: the evaler and decoder stop
  # after the checkpoint at train.max_steps.
  max_steps = f'--model_params_override=train.max_steps: {steps}'
  # Trained as a user's own model: its module given as a path, the trainer
  # run from a directory that is neither the project's nor the module's.
  module = tmp_path / 'models' / 'my_lm.py'
  module.parent.mkdir()
  module.write_text(_USER_MODULE)
  elsewhere = tmp_path / 'elsewhere'
  elsewhere.mkdir()
  run = _Job(logdir, max_steps, f'--model_module={module}',
             model='my_lm.MyCopyLM', cwd=elsewhere)
  assert run.returncode == 0, run.stderr[-4000:]
  # Its own lines only: where the events go, each step, the checkpoints;
  # no library logs, no traceback of Lingvo's expected start-up race.
  printed = run.stderr.splitlines()
  assert printed[0] == (f'lingvo_trainer: my_lm.MyCopyLM, job all: '
                        f'checkpoints and TensorBoard events under {logdir} '
                        f'(tensorboard --logdir {logdir}).'), printed[:5]
  assert len(printed) <= steps + 12, '\n'.join(printed[:40])
  assert 'Traceback' not in run.stderr and not run.stdout
  # A step's line: its number and the task's metrics, no log prefix.
  last = [l for l in printed if l.startswith(f'step {steps:5d}  ')]
  assert len(last) == 1, printed[-12:]
  assert re.fullmatch(r'step +\d+  accuracy \S+  loss \S+', last[0]), last
  assert any(l.endswith(f'Save checkpoint done: {logdir}/train/ckpt-'
                        f'{steps:08d}') for l in printed), printed[-12:]
  assert tf.train.latest_checkpoint(str(logdir / 'train')).endswith(
      f'ckpt-{steps:08d}')

  train = _Merged(_Events(logdir / 'train'))
  assert steps in train['loss'] and steps in train['accuracy']
  assert steps in train['global_step/sec']
  # The pipelined stack's per-stage summaries, one per stage (S = 4).
  per_stage = [_Tagged(train, f'activation_rms/stage_{i}/') for i in range(4)]
  assert all(len(tags) == 1 for tags in per_stage), per_stage
  assert not _Tagged(train, 'activation_rms/stage_4/')
  png = train['pipeline_schedule'][0]
  assert png[:8] == b'\x89PNG\r\n\x1a\n'

  # The evaler and decoder jobs, in one process (Lingvo runs a
  # comma-separated job list side by side; alone, each works the same), on
  # the registered model the user's subclasses unchanged.
  run = _Job(logdir, max_steps, '--job=evaler_dev,decoder_dev')
  assert run.returncode == 0, run.stderr[-4000:]
  dev = _Merged(_Events(logdir / 'eval_dev'))
  assert steps in dev['loss']
  assert 0.0 <= dev['accuracy'][steps] <= 1.0
  assert dev['total_samples'][steps] == 64  # both held-out batches
  assert len(_Tagged(dev, 'activation_rms/stage_')) == 4

  decoder = _Merged(_Events(logdir / 'decoder_dev'))
  exact = decoder['exact_copy_accuracy'][steps]
  assert decoder['total_samples'][steps] == 64
  # The job's metric is the exact-copy rate of greedy decoding through the
  # pipeline, which itself equals full-sequence greedy decoding.
  flags_and_seeds.EnsureFlagsParsed()
  held_out = trainer.DecodeHeldOut(model_registry.GetParams(_MODEL, 'Dev'),
                                   str(logdir / 'train'))
  assert held_out.Agrees(), held_out.Describe()
  assert held_out.num_sequences == 64
  assert abs(exact - held_out.exact_copies) < 1e-6, (exact, held_out)
  assert abs(decoder['token_accuracy'][steps] -
             held_out.token_accuracy) < 1e-6
  assert exact > 0.5, held_out.Describe()  # it learned to copy

  # (Resuming training is Lingvo's runner restoring that checkpoint, as the
  # evaler and decoder jobs just did; gpipe.apps.trainer's own resume is tested
  # in lm_params_test.)


def _Slept(clock, seconds):
  start = time.monotonic()
  clock.sleep(seconds)
  return time.monotonic() - start


def test_local_runs_skip_only_the_waiting_runners_sleep():
  """The clock lingvo.base_runner gets with --run_locally: a runner waiting
  for the model to be initialized does not sleep; every other sleep, in
  other threads (the evaler's checkpoint polling), still happens."""
  clock = lingvo_trainer._LocalRunnersClock()  # pylint: disable=protected-access
  assert _Slept(clock, 0.05) >= 0.05
  clock.waiting.active = True
  assert _Slept(clock, 30) < 1
  other = []
  thread = threading.Thread(target=lambda: other.append(_Slept(clock, 0.05)))
  thread.start()
  thread.join()
  assert other[0] >= 0.05
  clock.waiting.active = False
  assert _Slept(clock, 0.05) >= 0.05
  assert clock.time is lingvo_trainer.time.time  # the rest is `time`'s


def test_local_runs_wake_a_sleeping_runner_when_a_loop_ends():
  """The controller's 10-second sleep ends when the trainer's loop does
  (then it writes the last checkpoint); a loop that ended before a sleep
  began does not cut that sleep short."""
  clock = lingvo_trainer._LocalRunnersClock()  # pylint: disable=protected-access
  asleep, woke = threading.Event(), []

  def Controller():
    asleep.set()
    woke.append(_Slept(clock, 30))

  thread = threading.Thread(target=Controller)
  thread.start()
  asleep.wait()
  time.sleep(0.2)
  assert not woke  # still asleep
  clock.LoopEnded()
  thread.join(timeout=10)
  assert woke and 0.2 <= woke[0] < 10, woke
  assert _Slept(clock, 0.05) >= 0.05


def test_a_model_module_by_path_registers_its_models(tmp_path):
  from gpipe.lingvo_support import registered_models  # pylint: disable=g-import-not-at-top
  module = tmp_path / 'my_path_lm.py'
  module.write_text(_USER_MODULE.replace('MyCopyLM', 'MyPathCopyLM'))
  registered_models.ImportModules([str(module)])
  cfg = registered_models.GetParams('my_path_lm.MyPathCopyLM')
  assert cfg.task.stack.num_stages == 4  # lm.CopyLMSmall's
  with pytest.raises(LookupError, match=(
      r'--model_module .*/nowhere\.py cannot be imported \(no such file\)')):
    registered_models.ImportModules([str(tmp_path / 'nowhere.py')])


def test_the_trainer_refuses_a_missing_model_module_in_one_line(tmp_path):
  run = _Job(tmp_path / 'log', f'--model_module={tmp_path}/nowhere.py',
             model='nowhere.Model')
  assert run.returncode == 2
  errors = [l for l in run.stderr.splitlines() if 'error:' in l]
  assert errors == [f'lingvo_trainer: error: --model_module '
                    f'{tmp_path}/nowhere.py cannot be imported (no such '
                    'file).'], run.stderr[-2000:]


def test_lingvos_start_up_flags_take_effect():
  """As in Lingvo's trainer program: --use_eager=false leaves graph mode,
  --run_functions_eagerly=true runs tf.functions eagerly. In a process of
  its own: the switches are process-wide."""
  program = (
      'import types\n'
      'import tensorflow as tf\n'
      'from gpipe import lingvo_trainer\n'
      'lingvo_trainer._SetUpAsLingvosTrainerDoes(types.SimpleNamespace(\n'
      '    disable_tf2=False, use_eager=False, run_functions_eagerly=True,\n'
      '    enable_tf_data_debug_mode=False))\n'
      'print(tf.executing_eagerly(), tf.config.functions_run_eagerly())\n')
  done = subprocess.run([sys.executable, '-c', program], cwd=_ROOT,
                        capture_output=True, text=True, timeout=300,
                        check=False)
  assert done.returncode == 0, done.stderr
  assert done.stdout.split() == ['False', 'True']


@model_registry.RegisterMultiTaskModel
class _TwoTasks(base_model_params.MultiTaskModelParams):
  """A multi-task model: its params have no single `task`."""

  def Train(self):
    return base_model_params.MultiTaskModelParams.Train(self)

  def Model(self):
    return base_model.MultiTaskModel.Params()


def test_schedule_image_only_for_a_task_with_a_pipelined_stack(tmp_path):
  """Written in eager mode too (the trainer with --use_eager)."""
  assert tf.executing_eagerly()
  flags_and_seeds.EnsureFlagsParsed()  # the model registry reads flags
  name = next(k for k in model_registry.GetAllRegisteredClasses()
              if k.endswith('_TwoTasks'))
  lingvo_trainer._WriteScheduleImage(name, str(tmp_path / 'multi'))  # pylint: disable=protected-access
  assert not (tmp_path / 'multi').exists()
  lingvo_trainer._WriteScheduleImage(_MODEL, str(tmp_path / 'lm'))  # pylint: disable=protected-access
  images = _Merged(_Events(tmp_path / 'lm' / 'train'))['pipeline_schedule']
  assert images[0][:8] == b'\x89PNG\r\n\x1a\n'


def _Record(message, level=logging.INFO):
  return logging.LogRecord('tensorflow', level, 'runners.py', 1, message,
                           None, None)


def test_progress_lines_read_as_a_user_reads_them():
  shown = lingvo_trainer._ProgressOnly()  # pylint: disable=protected-access
  form = lingvo_trainer._ProgressFormat()  # pylint: disable=protected-access
  line = ('step:    12, steps/sec: 4.20, examples/sec: 134.4 '
          'grad_norm/all/loss:0.5 loss:1.25 accuracy:0.75 '
          'num_samples_in_batch:32 activation_rms/stage_0/stack:1.5')
  assert shown.filter(_Record(line))
  assert form.format(_Record(line)) == 'step    12  loss 1.25  accuracy 0.75'
  assert form.format(_Record('step:     0')) == 'step     0'
  evaled = 'eval_dev summary on checkpoint@20 loss = 0.6'
  assert shown.filter(_Record(evaled))
  assert form.format(_Record(evaled)) == evaled
  # Lingvo's other chatter is dropped; errors are kept and say so, except
  # the unused-op report an evaler leaves when its checkpoint is done.
  assert not shown.filter(_Record('cluster.job : \'evaler\''))
  assert shown.filter(_Record('disk full', logging.ERROR))
  assert form.format(_Record('disk full', logging.ERROR)) == (
      'lingvo_trainer: error: disk full')
  assert not shown.filter(_Record(
      '====\nObject was never used (type <class ...>)', logging.ERROR))


def test_the_trainer_answers_an_unknown_model_in_one_line(tmp_path):
  run = _Job(tmp_path / 'log', model='CopyLMSmall')
  assert run.returncode == 2, run.stderr[-2000:]
  lines = run.stderr.splitlines()
  assert len(lines) == 1, run.stderr[-2000:]
  said = ("lingvo_trainer: error: --model: Unknown model 'CopyLMSmall'. Did "
          'you mean lm.CopyLMSmall? Registered: ')
  assert lines[0].startswith(said), lines
  registered = lines[0][len(said):].rstrip('.').split(', ')
  assert 'lm.CopyLMSmall' in registered and 'lm.CopyLMPod8x2' in registered


@pytest.mark.parametrize('run_locally,flag,expected', [
    ('cpu', True, True), ('cpu', False, False), ('', True, False)])
def test_local_runs_train_layer_by_layer_unless_told_not_to(
    run_locally, flag, expected):
  """A layer whose layer_by_layer Param is unset runs layer by layer when
  the trainer runs locally with --layer_by_layer (its default); one whose
  Param says False runs the pipeline schedule whatever the flag."""
  flags = types.SimpleNamespace(run_locally=run_locally, layer_by_layer=flag)
  try:
    lingvo_trainer._ChooseOneDeviceRuns(flags)  # pylint: disable=protected-access
    with tf.Graph().as_default():
      unset = params.lm.CopyLMSmall().Task().stack.Set(name='unset').Instantiate()
      off = params.lm.CopyLMSmall().Task().stack.Set(
          name='off', layer_by_layer=False).Instantiate()
  finally:
    layer_by_layer.SetProgramDefault(False)
  assert unset.layer_by_layer.enabled == expected
  assert not off.layer_by_layer.enabled
