"""gpipe.schedule loads without TensorFlow: the standard library alone.

Its arithmetic must be importable (and testable) without TF or NumPy, so
that the schedule's tests and `python -m gpipe.schedule` run anywhere;
schedule_reference.py loads it from its files, without the gpipe package.
"""

import ast
import subprocess
import sys

# Loads gpipe/schedule/__init__.py without TensorFlow: before gpipe.
from tests.schedule import schedule_reference


def test_loading_schedule_does_not_import_tensorflow():
  if not schedule_reference.TF_LOADED_BEFORE:
    assert not schedule_reference.TF_LOADED_AFTER
  code = (
      'import importlib.util, sys\n'
      'def Load(name, path, where=None):\n'
      '  spec = importlib.util.spec_from_file_location(\n'
      '      name, path, submodule_search_locations=where)\n'
      '  mod = importlib.util.module_from_spec(spec)\n'
      '  sys.modules[name] = mod\n'
      '  spec.loader.exec_module(mod)\n'
      '  return mod\n'
      f'path = {str(schedule_reference.SCHEDULE_PATH)!r}\n'
      'mod = Load("s", path, [path.rsplit("/", 1)[0]])\n'
      f'streams = Load("t", {str(schedule_reference.STREAMS_PATH)!r})\n'
      'mod.FieldTables(mod.OneFOneB(mod.Schedule(3, 5, 2)).BackwardRows())\n'
      'streams.Streams(mod.Schedule(3, 5, 2)).WriteColumns()\n'
      'assert "tensorflow" not in sys.modules, "tensorflow imported"\n'
      'assert "gpipe" not in sys.modules, "gpipe package imported"\n')
  # -S: no site-packages, whose start-up .pth imports gpipe (tools/install.py):
  # the schedule loads with the standard library alone.
  result = subprocess.run([sys.executable, '-S', '-c', code],
                          capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stderr


def test_schedule_imports_only_the_standard_library_at_module_level():
  # The arithmetic must be importable (and testable) without TF or NumPy; the
  # only non-standard import is the plotting helper, loaded lazily inside the
  # command when --out is given.
  # Its own modules (one_f_one_b, work, zero_bubble) import each other
  # relative to the package, never through gpipe, and the standard library
  # only.
  own = {'one_f_one_b', 'work', 'zero_bubble'}
  for path in [schedule_reference.SCHEDULE_PATH] + [
      schedule_reference.SCHEDULE_PATH.with_name(f'{name}.py')
      for name in own]:
    tree = ast.parse(path.read_text())
    top_level, relative = set(), set()
    for node in tree.body:
      if isinstance(node, ast.Import):
        top_level.update(alias.name.split('.')[0] for alias in node.names)
      elif isinstance(node, ast.ImportFrom) and node.level:
        relative.add(node.module)
      elif isinstance(node, ast.ImportFrom):
        top_level.add(node.module.split('.')[0])
    assert top_level, f'{path.name}: expected at least the dataclasses import'
    assert top_level <= set(sys.stdlib_module_names), (
        path.name, top_level - set(sys.stdlib_module_names))
    assert relative <= own, (path.name, relative)
    nested = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node not in tree.body:
        nested.add(node.module)
      elif isinstance(node, ast.Import) and node not in tree.body:
        nested.update(alias.name for alias in node.names)
    assert nested <= {'gpipe'}, (path.name, nested)
  # Streams reads the schedule it is given: it imports nothing at all.
  tree = ast.parse(schedule_reference.STREAMS_PATH.read_text())
  assert not [node for node in ast.walk(tree)
              if isinstance(node, (ast.Import, ast.ImportFrom))]
