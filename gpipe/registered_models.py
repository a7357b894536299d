"""A registered Lingvo model by name, or an error that lists the names.

Lingvo's registry answers an unknown name with `Model X not found from list
of above known models.`, the list being a log line that quiet commands do
not show. The commands (gpipe.demo, gpipe.plan) look models up here
instead: an unknown name's error lists every registered model and, for a
name without its module (`CopyLMSmall`), the one it most likely means.
"""

import importlib

from gpipe import quiet
from gpipe import stage_call
from lingvo import model_registry
import params.lm  # pylint: disable=unused-import  (registers the models)


def GetParams(name, dataset='Train'):
  """The registered model `name`'s params for `dataset`.

  Raises:
    LookupError: no model of that name is registered; the message names
      the registered ones.
  """
  stage_call.EnsureFlagsParsed()  # the registry reads flags
  with quiet.LibraryPrints():
    try:
      # Imports the module a name like `my_pkg.MyModel` points into.
      return model_registry.GetParams(name, dataset)
    except (LookupError, ValueError) as e:
      known = sorted(model_registry.GetAllRegisteredClasses())
      if name in known:
        raise
      raise LookupError(UnknownModelMessage(name, known)) from e


def ImportModules(modules):
  """Imports each module (a --model_module): models of the user's own that
  register under names their module path does not start with.

  Raises:
    LookupError: one cannot be imported; the message says why.
  """
  for module in modules:
    why = _ImportError(module)
    if why:
      raise LookupError(f'--model_module {module} cannot be imported ({why}).')


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
