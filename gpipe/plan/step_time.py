"""What a candidate's predicted step rests on, read off its compiled module.

The roofline (gpipe.plan.roofline) takes numbers; this gathers them for
one planned candidate (a gpipe.plan.candidate.CandidateReport): the sizes
that set its HBM traffic (`StepBytes`), its matrix work (the dots and
convolutions of the partitioned module), its collectives as a TPU runs
them (XLA:CPU's all-reduce each device slices taken as a reduce-scatter:
gpipe.xla.reduce_scatters.AsTpuRuns) and what a schedule of the step hides
of them (gpipe.plan.overlap) at a given speed of the matrix units.
"""

import functools

from gpipe.model_step import train_step
from gpipe.plan import collectives
from gpipe.plan import overlap
from gpipe.plan import roofline
from gpipe import schedule as schedule_lib
from gpipe.xla import dependencies
from gpipe.xla import hlo_text
from gpipe.xla import reduce_scatters


class StepTime:
  """The roofline's inputs of one candidate (`report`)."""

  def __init__(self, report):
    self._report = report

  @functools.cached_property
  def _trips(self):
    return hlo_text.LoopTripCounts(self._report.compiled.hlo)

  @functools.cached_property
  def tpu_runs(self):
    """The compiled module with its collectives as a TPU runs them, which
    the step's time charges; the bytes sent per axis and their floors are
    as XLA:CPU compiled them."""
    return reduce_scatters.AsTpuRuns(self._report.compiled)

  @functools.cached_property
  def matmul_flops(self):
    """Of the FLOPs per device, the matrix units' (dots, convolutions)."""
    return dependencies.Module(self._report.compiled.hlo).EntryFlops()

  def Hidden(self, matmul_efficiency=1.0):
    """Collective seconds a schedule of the step hides, its matrix work
    at matmul_efficiency of peak (gpipe.plan.overlap)."""
    r = self._report
    return overlap.HiddenSeconds(
        self.tpu_runs, self._trips, r.chip,
        mesh_shape=r.mesh_shape or (r.compiled.num_devices,),
        matmul_efficiency=matmul_efficiency)

  @functools.cached_property
  def _hidden_at_peak(self):
    return self.Hidden()

  def Predicted(self, matmul_efficiency):
    """The roofline's prediction, calibrated at matmul_efficiency."""
    r = self._report
    hidden = self._hidden_at_peak
    return roofline.Predict(
        r.chip, r.flops_per_device, sum(r.loop_flops),
        r.schedule.bubble_fraction, self.StepBytes(),
        collectives.StepSeconds(self.tpu_runs, self._trips, r.chip,
                                mesh_shape=r.mesh_shape or None),
        r.model_flops, r.compiled.num_devices, hidden,
        matmul_flops=self.matmul_flops,
        calibration=(matmul_efficiency,
                     hidden if matmul_efficiency == 1.0 else
                     self.Hidden(matmul_efficiency)))

  def StepBytes(self):
    """The per-device sizes that set the fused step's HBM traffic."""
    r = self._report
    # The step updates its trainable weights (and slots) in place.
    trainable = {param for _, param in r.step.aliases}

    def Weights(on_stages, only_trainable=False):
      return r._ArgBytes(  # pylint: disable=protected-access
          lambda i, a: (a.kind == train_step.WEIGHT and
                        a.on_stages == on_stages and
                        (i in trainable or not only_trainable)))

    return roofline.StepBytes(
        loop_weights=Weights(on_stages=True),
        loop_trainable=Weights(on_stages=True, only_trainable=True),
        other_weights=Weights(on_stages=False),
        other_trainable=Weights(on_stages=False, only_trainable=True),
        slots=r.Bytes(train_step.SLOT),
        inputs=r.Bytes(train_step.INPUT),
        stored=self._StoredTrafficBytes(),
        # One iteration's buffer slot: what the rotation sends on.
        buffer=r.permute_bytes_per_iteration,
        iterations=r.schedule.num_iterations,
        circular_repeat=r.schedule.circular_repeat,
        recomputes_forward=r.candidate.remat_policy == 'recompute',
        one_f_one_b=r.one_f_one_b,
        clips_gradients=r.step.clip_norm > 0)

  def _StoredTrafficBytes(self):
    """What the stored activations amount to over a step, each written
    once and read once: the stacks, or T ring entries."""
    r = self._report
    if r.one_f_one_b:
      ring_size = schedule_lib.OneFOneB(r.schedule).ring_size
      return (r.stored_activation_bytes / ring_size *
              r.schedule.num_iterations)
    return r.stored_activation_bytes
