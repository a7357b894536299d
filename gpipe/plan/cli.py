"""The planner's command line: python -m gpipe.plan (see gpipe.plan)."""

import argparse
import json
import sys
import time

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
from gpipe import plan as plan_package
from gpipe import check_partitioning
from gpipe import param_checks
from gpipe import partitioning
from gpipe import remat
from gpipe import stage_call
from gpipe.plan import candidate as candidate_lib
from gpipe.plan import roofline
from gpipe.plan import targets

GIB = 2**30


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
      description=plan_package.__doc__.split('\n\n')[0],
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
    return targets.ModelTarget(args.model)
  if not args.input_shape:
    parser.error('--params needs --input_shape (one per input).')
  return targets.LayerTarget(_LoadParams(args.params), args.input_shape,
                            args.params)


def _LoadParams(spec):
  try:
    return check_partitioning.LoadParams(spec)
  except ValueError as e:
    raise targets.PlanError(str(e)) from None


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
      raise targets.PlanError(str(e)) from None
    m0 = stack.num_microbatches
    if m0 is None:
      if not args.num_microbatches:
        raise targets.PlanError('The layer sets no num_microbatches; pass '
                        '--num_microbatches.')
    policy0 = param_checks.RematPolicy(stack)
    candidates = [
        targets.Candidate(m, r, policy)
        for policy in (args.remat_policy or [policy0])
        for r in (args.circular_repeat or [stack.circular_repeat])
        for m in (args.num_microbatches or [m0])
    ]
  except targets.PlanError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  chip = roofline.CHIPS[args.tpu]
  hbm_bytes = args.hbm_gib * GIB if args.hbm_gib else chip.hbm_bytes
  start = time.time()
  plan = candidate_lib.MakePlan(
      target, candidates, num_devices, chip, hbm_bytes, args.depth_param,
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
