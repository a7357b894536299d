"""docs/how-it-works.md's route is true: every step names a definition that
exists, and each list visits its modules in the order the package maps
place them (tests/house_test.py reads the maps), each module once.
"""

import importlib
import pathlib
import re

import pytest

from tests import house_test

ROOT = pathlib.Path(__file__).resolve().parent.parent
_PAGE = ROOT / 'docs' / 'how-it-works.md'
_STEP = re.compile(r'^(\d+)\. `(gpipe(?:\.\w+)+)`')


def _Lists():
  """{heading: [(number, dotted name)]} of the route's numbered lists."""
  text = _PAGE.read_text()
  route = text.split('\n## The route\n', 1)[1].split('\n## ', 1)[0]
  lists, heading = {}, None
  for line in route.splitlines():
    if line.startswith('### '):
      heading = line[4:]
      lists[heading] = []
    match = _STEP.match(line)
    if match:
      lists[heading].append((int(match.group(1)), match.group(2)))
  return lists


def _Resolve(dotted):
  """(the module, the object) the dotted name names, or an error."""
  parts = dotted.split('.')
  for i in range(len(parts), 0, -1):
    try:
      module = importlib.import_module('.'.join(parts[:i]))
    except ModuleNotFoundError:
      continue
    thing = module
    for attr in parts[i:]:
      thing = getattr(thing, attr)
    return module.__name__, thing
  raise ModuleNotFoundError(dotted)


def _Position(module, maps):
  """The module's place from the top: its rank on each map from gpipe's
  down, e.g. (rank of pipeline on gpipe's, rank of iteration on
  pipeline's)."""
  parts = module.split('.')
  place = []
  for i in range(1, len(parts)):
    package = '.'.join(parts[:i])
    place.append(maps[package].index(parts[i]))
  return tuple(place)


def test_the_route_has_its_three_lists():
  lists = _Lists()
  assert list(lists) == ["Forward, the pod's schedule",
                         "Backward, the pod's schedule",
                         "With `backward_schedule='1f1b'`, forward and "
                         'backward']
  for steps in lists.values():
    assert len(steps) >= 5
    assert [n for n, _ in steps] == list(range(1, len(steps) + 1))


@pytest.mark.parametrize('heading', list(_Lists()))
def test_each_list_goes_down_the_maps_visiting_each_module_once(heading):
  maps = house_test._Maps()  # pylint: disable=protected-access
  modules = [_Resolve(name)[0] for _, name in _Lists()[heading]]
  assert len(set(modules)) == len(modules), modules
  places = [_Position(m, maps) for m in modules]
  assert places == sorted(places), list(zip(modules, places))


def test_the_order_check_sees_a_step_back():
  maps = house_test._Maps()  # pylint: disable=protected-access
  forward = [_Position(m, maps) for m in
             ('gpipe.pipeline.iteration', 'gpipe.pipeline.pipeline_loop')]
  assert forward != sorted(forward)
