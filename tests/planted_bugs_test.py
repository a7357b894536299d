"""Every bug tools/mutants.py plants still finds the code it replaces.

A refactor that moves or rewrites a planted bug's line leaves the bug
planting nothing: mutants.py then stops on it, but only when someone runs
it. Here each entry is checked against the tree as it is, without planting
or running anything: its text occurs once in its file, and the tests it
names exist.
"""

import pathlib
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT / 'tools'))
import planted_bugs  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.mark.parametrize('bug', planted_bugs.BUGS, ids=lambda b: b.name)
def test_each_bug_replaces_one_place_and_names_tests_that_exist(bug):
  text = (_ROOT / bug.path).read_text()
  assert text.count(bug.old) == 1, (
      f'{bug.name}: its text occurs {text.count(bug.old)} times in '
      f'{bug.path}; update tools/planted_bugs.py with the code')
  assert bug.new != bug.old
  files = [t.split('::')[0] for t in bug.tests if t.startswith('tests/')]
  assert files, f'{bug.name} names no test file'
  for f in files:
    assert (_ROOT / f).is_file(), f'{bug.name}: no {f}'


def test_names_are_unique():
  names = [b.name for b in planted_bugs.BUGS]
  assert len(names) == len(set(names))
