"""The model's work, the FLOPs a planned step's MFU counts.

3 x the FLOPs of the step's forward pass, compiled for one device with
every pipelined stack run as the plain stack: no bubble, nothing
recomputed. Counting them is a compile of its own, so it is done once
per plan and only when a prediction asks for it; each stack's layers run
as one loop over the layer index (gpipe.pipeline.layer_loop), so that
compile is of one layer, not of all of them.
"""

from gpipe.lingvo_support import tpu_build
from gpipe.pipeline import unrolled
from gpipe import sharding
from gpipe.xla import partitioning


class ModelFlops:
  """3 x ForwardFlops(step), counted when first asked for, then kept.

  Counting them compiles the step's forward pass once more: a plan's
  candidates share one ModelFlops (the model's work does not depend on
  its M, R or mesh), and a caller that reads no prediction (bytes per
  device, collectives) never compiles it.
  """

  def __init__(self, step, timeout=1800):
    self._step = step
    self._timeout = timeout
    self._flops = None

  def __call__(self):
    if self._flops is None:
      self._flops = 3 * ForwardFlops(self._step, self._timeout)
    return self._flops


def ForwardFlops(step, timeout=1800, as_loop=True):
  """XLA's FLOPs of the step's forward pass (its loss), compiled for one
  device with every pipelined stack run as the plain stack
  (gpipe.pipeline.unrolled.Everywhere): the model's own work, with no
  bubble and nothing recomputed. MFU counts 3 x these (a backward pass
  is twice its forward), as PaLM's and MaxText's MFU do. `timeout`: the
  seconds its compile may take. `as_loop`: each stack's layers as one
  loop (the same FLOPs, and a few scalar ones a layer for its index,
  gpipe.pipeline.layer_loop); False: every layer built into the module.
  """
  specs = [a.spec for a in step.weight_args + step.input_args]

  def Forward(*args):
    with sharding.SpmdPartitioning(False), unrolled.Everywhere(as_loop):
      return step.Loss(*args)

  with tpu_build.AsOnTpu():
    proto = partitioning.LowerFromShapes(Forward, specs)
  return partitioning.CompileFromShapes(proto, 1,
                                        timeout=timeout).Cost('flops')
