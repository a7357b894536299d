"""The commands print their own lines only; --verbose brings the logs back.

Run as a user runs them (python -m, a fresh process), since the noise comes
from TensorFlow's C++ libraries loading and from Lingvo's model registry.
(The demo's run is checked for the same in
lm_params_test.test_demo_trains_checks_and_draws_the_schedule.)
"""

import os
import pathlib
import subprocess
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _Command(*argv):
  env = dict(os.environ)
  env.pop('TF_CPP_MIN_LOG_LEVEL', None)  # as in a user's shell
  return subprocess.run([sys.executable, '-m', *argv], cwd=_ROOT, env=env,
                        capture_output=True, text=True, timeout=600,
                        check=False)


_CHECK = ('gpipe.check_partitioning', '--params',
          'tests.partitioning_test.CliParams', '--input_shape', '24,8')


def test_check_partitioning_is_quiet_and_verbose_on_request():
  pytest.importorskip('jax')
  quiet = _Command(*_CHECK)
  assert quiet.returncode == 0, quiet.stderr
  assert quiet.stderr == ''
  assert quiet.stdout.strip().endswith('OK')
  verbose = _Command(*_CHECK, '--verbose')
  assert verbose.returncode == 0, verbose.stderr
  assert verbose.stderr.strip()  # TensorFlow's own start-up lines
