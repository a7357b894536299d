"""A roofline model of a TPU chip: step time from FLOPs, bytes and collectives.

This is a *prediction*, not a measurement. Given what XLA reports for one
device's partitioned training step (FLOPs, bytes accessed, collective
bytes), it predicts

    step = max(flops / peak_flops, bytes_accessed / hbm_bandwidth)
           + sum over collectives of factor * bytes / link_bandwidth

with `factor` 1 for a collective-permute (a neighbour send over one link),
2 for an all-reduce (a ring's reduce-scatter + all-gather) and 1 for the
rest. Collectives are assumed not to overlap compute (pessimistic);
compute runs at peak (optimistic): the prediction ranks configurations, it
does not promise a wall time. FLOPs come from XLA's CPU compile of the same
module, counted for the model's own dtype, against the chip's bf16 peak.

The constants are the per-chip figures Google Cloud publishes for each
generation; a link's one-way bandwidth is the chip's bidirectional ICI
bandwidth / (2 x ICI ports).
"""

import dataclasses

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  name: str
  peak_flops: float  # bf16, per second
  hbm_bytes: float
  hbm_bandwidth: float  # bytes per second
  ici_bandwidth: float  # bidirectional, per chip, bytes per second
  ici_ports: int

  @property
  def link_bandwidth(self):
    """One ICI link, one direction, bytes per second."""
    return self.ici_bandwidth / (2 * self.ici_ports)

  def Describe(self):
    return (f'TPU {self.name}: {self.peak_flops / 1e12:g} TFLOP/s (bf16), '
            f'HBM {self.hbm_bytes / GIB:.1f} GiB at '
            f'{self.hbm_bandwidth / 1e9:g} GB/s, ICI {self.ici_bandwidth / 1e9:g}'
            f' GB/s per chip over {self.ici_ports} ports '
            f'({self.link_bandwidth / 1e9:g} GB/s per link and direction)')


CHIPS = {
    'v5e': Chip('v5e', 197e12, 16e9, 819e9, 400e9, 4),
    'v5p': Chip('v5p', 459e12, 95 * GIB, 2765e9, 1200e9, 6),
    'v6e': Chip('v6e', 918e12, 32e9, 1638e9, 800e9, 4),
}

_COLLECTIVE_FACTOR = {'collective-permute': 1.0, 'all-reduce': 2.0}


@dataclasses.dataclass(frozen=True)
class Prediction:
  compute_seconds: float
  memory_seconds: float
  collective_seconds: float

  @property
  def step_seconds(self):
    return (max(self.compute_seconds, self.memory_seconds) +
            self.collective_seconds)


def Predict(chip, flops, bytes_accessed, collective_bytes):
  """Step time on `chip` of one device's work.

  Args:
    chip: a Chip.
    flops: FLOPs one device executes in the step.
    bytes_accessed: bytes it reads and writes in HBM.
    collective_bytes: {collective kind: bytes it sends in the step}.
  """
  collective = sum(
      _COLLECTIVE_FACTOR.get(kind, 1.0) * nbytes
      for kind, nbytes in collective_bytes.items()) / chip.link_bandwidth
  return Prediction(
      compute_seconds=flops / chip.peak_flops,
      memory_seconds=bytes_accessed / chip.hbm_bandwidth,
      collective_seconds=collective)
