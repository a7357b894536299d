"""gpipe.xla.worker_pool: one spmd_worker per device count, kept between
modules; a failed, timed-out or outdated worker is replaced, its error
said as a one-shot worker's was."""

import os
import subprocess

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe.xla import partitioning
from gpipe.xla import worker_pool

pytestmark = pytest.mark.skipif(not partitioning.IsAvailable(),
                                reason='needs jax')


def _Double(x):
  return [x * 2.0]


def _Pid(num_devices):
  return worker_pool._WORKERS[num_devices]._proc.pid  # pylint: disable=protected-access


def _RunsRight(num_devices):
  """A partitioned run on a fresh worker or the kept one: its result."""
  x = np.arange(8, dtype=np.float32).reshape(num_devices, -1)
  run = partitioning.RunPartitioned(_Double, [x], num_devices)
  np.testing.assert_array_equal(run.outputs[0], 2 * x)
  return _Pid(num_devices)


def test_a_worker_serves_each_module_for_its_device_count(tmp_path,
                                                          monkeypatch):
  first = _RunsRight(2)
  assert _RunsRight(2) == first  # kept
  spec = [tf.TensorSpec([4, 4])]
  compiled = partitioning.CompileFromShapes(
      partitioning.LowerFromShapes(lambda x: [x @ x], spec), 2)
  assert compiled.num_devices == 2 and compiled.cost['flops'] > 0
  assert _Pid(2) == first
  assert _RunsRight(4) != first  # another device count, another worker

  # A variable its results cannot depend on changed: the same worker.
  monkeypatch.setenv('GPIPE_WORKER_POOL_TEST', '1')
  assert _RunsRight(2) == first
  # XLA's flags changed (to a default's value): a worker that has them.
  monkeypatch.setenv('XLA_FLAGS', os.environ.get('XLA_FLAGS', '') +
                     ' --xla_cpu_enable_fast_math=false')
  assert _RunsRight(2) != first

  # A module it cannot read: the worker's exit code and its stderr (the
  # traceback), as from a one-shot worker; the next job gets a new one.
  before = _Pid(2)
  (tmp_path / 'config.json').write_text('{"num_devices": 2}')
  (tmp_path / 'module.pb').write_bytes(b'not an HloModuleProto')
  with pytest.raises(RuntimeError,
                     match=r'Partitioning for 2 devices failed \(exit code 1'
                     r'\):\n(.|\n)*Traceback'):
    worker_pool.RunJob(str(tmp_path), 2, timeout=300)
  assert 2 not in worker_pool._WORKERS  # pylint: disable=protected-access
  assert _RunsRight(2) != before

  # Too slow: ended, said as subprocess.run says it; the next job works.
  (tmp_path / 'config.json').write_text('{"num_devices": 4}')
  with pytest.raises(subprocess.TimeoutExpired):
    worker_pool.RunJob(str(tmp_path), 4, timeout=0)
  assert 4 not in worker_pool._WORKERS  # pylint: disable=protected-access
  _RunsRight(4)


def test_a_worker_asked_for_another_device_count_fails_saying_so(tmp_path):
  _RunsRight(2)
  (tmp_path / 'config.json').write_text('{"num_devices": 4}')
  worker = worker_pool._WORKERS[2]  # pylint: disable=protected-access
  with pytest.raises(RuntimeError, match='asks for 4 devices; this worker '
                     'has 2'):
    worker.DoJob(str(tmp_path), timeout=300)
  worker_pool.CloseAll()
  assert not worker_pool._WORKERS  # pylint: disable=protected-access


def test_a_large_module_runs_alone_and_its_worker_ends(monkeypatch):
  """A module over LARGE_MODULE_BYTES: the other device counts' workers
  end before it runs, its own after (their memory back to the host); a
  small one keeps its worker."""
  _RunsRight(4)
  kept = _RunsRight(2)
  assert _RunsRight(2) == kept
  workers = dict(worker_pool._WORKERS)  # pylint: disable=protected-access
  monkeypatch.setattr(worker_pool, 'LARGE_MODULE_BYTES', 0)
  x = np.arange(8, dtype=np.float32).reshape(2, -1)
  run = partitioning.RunPartitioned(_Double, [x], 2)
  np.testing.assert_array_equal(run.outputs[0], 2 * x)
  assert not worker_pool._WORKERS  # pylint: disable=protected-access
  for worker in workers.values():
    assert worker._proc.poll() is not None  # pylint: disable=protected-access
