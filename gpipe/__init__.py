"""gpipe: a GShard-style pipeline-parallel layer for TensorFlow and Lingvo.

Importing gpipe makes lingvo importable on machines whose glibc is older than
lingvo's custom-op library needs (see gpipe.lingvo_support.lingvo_ops): the
first import of lingvo after `import gpipe` runs `lingvo_ops.EnsureLingvoOps()`
first. Import gpipe before lingvo. Importing gpipe alone loads neither
TensorFlow nor lingvo (the schedule command is pure arithmetic).

The package, by job (the public surface is each public module's __all__,
docs/api.md; each subpackage's docstring maps its modules):

    layers            PipelinedLayer (Lingvo's LayerwiseShardablePipelined-
                      Layer), ValidateParams
    sharding          XLA sharding annotations; SpmdPartitioning
    lingvo_compat     UseGpipeInLingvo: Lingvo's own models on gpipe
    schedule          the schedule's arithmetic (and the schedule command)
    microbatch        the batch in microbatches and back
    nest              nested structures of tensors, None leaves kept
    recurrent         the loop whose gradient recomputes each iteration
    quiet             the commands' quiet logs
    flag_spellings    older spellings of the commands' flags, still taken
    check_partitioning, demo, lingvo_trainer, plan (a package): the commands
    pipeline          the layer's data path, in the order a call runs it
    loops             the loops' machinery under recurrent
    xla               XLA's SPMD partitioner on virtual CPU devices
    model_step        a model's whole training step as a function of tensors
    lingvo_support    what gpipe needs of Lingvo around the layer
    apps              the commands' own code
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
