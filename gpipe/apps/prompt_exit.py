"""Ending a command at once when its work is done.

When a program returns, Python finalizes: it empties every module and runs
its cycle collector over everything they held. Once TensorFlow and Lingvo
have loaded, that is a great many objects (modules, op registries, then
graphs and function libraries), and the collection takes seconds after a
command's last line (measured in docs/testing.md, "How the suite stays
fast"). A command's files are closed before it returns, so nothing needs
that collection: `Exit` leaves the objects alive then to the process's end
(gc.freeze: the collector passes them over) and exits with the command's
status. Objects their last reference frees are finalized as ever, and exit
handlers (atexit) run as ever.

    sys.exit(status)          last line ... collecting ... shell
    prompt_exit.Exit(status)  last line ... shell
"""

import gc
import sys


def Exit(status):
  """sys.exit(status), without collecting the process's objects first."""
  gc.freeze()
  sys.exit(status)
