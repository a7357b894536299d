"""prompt_exit.Exit: the command's status, its objects left to the process's
end. (That the commands' files are all written by then is checked where they
are read back: the demo's checkpoint and schedule in lm_params_test, the
trainer's events and checkpoints in lingvo_trainer_test.)"""

import gc

import pytest

from gpipe.apps import prompt_exit


@pytest.mark.parametrize('status', [0, 1, 2, None])
def test_exit_passes_the_status_and_leaves_the_objects_uncollected(status):
  assert gc.get_freeze_count() == 0
  try:
    with pytest.raises(SystemExit) as done:
      prompt_exit.Exit(status)
    assert done.value.code == status
    assert gc.get_freeze_count() > 0  # the collector will pass them over
  finally:
    gc.unfreeze()
