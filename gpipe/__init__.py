"""gpipe: a GShard-style pipeline-parallel layer for TensorFlow and Lingvo.

Importing gpipe makes lingvo importable on machines whose glibc is older than
lingvo's custom-op library needs (see gpipe.lingvo_support.lingvo_ops): the
first import of lingvo after `import gpipe` runs `lingvo_ops.EnsureLingvoOps()`
first. Import gpipe before lingvo. Importing gpipe alone loads neither
TensorFlow nor lingvo (the schedule command is pure arithmetic).
"""

import sys

__version__ = '0.1.0'


class _LingvoOpsBeforeLingvo:
  """A sys.meta_path finder that finds nothing: it only runs
  EnsureLingvoOps() before the first import of lingvo goes on."""

  def __init__(self):
    self.done = False

  def find_spec(self, name, path=None, target=None):
    del path, target
    if not self.done and name.partition('.')[0] == 'lingvo':
      self.done = True
      from gpipe.lingvo_support import lingvo_ops  # pylint: disable=g-import-not-at-top
      lingvo_ops.EnsureLingvoOps()
    return None


if 'lingvo' in sys.modules:
  from gpipe.lingvo_support import lingvo_ops as _lingvo_ops  # pylint: disable=g-import-not-at-top
  _lingvo_ops.EnsureLingvoOps()
else:
  sys.meta_path.insert(0, _LingvoOpsBeforeLingvo())
