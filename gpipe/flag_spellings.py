"""Older spellings of command-line flags, accepted until gpipe REMOVED_IN.

The commands speak one dialect, Lingvo's: flags named like the layer's
Params, with underscores (--num_stages, --circular_repeat, --skip_check).
A spelling from before (--stages, --circular-repeat, --skip-check) is
rewritten to the current one with a one-line note on standard error, so
that scripts keep working while they are updated. The spellings and this
module go in version REMOVED_IN (CHANGELOG.md says so; a test fails once
the version reaches it).
"""

import sys

REMOVED_IN = '0.2.0'


def Respell(argv, renamed, prog, stream=None):
  """argv with each old flag spelling replaced by its current one.

  Args:
    argv: the command-line arguments (without the program name).
    renamed: {old flag: current flag}, e.g. {'--stages': '--num_stages'}.
    prog: the program's name, for the note.
    stream: where notes go (default: standard error).

  Returns:
    The arguments, `--old` and `--old=value` respelled; nothing after a
    bare `--` is touched.
  """
  stream = sys.stderr if stream is None else stream
  out, noted = [], set()
  for i, arg in enumerate(argv):
    if arg == '--':
      return out + list(argv[i:])
    flag, eq, value = arg.partition('=')
    current = renamed.get(flag)
    if current is not None:
      if flag not in noted:
        noted.add(flag)
        print(f'{prog}: note: {flag} is now spelled {current}; the old '
              f'spelling works until gpipe {REMOVED_IN}.', file=stream)
      arg = current + eq + value
    out.append(arg)
  return out
