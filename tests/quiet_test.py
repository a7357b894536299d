"""The commands print their own lines only; --verbose brings the logs back.

Their --help answers at once, before TensorFlow loads, and shows defaults.

Run as a user runs them (python -m, a fresh process), since the noise comes
from TensorFlow's C++ libraries loading and from Lingvo's model registry.
(The demo's run is checked for the same in
lm_params_test.test_demo_trains_checks_and_draws_the_schedule.)
"""

import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _Python(*argv):
  env = dict(os.environ)
  env.pop('TF_CPP_MIN_LOG_LEVEL', None)  # as in a user's shell
  return subprocess.run([sys.executable, *argv], cwd=_ROOT, env=env,
                        capture_output=True, text=True, timeout=600,
                        check=False)


def _Command(*argv):
  return _Python('-m', *argv)


# docs/partitioning.md's refused input: the command loads TensorFlow and
# runs the stack unrolled before it answers (exit 2).
_REFUSED = ('gpipe.check_partitioning', '--params',
            'examples.my_model.PipelineParams', '--input_shape', '16,12')


def test_check_partitioning_is_verbose_on_request():
  """(Quiet by default: docs_test runs the documented check_partitioning
  commands, this one among them, and matches what they print, from the
  first line to the last, with the page.)"""
  verbose = _Command(*_REFUSED, '--verbose')
  assert verbose.returncode == 2, verbose.stderr
  assert 'the stage body takes 8 features' in verbose.stderr
  # TensorFlow's start-up lines, in its C++ log format.
  assert re.search(r'^[IWE]\d{4} [\d:. ]+ \d+ \w+\.cc:\d+\] ',
                   verbose.stderr, re.M), verbose.stderr


# -- Help: at once, before TensorFlow loads, with each flag's default. -------


@pytest.mark.parametrize('module, default', [
    ('gpipe.check_partitioning', '(default: 0.0001)'),
    ('gpipe.demo', '(default: lm.TextLMSmall)'),
    ('gpipe.schedule', '(default: 1)'),
    ('gpipe.plan', '(default: v6e)'),
])
def test_help_answers_before_tensorflow_loads(module, default):
  began = time.monotonic()
  result = _Python('-X', 'importtime', '-m', module, '--help')
  seconds = time.monotonic() - began
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith(f'usage: python -m {module}')
  assert default in result.stdout
  imported = {line.split('|')[-1].strip().partition('.')[0]
              for line in result.stderr.splitlines() if '|' in line}
  assert 'argparse' in imported  # -X importtime listed the imports
  assert not imported & {'tensorflow', 'lingvo', 'jax', 'numpy'}, imported
  # Well under a second on an idle machine; slack for a loaded one.
  assert seconds < 3, seconds


def test_lingvo_trainer_help_lists_lingvos_flags():
  result = _Command('gpipe.lingvo_trainer', '--help')
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.startswith('usage: python -m gpipe.lingvo_trainer')
  assert 'lingvo.trainer:\n' in result.stdout
  assert '\n  --model: ' in result.stdout
  # Each flag with its default, e.g. --mode's.
  assert re.search(r"\n  --mode: .*\n(    .*\n)*?    \(default: 'async'\)",
                   result.stdout)
  assert 'Traceback' not in result.stderr

