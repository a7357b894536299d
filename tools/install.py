"""Installs gpipe and its dependencies into the running Python environment.

Usage: python tools/install.py [--extra test] [--extra ...]

`pip install .` works too, but pulls lingvo's full dependency set (apache-beam,
jupyter, tensorflow-datasets, ...: about 3.5 GB) although lingvo's core modules
need none of it. This script reads pyproject.toml, installs the packages listed
under [tool.gpipe.install].no_deps without their dependencies, and everything
else normally, then gpipe itself in editable mode, and a one-line
`gpipe_lingvo_ops.pth` in site-packages: Python then imports gpipe at start-up
(which loads neither TensorFlow nor lingvo), so lingvo is importable in this
environment whatever imports it first (gpipe.lingvo_support.lingvo_ops).
"""

import argparse
import pathlib
import re
import subprocess
import sys
import sysconfig
import tomllib

_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _Name(requirement):
  return re.split(r'[\s<>=!~;\[]', requirement, maxsplit=1)[0].lower()


def _Pip(*args):
  cmd = [sys.executable, '-m', 'pip', 'install', '--disable-pip-version-check',
         '-q', *args]
  print('+', ' '.join(cmd), flush=True)
  subprocess.check_call(cmd)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--extra', action='append', default=[],
                      help='optional-dependency group to install too')
  args = parser.parse_args()
  project = tomllib.loads((_ROOT / 'pyproject.toml').read_text())
  no_deps = {n.lower() for n in project['tool']['gpipe']['install']['no_deps']}
  requirements = list(project['project']['dependencies'])
  for extra in args.extra:
    requirements += project['project']['optional-dependencies'][extra]
  plain = [r for r in requirements if _Name(r) not in no_deps]
  lean = [r for r in requirements if _Name(r) in no_deps]
  _Pip(*plain)
  if lean:
    _Pip('--no-deps', *lean)
  _Pip('--no-deps', '-e', str(_ROOT))
  _LingvoImportableHere()


# Lines of a .pth file that start with `import` run at start-up; this one
# does nothing where gpipe cannot be found (a moved checkout).
_PTH_LINE = ("import importlib.util as _u; "
             "_u.find_spec('gpipe') and __import__('gpipe')\n")


def _LingvoImportableHere():
  """Every Python of this environment imports gpipe at start-up: lingvo is
  then importable whatever module imports it first (gpipe's import hook,
  which loads lingvo's ops or their stand-ins before lingvo)."""
  path = pathlib.Path(sysconfig.get_paths()['purelib']) / 'gpipe_lingvo_ops.pth'
  path.write_text(_PTH_LINE)
  print('+ wrote', path, flush=True)


if __name__ == '__main__':
  main()
