"""Lingvo layers built as for a TPU job, wherever they are built.

Lingvo picks some ops by --xla_device, and annotates some weights only for
a TPU; what is built to be partitioned for TPUs (the planner's step, the
model check's) is built this way on any host.
"""

import contextlib

from absl import flags as absl_flags

from gpipe.lingvo_support import flags_and_seeds
from lingvo.core import scatter_update


@contextlib.contextmanager
def AsOnTpu():
  """Lingvo layers build the code they would build for a TPU job.

  Lingvo picks some ops by --xla_device: on a TPU, e.g., a projection of a
  [time, batch, dim] input is an einsum; elsewhere a broadcasting matmul
  whose weight gradient materializes one [dim, hidden] product per time
  step before summing them; and weights get the sharding annotations
  their layers attach only for a TPU. The planner describes the TPU
  program, so it builds and lowers with xla_device='tpu' (and asserts off,
  as on a TPU). Lingvo's row writes (scatter_update, e.g. in its
  Recurrent) are the functional kind: TensorFlow's InplaceUpdate op has no
  XLA kernel.
  """
  flags_and_seeds.EnsureFlagsParsed()
  flags = absl_flags.FLAGS
  saved = flags.xla_device, flags.enable_asserts
  flags.xla_device, flags.enable_asserts = 'tpu', False
  try:
    with scatter_update.SetInplaceUpdate(False):
      yield
  finally:
    flags.xla_device, flags.enable_asserts = saved
