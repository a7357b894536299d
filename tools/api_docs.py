"""Writes docs/api.md from the public modules' docstrings.

    python tools/api_docs.py           # rewrite docs/api.md
    python tools/api_docs.py --check   # exit 1 if it is out of date

The public surface is each public module's `__all__`: for every name, its
signature and docstring, and for a class its own public methods. Everything
else in the package is internal (the subpackages' maps say what is where).
tests/api_docs_test.py fails when docs/api.md no longer says what the code
does.
"""

import argparse
import importlib
import inspect
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / 'docs' / 'api.md'
# In the order a user meets them.
PUBLIC_MODULES = ('gpipe.layers', 'gpipe.sharding', 'gpipe.lingvo_compat',
                  'gpipe.schedule', 'gpipe.schedule.streams',
                  'gpipe.recurrent', 'gpipe.microbatch',
                  'gpipe.quiet', 'gpipe.check_partitioning')
_HEADER = """# API

Generated from the docstrings by `python tools/api_docs.py` (the suite
checks it is current). The public surface is each module's `__all__`;
what is not listed here is internal and may change.
"""


# Type names as a reader writes them.
_SHORT = (('tensorflow.python.framework.tensor.', 'tf.'),
          ('lingvo.core.hyperparams.', 'hyperparams.'), ('numpy.', 'np.'),
          ('gpipe.pipeline.param_checks.', ''),
          ('gpipe.xla.partitioned_step.', 'partitioned_step.'),
          ('NoneType', 'None'))


def _Signature(obj):
  if inspect.isclass(obj) and hasattr(obj, 'Params') and hasattr(
      obj, 'FProp'):
    return '(params)'  # a Lingvo layer: built from its Params
  try:
    text = str(inspect.signature(obj))
  except (TypeError, ValueError):
    return '(...)'
  text = text.replace('(self, ', '(').replace('(self)', '()')
  for long, short in _SHORT:
    text = text.replace(long, short)
  return text


def _Doc(obj):
  doc = inspect.getdoc(obj) or '(no docstring)'
  return ['```text', doc, '```', '']


def _OwnMethods(cls):
  """Public methods the class defines itself or takes from gpipe's own
  bases (a mixin of the package), in source order, the class's first."""
  classes = [c for c in cls.__mro__
             if c is cls or c.__module__.startswith('gpipe.')]
  seen = set()
  for owner in classes:
    for name, value in vars(owner).items():
      if (name in seen or name.startswith('_') or
          not callable(getattr(value, '__func__', value))):
        continue
      seen.add(name)
      yield name, getattr(cls, name)


def _Entry(module_name, name, obj):
  kind = 'class' if inspect.isclass(obj) else 'function'
  lines = [f'### `{module_name}.{name}{_Signature(obj)}` ({kind})', '']
  lines += _Doc(obj)
  if inspect.isclass(obj):
    for method_name, method in _OwnMethods(obj):
      lines += [f'#### `{name}.{method_name}{_Signature(method)}`', '']
      lines += _Doc(method)
  return lines


def Render():
  """docs/api.md's text, from the code as it is."""
  if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
  lines = [_HEADER]
  for module_name in PUBLIC_MODULES:
    module = importlib.import_module(module_name)
    summary = (inspect.getdoc(module) or '').split('\n\n')[0]
    lines += [f'## `{module_name}`', '', summary, '']
    seen = {}
    for name in module.__all__:
      obj = getattr(module, name)
      if id(obj) in seen:  # another name for one listed above
        lines += [f'### `{module_name}.{name}`', '',
                  f'The same as `{seen[id(obj)]}`.', '']
        continue
      seen[id(obj)] = name
      lines += _Entry(module_name, name, obj)
  return '\n'.join(lines).rstrip() + '\n'


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--check', action='store_true',
                      help='exit 1 if docs/api.md is out of date')
  args = parser.parse_args(argv)
  text = Render()
  if args.check:
    if PAGE.read_text() != text:
      print('docs/api.md is out of date: run python tools/api_docs.py',
            file=sys.stderr)
      return 1
    return 0
  PAGE.write_text(text)
  print(f'api_docs: wrote {PAGE}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
