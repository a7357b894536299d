"""Plausible bugs, each put into a fresh copy of the checkout: the suite must
catch every one.

Each bug (tools/planted_bugs.py) is one of a kind that has slipped through
test suites, written as an exact replacement in one file, with the tests
that should catch it. For each, the
checkout's files (tracked and new, as `git ls-files` lists them) are copied
to a temporary directory, the replacement is made there, and those tests
run in the copy; the bug is caught when they fail. The tests are first run
unchanged (in a copy too): a test that fails anyway catches nothing.

    .venv/bin/python tools/mutants.py            # every bug (about 10 min)
    .venv/bin/python tools/mutants.py --list     # what is in the set
    .venv/bin/python tools/mutants.py --only plan-fit-on-temp,decode-stage-0
    .venv/bin/python tools/mutants.py --quick    # survivors: whole suite

With --quick, a bug its named tests miss is run against the whole suite
(`tests/`, stopping at the first failure; the unchanged suite is run once
first, if any bug needs it): caught there, its entry should name the test
that caught it.

Exits 1 if a bug got through, or if a replacement no longer matches the
code (update the entry with the code). When a feature lands, add the bugs
its tests are there to catch to tools/planted_bugs.py; when a bug gets
through, add it there with the test that now catches it.
"""

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


from planted_bugs import BUGS  # pylint: disable=g-bad-import-order
from planted_bugs import Bug  # pylint: disable=g-bad-import-order


def _Copy(dest):
  """The checkout's tracked and new (not ignored) files, copied to dest."""
  names = subprocess.run(
      ['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'],
      cwd=ROOT, check=True, capture_output=True).stdout.decode().split('\0')
  for name in filter(None, names):
    source = ROOT / name
    if source.is_file():
      target = dest / name
      target.parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(source, target)


def _Apply(dest, bug):
  """Makes the bug's replacement in the copy; '' or why it cannot."""
  path = dest / bug.path
  text = path.read_text()
  count = text.count(bug.old)
  if count != 1:
    return (f'{bug.path}: the text to replace occurs {count} times (once '
            'expected): update the entry with the code')
  path.write_text(text.replace(bug.old, bug.new))
  return ''


# The whole suite, for --quick's survivors: one worker (the machine's
# other core is left to whatever else runs), first failure ends it.
SUITE = ('-n', '1', 'tests')


def _RunTests(dest, tests, log):
  """Runs pytest on `tests` in the copy; its exit status."""
  env = dict(os.environ, PYTHONPATH=str(dest))
  with open(log, 'w') as out:
    return subprocess.run(
        [sys.executable, '-m', 'pytest', '-x', '-q', '-p',
         'no:cacheprovider', *tests], cwd=dest, env=env, stdout=out,
        stderr=subprocess.STDOUT).returncode


def _InCopy(bug, logs, mutate, tests=None, suffix=''):
  """Runs the bug's tests (or `tests`) in a fresh copy, with the bug if
  `mutate`; (exit status or None, problem)."""
  with tempfile.TemporaryDirectory(prefix='gpipe-bug-') as tmp:
    dest = pathlib.Path(tmp)
    _Copy(dest)
    if mutate:
      problem = _Apply(dest, bug)
      if problem:
        return None, problem
    suffix = ('bug' if mutate else 'unchanged') + suffix
    return _RunTests(dest, bug.tests if tests is None else tests,
                     logs / f'{bug.name}.{suffix}.log'), ''


def _Verdict(bug, logs, quick, suite_passes):
  """'caught', 'caught by the suite', 'GOT THROUGH', 'STALE' or 'TESTS
  FAIL UNCHANGED', and the problem; `suite_passes()` says (once) whether
  the unchanged suite passes."""
  status, problem = _InCopy(bug, logs, mutate=False)
  if status != 0:
    return 'TESTS FAIL UNCHANGED', problem
  status, problem = _InCopy(bug, logs, mutate=True)
  if problem:
    return 'STALE', problem
  if status not in (0, 5):
    return 'caught', ''
  if not quick:
    return 'GOT THROUGH', ''
  if not suite_passes():
    return 'GOT THROUGH', 'and the unchanged suite fails: see its log'
  status, _ = _InCopy(bug, logs, mutate=True, tests=SUITE, suffix='.suite')
  if status not in (0, 5):
    return 'caught by the suite', 'not by its tests: name the one that did'
  return 'GOT THROUGH', 'the whole suite too'


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--list', action='store_true',
                      help='list the bugs and the tests meant to catch them')
  parser.add_argument('--only', default='',
                      help='comma-separated bug names (default: all)')
  parser.add_argument('--quick', action='store_true',
                      help="each bug against its named tests, then, if "
                      'they miss it, against the whole suite')
  parser.add_argument('--logs', default='',
                      help='directory for each run\'s pytest output '
                      '(default: a temporary one, named at the end)')
  args = parser.parse_args(argv)
  bugs = BUGS
  if args.only:
    wanted = args.only.split(',')
    unknown = sorted(set(wanted) - {b.name for b in BUGS})
    if unknown:
      parser.error(f'--only: no bug named {", ".join(unknown)}; --list '
                   'lists them')
    bugs = [b for b in BUGS if b.name in wanted]
  if args.list:
    for b in bugs:
      print(f'{b.name:32} {b.why}\n{"":32} {b.path}; tests: '
            f'{" ".join(b.tests)}')
    return 0
  logs = pathlib.Path(args.logs or tempfile.mkdtemp(prefix='gpipe-bugs-'))
  logs.mkdir(parents=True, exist_ok=True)
  failures = []
  suite = []  # the unchanged suite's exit status, once run

  def SuitePasses():
    if not suite:
      suite.append(_InCopy(Bug('suite', '', '', '', '', SUITE), logs,
                           mutate=False)[0])
    return suite[0] == 0

  for bug in bugs:
    began = time.time()
    verdict, problem = _Verdict(bug, logs, args.quick, SuitePasses)
    if not verdict.startswith('caught'):
      failures.append(bug.name)
    print(f'{verdict:20} {bug.name:32} {time.time() - began:5.0f} s'
          f'{"  " + problem if problem else ""}', flush=True)
  print(f'{len(bugs) - len(failures)} of {len(bugs)} caught; pytest output '
        f'in {logs}')
  return 1 if failures else 0


if __name__ == '__main__':
  sys.exit(main())
