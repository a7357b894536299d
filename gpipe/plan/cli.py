"""The planner's command line: python -m gpipe.plan (see gpipe.plan).

Exit status: 0 with a plan; 2 when what was asked cannot be planned (bad
arguments, refused before anything is built; or every candidate skipped,
each with its reason); 1 when building or compiling a candidate fails for
another reason (the model's own error, said with its message).
"""

import argparse
import json
import math
import os
import sys
import time
import traceback

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
from gpipe import plan as plan_package
from gpipe import check_partitioning
from gpipe import param_checks
from gpipe import partitioning
from gpipe import remat
from gpipe import stage_call
from gpipe.plan import candidate as candidate_lib
from gpipe.plan import plot
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


def _Positive(convert, what, text):
  """A finite number above 0: a size or count of 0 or less means nothing."""
  try:
    value = convert(text)
  except ValueError:
    raise argparse.ArgumentTypeError(
        f'expected {what} above 0, got {text!r}') from None
  if not value > 0 or math.isinf(value):
    raise argparse.ArgumentTypeError(
        f'expected {what} above 0, got {text!r}')
  return value


def _PositiveInt(text):
  return _Positive(int, 'an integer', text)


def _PositiveFloat(text):
  return _Positive(float, 'a number', text)


def _PlotPath(text):
  """A .png path whose directory exists and is writable, checked before
  anything is compiled."""
  if not text.lower().endswith('.png'):
    raise argparse.ArgumentTypeError(f'expected a .png file, got {text!r}')
  directory = os.path.dirname(os.path.abspath(text))
  if not os.path.isdir(directory):
    raise argparse.ArgumentTypeError(
        f'{text!r}: directory {directory!r} does not exist')
  if os.path.isdir(text) or not os.access(directory, os.W_OK):
    raise argparse.ArgumentTypeError(f'{text!r}: cannot write there')
  return text


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
  parser.add_argument('--pipeline_layer', choices=('gpipe', 'lingvo'),
                      default='gpipe',
                      help='build the stack with gpipe\'s PipelinedLayer or Lingvo\'s own '
                      'LayerwiseShardablePipelinedLayer (same Params)')
  parser.add_argument('--input_shape', type=_Shape, action='append',
                      help='with --params: one input\'s shape, batch first; '
                      'repeat for several inputs')
  parser.add_argument('--num_devices', type=_PositiveInt, default=None,
                      help='devices of the slice (default: num_stages, or '
                      'the size of device_mesh)')
  parser.add_argument('--tpu', choices=sorted(roofline.CHIPS), default='v6e',
                      help='TPU generation of the roofline model')
  parser.add_argument('--hbm_gib', type=_PositiveFloat, default=None,
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
  parser.add_argument('--plot', type=_PlotPath, default=None,
                      metavar='FILE.png',
                      help='also draw each candidate\'s bytes per chip '
                      '(weights, optimizer slots, stored activations, other '
                      'temporaries) against the HBM size')
  return parser, parser.parse_args(argv)


def _Target(parser, args):
  if args.model:
    if args.input_shape:
      parser.error('--input_shape goes with --params; a --model has its own '
                   'input generator.')
    return targets.ModelTarget(args.model,
                               lingvos_layer=args.pipeline_layer == 'lingvo')
  if not args.input_shape:
    parser.error('--params needs --input_shape (one per input).')
  return targets.LayerTarget(_LoadParams(args.params), args.input_shape,
                            args.params,
                            lingvos_layer=args.pipeline_layer == 'lingvo')


def _LoadParams(spec):
  try:
    return check_partitioning.LoadParams(spec)
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
    num_devices = check_partitioning.CheckDevices(stack, args.num_devices)
  except ValueError as e:
    raise targets.PlanError(str(e)) from None
  m0 = stack.num_microbatches
  if m0 is None and not args.num_microbatches:
    raise targets.PlanError('The layer sets no num_microbatches; pass '
                            '--num_microbatches.')
  policy0 = param_checks.RematPolicy(stack)
  candidates = [
      targets.Candidate(m, r, policy)
      for policy in (args.remat_policy or [policy0])
      for r in (args.circular_repeat or [stack.circular_repeat])
      for m in (args.num_microbatches or [m0])
  ]
  return target, num_devices, candidates


def main(argv=None):
  parser, args = _Args(argv)
  stage_call.EnsureFlagsParsed()
  if not partitioning.IsAvailable():
    print("gpipe.plan needs jax and jaxlib: pip install 'gpipe[spmd]'",
          file=sys.stderr)
    return 2
  try:
    target, num_devices, candidates = _Candidates(parser, args)
  except targets.PlanError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  chip = roofline.CHIPS[args.tpu]
  hbm_bytes = args.hbm_gib * GIB if args.hbm_gib else chip.hbm_bytes
  start = time.time()
  try:
    plan = candidate_lib.MakePlan(
        target, candidates, num_devices, chip, hbm_bytes, args.depth_param,
        log=lambda m: print(m, file=sys.stderr, flush=True))
  except candidate_lib.CandidateError as e:
    print(f'error: building or compiling {e}', file=sys.stderr)
    if args.verbose:
      traceback.print_exception(e.error)
    else:
      print('(--verbose shows the traceback)', file=sys.stderr)
    return 1
  if args.json:
    report = plan.ToJson()
    report['wall_seconds'] = time.time() - start
    print(json.dumps(report, indent=1))
  if not plan.reports:
    print('error: every candidate was skipped:\n' + '\n'.join(
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
