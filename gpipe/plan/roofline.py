"""A roofline model of a TPU chip: step time from FLOPs, bytes and collectives.

This is a *prediction*, not a measurement. From what XLA measured of one
device's partitioned training step (FLOPs, per loop and in all; the
collectives), what the schedule says (the bubble) and the bytes a fused
step must move through HBM (`StepBytes`, from the step's per-device
argument sizes and the loop's stored tensors), it predicts

    compute    = flops / peak_flops
      of which model work = model_flops / N / peak_flops
               bubble     = bubble_fraction x the loops' flops / peak_flops
               the rest   (recomputation, the optimizer, ...)
    memory     = fused-step HBM traffic / hbm_bandwidth
    collective = every collective's time, one after another
                 (gpipe.plan.collectives.Seconds: a latency per ring step,
                 its bytes over one link, its own HBM traffic)

and four steps from them, each with its MFU (model FLOPs / (N x peak x
step)):

    calibrated  max(compute', memory) + what a schedule leaves of the
                collectives, compute' with the matrix work at the fitted
                efficiency (gpipe.plan.calibration): the prediction,
                what the planner's pick and the targets use
    ceiling     max(compute, memory): everything at peak, every
                collective hidden; a bound no step beats
    no overlap  max(compute, memory) + collective: at peak, collectives
                beside nothing (pessimistic)
    overlapped  the no-overlap step less what a list schedule of each
                computation runs beside its compute at peak
                (gpipe.plan.overlap)

The bytes a chip sends are each collective's, by the ring algorithm of its
kind and group size (gpipe.plan.collectives: an all-reduce over n devices
sends 2 (n - 1) / n of its bytes, a collective-permute all of them), all
over one link in one direction. Compute and HBM traffic overlap (a TPU
streams operands while its matrix units run: the larger one sets the
time). FLOPs come from XLA's CPU compile of the same module, counted for
the model's own dtype, against the chip's bf16 peak.

Why not XLA's own "bytes accessed": XLA:CPU counts every unfused
instruction's operands and results, which a TPU's fusions never write to
HBM; that count (kept in the JSON) makes most steps look memory-bound. The
traffic here is what any fused step still moves: weights read by each
iteration, gradients accumulated, the update's reads and writes, stored
activations and the loop's buffer (`StepBytes.Traffic`). It leaves out the
body's own intermediates between fusions (XLA:TPU's fusion decisions are
not known here), so it is a lower bound of the traffic.

The constants are the per-chip figures Google Cloud publishes for each
generation; a link's one-way bandwidth is the chip's bidirectional ICI
bandwidth / (2 x ICI ports). How many links in one direction a collective's
ring drives at once depends on where the mesh lies on the slice
(`Chip.links_per_axis`, gpipe.plan.torus): one, unless said otherwise.
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
  # Per mesh axis, the links (one direction each) a chip's collective along
  # it drives at once (gpipe.plan.torus.LinksPerAxis); () for one each.
  links_per_axis: tuple = ()
  # The slice's dimensions, where each candidate's links follow from its
  # mesh laid on them (gpipe.plan.torus.OnSlice); () for none.
  slice_dims: tuple = ()

  @property
  def link_bandwidth(self):
    """One ICI link, one direction, bytes per second."""
    return self.ici_bandwidth / (2 * self.ici_ports)

  def Links(self, axes):
    """The links (one direction each) a collective along mesh `axes`
    drives at once: the most any of them has (one where none is said:
    an axis along one dimension of a slice without a wraparound link)."""
    return max((self.links_per_axis[a] if a < len(self.links_per_axis)
                else 1 for a in axes), default=1)

  def Describe(self):
    return (f'TPU {self.name}: {self.peak_flops / 1e12:g} TFLOP/s (bf16), '
            f'HBM {self.hbm_bytes / GIB:.1f} GiB at '
            f'{self.hbm_bandwidth / 1e9:g} GB/s, ICI '
            f'{self.ici_bandwidth / 1e9:g} GB/s per chip over '
            f'{self.ici_ports} ports '
            f'({self.link_bandwidth / 1e9:g} GB/s per link and direction)'
            + _Said(', on a {} slice', self.slice_dims)
            + _Said(', links per mesh axis {}', self.links_per_axis))


def _Said(text, dims):
  """text with dims as '4x8' in it; '' without dims."""
  return text.format('x'.join(map(str, dims))) if dims else ''


CHIPS = {
    'v5e': Chip('v5e', 197e12, 16e9, 819e9, 400e9, 4),
    'v5p': Chip('v5p', 459e12, 95 * GIB, 2765e9, 1200e9, 6),
    'v6e': Chip('v6e', 918e12, 32e9, 1638e9, 800e9, 4),
}

@dataclasses.dataclass(frozen=True)
class StepBytes:
  """Per-device sizes that set a fused training step's HBM traffic.

  All bytes per device. The pipeline's loops run `iterations` times each
  (forward, then backward); with circular repeats a device holds R
  repeats of its stage and each iteration uses one of them.
  """
  loop_weights: float  # stage-stacked weights (all R repeats)
  loop_trainable: float  # of which trainable: their gradients accumulate
  other_weights: float  # the rest (embeddings, softmax, ...)
  other_trainable: float
  slots: float  # optimizer slots
  inputs: float  # the input batch
  stored: float  # activations the forward loop stores for the backward loop
  buffer: float  # the loop's buffer slot: what one iteration passes on
  iterations: int
  circular_repeat: int = 1
  recomputes_forward: bool = True  # the backward loop runs the body again
  clips_gradients: bool = False  # the global norm reads every gradient
  # backward_schedule='1f1b': the gradient loop runs the forward again (a
  # forward wave), and its backward wave carries the buffer's gradient.
  one_f_one_b: bool = False

  def Traffic(self):
    """{part: bytes read + written in HBM} of one step, per device.

    loop_weight_reads: each iteration reads its repeat's weights once
      forward, and backward once for the input gradient (twice with a
      recomputed forward; 1f1b: once more, for its forward wave).
    gradient_accumulation: each backward iteration reads and writes its
      repeat's weight-gradient accumulator; other gradients are written once.
    update: the optimizer reads weights, gradients and slots and writes
      weights and slots (clipping reads the gradients once more).
    stored_activations: written by the forward pass, read by the backward
      (1f1b: `stored` is T ring entries).
    buffer: each iteration reads and writes the buffer slot, forward and
      (its gradient) backward (1f1b: and in its forward wave).
    other_weights_and_inputs: read forward and backward; inputs once.
    """
    t, r = self.iterations, self.circular_repeat
    trainable = self.loop_trainable + self.other_trainable
    backward_reads = (2 if self.recomputes_forward else 1) + int(
        self.one_f_one_b)
    return {
        'loop_weight_reads': t * self.loop_weights / r * (1 + backward_reads),
        'gradient_accumulation': (2 * t * self.loop_trainable / r +
                                  self.other_trainable),
        'update': ((4 if self.clips_gradients else 3) * trainable +
                   2 * self.slots),
        'stored_activations': 2 * self.stored,
        'buffer': (6 if self.one_f_one_b else 4) * t * self.buffer,
        'other_weights_and_inputs': 2 * self.other_weights + self.inputs,
    }


@dataclasses.dataclass(frozen=True)
class Prediction:
  """The predicted step on one chip, by part (seconds unless named)."""
  compute_seconds: float  # FLOPs per device / peak
  bubble_seconds: float  # of compute: the schedule's idle share of the loops
  memory_seconds: float  # fused-step HBM traffic / bandwidth
  collective_seconds: float  # not overlapped with anything
  memory_traffic_bytes: dict  # {part: bytes}, see StepBytes.Traffic
  model_flops: float  # the model's work, all devices: 3 x its forward pass
  num_devices: int
  peak_flops: float
  # Of collective: what the compute beside each collective hides in a
  # schedule of the step (gpipe.plan.overlap), the matrix work at peak; the
  # overlapped step leaves it out.
  hidden_collective_seconds: float = 0.0
  # The calibrated step (gpipe.plan.calibration): of compute, the matrix
  # work (dots, convolutions) at peak, run at matmul_efficiency of it, and
  # what a schedule hides at that speed.
  matmul_seconds: float = 0.0
  matmul_efficiency: float = 1.0
  hidden_calibrated_seconds: float = 0.0

  @property
  def model_seconds(self):
    """Of compute: the model's own work, a device's share."""
    return self.model_flops / self.num_devices / self.peak_flops

  @property
  def other_compute_seconds(self):
    """Of compute: neither the model's work nor bubbles (a recomputed
    forward, the optimizer update, work done twice)."""
    return self.compute_seconds - self.model_seconds - self.bubble_seconds

  @property
  def step_seconds(self):
    return (max(self.compute_seconds, self.memory_seconds) +
            self.collective_seconds)

  @property
  def step_seconds_overlapped(self):
    """The step less the collectives' hidden time: never below
    max(compute, memory traffic)."""
    return max(self.compute_seconds, self.memory_seconds,
               self.step_seconds - self.hidden_collective_seconds)

  @property
  def compute_seconds_calibrated(self):
    """The compute with the matrix work at matmul_efficiency of peak (the
    rest, elementwise work, at peak)."""
    return (self.compute_seconds +
            self.matmul_seconds * (1.0 / self.matmul_efficiency - 1.0))

  @property
  def step_seconds_calibrated(self):
    """max(calibrated compute, memory traffic) + what of the collectives
    a schedule at that speed does not hide: the step targets and the
    planner's pick use."""
    return (max(self.compute_seconds_calibrated, self.memory_seconds) +
            max(0.0, self.collective_seconds - self.hidden_calibrated_seconds))

  @property
  def step_seconds_ceiling(self):
    """Every collective hidden, everything at peak: no step is shorter."""
    return max(self.compute_seconds, self.memory_seconds)

  @property
  def bound(self):
    """Which of compute and memory traffic sets the step."""
    return ('compute' if self.compute_seconds >= self.memory_seconds else
            'memory')

  @property
  def mfu(self):
    """Model FLOPs / (devices x peak x predicted step)."""
    return self.model_flops / (self.num_devices * self.peak_flops *
                               self.step_seconds)

  @property
  def mfu_overlapped(self):
    """MFU of the overlapped step."""
    return self._Mfu(self.step_seconds_overlapped)

  @property
  def mfu_calibrated(self):
    """MFU of the calibrated step: the prediction."""
    return self._Mfu(self.step_seconds_calibrated)

  @property
  def mfu_ceiling(self):
    """MFU of the ceiling step: a bound, not a prediction."""
    return self._Mfu(self.step_seconds_ceiling)

  def _Mfu(self, step_seconds):
    return self.model_flops / (self.num_devices * self.peak_flops *
                               step_seconds)

  def ToJson(self):
    return {
        'compute_seconds': self.compute_seconds,
        'model_compute_seconds': self.model_seconds,
        'bubble_seconds': self.bubble_seconds,
        'other_compute_seconds': self.other_compute_seconds,
        'memory_traffic_seconds': self.memory_seconds,
        'memory_traffic_bytes': dict(self.memory_traffic_bytes),
        'collective_seconds': self.collective_seconds,
        'step_seconds': self.step_seconds,
        'bound': self.bound,
        'overlap': 'step = max(compute, memory traffic) + collectives: '
                   'compute and HBM traffic overlap, collectives overlap '
                   'neither (what targets and the pick use); '
                   'step_seconds_overlapped = step - hidden collective '
                   'seconds (gpipe.plan.overlap)',
        'model_flops': self.model_flops,
        'mfu': self.mfu,
        'hidden_collective_seconds': self.hidden_collective_seconds,
        'step_seconds_overlapped': self.step_seconds_overlapped,
        'mfu_overlapped': self.mfu_overlapped,
        'matmul_seconds': self.matmul_seconds,
        'matmul_efficiency': self.matmul_efficiency,
        'compute_seconds_calibrated': self.compute_seconds_calibrated,
        'hidden_calibrated_seconds': self.hidden_calibrated_seconds,
        'step_seconds_calibrated': self.step_seconds_calibrated,
        'mfu_calibrated': self.mfu_calibrated,
        'step_seconds_ceiling': self.step_seconds_ceiling,
        'mfu_ceiling': self.mfu_ceiling,
    }


def Predict(chip, flops, loop_flops, bubble_fraction, step_bytes,
            collective_seconds, model_flops, num_devices, hidden_seconds=0.0,
            matmul_flops=0.0, calibration=None):
  """The step time on `chip` of one device's work, by part.

  Args:
    chip: a Chip.
    flops: FLOPs one device executes in the step.
    loop_flops: of which in the pipeline's loops (all iterations).
    bubble_fraction: the schedule's idle share of the loop iterations.
    step_bytes: a StepBytes: what sets the step's HBM traffic.
    collective_seconds: every collective of one device's step, one after
      another (gpipe.plan.collectives.StepSeconds).
    model_flops: the model's work, all devices (3 x its forward pass's
      FLOPs: gpipe.plan.model_flops.ForwardFlops).
    num_devices: devices the step runs on.
    hidden_seconds: of the collectives' time, what the compute beside
      them hides (gpipe.plan.overlap.HiddenSeconds): the overlapped step's.
    matmul_flops: of flops, the matrix units' (dots, convolutions).
    calibration: (matmul_efficiency, hidden seconds at that efficiency) of
      the calibrated step (gpipe.plan.calibration); None: the figures at
      peak.
  """
  traffic = step_bytes.Traffic()
  efficiency, hidden_calibrated = calibration or (1.0, hidden_seconds)
  return Prediction(
      compute_seconds=flops / chip.peak_flops,
      bubble_seconds=bubble_fraction * loop_flops / chip.peak_flops,
      memory_seconds=sum(traffic.values()) / chip.hbm_bandwidth,
      collective_seconds=collective_seconds,
      memory_traffic_bytes=traffic,
      model_flops=model_flops,
      num_devices=num_devices,
      peak_flops=chip.peak_flops,
      hidden_collective_seconds=hidden_seconds,
      matmul_seconds=matmul_flops / chip.peak_flops,
      matmul_efficiency=efficiency,
      hidden_calibrated_seconds=hidden_calibrated)
