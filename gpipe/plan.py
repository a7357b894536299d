"""Will it fit? Per-chip memory, FLOPs and collectives of your training step.

    python -m gpipe.plan --model lm.CopyLMPod8x2 --num_devices 8 \\
        --num_microbatches 16,32 --circular_repeat 1,2 \\
        [--remat_policy recompute,save_all] [--json]
    python -m gpipe.plan --params my_module.PipelineParams \\
        --input_shape 64,1024 --num_devices 4

For each candidate (num_microbatches, circular_repeat, remat_policy) the
planner lowers
the whole training step (forward, loss, backward, the optimizer update with
its slots) from shapes alone, so no weight is ever allocated; XLA's SPMD
partitioner splits it for N virtual CPU devices and XLA compiles it without
running it. Per step:

    params --build in a scratch graph--> TrainStep (gpipe.train_step)
      --TensorSpecs--> HLO --partition for N devices, compile--> what XLA says
      --roofline (gpipe.roofline)--> predicted step time

Measured by XLA (the compiled module): bytes per device of weights and
optimizer slots (each parameter's per-device shape), temporaries (buffer
assignment: activations and workspace) and the peak; FLOPs and bytes
accessed per device (cost analysis, loops counted per iteration) against
the same step compiled unpartitioned for one device; every collective and
its bytes. From the schedule (gpipe.schedule): iterations and bubble
fraction. Predicted (a model, not a measurement): the step time on a TPU
generation, and so the recommendation: the fitting candidate, split as
intended, with the lowest predicted step time.

Varying circular_repeat keeps the model's depth: a stage body with a
`--depth_param` (default `num_blocks`, e.g. params.lm.StageBlocks) gets
depth * R0 / R blocks; a body without one plans only its own R.
"""

# Before TensorFlow loads, so that the command prints its own lines only.
if __name__ == '__main__':
  from gpipe import quiet  # pylint: disable=g-import-not-at-top
  quiet.UnlessVerbose()

import argparse
import contextlib
import dataclasses
import json
import sys
import time

from absl import flags as absl_flags
import numpy as np
import tensorflow as tf

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
from gpipe import check_partitioning
from gpipe import layers as gpipe_layers
from gpipe import param_checks
from gpipe import partitioning
from gpipe import quiet
from gpipe import remat
from gpipe import roofline
from gpipe import schedule as schedule_lib
from gpipe import sharding
from gpipe import stage_call
from gpipe import train_step
from lingvo.core import hyperparams

GIB = 2**30


class PlanError(ValueError):
  """A problem with what was asked for, said in one line."""


@dataclasses.dataclass(frozen=True)
class Candidate:
  num_microbatches: int
  circular_repeat: int
  remat_policy: str = 'recompute'

  def Describe(self):
    return (f'M={self.num_microbatches} R={self.circular_repeat} '
            f'{self.remat_policy}')


# -----------------------------------------------------------------------------
# What to plan: a registered Lingvo model, or a PipelinedLayer on inputs.


class ModelTarget:
  """A registered Lingvo model whose task holds one PipelinedLayer."""

  def __init__(self, name):
    # pylint: disable=g-import-not-at-top
    from lingvo import model_registry
    import params  # pylint: disable=unused-import
    import params.lm  # pylint: disable=unused-import
    # pylint: enable=g-import-not-at-top
    try:
      with quiet.LibraryPrints():
        self._cfg = model_registry.GetParams(name, 'Train')
    except LookupError as e:
      raise PlanError(f'--model {name!r}: {e}') from None
    self.name = name
    self.batch_size = self._cfg.input.batch_size

  @property
  def stack_params(self):
    return _OneStack(self._cfg.task, f'{self.name} task')

  def Build(self, candidate, depth_param):
    cfg = self._cfg.Copy()
    _Reshape(_OneStack(cfg.task, self.name), candidate, depth_param)
    gpipe_layers.ValidateParams(_OneStack(cfg.task, self.name),
                                self.batch_size)
    with tf.Graph().as_default():
      task = cfg.task.Instantiate()
    return train_step.TaskStep(task, train_step.InputSpecs(cfg.input))


class LayerTarget:
  """A PipelinedLayer's Params trained on float32 inputs of given shapes."""

  def __init__(self, layer_params, input_shapes, name='layer'):
    try:
      check_partitioning.CheckPipelineParams(layer_params, name)
    except ValueError as e:
      raise PlanError(str(e)) from None
    self._params = layer_params
    self._input_shapes = input_shapes
    self.name = name
    self.batch_size = input_shapes[0][0]

  @property
  def stack_params(self):
    return self._params

  def Build(self, candidate, depth_param):
    p = self._params.Copy()
    _Reshape(p, candidate, depth_param)
    gpipe_layers.ValidateParams(p, self.batch_size)
    with tf.Graph().as_default():
      layer = p.Instantiate()
    return train_step.LayerStep(layer, self._input_shapes)


def _OneStack(task_params, where):
  """The Params of the one PipelinedLayer inside `task_params`."""
  found = list(_FindStacks(task_params, ''))
  if len(found) != 1:
    raise PlanError(
        f'{where} has {len(found)} PipelinedLayer params '
        f'({", ".join(path for path, _ in found) or "none"}); the planner '
        'plans a model with exactly one pipelined stack.')
  return found[0][1]


def _FindStacks(p, path):
  if isinstance(getattr(p, 'cls', None), type) and issubclass(
      p.cls, gpipe_layers.PipelinedLayer):
    yield path or '.', p
    return
  for name, value in p.IterParams():
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
      if isinstance(v, hyperparams.Params):
        yield from _FindStacks(v, f'{path}.{name}' if path else name)


def _Reshape(stack, candidate, depth_param):
  """Sets M and R on stack params, keeping depth S x R x blocks per body."""
  r0, r = stack.circular_repeat, candidate.circular_repeat
  if r != r0:
    body = stack.single_stage_body or stack.stage_parallel_body
    if depth_param not in body:
      raise PlanError(
          f'circular_repeat={r} would change the model\'s depth (it has '
          f'{stack.num_stages} x {r0} stage bodies); the stage body '
          f'{body.cls.__name__} has no {depth_param!r} param to keep it. '
          'Pass --depth_param NAME, or plan only circular_repeat='
          f'{r0}.')
    depth = body.Get(depth_param) * r0
    if depth % r:
      raise PlanError(
          f'circular_repeat={r}: {depth} blocks per stage (over all '
          f'repeats) do not split into {r} repeats.')
    body.Set(**{depth_param: depth // r})
  stack.Set(num_microbatches=candidate.num_microbatches, microbatch_size=None,
            circular_repeat=r, remat_policy=candidate.remat_policy,
            store_body_intermediates=False)


# -----------------------------------------------------------------------------
# One candidate: lower, compile, read what XLA says.


@dataclasses.dataclass
class CandidateReport:
  """What XLA measured for one candidate, and what the roofline predicts."""
  candidate: Candidate
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


# -----------------------------------------------------------------------------
# The report.


@dataclasses.dataclass
class Plan:
  num_devices: int
  chip: roofline.Chip
  hbm_bytes: float
  reports: list  # of CandidateReport
  skipped: list  # of (Candidate, reason)

  @property
  def recommended(self):
    """Index of the fitting, correctly split, fastest-predicted candidate."""
    ok = [
        i for i, r in enumerate(self.reports) if r.fits and not r.Problems()
    ]
    if not ok:
      return None
    return min(ok, key=lambda i: self.reports[i].prediction.step_seconds)

  def ToJson(self):
    weights = self.reports[0].TotalBytes(train_step.WEIGHT) if (
        self.reports) else None
    return {
        'num_devices': self.num_devices,
        'total_weight_bytes': weights,
        'hbm_bytes': self.hbm_bytes,
        'tpu': dataclasses.asdict(self.chip),
        'candidates': [r.ToJson() for r in self.reports],
        'skipped': [{
            'num_microbatches': c.num_microbatches,
            'circular_repeat': c.circular_repeat,
            'remat_policy': c.remat_policy,
            'reason': reason
        } for c, reason in self.skipped],
        'recommended': self.recommended,
        'measured_by_xla': [
            'per_device_bytes', 'flops_per_device', 'flops_unpartitioned',
            'bytes_accessed_per_device', 'loops',
            'permute_bytes_per_iteration', 'collective_bytes_per_step'
        ],
        'from_the_schedule': ['iterations', 'bubble_fraction'],
        'predicted_by_the_roofline_model': [
            'predicted_step_seconds', 'predicted', 'recommended'
        ],
    }

  def Render(self):
    lines = [f'Partitioned for {self.num_devices} virtual devices; compiled, '
             'not run.']
    if self.reports:
      total = self.reports[0].TotalBytes(train_step.WEIGHT)
      lines.append(f'Weights: {total / GIB:.2f} GiB in all.')
    lines.append('')
    unit, scale = _ByteUnit(
        max([r.per_device_bytes['peak'] for r in self.reports] or [0]))
    header = (f'{"M":>4} {"R":>3} {"remat":>9} {"iters":>5} {"bubble":>6} | '
              f'{"weights":>8} {"optim":>8} {"temp":>8} {"peak":>8} '
              f'{"fits":>4} | {"FLOP/dev":>9} {"/(unp/N)":>8} '
              f'{"permute/it":>10} | {"pred step":>9}')
    lines += [header, '-' * len(header)]
    for i, r in enumerate(self.reports):
      b = {k: f'{v / scale:>8.3f}' for k, v in r.per_device_bytes.items()}
      j = r.ToJson()
      mark = ' <- recommended' if i == self.recommended else ''
      lines.append(
          f'{r.candidate.num_microbatches:>4} {r.candidate.circular_repeat:>3}'
          f' {r.candidate.remat_policy:>9}'
          f' {r.schedule.num_iterations:>5} {r.schedule.bubble_fraction:>6.3f}'
          f' | {b["weights"]} {b["optimizer"]} {b["temp"]} {b["peak"]} '
          f'{"yes" if r.fits else "NO":>4} | {r.flops_per_device:>9.3g} '
          f'{j["flops_ratio"]:>8.3f} '
          f'{r.permute_bytes_per_iteration / scale:>10.4g} | '
          f'{_Seconds(r.prediction.step_seconds):>9}{mark}')
    lines.append(f'(bytes per device in {unit}; permute/it: {unit} sent by '
                 'collective-permutes per forward iteration; /(unp/N): FLOPs '
                 'per device over the unpartitioned step\'s FLOPs / N)')
    for c, reason in self.skipped:
      lines.append(f'skipped {c.Describe()}: {reason}')
    for r in self.reports:
      lines.append('')
      lines.append(f'{r.candidate.Describe()} (compiled in '
                   f'{r.seconds:.0f} s):')
      for i, loop in enumerate(r.LoopSummaries()):
        kinds = ', '.join(
            f'{c["count"]} {k} ({c["bytes"] / 2**20:.2f} MiB)'
            for k, c in loop['collectives'].items()) or 'no collectives'
        lines.append(f'  loop {i} ({loop["iterations"]} iterations), per '
                     f'iteration: {kinds}')
      outside = {}
      for c in r.compiled.LoopCollectives(-1):
        outside[c.kind] = outside.get(c.kind, 0) + c.bytes
      lines.append('  outside the loops: ' + (', '.join(
          f'{k} {v / 2**20:.2f} MiB' for k, v in sorted(outside.items())) or
                                               'no collectives'))
      lines.append('  largest buffers: ' + '; '.join(
          f'{b / scale:.3g} {unit} {t} ({op[-60:] or "?"})'
          for b, t, op in partitioning.LargestBuffers(r.compiled.hlo, 3)))
      for problem in r.Problems():
        lines.append(f'  PROBLEM: {problem}')
    lines.append('')
    lines.append('Measured by XLA: bytes per device (parameter shardings and '
                 'buffer assignment), FLOPs (cost analysis, loops counted '
                 'per iteration; /(unp/N) is about 1 when each device does '
                 'only its share), collectives. From the schedule: iters, '
                 'bubble.')
    lines.append('Predicted by a roofline model of '
                 f'{self.chip.Describe()}: "pred step", and so the '
                 'recommendation.')
    lines.append(f'Fits: peak <= {self.hbm_bytes / GIB:.1f} GiB of HBM.')
    rec = self.recommended
    if rec is None:
      lines.append('Recommendation: none of the candidates fits and splits '
                   'as intended.')
    else:
      c = self.reports[rec].candidate
      lines.append(f'Recommendation: num_microbatches={c.num_microbatches}, '
                   f'circular_repeat={c.circular_repeat}, '
                   f'remat_policy={c.remat_policy!r}.')
    return '\n'.join(lines)


def _ByteUnit(largest):
  """('GiB', 2**30), ('MiB', 2**20) or ('KiB', 2**10) to show `largest`."""
  for unit, scale in (('GiB', 2**30), ('MiB', 2**20)):
    if largest >= scale:
      return unit, scale
  return 'KiB', 2**10


def _Seconds(seconds):
  if seconds >= 1:
    return f'{seconds:.3g} s'
  if seconds >= 1e-3:
    return f'{seconds * 1e3:.3g} ms'
  return f'{seconds * 1e6:.3g} us'


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
    except (PlanError, ValueError) as e:
      skipped.append((candidate, str(e).splitlines()[0]))
  return Plan(num_devices=num_devices, chip=chip, hbm_bytes=hbm_bytes,
              reports=reports, skipped=skipped)


# -----------------------------------------------------------------------------
# Command line.


def _IntList(text):
  try:
    values = [int(v) for v in text.split(',') if v]
  except ValueError:
    raise argparse.ArgumentTypeError(
        f'expected comma-separated integers, got {text!r}') from None
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(
        f'expected positive integers, got {text!r}')
  return values


def _Shape(text):
  return tuple(_IntList(text))


def _PolicyList(text):
  values = [v for v in text.split(',') if v]
  unknown = [v for v in values if v not in remat.POLICIES]
  if not values or unknown:
    raise argparse.ArgumentTypeError(
        f'expected names from {", ".join(remat.POLICIES)}, got {text!r}')
  return values


def _Args(argv):
  parser = argparse.ArgumentParser(
      prog='python -m gpipe.plan',
      description=__doc__.split('\n\n')[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  what = parser.add_mutually_exclusive_group(required=True)
  what.add_argument('--model', help='a registered Lingvo model, e.g. '
                    'lm.CopyLMPod8x2')
  what.add_argument('--params', help='module.attribute: PipelinedLayer '
                    'Params, or a function returning them')
  parser.add_argument('--input_shape', type=_Shape, action='append',
                      help='with --params: one input\'s shape, batch first; '
                      'repeat for several inputs')
  parser.add_argument('--num_devices', type=int, default=None,
                      help='devices of the slice (default: num_stages, or '
                      'the size of device_mesh)')
  parser.add_argument('--tpu', choices=sorted(roofline.CHIPS), default='v6e',
                      help='TPU generation of the roofline model')
  parser.add_argument('--hbm_gib', type=float, default=None,
                      help='HBM per chip in GiB (default: the generation\'s)')
  parser.add_argument('--num_microbatches', type=_IntList, default=None,
                      help='candidates, e.g. 8,16,32 (default: the model\'s)')
  parser.add_argument('--circular_repeat', type=_IntList, default=None,
                      help='candidates, e.g. 1,2,4 (default: the model\'s)')
  parser.add_argument('--remat_policy', type=_PolicyList, default=None,
                      help='candidates, e.g. recompute,save_all (default: '
                      'the model\'s); see gpipe.remat')
  parser.add_argument('--depth_param', default='num_blocks',
                      help='stage-body param holding its depth, scaled to '
                      'keep S x R x depth fixed as circular_repeat varies')
  parser.add_argument('--verbose', action='store_true',
                      help='also show TensorFlow, XLA and Lingvo logs')
  parser.add_argument('--json', action='store_true',
                      help='print the report as JSON')
  return parser, parser.parse_args(argv)


def _Target(parser, args):
  if args.model:
    if args.input_shape:
      parser.error('--input_shape goes with --params; a --model has its own '
                   'input generator.')
    return ModelTarget(args.model)
  if not args.input_shape:
    parser.error('--params needs --input_shape (one per input).')
  return LayerTarget(_LoadParams(args.params), args.input_shape, args.params)


def _LoadParams(spec):
  try:
    return check_partitioning.LoadParams(spec)
  except ValueError as e:
    raise PlanError(str(e)) from None


def main(argv=None):
  parser, args = _Args(argv)
  stage_call.EnsureFlagsParsed()
  if not partitioning.IsAvailable():
    print("gpipe.plan needs jax and jaxlib: pip install 'gpipe[spmd]'",
          file=sys.stderr)
    return 2
  try:
    target = _Target(parser, args)
    stack = target.stack_params
    try:
      num_devices = check_partitioning.CheckDevices(stack, args.num_devices)
    except ValueError as e:
      raise PlanError(str(e)) from None
    m0 = stack.num_microbatches
    if m0 is None:
      if not args.num_microbatches:
        raise PlanError('The layer sets no num_microbatches; pass '
                        '--num_microbatches.')
    policy0 = param_checks.RematPolicy(stack)
    candidates = [
        Candidate(m, r, policy)
        for policy in (args.remat_policy or [policy0])
        for r in (args.circular_repeat or [stack.circular_repeat])
        for m in (args.num_microbatches or [m0])
    ]
  except PlanError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  chip = roofline.CHIPS[args.tpu]
  hbm_bytes = args.hbm_gib * GIB if args.hbm_gib else chip.hbm_bytes
  start = time.time()
  plan = MakePlan(target, candidates, num_devices, chip, hbm_bytes,
                  args.depth_param,
                  log=lambda m: print(m, file=sys.stderr, flush=True))
  if args.json:
    report = plan.ToJson()
    report['wall_seconds'] = time.time() - start
    print(json.dumps(report, indent=1))
  else:
    print(plan.Render())
    print(f'Planned in {time.time() - start:.0f} s.')
  return 0


if __name__ == '__main__':
  sys.exit(main())
