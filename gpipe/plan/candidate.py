"""One candidate: lowered from shapes, partitioned, compiled; what XLA says.

    target.Build(candidate) -> TrainStep --LowerFromShapes--> HLO (as a TPU
    job builds it) --CompileFromShapes(N devices)--> CompiledModule
    --> CandidateReport: bytes per device by kind, FLOPs, collectives per
        loop, problems (weights not split, gathered), the roofline's
        prediction

Only a candidate gpipe's own checks refuse (an M that does not divide the
batch, an R that cannot keep the depth, an unknown remat policy) is
skipped; anything else that fails while building or compiling one is the
model's or XLA's error, and MakePlan raises it as a CandidateError.
"""

import dataclasses
import functools
import re
import subprocess
import time

import numpy as np

from gpipe import layers as gpipe_layers
from gpipe.lingvo_support import tpu_build
from gpipe.model_step import stacks
from gpipe.model_step import train_step
from gpipe.plan import calibration
from gpipe.plan import collectives
from gpipe.plan import loops
from gpipe.plan import model_flops as model_flops_lib
from gpipe.plan.report import Plan
from gpipe.plan import roofline
from gpipe.plan import step_time as step_time_lib
from gpipe.plan import targets
from gpipe.plan import torus
from gpipe.plan import traffic_floor
from gpipe import schedule as schedule_lib
from gpipe import sharding
from gpipe.xla import hlo_text
from gpipe.xla import partitioned_step
from gpipe.xla import partitioning
from gpipe.xla import user_layer


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
  # The device mesh the stack's stages are placed on: its shape ((N,) for
  # shard_stages_1d) and the axis of the stage dim.
  mesh_shape: tuple = ()
  stage_axis: int = 0
  # Mesh axes the stack's weights are gathered over for use (FSDP).
  gathered_over: tuple = ()
  # The built stack's backward schedule and stream_io.
  backward_schedule: str = 'reverse'
  stream_io: bool = False
  # Gives 3 x the FLOPs of the step's forward pass, the stacks run
  # unpipelined (ForwardFlops): the work MFU counts, all devices. A
  # function, as counting them is a compile of its own (ModelFlops).
  model_flops_fn: object = lambda: 0.0
  # Gives XLA's FLOPs of the step unpartitioned, on one device (what the
  # partitioned step's FLOPs are compared with). A function, as lowering
  # and compiling that step takes as long as the candidate's own compile,
  # and only a report that shows the ratio needs it.
  unpartitioned_flops_fn: object = lambda: 0.0
  # What the least traffic per mesh axis depends on (traffic_floor), or
  # None where the model does not say.
  model_shape: traffic_floor.ModelShape = None

  @property
  def one_f_one_b(self):
    return self.backward_schedule == '1f1b'

  def Bytes(self, kind):
    """Bytes one device holds of the step arguments of `kind`."""
    return self._ArgBytes(lambda i, arg: arg.kind == kind)

  def _ArgBytes(self, keep):
    """Bytes one device holds of the arguments with keep(index, arg)."""
    return sum(
        int(np.prod(shard, dtype=np.int64)) * arg.spec.dtype.size
        for i, (arg, shard) in enumerate(
            zip(self.step.args, self.compiled.param_shard_shapes))
        if keep(i, arg))

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

  def UnderSplit(self):
    """[(name, per-device shape, annotated shape)] of stage-stacked weights
    and slots held on more devices than their own annotation splits them
    over (e.g. replicated over a model axis they should be split on)."""
    unsplit = set(self.Unsplit())
    return [
        (arg.name, tuple(shard), arg.annotated_shard)
        for arg, shard in zip(self.step.args, self.compiled.param_shard_shapes)
        if arg.on_stages and arg.annotated_shard and arg.name not in unsplit
        and np.prod(shard) > np.prod(arg.annotated_shard)
    ]

  def Gathered(self):
    """All-gathers / all-to-alls whose result is a weight's or slot's shape."""
    shapes = [
        tuple(a.spec.shape) for a in self.step.args
        if a.kind in (train_step.WEIGHT, train_step.SLOT) and a.on_stages
    ]
    return hlo_text.GatheredTensors(self.compiled.collectives, shapes,
                                    self.mesh_shape, self.gathered_over)

  def Problems(self):
    problems = []
    unsplit = self.Unsplit()
    if unsplit:
      problems.append(
          f'{len(unsplit)} stage-stacked weights/slots are not split over '
          f'the devices (e.g. {unsplit[0]}): set shard_stages_1d=True (or '
          'pipeline_stage_mesh_dim with device_mesh) on the PipelinedLayer')
    under = self.UnderSplit()
    if under:
      name, shard, annotated = under[0]
      problems.append(
          f'{len(under)} stage-stacked weights/slots are split over fewer '
          f'devices than their annotation asks (e.g. {name}: '
          f'{list(shard)} per device, annotated {list(annotated)})')
    for c in self.Gathered():
      problems.append(f'{c.kind} of a weight or slot ({c.shape}, from '
                      f'{c.op_name or "?"})')
    for axes, sent, floor in traffic_floor.UnderFloor(self.sent_per_axis,
                                                      self.traffic_floors):
      problems.append(
          f'{axes} sends {sent / floor:.2f} x its floor ({sent:.4g} of '
          f'{floor:.4g} bytes; under {traffic_floor.LEAST_RATIO} is the '
          'planner\'s error: a floor part the step does not need, or a '
          'collective not counted)')
    return problems

  def LoopSummaries(self):
    """Per loop: its role ('forward', or 'backward': the reverse loop or
    a 1f1b gradient loop), trip count and, per iteration, {kind: {count,
    bytes}} and {'kind over axes': {count, bytes}} (`ByMeshAxes`)."""
    summaries = []
    for i, body in enumerate(self.compiled.loops):
      loop_collectives = self.compiled.LoopCollectives(i)
      summaries.append({
          'role': 'forward' if i == self.forward_loop else 'backward',
          'iterations': self._trips.get(body, 1),
          'collectives': collectives.CountAndWireBytes(
              loop_collectives, lambda c: c.kind),
          'by_mesh_axes': self.ByMeshAxes(loop_collectives),
      })
    return summaries

  @functools.cached_property
  def _trips(self):
    return hlo_text.LoopTripCounts(self.compiled.hlo)

  @property
  def _mesh(self):
    return self.mesh_shape or (self.compiled.num_devices,)

  @property
  def axis_names(self):
    """A name per mesh axis: its role in the model ('stage', 'model',
    ...) where the model says, else 'stage' and 'axis k'."""
    if self.model_shape is not None:
      return self.model_shape.AxisNames(len(self._mesh))
    return collectives.MeshAxisNames(len(self._mesh), self.stage_axis)

  def ByMeshAxes(self, some):
    """{'kind over axes': {count, bytes}} of `some` collectives: which
    mesh axes each runs on (the rotation's permutes on the stage axis, a
    model axis's all-reduces on that axis, ...); bytes in the
    partitioner's dtype."""
    return collectives.CountAndWireBytes(
        some, lambda c: collectives.KindOverAxes(c, self._mesh,
                                                 self.axis_names))

  @property
  def outside_by_mesh_axes(self):
    """ByMeshAxes of the collectives outside the loops (once a step)."""
    return self.ByMeshAxes(self.compiled.LoopCollectives(-1))

  @functools.cached_property
  def sent_per_axis(self):
    """{axes: {kind: bytes one chip sends in the step}}
    (gpipe.plan.collectives.PerAxis)."""
    return collectives.PerAxis(self.compiled, self._trips, self._mesh,
                               self.axis_names)

  @functools.cached_property
  def traffic_floors(self):
    """[traffic_floor.Floor]: the least each set of axes must carry, or
    [] where the model does not say (model_shape None)."""
    if self.model_shape is None:
      return []
    # A weight's gradient is in the weight's own dtype: as many bytes.
    trainable = {param for _, param in self.step.aliases
                 if self.step.args[param].kind == train_step.WEIGHT}
    gradient_bytes = self._ArgBytes(lambda i, a: i in trainable)
    return traffic_floor.Floors(self.model_shape, self.schedule, self._mesh,
                                self.candidate.remat_policy, gradient_bytes)

  @functools.cached_property
  def forward_loop(self):
    """Index of the forward loop among the compiled loops
    (partitioned_step.ForwardLoop)."""
    return partitioned_step.ForwardLoop(self.compiled.hlo,
                                        self.compiled.loops)

  @property
  def permute_bytes_per_iteration(self):
    """Collective-permute bytes per iteration of the forward loop."""
    summaries = self.LoopSummaries()
    if not summaries:
      return 0
    return summaries[self.forward_loop]['collectives'].get(
        'collective-permute', {}).get('bytes', 0)

  @property
  def flops_per_device(self):
    return self.compiled.Cost('flops')

  @functools.cached_property
  def flops_unpartitioned(self):
    return self.unpartitioned_flops_fn()

  @functools.cached_property
  def loop_flops(self):
    """Per loop (forward, backward): FLOPs per device, all iterations."""
    return loops.LoopFlops(self.compiled.hlo, self.compiled.loops)

  @functools.cached_property
  def stored_activations(self):
    """[(bytes, HLO type)] per device the forward pass stores for the
    backward pass: the forward loop's stacks (loops.StoredActivations),
    or with backward_schedule='1f1b' the gradient loop's rings
    (loops.Rings)."""
    if not self.compiled.loops:
      return []
    gradient = [b for i, b in enumerate(self.compiled.loops)
                if i != self.forward_loop]
    if self.one_f_one_b:
      ring_size = schedule_lib.OneFOneB(self.schedule).ring_size
      return loops.Rings(self.compiled.hlo, gradient, ring_size)
    return loops.StoredActivations(self.compiled.hlo,
                                   self.compiled.loops[self.forward_loop])

  @property
  def stored_activation_bytes(self):
    return sum(nbytes for nbytes, _ in self.stored_activations)

  @property
  def model_flops(self):
    return self.model_flops_fn()

  @functools.cached_property
  def step_time(self):
    """What the roofline's step rests on (gpipe.plan.step_time)."""
    return step_time_lib.StepTime(self)

  @property
  def step_bytes(self):
    """The per-device sizes that set the fused step's HBM traffic."""
    return self.step_time.StepBytes()

  def Predicted(self, matmul_efficiency):
    """The roofline's prediction, calibrated at matmul_efficiency."""
    return self.step_time.Predicted(matmul_efficiency)

  @functools.cached_property
  def prediction(self):
    """The prediction at the planner's calibration."""
    return self.Predicted(calibration.MATMUL_EFFICIENCY)

  def FloorsJson(self):
    """The floors and sent / floor per set of mesh axes, as ToJson has
    them: each floor with and without its recomputed part."""
    ratios = traffic_floor.Ratios(self.sent_per_axis, self.traffic_floors)

    def Over(floor_bytes):
      return {axes: sent / floor_bytes(f) if f and floor_bytes(f) else None
              for axes, (sent, f) in ratios.items()}

    return {
        'collective_floor_per_step': {
            f.axes: {'bytes': f.bytes,
                     'bytes_without_recompute': f.without_recompute,
                     'parts': f.parts, 'layout': f.layout}
            for f in self.traffic_floors},
        'collective_sent_over_floor': Over(lambda f: f.bytes),
        'collective_sent_over_floor_without_recompute':
            Over(lambda f: f.without_recompute),
    }

  def ToJson(self):
    n = self.compiled.num_devices
    return {
        'num_microbatches': self.candidate.num_microbatches,
        'circular_repeat': self.candidate.circular_repeat,
        'remat_policy': self.candidate.remat_policy,
        'backward_schedule': self.backward_schedule,
        'stream_io': self.stream_io,
        'delayed_sends': self.schedule.delayed_sends,
        'iterations': self.schedule.num_iterations,
        'bubble_fraction': self.schedule.bubble_fraction,
        'per_device_bytes': self.per_device_bytes,
        'fits': self.fits,
        'problems': self.Problems(),
        'flops_per_device': self.flops_per_device,
        'flops_unpartitioned': self.flops_unpartitioned,
        'flops_ratio': self.flops_per_device / (self.flops_unpartitioned / n),
        'loop_flops_per_device': self.loop_flops,
        'xla_cpu_unfused_bytes_accessed_per_device':
            self.compiled.Cost('bytes accessed'),
        'stored_activation_bytes': self.stored_activation_bytes,
        'permute_bytes_per_iteration': self.permute_bytes_per_iteration,
        'mesh_shape': list(self.mesh_shape),
        'fsdp_mesh_dims': list(self.gathered_over),
        'stage_axis': self.stage_axis,
        'links_per_axis': list(self.chip.links_per_axis),
        'loops': self.LoopSummaries(),
        'outside_loops_by_mesh_axes': self.outside_by_mesh_axes,
        'collective_bytes_sent_per_step': self.sent_per_axis,
        **self.FloorsJson(),
        'predicted_step_seconds': self.prediction.step_seconds,
        'predicted': self.prediction.ToJson(),
        'largest_buffers': [{
            'bytes': b, 'type': t, 'op': op
        } for b, t, op in hlo_text.LargestBuffers(self.compiled.hlo)],
        'compile_seconds': self.seconds,
    }


def PlanCandidate(target, candidate, num_devices, chip, hbm_bytes,
                  depth_param='num_blocks', log=None, model_flops=None,
                  compile_timeout=1800):
  """Lowers, partitions and compiles one candidate; a CandidateReport.

  `log` (if given) is told once the candidate is built, before its compile:
  a candidate skipped while building is never said to be compiling.
  `model_flops`: a callable of the model's FLOPs, shared by a target's
  candidates; None: a new model_flops.ModelFlops of this candidate's step.
  `compile_timeout`: seconds each of its compiles may take.
  """
  start = time.time()
  with tpu_build.AsOnTpu():  # Lingvo's layers then annotate their weights
    step = target.Build(candidate, depth_param)
  if log:
    log(f'Compiling {candidate.Describe()} for {num_devices} devices...')
  pipelined = train_step.FindPipelinedLayers(step.root)
  stack_p = pipelined[0][1].params
  sched = schedule_lib.Schedule.ForLayer(stack_p, candidate.num_microbatches)

  def Partitioned(*args):
    with sharding.SpmdPartitioning():
      return step(*args)

  def Unpartitioned(*args):
    with sharding.SpmdPartitioning(False):
      return step(*args)

  def UnpartitionedFlops():
    with tpu_build.AsOnTpu():
      unpartitioned = partitioning.LowerFromShapes(Unpartitioned, step.specs)
    return partitioning.CompileFromShapes(
        unpartitioned, 1, timeout=compile_timeout).Cost('flops')

  with tpu_build.AsOnTpu():
    partitioned = partitioning.LowerFromShapes(Partitioned, step.specs)
  compiled = partitioning.CompileFromShapes(
      partitioned, num_devices, aliases=step.aliases, timeout=compile_timeout)
  if model_flops is None:
    model_flops = _Guarded(model_flops_lib.ModelFlops(
        step, timeout=compile_timeout), candidate, target)
  mesh = partitioned_step.StackMesh(stack_p, num_devices)
  return CandidateReport(candidate=candidate, schedule=sched,
                         compiled=compiled, step=step,
                         chip=torus.OnSlice(chip, mesh['mesh_shape']),
                         hbm_bytes=hbm_bytes, seconds=time.time() - start,
                         backward_schedule=stack_p.backward_schedule,
                         stream_io=stack_p.stream_io,
                         model_flops_fn=model_flops,
                         unpartitioned_flops_fn=_Guarded(
                             UnpartitionedFlops, candidate, target),
                         model_shape=traffic_floor.ShapeOf(
                             step, mesh['stage_axis']),
                         **mesh)


def _Guarded(compile_fn, candidate, target):
  """compile_fn (a one-device compile for FLOPs, run when a report is
  printed), failing with a CandidateError as the candidate's compile does."""
  def Guarded():
    try:
      return compile_fn()
    except CandidateError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      raise CandidateError(candidate, e, target.DescribeError(e)) from e

  return Guarded


class CandidateError(RuntimeError):
  """Building or compiling a candidate failed for another reason than its
  M, R or remat policy: the model's own error (or XLA's), not a choice the
  planner can skip."""

  def __init__(self, candidate, error, description=None):
    # The target's own description of the error (an input shape the layer
    # cannot take); else the first line says what failed; an XLA abort in
    # the partitioning worker says why in its fatal log line, other long
    # messages at their end.
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if description:
      summary = description
    elif isinstance(error, subprocess.TimeoutExpired):
      summary = (f'the compile took longer than {error.timeout / 60:g} '
                 'minutes: give it more with --compile_timeout_minutes')
    elif re.search(r'^F\d{4} ', str(error), re.M):
      summary = user_layer.PartitionerMessage(error)
    else:
      summary = ' ... '.join(lines[:1] + lines[1:][-1:]) or '(no message)'
    super().__init__(
        f'{candidate.Describe()}: {type(error).__name__}: {summary}')
    self.candidate = candidate
    self.error = error


def CheckCandidate(target, candidate):
  """Raises targets.PlanError if gpipe's param checks refuse the candidate.

  The same checks the target's Build runs (an M that does not divide the
  batch, an unknown remat policy, ...), run first on a copy of the stack's
  params, so that a ValueError raised later while building is known to be
  the model's own.
  """
  p = target.stack_params.Copy()
  stacks.SetSchedule(p, candidate)
  try:
    gpipe_layers.ValidateParams(p, target.batch_size)
  except ValueError as e:
    raise targets.PlanError(str(e).splitlines()[0]) from None


def MakePlan(target, candidates, num_devices, chip, hbm_bytes,
             depth_param='num_blocks', log=None, compile_timeout=1800):
  """Plans every candidate; those gpipe refuses are skipped with the reason.

  `compile_timeout`: seconds one candidate's compile may take.

  Raises:
    CandidateError: building or compiling a valid candidate failed.
  """
  reports, skipped = [], []
  for candidate in candidates:
    try:
      CheckCandidate(target, candidate)
      reports.append(PlanCandidate(
          target, candidate, num_devices, chip, hbm_bytes, depth_param, log,
          model_flops=reports[0].model_flops_fn if reports else None,
          compile_timeout=compile_timeout))
    except targets.PlanError as e:
      skipped.append((candidate, str(e).splitlines()[0]))
    except Exception as e:  # pylint: disable=broad-except
      raise CandidateError(candidate, e, target.DescribeError(e)) from e
  return Plan(num_devices=num_devices, chip=chip, hbm_bytes=hbm_bytes,
              reports=reports, skipped=skipped)
