"""docs/how-it-works.md's route is the order the calls run in.

A small pipelined FProp and its gradient are built under a profiler
(sys.setprofile) that records each gpipe function the first time it is
entered, and every call from a gpipe function into one the package maps
(tests/house_test.py reads them) place above it: a call back up. Then:

  * each route list's stops are entered in the list's order: each stop
    after the one before it (the forward list while FProp builds, the
    backward list while tf.gradients builds, with stream_io, the 1f1b list
    through both);
  * every call back up comes from a stop that says it calls back up, and
    every stop that says so does.

Three kinds of call are not gpipe calling back up, and are left out: a
function gpipe.nest maps over a structure (its caller's), an op's gradient
(TensorFlow's gradient machinery calls it; the route's backward list names
the cell's gradient, built through them) and a Lingvo hook a layer
overrides (Lingvo calls it).
"""

import dataclasses
import functools
import importlib
import pathlib
import re
import sys

import numpy as np
import pytest

import tensorflow as tf
from tests import house_test
from tests import pipeline_harness

ROOT = pathlib.Path(__file__).resolve().parent.parent
_PAGE = ROOT / 'docs' / 'how-it-works.md'
_STEP = re.compile(r'^(\d+)\. `(gpipe(?:\.\w+)+)`( calls back up)?')
_CALLED_BY_TENSORFLOWS_GRADIENTS = ('gradients_util.py', 'custom_gradient.py',
                                    'backprop.py')
_COMPREHENSIONS = ('<listcomp>', '<setcomp>', '<dictcomp>', '<genexpr>')
_LISTS = {
    "Forward, the pod's schedule": ('reverse', 'forward'),
    "Backward, the pod's schedule": ('stream_io', 'backward'),
    "With `backward_schedule='1f1b'`, forward and backward": ('1f1b',
                                                              'both'),
}
_CASES = {
    'reverse': pipeline_harness.Case(num_stages=2, num_microbatches=3,
                                     batch=6),
    '1f1b': pipeline_harness.Case(num_stages=2, num_microbatches=3, batch=6,
                                  backward_schedule='1f1b'),
    'stream_io': pipeline_harness.Case(num_stages=2, num_microbatches=3,
                                       batch=6, stream_io=True),
}


@dataclasses.dataclass(frozen=True)
class Entry:
  number: int
  name: str
  calls_back_up: bool


def _Lists():
  """{heading: [Entry]} of the route's numbered lists."""
  text = _PAGE.read_text()
  route = text.split('\n## The route\n', 1)[1].split('\n## ', 1)[0]
  lists, heading = {}, None
  for line in route.splitlines():
    if line.startswith('### '):
      heading = line[4:]
      lists[heading] = []
    match = _STEP.match(line)
    if match:
      lists[heading].append(
          Entry(int(match.group(1)), match.group(2), bool(match.group(3))))
  return lists


@functools.lru_cache(maxsize=None)
def _ModuleOf(filename):
  """The gpipe module a source file is, or None."""
  try:
    parts = list(pathlib.Path(filename).relative_to(ROOT).with_suffix('').parts)
  except ValueError:
    return None
  if parts[0] != 'gpipe':
    return None
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def _IsAbove(callee, caller, maps):
  """Whether the map of the innermost package holding both modules places
  the callee's part of it above the caller's."""
  a, b = callee.split('.'), caller.split('.')
  i = 0
  while i < min(len(a), len(b)) and a[i] == b[i]:
    i += 1
  order = maps.get('.'.join(a[:i]))
  if i == min(len(a), len(b)) or not order:
    return False
  return order.index(a[i]) < order.index(b[i])


def _LeftOut(frame, caller_module):
  """The three kinds of call the module docstring leaves out."""
  direct = frame.f_back.f_code.co_filename
  if caller_module == 'gpipe.nest' or '/lingvo/' in direct:
    return True
  return '/tensorflow/' in direct and direct.endswith(
      _CALLED_BY_TENSORFLOWS_GRADIENTS)


class _Recorder:
  """sys.setprofile's hook: first entries per phase, calls back up."""

  def __init__(self, maps):
    self.maps = maps
    self.entered = {}  # phase: [dotted name], in order of first entry
    self.up = set()  # (caller's dotted name, callee's)
    self.phase = None

  def __call__(self, frame, event, arg):
    del arg
    if event != 'call':
      return
    module = _ModuleOf(frame.f_code.co_filename)
    if module is None or frame.f_code.co_name in _COMPREHENSIONS:
      return  # a comprehension is its function's own body
    name = f'{module}.{frame.f_code.co_qualname}'
    entered = self.entered.setdefault(self.phase, [])
    if name not in entered:
      entered.append(name)
    caller = frame.f_back
    while caller is not None and _ModuleOf(caller.f_code.co_filename) is None:
      caller = caller.f_back
    if caller is None:
      return
    caller_module = _ModuleOf(caller.f_code.co_filename)
    if (_IsAbove(module, caller_module, self.maps) and
        not _LeftOut(frame, caller_module)):
      self.up.add((f'{caller_module}.{caller.f_code.co_qualname}', name))


@functools.lru_cache(maxsize=None)
def _Traced(case_name):
  """The _Recorder of building the case's layer, FProp and gradient."""
  case = _CASES[case_name]
  recorder = _Recorder(house_test._Maps())  # pylint: disable=protected-access
  x = np.random.RandomState(0).uniform(
      -1, 1, (case.batch,) + case.example_shape).astype(np.float32)
  with tf.Graph().as_default():
    sys.setprofile(recorder)
    try:
      recorder.phase = 'instantiate'
      layer = case.Params().Instantiate()
      inputs = tf.constant(x)
      recorder.phase = 'forward'
      y = layer.FProp(layer.theta, inputs)
      recorder.phase = 'backward'
      tf.gradients(tf.reduce_sum(y * y), [inputs] + layer.vars.Flatten())
    finally:
      sys.setprofile(None)
  return recorder


def _Entered(case_name, phase):
  recorder = _Traced(case_name)
  if phase == 'both':
    return recorder.entered['forward'] + recorder.entered['backward']
  return recorder.entered[phase]


def _FirstEntry(name, entered, start=0):
  """Where, from `start` on, `name` (a function, or a class: any of its
  methods) or one of its nested functions is first entered, or None."""
  for i in range(start, len(entered)):
    if _Owns(name, entered[i]):
      return i
  return None


def _Owns(stop_name, function):
  return function == stop_name or function.startswith(stop_name + '.')


def test_the_route_has_its_three_lists():
  lists = _Lists()
  assert list(lists) == list(_LISTS)
  for stops in lists.values():
    assert len(stops) >= 5
    assert [s.number for s in stops] == list(range(1, len(stops) + 1))


@pytest.mark.parametrize('name', [s.name for stops in _Lists().values()
                                  for s in stops])
def test_every_stop_names_a_definition(name):
  parts = name.split('.')
  for i in range(len(parts), 0, -1):
    try:
      thing = importlib.import_module('.'.join(parts[:i]))
    except ModuleNotFoundError:
      continue
    for attr in parts[i:]:
      thing = getattr(thing, attr)
    assert callable(thing), name
    return
  raise AssertionError(f'{name}: no such module')


@pytest.mark.parametrize('heading', list(_LISTS))
def test_each_list_is_the_order_the_calls_run_in(heading):
  case_name, phase = _LISTS[heading]
  entered = _Entered(case_name, phase)
  at = 0
  for stop in _Lists()[heading]:
    i = _FirstEntry(stop.name, entered, at)
    assert i is not None, (
        f'{heading}: stop {stop.number}, {stop.name}, is not entered after '
        f'stop {stop.number - 1}' if _FirstEntry(stop.name, entered) is not None
        else f'{heading}: stop {stop.number}, {stop.name}, is never entered')
    at = i


def test_every_call_back_up_is_a_stop_that_says_so():
  flagged = {s.name for stops in _Lists().values() for s in stops
             if s.calls_back_up}
  found = set()
  for case_name in _CASES:
    for caller, callee in _Traced(case_name).up:
      owners = [f for f in flagged if _Owns(f, caller)]
      assert owners, f'{caller} calls {callee}, which the maps place above'
      found.update(owners)
  assert found == flagged, f'said to call back up, never do: {flagged - found}'


def test_the_order_check_sees_a_stop_back():
  entered = _Entered('reverse', 'forward')
  stop = _FirstEntry('gpipe.pipeline.iteration.Iterate', entered)
  assert stop is not None
  assert _FirstEntry('gpipe.pipeline.pipeline_loop.RunReverse', entered,
                     stop) is None


def test_the_recorder_sees_a_call_back_up():
  """The 1f1b loops hand Iterate a cell from above it (one_f_one_b.cell):
  Iterate's call of its Apply is a call back up."""
  assert any(caller == 'gpipe.pipeline.iteration.Iterate' and
             callee.startswith('gpipe.pipeline.one_f_one_b.cell.')
             for caller, callee in _Traced('1f1b').up)
