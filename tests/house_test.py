"""The tree keeps the shape a newcomer can read: checked over the source.

- At most 12 modules at the top of gpipe/: the public ones and the
  commands' entry points; the rest lives in subpackages by job, each with
  a module map in its docstring.
- The ground floor (the schedule's arithmetic, nest, microbatch,
  sharding) imports nothing of gpipe above it.
- Library code never imports an app (a module with a `__main__` block;
  the schedule command and the SPMD worker aside, which the library runs)
  or the model zoo (`params`).
- Sizes: a module at most 500 lines, a class 400, a function 80.
- The tests mirror the tree and share one close-assertion helper.
- Each trick once: one module asks TensorFlow whether XLA compiles, none
  imports gpipe for its side effect, no top-level function is dead, and
  measured figures live in the docs, not in the code.
"""

import ast
import collections
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
GPIPE = ROOT / 'gpipe'
_SIZED = ('gpipe', 'params', 'tools', 'benchmarks', 'examples', 'tests')
# Commands the library runs or draws with: allowed to be imported.
_RUN_BY_THE_LIBRARY = ('gpipe.schedule', 'gpipe.xla.spmd_worker')


def _Modules(*tops):
  for top in tops:
    yield from sorted((ROOT / top).rglob('*.py'))


def _Dotted(path):
  parts = list(path.relative_to(ROOT).with_suffix('').parts)
  if parts[-1] == '__init__':
    parts.pop()
  return '.'.join(parts)


def _HasMainBlock(path):
  return (path.name == '__main__.py' or
          "if __name__ == '__main__':" in path.read_text())


def _Imports(source):
  """Every module path the source imports, anywhere in it."""
  found = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      found.add(node.module)
      found.update(f'{node.module}.{alias.name}' for alias in node.names)
  return found


def test_at_most_12_modules_at_the_top_of_gpipe():
  top = sorted(p.name for p in GPIPE.glob('*.py'))
  assert len(top) <= 12, top


def test_every_subpackage_maps_its_modules():
  for package in sorted(p.parent for p in GPIPE.glob('*/__init__.py')):
    doc = ast.get_docstring(ast.parse((package / '__init__.py').read_text()))
    assert doc, package
    for module in sorted(package.glob('*.py')):
      if module.stem not in ('__init__', '__main__'):
        assert module.stem in doc, f'{package.name}: {module.stem} unmapped'


def test_library_code_imports_no_app_and_no_model_zoo():
  apps = {_Dotted(p) for p in _Modules('gpipe') if _HasMainBlock(p)}
  apps = {a for a in apps if not a.startswith(_RUN_BY_THE_LIBRARY)}
  assert 'gpipe.check_partitioning' in apps and 'gpipe.demo' in apps
  wrong = []
  for path in _Modules('gpipe'):
    if _HasMainBlock(path):
      continue
    for name in sorted(_Imports(path.read_text())):
      if name in apps or name == 'params' or name.startswith('params.'):
        wrong.append(f'{_Dotted(path)} imports {name}')
  assert not wrong, wrong


# The ground floor: what every part of gpipe stands on, which stands on no
# part of gpipe but itself: the schedule's arithmetic (not its command's
# modules) and these utilities.
_GROUND = ('gpipe.schedule', 'gpipe.schedule.streams', 'gpipe.nest',
           'gpipe.microbatch', 'gpipe.sharding')


def test_the_ground_floor_imports_nothing_above_it():
  wrong = []
  for path in _Modules('gpipe'):
    if _Dotted(path) not in _GROUND:
      continue
    for name in sorted(_Imports(path.read_text())):
      if name.startswith('gpipe.') and name not in _GROUND:
        wrong.append(f'{_Dotted(path)} imports {name}')
  assert not wrong, wrong


def test_tests_mirror_the_tree():
  """A directory of tests per subpackage it tests, and no other."""
  packages = {p.parent.name for p in GPIPE.glob('*/__init__.py')}
  test_dirs = {p.name for p in (ROOT / 'tests').iterdir()
               if p.is_dir() and p.name != '__pycache__'}
  assert test_dirs <= packages, test_dirs - packages


def _ComparesItself(function):
  """Whether a function calls np.testing.assert_allclose itself."""
  return any(isinstance(node, ast.Attribute) and node.attr == 'assert_allclose'
             for node in ast.walk(function))


def test_one_close_assertion_helper():
  """tests/close.py's AssertClose, with its named tolerances: no helper of a
  test file compares floats with a tolerance of its own (a test may still
  call assert_allclose once, inline)."""
  own = [f'{path.relative_to(ROOT)}: {node.name}'
         for path in _Modules('tests') if path.name != 'close.py'
         for node in ast.walk(ast.parse(path.read_text()))
         if isinstance(node, ast.FunctionDef) and
         not node.name.startswith('test_') and _ComparesItself(node)]
  assert not own, own


def _Sizes(path):
  source = path.read_text()
  yield 'module', path.stem, len(source.splitlines()), 500
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.ClassDef):
      yield 'class', node.name, node.end_lineno - node.lineno + 1, 400
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      yield 'function', node.name, node.end_lineno - node.lineno + 1, 80


@pytest.mark.parametrize('top', _SIZED)
def test_modules_classes_and_functions_stay_small(top):
  too_big = [f'{path.relative_to(ROOT)}: {kind} {name} has {size} lines '
             f'(at most {most})'
             for path in _Modules(top)
             for kind, name, size, most in _Sizes(path) if size > most]
  assert not too_big, too_big


def test_the_checks_see_what_they_check():
  """The parsing above, on a module written here: a function-local import
  counts, and so does a name imported from a package."""
  source = ('def F():\n  from gpipe import demo\n  import params.lm\n'
            'from gpipe.xla import hlo_text\n')
  assert {'gpipe.demo', 'params.lm', 'gpipe.xla.hlo_text'} <= _Imports(source)


# A measured figure: 0.85x, 1.6-2.3x, 4 ms, 63 us, 18 %, 5-10 % (not dim0 %
# n, a format's :.0%, or 2 x rows).
_MEASURED = re.compile(
    r'(?<![\w.])\d+(\.\d+)?(-\d+(\.\d+)?)?x(?!\w)|'
    r'(?<![\w.])\d+(\.\d+)? ?(ms|us)\b|'
    r'(?<![\w.])\d+(\.\d+)?(-\d+(\.\d+)?)? ?%(?![\w(])')
# Lines that show a format, not a measurement.
_FORMAT_EXAMPLES = ("'17.3 s', '2.85 us', '512 ns'",
                    "'43 %', '1.2 %', '0.0031 %'")


def test_measured_figures_live_with_their_benchmark():
  """The library's comments and messages give the reason and point to the
  docs; the figures there are updated with each run, not in the code."""
  found = [f'{path.relative_to(ROOT)}:{i}: {line.strip()}'
           for path in _Modules('gpipe')
           for i, line in enumerate(path.read_text().splitlines(), 1)
           if _MEASURED.search(line) and
           not any(e in line for e in _FORMAT_EXAMPLES)]
  assert not found, found
  assert _MEASURED.search('took 0.85-1.01x the step, 63 us, 18 % faster')


def test_one_module_asks_tensorflow_whether_xla_compiles():
  private = re.compile(r'_is_under_xla_context|InXlaContext\(')
  askers = [_Dotted(p) for p in _Modules('gpipe', 'params')
            if private.search(p.read_text())]
  assert askers == ['gpipe.loops.compiled_loops'], askers


def test_no_module_imports_gpipe_for_its_side_effect():
  """lingvo is importable without it (the package's own modules run
  gpipe/__init__ anyway; the environment imports gpipe at start-up)."""
  ritual = re.compile(r'^import gpipe\b', re.M)
  found = [_Dotted(p) for p in _Modules('gpipe', 'params')
           if ritual.search(p.read_text())]
  assert not found, found


def test_every_top_level_function_of_gpipe_is_used():
  """A function or class nothing outside its definition names is dead."""
  sources = {p: p.read_text() for p in _Modules(
      'gpipe', 'params', 'benchmarks', 'examples', 'tools')}
  # How often each word occurs (a maximal run of word characters, what
  # rf'\b{name}\b' would find), counted once for all the sources.
  words = collections.Counter(
      w for s in sources.values() for w in re.findall(r'\w+', s))
  unused = []
  for path in _Modules('gpipe'):
    for node in ast.parse(sources[path]).body:
      if (isinstance(node, (ast.FunctionDef, ast.ClassDef)) and
          node.name != 'main' and words[node.name] < 2):
        unused.append(f'{_Dotted(path)}.{node.name}')
  assert not unused, unused
