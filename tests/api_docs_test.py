"""The public surface: marked by __all__, typed, documented in docs/api.md.

docs/api.md is generated from the docstrings (tools/api_docs.py); this test
fails when the code and the page disagree, when a public name has no
docstring, or when a public function leaves a parameter or its result
untyped.
"""

import importlib
import inspect
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT / 'tools') not in sys.path:
  sys.path.insert(0, str(ROOT / 'tools'))
import api_docs  # pylint: disable=g-import-not-at-top,wrong-import-position


def test_api_page_says_what_the_code_does():
  assert (ROOT / 'docs' / 'api.md').read_text() == api_docs.Render(), (
      'docs/api.md is out of date: run python tools/api_docs.py')


def _Public(module_name):
  module = importlib.import_module(module_name)
  assert module.__all__, module_name
  return [(name, getattr(module, name)) for name in module.__all__]


@pytest.mark.parametrize('module_name', api_docs.PUBLIC_MODULES)
def test_every_public_name_is_documented(module_name):
  for name, obj in _Public(module_name):
    assert inspect.getdoc(obj), f'{module_name}.{name} has no docstring'


def _Untyped(fn):
  """The parameters (and 'return') a function leaves without a type."""
  signature = inspect.signature(fn)
  missing = [p.name for p in signature.parameters.values()
             if p.name != 'self' and p.kind not in (p.VAR_POSITIONAL,
                                                    p.VAR_KEYWORD)
             and p.annotation is inspect.Parameter.empty]
  if (fn.__name__ != '__init__' and
      signature.return_annotation is inspect.Signature.empty):
    missing.append('return')
  return missing


@pytest.mark.parametrize('module_name', api_docs.PUBLIC_MODULES)
def test_public_functions_are_typed(module_name):
  untyped = []
  for name, obj in _Public(module_name):
    if inspect.isclass(obj):
      is_layer = hasattr(obj, 'FProp') and hasattr(obj, 'Params')
      if is_layer or '__init__' not in vars(obj):
        continue  # built from its Params, or a dataclass (typed fields)
      obj = obj.__init__
    missing = _Untyped(inspect.unwrap(obj))
    if missing:
      untyped.append(f'{module_name}.{name}: {missing}')
  assert not untyped, untyped


def test_the_typing_check_sees_an_untyped_parameter():
  def Typed(a: int, *args, b: str = '', **kwargs) -> int:
    del args, kwargs
    return a + len(b)

  def Untyped(a, b: int):
    return a + b

  assert not _Untyped(Typed)
  assert _Untyped(Untyped) == ['a', 'return']
