"""What the commands print: their own lines, and help that shows defaults.

TensorFlow's C++ runtime and XLA log as they load (CUDA probing on a machine
without a GPU, oneDNN and CPU-feature notices), Lingvo logs every model
module it imports, and TensorFlow warns while it serializes Lingvo's graph
collections. None of it is about the user's run. Each command calls
`UnlessVerbose()` first, before TensorFlow is imported; with `--verbose` on
the command line everything is left as it is.

`UnlessVerbose()` itself imports no TensorFlow: it arranges for TensorFlow's
first import, whenever it comes, to run with standard error silenced. A
command reads its arguments before it imports TensorFlow, so `--help` and a
usage error answer at once.
"""

import argparse
import contextlib
import importlib.abc
import importlib.util
import io
import logging
import os
import sys
from typing import ContextManager, Optional, Sequence
import warnings

__all__ = [
    'UnlessVerbose',
    'LibraryPrints',
]

_QUIET = []  # [True] once UnlessVerbose silenced the libraries

# Python loggers of the libraries underneath.
_LIBRARY_LOGGERS = ('tensorflow', 'absl', 'jax', 'h5py', 'matplotlib')


def UnlessVerbose(argv: Optional[Sequence[str]] = None) -> bool:
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
  if 'tensorflow' not in sys.modules and not any(
      isinstance(f, _FirstImportWithoutStderr) for f in sys.meta_path):
    sys.meta_path.insert(0, _FirstImportWithoutStderr('tensorflow'))
  _QUIET.append(True)
  return True


def LibraryPrints() -> ContextManager:
  """Context swallowing what library code prints to stderr, when quiet.

  Lingvo's model registry prints every module it tries to import.
  """
  if not _QUIET:
    return contextlib.nullcontext()
  return contextlib.redirect_stderr(io.StringIO())


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """Keeps the description's layout and appends each flag's default.

  A default of None or False is left to the flag's own help, which says in
  words what happens without the flag (e.g. "default: num_stages").
  """

  def _get_help_string(self, action):
    text = action.help or ''
    default = action.default
    if (action.option_strings and default not in (None, False) and
        default is not argparse.SUPPRESS and 'default' not in text):
      text += ' (default: %(default)s)'
    return text


class _FirstImportWithoutStderr(importlib.abc.MetaPathFinder):
  """Finds nothing itself: it hands one module's loader to
  _LoaderWithoutStderr, once, and leaves sys.meta_path."""

  def __init__(self, name):
    self.name = name

  def find_spec(self, name, path=None, target=None):
    del path, target
    if name != self.name:
      return None
    if self in sys.meta_path:
      sys.meta_path.remove(self)
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.loader is not None:
      spec.loader = _LoaderWithoutStderr(spec.loader)
    return spec


class _LoaderWithoutStderr(importlib.abc.Loader):
  """Runs a module's loader with file descriptor 2 sent to /dev/null.

  TensorFlow's C++ libraries log as they load (oneDNN notices, CUDA
  probing), before any log level they read takes effect. The module keeps
  its own loader.
  """

  def __init__(self, loader):
    self.loader = loader

  def create_module(self, spec):
    return self.loader.create_module(spec)

  def exec_module(self, module):
    module.__spec__.loader = module.__loader__ = self.loader
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
      os.dup2(devnull, 2)
      self.loader.exec_module(module)
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      os.close(devnull)
