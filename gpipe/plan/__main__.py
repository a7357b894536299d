"""python -m gpipe.plan: see gpipe.plan.cli."""

import sys

# Before TensorFlow loads, so that the command prints its own lines only.
from gpipe import quiet  # pylint: disable=g-bad-import-order

quiet.UnlessVerbose()

from gpipe.plan import cli  # pylint: disable=g-import-not-at-top

if __name__ == '__main__':
  sys.exit(cli.main())
