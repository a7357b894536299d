"""TensorBoard, as the README has users run it, shows what training wrote.

A tiny training run (gpipe.apps.trainer.Train, the demo's driver, on a small
copy LM whose stack has 2 stages) writes its events; the venv's `tensorboard
--logdir` serves them as a real server and is asked over HTTP what its web
page asks: the runs, the scalar tags and values, the image tags and the
image itself. The server runs in a process group of its own, which is ended
whether the test passes or not.
"""

import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

import gpipe  # pylint: disable=unused-import
from gpipe.apps import trainer
from gpipe import schedule as schedule_lib
from gpipe.schedule import plot as schedule_plot
from lingvo.core import base_model
from lingvo.core import py_utils
from params import lm

_NUM_STAGES = 2
_PNG = b'\x89PNG\r\n\x1a\n'


def _TinyCopyLM():
  task = lm.CopyLMParams(
      vocab_size=8, model_dim=16, num_heads=2, hidden_dim=32,
      blocks_per_stage=1, num_stages=_NUM_STAGES, circular_repeat=1,
      num_microbatches=2, dropout_prob=0.0, shard_stages_1d=False,
      learning_rate=1e-3, max_steps=10, max_seq_len=6)
  cfg = base_model.SingleTaskModel.Params(task)
  cfg.input = lm.CopyTaskInput.Params().Set(vocab_size=8, copy_length=3,
                                            batch_size=4)
  return cfg


@contextlib.contextmanager
def _TensorBoard(logdir, log_path):
  """A running `tensorboard --logdir logdir`; yields a function that waits
  for the server to listen and returns its base URL."""
  binary = pathlib.Path(sys.executable).parent / 'tensorboard'
  assert binary.exists(), f'{binary} is not installed'
  with open(log_path, 'wb') as log:
    # --port 0: a free port the server picks and prints in its URL.
    server = subprocess.Popen(
        [str(binary), '--logdir', str(logdir), '--host', '127.0.0.1',
         '--port', '0', '--reload_interval', '1'],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
  try:
    yield lambda: _Url(server, log_path)
  finally:
    _Stop(server)


def _Url(server, log_path, timeout=120):
  """The URL the server prints once it listens."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    text = pathlib.Path(log_path).read_text(errors='replace')
    found = re.search(r'(http://127\.0\.0\.1:\d+)/', text)
    if found:
      return found.group(1)
    assert server.poll() is None, f'tensorboard exited:\n{text}'
    time.sleep(0.2)
  raise AssertionError(f'tensorboard printed no URL in {timeout} s:\n{text}')


def _Stop(server):
  """Ends the server's whole process group (it may have started helpers) at
  once: SIGKILL, since a server that only read a temporary directory has
  nothing to save (SIGTERM let it collect TensorFlow's objects: 1 s)."""
  with contextlib.suppress(ProcessLookupError):
    os.killpg(server.pid, signal.SIGKILL)
  server.wait(timeout=10)


def _Get(url, path, **query):
  if query:
    path += '?' + urllib.parse.urlencode(query)
  with urllib.request.urlopen(url + path, timeout=30) as response:
    return response.read()


def _Json(url, path, **query):
  return json.loads(_Get(url, path, **query))


def _WhenLoaded(url, timeout=120):
  """Polls the scalar tags until the server has read the whole run."""
  deadline = time.time() + timeout
  tags = {}
  while time.time() < deadline:
    with contextlib.suppress(urllib.error.URLError, ConnectionError):
      tags = _Json(url, '/data/plugin/scalars/tags')
      images = _Json(url, '/data/plugin/images/tags')
      if any('loss' in t for t in tags.values()) and any(
          'pipeline_schedule' in t for t in images.values()):
        return tags, images
    time.sleep(0.5)
  raise AssertionError(f'tensorboard showed no loss and schedule in '
                       f'{timeout} s; scalar tags: {tags}')


@pytest.mark.runs_long
def test_tensorboard_serves_the_training_runs_events(tmp_path):
  logdir = tmp_path / 'run'
  logdir.mkdir()
  # The server starts (and imports TensorFlow) while the model trains.
  initial = str(tmp_path / 'initial' / 'ckpt')

  def SaveTheInitialWeights(sess, train_graph):
    train_graph.saver.save(sess, initial)

  with _TensorBoard(logdir, tmp_path / 'tensorboard.log') as listening:
    history = trainer.Train(_TinyCopyLM(), steps=1, logdir=str(logdir),
                            on_start=SaveTheInitialWeights)
    # The reference, computed while the server reads the events.
    per_microbatch = [_PlainStackLayerRms(initial, m) for m in range(2)]
    url = listening()
    scalars, images = _WhenLoaded(url)
    assert _Json(url, '/data/runs') == ['.']
    tags = scalars['.']
    assert {'loss', 'accuracy', 'step_time_seconds'} <= set(tags)
    for stage in range(_NUM_STAGES):
      assert any(t.startswith(f'activation_rms/stage_{stage}/')
                 for t in tags), (stage, sorted(tags))
    assert not any(t.startswith(f'activation_rms/stage_{_NUM_STAGES}/')
                   for t in tags)
    # The loss the run computed, labelled with the step after the update.
    [(_, step, loss)] = _Json(url, '/data/plugin/scalars/scalars', run='.',
                              tag='loss')
    assert step == 1
    assert abs(loss - history[0].loss) <= 1e-6 * abs(history[0].loss)
    assert list(images) == ['.'] and 'pipeline_schedule' in images['.']
    [image] = _Json(url, '/data/plugin/images/images', run='.',
                    tag='pipeline_schedule')
    png = _Get(url, '/data/plugin/images/individualImage?' + image['query'])
    assert png.startswith(_PNG)
    # The picture of this stack's schedule (2 stages, 2 microbatches); the
    # picture's own content is checked in schedule_cli_test.
    assert png == schedule_plot.PngBytes(schedule_lib.Schedule(_NUM_STAGES, 2))
    # Each stage's activation RMS (averaged over the microbatches, each
    # microbatch's RMS weighted alike) as the plain stack (unrolled, one
    # block a stage: stage i is layer i) computes it on each microbatch of
    # the same batch, from the same weights: the values the body itself
    # reports, in layer order, before gpipe names or combines anything.
    for stage in range(_NUM_STAGES):
      [tag] = [t for t in tags
               if t.startswith(f'activation_rms/stage_{stage}/')]
      want = np.mean([layers[stage] for layers in per_microbatch])
      [(_, step, got)] = _Json(url, '/data/plugin/scalars/scalars', run='.',
                               tag=tag)
      assert step == 1 and abs(got - want) <= 1e-5 * abs(want), (
          tag, got, want, per_microbatch)


class _MicrobatchOfCopyTask(lm.CopyTaskInput):
  """Rows m, m + M, ... of the copy task's batch: microbatch m of M."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('microbatch', 0, 'm.')
    p.Define('num_microbatches', 2, 'M.')
    return p

  def _InputBatch(self):
    p = self.params
    return tf.nest.map_structure(
        lambda t: t[p.microbatch::p.num_microbatches],
        super()._InputBatch())


def _PlainStackLayerRms(checkpoint, microbatch):
  """[activation RMS of each layer], as the stage body reports it on one
  microbatch of global step 0's batch, the stack unrolled, from the
  weights in `checkpoint` (its summary calls recorded as they are made)."""
  cfg = _TinyCopyLM()
  cfg.task.stack.unroll = 'always'
  cfg.input = _MicrobatchOfCopyTask.Params().Set(
      microbatch=microbatch, **{k: v for k, v in cfg.input.IterParams()
                                if k not in ('cls', 'name')})
  reported = []
  add = py_utils.AddTpuSummaryTensor

  def Record(name, value, *args, **kwargs):
    if name == 'activation_rms':
      reported.append(value)
    return add(name, value, *args, **kwargs)

  with mock.patch.object(py_utils, 'AddTpuSummaryTensor', Record):
    tg = trainer.BuildTrainGraph(cfg)
  assert len(reported) == _NUM_STAGES, reported
  with tg.graph.as_default(), tf.compat.v1.Session(graph=tg.graph) as sess:
    tg.saver.restore(sess, checkpoint)
    assert sess.run(tg.global_step) == 0
    return sess.run(reported)
