"""Lingvo's absl flags and step seeds, as the pipeline needs them.

Lingvo reads absl flags while it builds a model and keys its step seeds by
graph; the layer and the commands use these three wherever they build
Lingvo layers outside Lingvo's own programs (a script, a test, a
tf.function).
"""

from absl import flags
import tensorflow as tf

from lingvo.core import py_utils


def NextStepSeed():
  """py_utils.GetIncStepSeed(), safe against a stale seed of a dead graph.

  Lingvo keys the step seed by id() of the default graph; a new graph can
  reuse the id of one that was garbage collected, and would then be handed
  a tensor of that dead graph. Such a seed is reset first, as for a new
  graph.
  """
  seed = py_utils.GetStepSeed()
  if (not tf.executing_eagerly() and hasattr(seed, 'graph') and
      seed.graph is not tf.compat.v1.get_default_graph()):
    py_utils.ResetStepSeed()
  return py_utils.GetIncStepSeed()


def CallersGlobalStep():
  """The global step the caller's FProp sees, or None where there is none.

  Lingvo reads its --xla_device flag to find a global step when no
  GlobalStepContext is active; without parsed flags (a plain script or a
  test) there is none to find.
  """
  try:
    return py_utils.GetGlobalStep()
  except flags.UnparsedFlagAccessError:
    return None


def EnsureFlagsParsed():
  """Lingvo reads absl flags (e.g. --xla_device) while building a model.

  A script, a test or a tf.function that never ran absl.app has unparsed
  flags, and Lingvo code would raise UnparsedFlagAccessError; mark them
  parsed so that their defaults apply (a later absl.app.run still parses
  the command line).
  """
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
