"""Every dotted gpipe name the code and the docs mention names something.

Docstrings and pages point readers on by name (`gpipe.schedule.OneFOneB`,
`gpipe.pipeline.streamed_io.StreamedIo`); a module renamed or a function
removed leaves such a pointer dangling, and nothing else would notice.
"""

import collections
import importlib
import pathlib
import re

_ROOT = pathlib.Path(__file__).resolve().parents[1]
# gpipe.a.b.C.d, not inside a path (gpipe/...) or a longer name (my_gpipe.x).
_NAME = re.compile(r'(?<![\w./-])gpipe(?:\.[A-Za-z_]\w*)+')


def _Texts():
  """(path, text) of every source file and page a reader meets."""
  paths = [p for d in ('gpipe', 'params', 'benchmarks', 'examples', 'tools')
           for p in sorted((_ROOT / d).rglob('*.py'))]
  paths += sorted((_ROOT / 'docs').glob('*.md'))
  paths += [_ROOT / n for n in ('README.md', 'BENCHMARKS.md', 'CHANGELOG.md')]
  return [(p.relative_to(_ROOT), p.read_text()) for p in paths]


def _Module(parts):
  """(the longest importable module prefix of parts, the rest)."""
  for i in range(len(parts), 0, -1):
    name = '.'.join(parts[:i])
    if parts[i - 1] == '__main__':
      continue
    try:
      return importlib.import_module(name), parts[i:]
    except ModuleNotFoundError as e:
      if e.name and name.startswith(e.name):
        continue  # that module does not exist: try a shorter prefix
      raise
  raise AssertionError(parts)


def _Resolves(dotted):
  """Whether gpipe.x.y.z names a module, or an attribute or field of one."""
  obj, rest = _Module(dotted.split('.'))
  for attr in rest:
    if hasattr(obj, attr):
      obj = getattr(obj, attr)
    else:  # a dataclass field or annotated attribute names a value too
      return (attr in getattr(obj, '__dataclass_fields__', {}) or
              attr in getattr(obj, '__annotations__', {}))
  return True


def test_every_dotted_gpipe_name_resolves():
  texts = _Texts()
  mentions = collections.defaultdict(set)
  for path, text in texts:
    for match in _NAME.finditer(text):
      mentions[match.group(0)].add(str(path))
  assert len(mentions) > 100, 'the pattern no longer finds the names'
  dangling = {name: sorted(paths) for name, paths in mentions.items()
              if not _Resolves(name)}
  assert not dangling, (
      'These names resolve to nothing (renamed or removed?): ' +
      '; '.join(f'{n} in {", ".join(p)}' for n, p in sorted(dangling.items())))


def test_a_dangling_name_is_found():
  assert _Resolves('gpipe.schedule.streams.Streams')
  assert _Resolves('gpipe.pipeline.loop_io')
  assert not _Resolves('gpipe.streams')
  assert not _Resolves('gpipe.schedule.NoSuchThing')
