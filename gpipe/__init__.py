"""gpipe: a GShard-style pipeline-parallel layer for TensorFlow and Lingvo.

Importing gpipe makes lingvo importable on machines whose glibc is older than
lingvo's custom-op library needs (see gpipe.lingvo_ops). Import gpipe before
lingvo.
"""

from gpipe import lingvo_ops as _lingvo_ops

_lingvo_ops.EnsureLingvoOps()

__version__ = '0.1.0'
