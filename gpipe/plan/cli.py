"""The planner's command line: python -m gpipe.plan (see gpipe.plan).

Exit status: 0 with a plan; 2 when what was asked cannot be planned (bad
arguments, refused before anything is built; or every candidate skipped,
each with its reason); 1 when building or compiling a candidate fails for
another reason (the model's own error, said with its message).
"""

import dataclasses
import json
import sys
import time
import traceback

import numpy as np

from gpipe.lingvo_support import flags_and_seeds
from gpipe.lingvo_support import registered_models
from gpipe.pipeline import param_checks
from gpipe.plan import candidate as candidate_lib
from gpipe.plan import flags
from gpipe.plan import plot
from gpipe.plan import roofline
from gpipe.plan import targets
from gpipe.plan import torus
from gpipe.xla import partitioning
from gpipe.xla import user_layer

GIB = 2**30


def _Target(parser, args):
  if args.model:
    if args.input_shape:
      parser.error('--input_shape goes with --params; a --model has its own '
                   'input generator.')
    try:
      registered_models.ImportModules(args.model_module)
    except LookupError as e:
      raise targets.PlanError(str(e)) from None
    return targets.ModelTarget(args.model,
                               lingvos_layer=args.pipeline_layer == 'lingvo')
  if args.model_module:
    parser.error('--model_module goes with --model.')
  if not args.input_shape:
    parser.error('--params needs --input_shape (one per input).')
  return targets.LayerTarget(_LoadParams(args.params), args.input_shape,
                            args.params,
                            lingvos_layer=args.pipeline_layer == 'lingvo')


def _LoadParams(spec):
  try:
    return user_layer.LoadParams(spec)
  except ValueError as e:
    raise targets.PlanError(str(e)) from None


def _Candidates(parser, args):
  """(target, num_devices, candidates) the arguments ask for.

  Raises:
    targets.PlanError: they cannot be planned (said in one line).
  """
  target = _Target(parser, args)
  stack = target.stack_params
  try:
    num_devices = user_layer.CheckDevices(stack, args.num_devices)
  except ValueError as e:
    raise targets.PlanError(str(e)) from None
  _CheckLinks(stack, args.links_per_axis)
  meshes = _Meshes(stack, args.mesh, num_devices, args.circular_repeat)
  _CheckSlice(stack, args, meshes, num_devices)
  m0 = stack.num_microbatches
  if m0 is None and not args.num_microbatches:
    raise targets.PlanError('The layer sets no num_microbatches; pass '
                            '--num_microbatches.')
  policy0 = param_checks.RematPolicy(stack)
  candidates = [
      targets.Candidate(m, r, policy, mesh, schedule, stream_io, fsdp)
      for mesh in meshes
      for fsdp in (args.fsdp_mesh_dim or [None])
      for schedule in (args.backward_schedule or [None])
      for stream_io in (args.stream_io or [None])
      for policy in (args.remat_policy or [policy0])
      for r in (args.circular_repeat or [_OwnRepeat(stack, mesh)])
      for m in (args.num_microbatches or [m0])
  ]
  return target, num_devices, candidates


def _CheckLinks(stack, links_per_axis):
  """--links_per_axis gives one figure per axis of the stack's mesh.

  Raises:
    targets.PlanError: it gives another number of them.
  """
  if links_per_axis is None:
    return
  rank = (np.ndim(stack.device_mesh)
          if stack.pipeline_stage_mesh_dim is not None else 1)
  if len(links_per_axis) != rank:
    raise targets.PlanError(
        f'--links_per_axis {",".join(map(str, links_per_axis))} gives '
        f'{len(links_per_axis)} figures for a mesh of {rank} axes; give one '
        'per axis.')


def _CheckSlice(stack, args, meshes, num_devices):
  """--slice has the devices, and every mesh candidate lies along it.

  Raises:
    targets.PlanError: it does not, or --links_per_axis is given too.
  """
  if args.slice is None:
    return
  if args.links_per_axis is not None:
    raise targets.PlanError(
        '--slice and --links_per_axis both say the links: give one.')
  for mesh in meshes:
    shape = mesh or (np.shape(stack.device_mesh)
                     if stack.pipeline_stage_mesh_dim is not None else
                     (num_devices,))
    try:
      torus.LinksPerAxis(shape, args.slice)
    except ValueError as e:
      raise targets.PlanError(f'--slice {targets.MeshName(args.slice)}: '
                              f'{e}') from None


def _OwnRepeat(stack, mesh):
  """The circular_repeat a mesh candidate keeps of the stack's own: 1 on
  a stage axis of one device (no pipeline to circle; the depth is kept in
  the stage's blocks), else the stack's."""
  if mesh is not None and mesh[stack.pipeline_stage_mesh_dim] == 1:
    return 1
  return stack.circular_repeat


def _Meshes(stack, meshes, num_devices, circular_repeat=None):
  """The --mesh candidates, checked against the stack; [None] without.

  Raises:
    targets.PlanError: the stack is not on a mesh, or a mesh has another
      rank or size than the stack's.
  """
  if not meshes:
    return [None]
  if stack.pipeline_stage_mesh_dim is None:
    raise targets.PlanError(
        '--mesh: the pipelined stack is not placed on a device mesh '
        '(pipeline_stage_mesh_dim with device_mesh); its stages are over '
        'num_stages devices, so there is no other axis to trade them for.')
  rank = np.ndim(stack.device_mesh)
  for mesh in meshes:
    name = targets.MeshName(mesh)
    if mesh[stack.pipeline_stage_mesh_dim] == 1 and (
        any(r > 1 for r in circular_repeat or ())):
      raise targets.PlanError(
          f'--mesh {name} has a stage axis of 1 device (no pipeline), but '
          f'--circular_repeat asks for {max(circular_repeat)}: there is no '
          'pipeline to circle; plan that mesh with --circular_repeat 1.')
    if len(mesh) != rank:
      raise targets.PlanError(
          f'--mesh {name}: the model\'s device_mesh has {rank} axes '
          f'(shape {targets.MeshName(np.shape(stack.device_mesh))}); give '
          f'{rank} sizes.')
    if int(np.prod(mesh)) != num_devices:
      raise targets.PlanError(
          f'--mesh {name} has {int(np.prod(mesh))} devices, not '
          f'--num_devices {num_devices}.')
  return [tuple(m) for m in meshes]


def main(argv=None):
  parser, args = flags.Parse(argv)
  flags_and_seeds.EnsureFlagsParsed()
  if not partitioning.IsAvailable():
    print('plan: error: gpipe.plan needs jax and jaxlib: python '
          'tools/install.py --extra spmd in the checkout', file=sys.stderr)
    return 2
  try:
    target, num_devices, candidates = _Candidates(parser, args)
  except targets.PlanError as e:
    print(f'plan: error: {e}', file=sys.stderr)
    return 2
  chip = dataclasses.replace(roofline.CHIPS[args.tpu],
                             links_per_axis=tuple(args.links_per_axis or ()),
                             slice_dims=tuple(args.slice or ()))
  hbm_bytes = args.hbm_gib * GIB if args.hbm_gib else chip.hbm_bytes
  start = time.time()
  try:
    plan = candidate_lib.MakePlan(
        target, candidates, num_devices, chip, hbm_bytes, args.depth_param,
        log=lambda m: print(m, file=sys.stderr, flush=True),
        compile_timeout=60 * args.compile_timeout_minutes)
    # The report compiles the unpartitioned step for its FLOPs when asked.
    return _PrintPlan(plan, args, start)
  except candidate_lib.CandidateError as e:
    print(f'plan: error: building or compiling {e}', file=sys.stderr)
    if args.verbose:
      traceback.print_exception(e.error)
    else:
      print('(--verbose shows the traceback)', file=sys.stderr)
    return 1


def _PrintPlan(plan, args, start):
  """Prints the plan as --json and --plot ask; the exit status."""
  if args.json:
    report = plan.ToJson()
    report['wall_seconds'] = time.time() - start
    print(json.dumps(report, indent=1))
  if not plan.reports:
    print('plan: error: every candidate was skipped:\n' + '\n'.join(
        f'  {reason}' for reason in plan.SkippedReasons()), file=sys.stderr)
    return 2
  if not args.json:
    print(plan.Render())
    print(f'Planned in {time.time() - start:.0f} s.')
  if args.plot:
    plot.WritePlot(plan, args.plot)
    print(f'Wrote {args.plot}.', file=sys.stderr)
  return 0


if __name__ == '__main__':
  sys.exit(main())
