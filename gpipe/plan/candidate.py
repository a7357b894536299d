"""One candidate: lowered from shapes, partitioned, compiled; what XLA says.

    target.Build(candidate) -> TrainStep --LowerFromShapes--> HLO (as a TPU
    job builds it) --CompileFromShapes(N devices)--> CompiledModule
    --> CandidateReport: bytes per device by kind, FLOPs, collectives per
        loop, problems (weights not split, gathered), the roofline's
        prediction
"""

import contextlib
import dataclasses
import time

from absl import flags as absl_flags
import numpy as np

from gpipe import partitioning
from gpipe import schedule as schedule_lib
from gpipe import sharding
from gpipe import stage_call
from gpipe.plan import roofline
from gpipe.plan import targets
from gpipe.plan import train_step
from gpipe.plan.report import Plan


@dataclasses.dataclass
class CandidateReport:
  """What XLA measured for one candidate, and what the roofline predicts."""
  candidate: targets.Candidate
  schedule: schedule_lib.Schedule
  compiled: partitioning.CompiledModule
  step: train_step.TrainStep
  chip: roofline.Chip
  hbm_bytes: float
  seconds: float  # wall time to lower and compile

  def Bytes(self, kind):
    """Bytes one device holds of the step arguments of `kind`."""
    return sum(
        int(np.prod(shard, dtype=np.int64)) * arg.spec.dtype.size
        for arg, shard in zip(self.step.args, self.compiled.param_shard_shapes)
        if arg.kind == kind)

  def TotalBytes(self, kind):
    return sum(arg.spec.shape.num_elements() * arg.spec.dtype.size
               for arg in self.step.args if arg.kind == kind)

  @property
  def per_device_bytes(self):
    return {
        'weights': self.Bytes(train_step.WEIGHT),
        'optimizer': self.Bytes(train_step.SLOT),
        'temp': self.compiled.memory['temp_size_in_bytes'],
        'peak': self.compiled.peak_bytes,
    }

  @property
  def fits(self):
    return self.compiled.peak_bytes <= self.hbm_bytes

  def Unsplit(self):
    """Stage-stacked weights and slots that every device holds whole."""
    num_stages = self.schedule.num_stages
    if num_stages == 1:
      return []
    return [
        arg.name
        for arg, shard in zip(self.step.args, self.compiled.param_shard_shapes)
        if arg.on_stages and tuple(shard) == tuple(arg.spec.shape)
    ]

  def Gathered(self):
    """All-gathers / all-to-alls whose result is a weight's or slot's shape."""
    shapes = [
        tuple(a.spec.shape) for a in self.step.args
        if a.kind in (train_step.WEIGHT, train_step.SLOT) and a.on_stages
    ]
    return partitioning.GatheredTensors(self.compiled.collectives, shapes)

  def Problems(self):
    problems = []
    unsplit = self.Unsplit()
    if unsplit:
      problems.append(
          f'{len(unsplit)} stage-stacked weights/slots are not split over '
          f'the devices (e.g. {unsplit[0]}): set shard_stages_1d=True (or '
          'pipeline_stage_mesh_dim with device_mesh) on the PipelinedLayer')
    for c in self.Gathered():
      problems.append(f'{c.kind} of a weight or slot ({c.shape}, from '
                      f'{c.op_name or "?"})')
    return problems

  def LoopSummaries(self):
    """Per loop: trip count and {kind: [count, bytes]} per iteration."""
    summaries = []
    trips = partitioning.LoopTripCounts(self.compiled.hlo)
    for i, body in enumerate(self.compiled.loops):
      kinds = {}
      for c in self.compiled.LoopCollectives(i):
        count, nbytes = kinds.get(c.kind, (0, 0))
        kinds[c.kind] = (count + 1, nbytes + c.bytes)
      summaries.append({
          'iterations': trips.get(body, 1),
          'collectives': {k: {'count': n, 'bytes': b}
                          for k, (n, b) in sorted(kinds.items())},
      })
    return summaries

  def CollectiveBytesPerStep(self):
    total = {}
    for loop in self.LoopSummaries():
      for kind, c in loop['collectives'].items():
        total[kind] = total.get(kind, 0) + c['bytes'] * loop['iterations']
    for c in self.compiled.LoopCollectives(-1):
      total[c.kind] = total.get(c.kind, 0) + c.bytes
    return total

  @property
  def permute_bytes_per_iteration(self):
    """Collective-permute bytes per iteration of the forward (first) loop."""
    loops = self.LoopSummaries()
    if not loops:
      return 0
    return loops[0]['collectives'].get('collective-permute',
                                       {}).get('bytes', 0)

  @property
  def flops_per_device(self):
    return self.compiled.Cost('flops')

  @property
  def flops_unpartitioned(self):
    return self.compiled.reference_cost['flops']

  @property
  def prediction(self):
    return roofline.Predict(self.chip, self.flops_per_device,
                            self.compiled.Cost('bytes accessed'),
                            self.CollectiveBytesPerStep())

  def ToJson(self):
    n = self.compiled.num_devices
    return {
        'num_microbatches': self.candidate.num_microbatches,
        'circular_repeat': self.candidate.circular_repeat,
        'remat_policy': self.candidate.remat_policy,
        'iterations': self.schedule.num_iterations,
        'bubble_fraction': self.schedule.bubble_fraction,
        'per_device_bytes': self.per_device_bytes,
        'fits': self.fits,
        'problems': self.Problems(),
        'flops_per_device': self.flops_per_device,
        'flops_unpartitioned': self.flops_unpartitioned,
        'flops_ratio': self.flops_per_device / (self.flops_unpartitioned / n),
        'bytes_accessed_per_device': self.compiled.Cost('bytes accessed'),
        'permute_bytes_per_iteration': self.permute_bytes_per_iteration,
        'loops': self.LoopSummaries(),
        'collective_bytes_per_step': self.CollectiveBytesPerStep(),
        'predicted_step_seconds': self.prediction.step_seconds,
        'predicted': dataclasses.asdict(self.prediction),
        'largest_buffers': [{
            'bytes': b, 'type': t, 'op': op
        } for b, t, op in partitioning.LargestBuffers(self.compiled.hlo)],
        'compile_seconds': self.seconds,
    }


def PlanCandidate(target, candidate, num_devices, chip, hbm_bytes,
                  depth_param='num_blocks'):
  """Lowers, partitions and compiles one candidate; a CandidateReport."""
  start = time.time()
  step = target.Build(candidate, depth_param)
  stacks = train_step.FindPipelinedLayers(step.root)
  stack_p = stacks[0][1].params
  sched = schedule_lib.Schedule(
      num_stages=stack_p.num_stages,
      num_microbatches=candidate.num_microbatches,
      circular_repeat=candidate.circular_repeat)

  def Partitioned(*args):
    with sharding.SpmdPartitioning():
      return step(*args)

  def Unpartitioned(*args):
    with sharding.SpmdPartitioning(False):
      return step(*args)

  with AsOnTpu():
    partitioned = partitioning.LowerFromShapes(Partitioned, step.specs)
    reference = partitioning.LowerFromShapes(Unpartitioned, step.specs)
  compiled = partitioning.CompileFromShapes(
      partitioned,
      num_devices,
      reference_proto=reference,
      aliases=step.aliases)
  return CandidateReport(candidate=candidate, schedule=sched,
                         compiled=compiled, step=step, chip=chip,
                         hbm_bytes=hbm_bytes, seconds=time.time() - start)


@contextlib.contextmanager
def AsOnTpu():
  """Lingvo layers build the code they would build for a TPU job.

  Lingvo picks some ops by --xla_device: on a TPU, e.g., a projection of a
  [time, batch, dim] input is an einsum; elsewhere a broadcasting matmul
  whose weight gradient materializes one [dim, hidden] product per time
  step before summing them. The planner describes the TPU program, so it
  lowers with xla_device='tpu' (and asserts off, as on a TPU).
  """
  stage_call.EnsureFlagsParsed()
  flags = absl_flags.FLAGS
  saved = flags.xla_device, flags.enable_asserts
  flags.xla_device, flags.enable_asserts = 'tpu', False
  try:
    yield
  finally:
    flags.xla_device, flags.enable_asserts = saved


def MakePlan(target, candidates, num_devices, chip, hbm_bytes,
             depth_param='num_blocks', log=None):
  """Plans every candidate; invalid ones are skipped with their reason."""
  reports, skipped = [], []
  for candidate in candidates:
    if log:
      log(f'Compiling {candidate.Describe()} for {num_devices} devices...')
    try:
      reports.append(PlanCandidate(target, candidate, num_devices, chip,
                                   hbm_bytes, depth_param))
    except (targets.PlanError, ValueError) as e:
      skipped.append((candidate, str(e).splitlines()[0]))
  return Plan(num_devices=num_devices, chip=chip, hbm_bytes=hbm_bytes,
              reports=reports, skipped=skipped)

