"""python -m gpipe.plan: see gpipe.plan.cli."""

# The arguments are read before TensorFlow loads (--help and usage errors
# answer at once), and the libraries are quieted before they load.
from gpipe.plan import flags  # pylint: disable=g-bad-import-order
from gpipe import quiet  # pylint: disable=g-bad-import-order

if __name__ == '__main__':
  flags.Parse()
  quiet.UnlessVerbose()

from gpipe.plan import cli  # pylint: disable=g-import-not-at-top
import params.lm  # pylint: disable=g-import-not-at-top,unused-import  (the zoo)

if __name__ == '__main__':
  from gpipe.apps import prompt_exit  # pylint: disable=g-import-not-at-top
  prompt_exit.Exit(cli.main())
