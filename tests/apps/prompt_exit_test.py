"""prompt_exit.Exit: the command's status, and no collection of the
process's objects on the way out. (That the commands' files are all written
by then is checked where they are read back: the demo's checkpoint and
schedule in lm_params_test, the trainer's events and checkpoints in
lingvo_trainer_test.)

A process of its own per case: what is tested is how a process ends.
"""

import pathlib
import subprocess
import sys

import pytest

# What the program below imports.
from gpipe.apps import prompt_exit  # pylint: disable=unused-import

_ROOT = pathlib.Path(__file__).resolve().parent.parent.parent

# A reference cycle whose finalizer says when the collector freed it: only
# the collection Python runs as it finalizes frees a cycle made this late.
_PROGRAM = """
import sys
from gpipe.apps import prompt_exit


class Node:

  def __del__(self):
    print('collected', flush=True)


node = Node()
node.self = node
del node
print('last line', flush=True)
{end}({status})
"""


def _Ended(end, status):
  return subprocess.run(
      [sys.executable, '-c', _PROGRAM.format(end=end, status=status)],
      cwd=_ROOT, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize('status, code', [(0, 0), (2, 2), (None, 0)])
def test_exit_passes_the_status_and_collects_nothing(status, code):
  ended = _Ended('prompt_exit.Exit', status)
  assert ended.stderr == ''
  assert ended.returncode == code
  assert ended.stdout.splitlines() == ['last line']
  # The same program ended by sys.exit: Python's collection frees the cycle.
  ended = _Ended('sys.exit', status)
  assert ended.returncode == code
  assert ended.stdout.splitlines() == ['last line', 'collected']
