"""Test session set-up: quiet TF logs, report the largest numerical errors.

With pytest-xdist each worker records its own largest errors; the workers
send them to the controller, which reports the largest of all.
"""

import gc
import os
import sys

import pytest

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
# TensorFlow's oneDNN kernels (on by default on x86) change float32 results
# on some CPUs beyond the tests' ~1e-5 (docs/testing.md, "oneDNN"): the
# tests run the kernels that compute as written. Subprocesses (the
# commands' tests) inherit it.
os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')
# The tests' jit steps are tiny: compiling them dominates. LLVM's machine-code
# optimization level changes how fast the compiled code runs, not what the
# HLO computes (every XLA pass, the SPMD partitioner's included, still
# runs); docs/testing.md says what it saves. Benchmarks use the default.
os.environ['XLA_FLAGS'] = ' '.join(
    [os.environ.get('XLA_FLAGS', ''), '--xla_backend_optimization_level=0'])

# Building graphs makes Python objects by the million (TensorFlow's ops,
# Lingvo's params): at the default thresholds (700, 10, 10) the collector
# runs thousands of times a module, about 8 % of a worker's time
# (docs/testing.md, "Where the time goes"); what a test leaves is still
# collected, less often.
gc.set_threshold(50_000, 20, 20)

_WORKER_ERRORS = []


def pytest_configure(config):
  config.addinivalue_line(
      'markers', 'runs_long: a test of ten seconds or more (a whole program '
      'in a process of its own, or a model built, differentiated and '
      'compiled); scheduled first')


def pytest_collection_modifyitems(items):
  """Long tests first: with xdist's worksteal each worker starts on its own
  half of the tests and takes over the other's remaining ones, so a long
  test started last would keep one worker busy while the other idles
  (docs/testing.md, 'Where the time goes')."""
  items.sort(key=lambda item: item.get_closest_marker('runs_long') is None)


@pytest.fixture(autouse=True)
def _eager_random_ops_start_afresh():
  """Each test's eager random values depend on the test alone.

  An eager random op with an op seed (Lingvo's weight initializers) also
  counts how often that seed has run in the process, so without a reset a
  test's initial weights would depend on which tests its xdist worker ran
  before it.
  """
  tf = sys.modules.get('tensorflow')
  if tf is not None:
    tf.random.set_seed(0)
  yield


@pytest.fixture(autouse=True)
def _tf_state_is_left_as_found():
  """Fails a test that leaves graph mode, a default graph or a Lingvo
  variable store behind.

  Turning eager execution off is process-wide (e.g. Lingvo's
  py_utils.SetEagerMode(False)), and so is a graph entered and not left:
  every test its xdist worker ran next would run in graph mode on that
  graph, sharing its variables.
  """
  tf = sys.modules.get('tensorflow')
  before = None
  if tf is not None:
    before = (tf.executing_eagerly(), tf.compat.v1.get_default_graph())
    store = getattr(before[1], 'lingvo_variable_store', None)
  yield
  tf = sys.modules.get('tensorflow')
  if tf is not None and before is not None:
    after = (tf.executing_eagerly(), tf.compat.v1.get_default_graph())
    assert after == before, (
        f'the test left TF in another state: (eager, default graph) '
        f'{before} before, {after} after')
    left = getattr(after[1], 'lingvo_variable_store', None)
    if left is not store:
      after[1].lingvo_variable_store = store  # the next tests start clean
      pytest.fail(
          "the test left a Lingvo variable store on the default graph (a "
          "layer's __init__ that raised while building eagerly: Lingvo's "
          'VariableStore does not restore the graph on an exception). Every '
          'later test of the worker would reuse its variables; build such a '
          'layer inside a tf.Graph().')


def _LocalErrors():
  harness = sys.modules.get('tests.pipeline_harness')
  if harness is None:
    return {'abs': 0.0, 'rel': 0.0, 'checks': 0}
  return harness.LargestErrors()


def pytest_sessionfinish(session):
  workeroutput = getattr(session.config, 'workeroutput', None)
  if workeroutput is not None:  # an xdist worker
    workeroutput['gpipe_errors'] = _LocalErrors()


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config):
  """An xdist worker ends here, its results sent (xdist's
  pytest_sessionfinish sent them before this hook), first of the
  unconfigure hooks: pytest's own sweep for unraisable exceptions collects
  garbage for seconds with TensorFlow, Lingvo and the tests' graphs in
  memory, and so does Python's finalization (docs/testing.md, 'Where the
  time goes'); a worker still sweeping when the controller shut it down
  printed a KeyboardInterrupt warning."""
  if hasattr(config, 'workerinput'):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # pylint: disable=protected-access


try:
  import xdist  # pylint: disable=g-import-not-at-top,unused-import
except ImportError:  # pytest would reject the xdist hook below.
  xdist = None

if xdist is not None:

  _CRASHED_ONCE = set()

  def pytest_handlecrashitem(crashitem, report, sched):
    """A test that crashed its worker (a segfault in TensorFlow's runtime)
    runs once more, in the new worker xdist starts; a second crash fails.

    (Done here rather than by pytest-rerunfailures, whose bookkeeping asks
    the controller over a socket before every test: docs/testing.md says
    what that cost.)"""
    if crashitem not in _CRASHED_ONCE:
      _CRASHED_ONCE.add(crashitem)
      sched.mark_test_pending(crashitem)
      report.outcome = 'rerun'

  def pytest_report_teststatus(report):
    if report.outcome == 'rerun':
      return 'rerun', 'R', ('RERUN', {'yellow': True})
    return None

  def pytest_testnodedown(node, error):
    del error
    errors = getattr(node, 'workeroutput', {}).get('gpipe_errors')
    if errors:
      _WORKER_ERRORS.append(errors)


def pytest_terminal_summary(terminalreporter):
  """Prints the largest pipelined-vs-reference errors seen in this run."""
  all_errors = _WORKER_ERRORS + [_LocalErrors()]
  checks = sum(e['checks'] for e in all_errors)
  if checks:
    largest_abs = max(e['abs'] for e in all_errors)
    largest_rel = max(e['rel'] for e in all_errors)
    terminalreporter.write_line(
        f'pipelined vs reference: {checks} tensor comparisons, '
        f'largest abs error {largest_abs:.3g}, largest rel error '
        f'{largest_rel:.3g} (rel = |err| / max(|ref|, 1))')
