"""The tree keeps the shape a newcomer can read: checked over the source.

- At most 12 modules at the top of gpipe/: the public ones and the
  commands' entry points; the rest lives in subpackages by job, each with
  a module map in its docstring.
- A walk without going back: each module imports only modules that the
  package maps (gpipe/__init__.py's docstring, and each subpackage's)
  place below it, so the ground floor (the schedule, nest, microbatch,
  sharding, quiet) imports nothing of gpipe above it.
- Library code never imports an app (a module with a `__main__` block;
  the schedule command and the SPMD worker aside, which the library runs)
  or the model zoo (`params`), and the model zoo imports no command.
- Sizes: a module at most 500 lines, a class 400, a function 80.
- The tests mirror the tree and share one close-assertion helper.
- Each trick once: one module asks TensorFlow whether XLA compiles, none
  imports gpipe for its side effect, no top-level function is dead, no
  two of the pipeline's share a name, and measured figures live in the
  docs, not in the code.
- pyproject.toml lists every package, so an install ships them all.
"""

import ast
import collections
import pathlib
import re
import tomllib

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


def _Imports(source, package=''):
  """Every module path the source imports, anywhere in it (relative ones
  resolved against `package`, the dotted package the source is in)."""
  found = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      module = node.module
      if node.level:
        parts = package.split('.')
        base = '.'.join(parts[:len(parts) - node.level + 1])
        module = f'{base}.{module}' if module else base
      found.add(module)
      found.update(f'{module}.{alias.name}' for alias in node.names)
  return found


def _ImportsOf(path):
  """_Imports of a module file, relative imports resolved."""
  dotted = _Dotted(path)
  package = dotted if path.name == '__init__.py' else dotted.rpartition('.')[0]
  return _Imports(path.read_text(), package)


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
    for name in sorted(_ImportsOf(path)):
      if name in apps or name == 'params' or name.startswith('params.'):
        wrong.append(f'{_Dotted(path)} imports {name}')
  assert not wrong, wrong


def test_the_model_zoo_imports_no_command():
  """A model's Params are asked by the commands (the planner asks a task
  its TrafficShape), and ask nothing of them."""
  commands = {_Dotted(p) for p in _Modules('gpipe') if _HasMainBlock(p)}
  commands |= {_Dotted(p.parent) for p in GPIPE.rglob('__main__.py')}
  commands = {c for c in commands if not c.startswith(_RUN_BY_THE_LIBRARY)}
  assert 'gpipe.plan' in commands and 'gpipe.demo' in commands
  wrong = [f'{_Dotted(path)} imports {name}'
           for path in _Modules('params')
           for name in sorted(_ImportsOf(path))
           if any(_Within(name, c) for c in commands)]
  assert not wrong, wrong


# Packages whose own map's order is not checked. Each still counts as one
# module on its parent's map, where its modules' imports out of it are
# checked.
_ORDER_NOT_YET_CHECKED = ()


def _Within(name, package):
  return name == package or name.startswith(package + '.')


def _Packages():
  return sorted(_Dotted(p) for p in GPIPE.rglob('__init__.py'))


def _Children(package):
  """What the package's map places: its modules (not __init__, __main__)
  and its subpackages."""
  directory = ROOT.joinpath(*package.split('.'))
  return ({p.stem for p in directory.glob('*.py')} -
          {'__init__', '__main__'}) | {
              p.parent.name for p in directory.glob('*/__init__.py')}


def _Maps():
  """{package: its map, top down}: the map is the indented lines of the
  package's docstring that start with the name of one of its modules."""
  maps = {}
  for package in _Packages():
    if package in _ORDER_NOT_YET_CHECKED:
      continue
    init = ROOT.joinpath(*package.split('.'), '__init__.py')
    doc = ast.get_docstring(ast.parse(init.read_text())) or ''
    children = _Children(package)
    maps[package] = [line.split()[0] for line in doc.splitlines()
                     if line.startswith(' ') and line.strip() and
                     line.split()[0] in children]
  return maps


def _Module(name, modules):
  """The longest prefix of an imported name that is one of the modules."""
  parts = name.split('.')
  return next((m for m in ('.'.join(parts[:i])
                           for i in range(len(parts), 0, -1))
               if m in modules), None)


def _UpwardImports(imports, maps):
  """'X imports Y, which the map places above it' for each import by X
  (imports: {X: the names it imports}) of a gpipe module Y that the map of
  the innermost package holding both places above X (each by the module
  or subpackage of that package it is in)."""
  modules = {_Dotted(p) for p in _Modules('gpipe')}
  packages = _Packages()
  wrong = []
  for importer, names in sorted(imports.items()):
    found = {_Module(name, modules) for name in names} - {None}
    # `from gpipe.xla import hlo_text` names gpipe.xla too: the module is
    # the import.
    found = {m for m in found
             if not any(o != m and _Within(o, m) for o in found)}
    for imported in sorted(found):
      if _Within(importer, imported):
        continue  # the importer's own package
      common = max((p for p in packages
                    if _Within(importer, p) and _Within(imported, p)),
                   key=len)
      if (importer in (common, f'{common}.__main__') or
          common not in maps):
        continue  # a re-export, a command's main, or not checked yet
      depth = common.count('.') + 1
      mine, theirs = (n.split('.')[depth] for n in (importer, imported))
      order = maps[common]
      if mine not in order or theirs not in order:
        wrong.append(f'{common}\'s map lacks {mine} or {theirs}')
      elif order.index(theirs) < order.index(mine):
        wrong.append(f'{importer} imports {imported}, which the map places '
                     f'above it ({common}: {theirs} above {mine})')
  return wrong


def test_each_map_places_each_module_of_its_package_once():
  maps = _Maps()
  assert set(maps) == set(_Packages()) - set(_ORDER_NOT_YET_CHECKED)
  wrong = []
  for package, order in maps.items():
    wrong += [f'{package}\'s map lacks {name}'
              for name in sorted(_Children(package) - set(order))]
    wrong += [f'{package}\'s map places {name} {n} times'
              for name, n in collections.Counter(order).items() if n > 1]
  assert not wrong, wrong


def test_no_module_imports_one_the_map_places_above_it():
  """The walk down never goes back up: the commands stand on the layer,
  the layer on the ground floor (the schedule's arithmetic, nest,
  microbatch, sharding, quiet), which imports nothing of gpipe above it."""
  imports = {_Dotted(p): _ImportsOf(p) for p in _Modules('gpipe')}
  wrong = _UpwardImports(imports, _Maps())
  assert not wrong, wrong


def test_the_order_check_sees_an_upward_import():
  """On imports written here: up the top map and up a subpackage's map
  are named; down, a package's re-export and its command's main are not."""
  imports = {
      'gpipe.nest': {'gpipe.layers.PipelinedLayer'},
      'gpipe.layers': {'gpipe.nest', 'gpipe'},
      'gpipe.xla.spmd_worker': {'gpipe.xla.check_model'},
      'gpipe.xla.check_model': {'gpipe.xla.spmd_worker', 'gpipe.xla'},
      'gpipe.xla': {'gpipe.xla.check_model'},
      'gpipe.plan.__main__': {'gpipe.plan.cli'},
  }
  assert _UpwardImports(imports, _Maps()) == [
      'gpipe.nest imports gpipe.layers, which the map places above it '
      '(gpipe: layers above nest)',
      'gpipe.xla.spmd_worker imports gpipe.xla.check_model, which the map '
      'places above it (gpipe.xla: check_model above spmd_worker)']


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


def test_no_two_top_level_functions_of_the_pipeline_share_a_name():
  """A name says which function it is: pipeline_loop.RunReverse, not one
  of several `Run`s (private helpers included)."""
  where = collections.defaultdict(list)
  for path in _Modules('gpipe/pipeline'):
    for node in ast.parse(path.read_text()).body:
      if isinstance(node, ast.FunctionDef):
        where[node.name].append(_Dotted(path))
  assert len(where) > 50, 'the check no longer sees the functions'
  shared = {name: paths for name, paths in where.items() if len(paths) > 1}
  assert not shared, shared


def test_the_1f1b_loops_share_their_cell_and_nothing_else():
  """The forward loop and the gradient loop each build on one_f_one_b.cell;
  neither imports the other."""
  package = 'gpipe.pipeline.one_f_one_b'
  read = lambda m: _Imports((GPIPE / 'pipeline' / 'one_f_one_b' /
                             f'{m}.py').read_text())
  forward, gradient = read('forward_loop'), read('gradient_loop')
  for imports, other in ((forward, 'gradient_loop'),
                         (gradient, 'forward_loop')):
    assert any(_Within(n, f'{package}.cell') for n in imports)
    assert not any(_Within(n, f'{package}.{other}') for n in imports)


def test_modules_open_with_their_entry_point():
  """recurrent.py's first public definition is Recurrent, the iteration's
  is Iterate, each loop's its loop."""
  firsts = {'recurrent.py': 'Recurrent', 'pipeline/iteration.py': 'Iterate',
            'pipeline/pipeline_loop.py': 'RunReverse',
            'pipeline/one_f_one_b/pipelined.py': 'RunOneFOneB',
            'pipeline/one_f_one_b/forward_loop.py': 'ForwardLoop',
            'pipeline/one_f_one_b/gradient_loop.py': 'GradientLoop',
            'pipeline/loop_io.py': 'LoopInputs',
            'pipeline/loop_choices.py': 'Decide'}
  for path, name in firsts.items():
    tree = ast.parse((GPIPE / path).read_text())
    public = [n.name for n in tree.body
              if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and
              not n.name.startswith('_')]
    assert public[0] == name, (path, public[:3])


def test_the_install_ships_every_package():
  """pyproject.toml lists every package (a non-editable install ships only
  those it lists)."""
  listed = tomllib.loads((ROOT / 'pyproject.toml').read_text())
  listed = set(listed['tool']['setuptools']['packages'])
  found = {_Dotted(p) for p in ROOT.glob('gpipe/**/__init__.py')}
  found |= {_Dotted(p) for p in ROOT.glob('params/**/__init__.py')}
  assert 'gpipe.pipeline.one_f_one_b' in found
  assert listed == found, (sorted(found - listed), sorted(listed - found))


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
                    "'43.2 %', '1.2 %', '0.031 %'")


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
