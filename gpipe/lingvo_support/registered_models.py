"""A registered Lingvo model by name, or an error that lists the names.

Lingvo's registry answers an unknown name with `Model X not found from list
of above known models.`, the list being a log line that quiet commands do
not show. The commands (gpipe.demo, gpipe.plan) look models up here
instead: an unknown name's error lists every registered model and, for a
name without its module (`CopyLMSmall`), the one it most likely means.

The commands import the model zoo (`params.lm`) themselves; this module
finds what is registered.
"""

import importlib
import os
import sys

from gpipe.lingvo_support import flags_and_seeds
from gpipe import quiet
from lingvo import model_registry


def GetParams(name, dataset='Train'):
  """The registered model `name`'s params for `dataset`.

  Raises:
    LookupError: no model of that name is registered; the message names
      the registered ones.
  """
  flags_and_seeds.EnsureFlagsParsed()  # the registry reads flags
  with quiet.LibraryPrints():
    try:
      # Imports the module a name like `my_pkg.MyModel` points into.
      return model_registry.GetParams(name, dataset)
    except (LookupError, ValueError) as e:
      known = sorted(model_registry.GetAllRegisteredClasses())
      if name in known:
        raise
      raise LookupError(UnknownModelMessage(name, known)) from e


def GetClass(name):
  """The registered model class `name` (its Params are made by its methods,
  so a subclass can change a class attribute and keep the rest).

  Raises:
    LookupError: as GetParams.
  """
  GetParams(name, None)  # the model's module imported, or the error
  with quiet.LibraryPrints():
    return model_registry.GetClass(name)


def ImportModules(modules):
  """Imports each module (a --model_module): models of the user's own that
  register under names their module path does not start with.

  A module is a dotted name importable from here, or a path to a .py file:
  that file is imported under its own name with its directory first on
  sys.path (its models are then `<file name>.<Class>`, and it imports its
  neighbours), from whatever directory the command runs in.

  Raises:
    LookupError: one cannot be imported; the message says why.
  """
  for module in modules:
    name, why = module, None
    if module.endswith('.py'):
      name, why = _NameOfFile(module)
    why = why or _ImportError(name)
    if why:
      raise LookupError(f'--model_module {module} cannot be imported ({why}).')


def _NameOfFile(path):
  """(module name, None) of a .py file, its directory put on sys.path; or
  (None, why not)."""
  if not os.path.isfile(path):
    return None, 'no such file'
  directory = os.path.dirname(os.path.abspath(path))
  if directory not in sys.path:
    sys.path.insert(0, directory)
  return os.path.splitext(os.path.basename(path))[0], None


def UnknownModelMessage(name, known):
  """Names the registered models and, if one ends like `name`, that one;
  for a name whose module cannot be imported, why not."""
  likely = [k for k in known if k.endswith('.' + name)]
  hint = f' Did you mean {likely[0]}?' if len(likely) == 1 else ''
  module = name.rpartition('.')[0]
  if not hint and '.' in module:
    why = _ImportError(module)
    if why:
      hint = (f' Its module {module} cannot be imported ({why}); a model '
              'of your own is named <module>.<class>, the module '
              'importable from where you run (Lingvo\'s convention).')
  return (f'Unknown model {name!r}.{hint} Registered: {", ".join(known)}.')


def _ImportError(module):
  """Why `module` cannot be imported, in one line; None if it can."""
  try:
    importlib.import_module(module)
  except Exception as e:  # pylint: disable=broad-except
    return f'{type(e).__name__}: {e}'.splitlines()[0]
  return None
