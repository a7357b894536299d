"""Commands print their own lines: library logs stay off unless --verbose.

TensorFlow's C++ runtime and XLA log as they load (CUDA probing on a machine
without a GPU, oneDNN and CPU-feature notices), Lingvo logs every model
module it imports, and TensorFlow warns while it serializes Lingvo's graph
collections. None of it is about the user's run. Each command calls
`UnlessVerbose()` first, before TensorFlow is imported; with `--verbose` on
the command line everything is left as it is.
"""

import contextlib
import io
import logging
import os
import sys
import warnings

_QUIET = []  # [True] once UnlessVerbose silenced the libraries

# Python loggers of the libraries underneath.
_LIBRARY_LOGGERS = ('tensorflow', 'absl', 'jax', 'h5py', 'matplotlib')


def UnlessVerbose(argv=None):
  """Silences library logging unless argv (default sys.argv) has --verbose.

  Returns:
    True if logging was silenced.
  """
  argv = sys.argv[1:] if argv is None else argv
  if '--verbose' in argv:
    return False
  # C++ logs (TensorFlow, XLA): read once, when TensorFlow loads.
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  for name in _LIBRARY_LOGGERS:
    logging.getLogger(name).setLevel(logging.ERROR)
  logging.getLogger().setLevel(logging.ERROR)
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  absl_logging.set_verbosity(absl_logging.ERROR)
  warnings.filterwarnings('ignore', category=DeprecationWarning)
  warnings.filterwarnings('ignore', category=UserWarning,
                          module=r'(tensorflow|keras|lingvo)\b')
  _ImportWithoutStderr('tensorflow')
  _QUIET.append(True)
  return True


def LibraryPrints():
  """Context swallowing what library code prints to stderr, when quiet.

  Lingvo's model registry prints every module it tries to import.
  """
  if not _QUIET:
    return contextlib.nullcontext()
  return contextlib.redirect_stderr(io.StringIO())


def _ImportWithoutStderr(module):
  """Imports `module` with file descriptor 2 sent to /dev/null.

  TensorFlow's C++ libraries log as they load (oneDNN notices, CUDA
  probing), before any log level they read takes effect.
  """
  sys.stderr.flush()
  saved = os.dup(2)
  devnull = os.open(os.devnull, os.O_WRONLY)
  try:
    os.dup2(devnull, 2)
    __import__(module)
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)
    os.close(devnull)
