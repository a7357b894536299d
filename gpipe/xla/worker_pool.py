"""One long-lived `gpipe.xla.spmd_worker` process per number of devices.

Starting a worker (Python, jax, XLA's CPU client for N virtual devices)
takes longer than compiling a small module; a planner comparing
candidates, or a process checking several layers, pays it once per device
count and environment rather than once per module (docs/testing.md says
what it saves):

    RunJob(dir, N) --"dir\\n"--> worker(N) [--serve N] --"done\\n"--> results in dir

A worker that fails (a Python error or an XLA abort: it exits, its exit
code and stderr saying why) or outlives its timeout is ended; the next job
for N starts a new one. So is one that has compiled a large module (a pod
LM's step: a worker keeps the memory such a compile took, gigabytes a
host needs for the next one); other workers end before a large job
starts. Workers read their jobs from a pipe: when this process ends, so
do they.
"""

import atexit
import os
import select
import subprocess
import sys
import tempfile
import threading

from gpipe.xla import spmd_worker

_STDERR_TAIL = 4000
# The environment variables a worker's results can depend on (XLA's and
# jax's flags, TensorFlow's logging, Python's paths); a change to any of
# them starts a new worker. Others (e.g. PYTEST_CURRENT_TEST, set anew for
# every test) do not.
_WORKER_ENV_PREFIXES = ('XLA_', 'JAX_', 'TF_', 'PYTHON')
# A module this large (its serialized HLO, spmd_worker's module.pb) runs
# in a worker of its own and ends it: what the tests compile is a few MB.
LARGE_MODULE_BYTES = 64 * 2**20


class _Worker:
  """An spmd_worker serving jobs for `num_devices` devices in `env`."""

  def __init__(self, num_devices, env):
    self.num_devices = num_devices
    self.env_key = _EnvKey(env)
    # Appended to by the worker; emptied before each job, so that a
    # failure reports that job's stderr alone.
    self._stderr = tempfile.TemporaryFile(mode='a+b')
    self._proc = subprocess.Popen(
        [sys.executable, '-m', spmd_worker.__name__, '--serve',
         str(num_devices)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
        env=env, text=True)

  def DoJob(self, workdir, timeout):
    """Does one job. Raises subprocess.TimeoutExpired if it takes longer
    than `timeout` seconds, RuntimeError (the exit code and stderr) if the
    worker fails; either way the worker is done for (Close it)."""
    self._stderr.truncate(0)
    try:
      self._proc.stdin.write(f'{workdir}\n')
      self._proc.stdin.flush()
    except BrokenPipeError:
      pass  # it has ended: its exit code says why, below
    ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
    if not ready:
      raise subprocess.TimeoutExpired(self._proc.args, timeout)
    if self._proc.stdout.readline() != 'done\n':
      code = self._proc.wait()
      self._stderr.seek(0)
      stderr = self._stderr.read().decode(errors='replace')
      raise RuntimeError(
          f'Partitioning for {self.num_devices} devices failed (exit code '
          f'{code}):\n{stderr[-_STDERR_TAIL:]}')

  def Close(self):
    if self._proc.poll() is None:
      self._proc.kill()
    self._proc.wait()
    for stream in (self._proc.stdin, self._proc.stdout, self._stderr):
      try:
        stream.close()
      except BrokenPipeError:  # a job's path unsent to an ended worker
        pass


_WORKERS = {}
_LOCK = threading.Lock()


def RunJob(workdir, num_devices, timeout):
  """Has the worker for `num_devices` (in this process's environment) do
  the job written in `workdir` (spmd_worker's DIR)."""
  env = dict(os.environ)
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  large = _IsLarge(workdir)
  with _LOCK:
    if large:
      _CloseWorkers(lambda n: n != num_devices)
    worker = _WORKERS.get(num_devices)
    if worker is not None and worker.env_key != _EnvKey(env):
      worker.Close()
      worker = None
    if worker is None:
      worker = _WORKERS[num_devices] = _Worker(num_devices, env)
    try:
      worker.DoJob(workdir, timeout)
    except BaseException:
      del _WORKERS[num_devices]
      worker.Close()
      raise
    if large:
      _CloseWorkers(lambda n: n == num_devices)


def _IsLarge(workdir):
  module = os.path.join(workdir, 'module.pb')
  return (os.path.exists(module) and
          os.path.getsize(module) > LARGE_MODULE_BYTES)


def _CloseWorkers(which):
  """Ends the workers whose device count `which` accepts (_LOCK held)."""
  for n in [n for n in _WORKERS if which(n)]:
    _WORKERS.pop(n).Close()


def _EnvKey(env):
  return {k: v for k, v in env.items() if k.startswith(_WORKER_ENV_PREFIXES)}


def CloseAll():
  """Ends every worker (they would end anyway once this process's end
  closes their stdin)."""
  with _LOCK:
    _CloseWorkers(lambda n: True)


atexit.register(CloseAll)
