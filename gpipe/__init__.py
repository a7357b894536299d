"""gpipe: a GShard-style pipeline-parallel layer for TensorFlow and Lingvo.

Importing gpipe makes lingvo importable on machines whose glibc is older than
lingvo's custom-op library needs (see gpipe.lingvo_support.lingvo_ops): the
first import of lingvo after `import gpipe` runs `lingvo_ops.EnsureLingvoOps()`
first. Import gpipe before lingvo. Importing gpipe alone loads neither
TensorFlow nor lingvo (the schedule command is pure arithmetic).

The package, from the top down: each module imports only modules listed
below it. A subpackage counts as one module here, and the map in its
docstring orders its own modules the same way; a package's __init__ (its
re-exports) and __main__ may import anything of their package
(tests/house_test.py checks). The public surface is each public module's
__all__ (docs/api.md).

  The commands:
    check_partitioning  does a PipelinedLayer (or a registered model) split
                        over devices as intended?
    demo                trains a pipelined LM on CPU, shows its schedule
    lingvo_trainer      Lingvo's own trainer, gpipe's models registered
    plan                will it fit? (a package: the planner)
  What the commands stand on:
    apps                the commands' own code
    xla                 XLA's SPMD partitioner on virtual CPU devices
    model_step          a model's whole training step as a function of
                        tensors
  The layer:
    lingvo_compat       UseGpipeInLingvo: Lingvo's own models on gpipe
    layers              PipelinedLayer (Lingvo's LayerwiseShardablePipelined-
                        Layer), ValidateParams
    lingvo_support      what gpipe needs of Lingvo around the layer
    pipeline            the layer's data path, in the order a call runs it
    recurrent           the loop whose gradient recomputes each iteration
    loops               the loops' machinery under recurrent
  The ground floor:
    microbatch          the batch in microbatches and back
    sharding            XLA sharding annotations; SpmdPartitioning
    nest                nested structures of tensors, None leaves kept
    schedule            the schedule's arithmetic (and the schedule command)
    flag_spellings      older spellings of the commands' flags, still taken
    quiet               the commands' quiet logs
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
