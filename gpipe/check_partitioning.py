"""Checks that a pipelined layer partitions as intended, for your params.

    python -m gpipe.check_partitioning --params my_module.PipelineParams \\
        --input_shape 16,128 --num_devices 4
    python -m gpipe.check_partitioning --model lm.CopyLMMeshSmall

`--params` names a `PipelinedLayer` Params object, or a function returning
one, as module.attribute of an importable module or as
path/to/file.py:attribute. The check builds one training step of
the layer (forward, a loss, gradients w.r.t. every weight and the input),
partitions it with XLA's SPMD partitioner for N virtual CPU devices, runs it,
and prints what is listed below. `--model` names a registered Lingvo model
instead (as gpipe.plan takes it; see gpipe.xla.check_model): the step is the
task's loss and gradients on a batch of its input, and a stack weight
split over fewer devices than its own annotation asks is a failed check
too. It prints:

  * the collectives per kind inside the loop bodies, per iteration (each
    loop labelled forward or backward, with its iterations), and outside
    them: a pipeline's buffer shift is one collective-permute per carried
    tensor and iteration; an all-gather or all-to-all of the stage-stacked
    weights means an annotation is wrong;
  * each weight's per-device shape, and the bytes one device holds vs the
    total;
  * the largest difference between the partitioned run and the same step run
    unpartitioned on one device.

Exit status 0 when the partitioned run matches, every stage-stacked weight
is split and none is gathered; 1 when a check fails; 2 when the params, the
device count or the input shapes do not fit the layer (one line says why).
"""

import argparse
import sys
from typing import Optional, Sequence

__all__ = ['CheckPartitioning', 'LoadParams', 'main']


def _ParseShape(text):
  try:
    return tuple(int(d) for d in text.split(','))
  except ValueError:
    raise argparse.ArgumentTypeError(
        f'--input_shape must be comma-separated integers, got {text!r}.'
    ) from None


def _Parser():
  from gpipe import quiet  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(
      prog='python -m gpipe.check_partitioning',
      description=__doc__.split('\n\n')[0],
      epilog=__doc__.strip().split('\n\n')[-1],
      formatter_class=quiet.HelpFormatter)
  what = parser.add_mutually_exclusive_group(required=True)
  what.add_argument('--params',
                    help='PipelinedLayer Params, or a function returning '
                    'them: module.attribute of an importable module, or '
                    'path/to/file.py:attribute')
  what.add_argument('--model', help='a registered Lingvo model, e.g. '
                    'lm.CopyLMMeshSmall (its whole training step)')
  parser.add_argument('--model_module', action='append', default=[],
                      help='with --model: a module to import first, which '
                      'registers models of your own (a dotted name, or a '
                      'path to its .py file); repeat for several')
  parser.add_argument('--input_shape', type=_ParseShape, action='append',
                      help='with --params: shape of one input, batch first, '
                      'e.g. 16,128; repeat for several inputs')
  parser.add_argument('--num_devices', type=int, default=None,
                      help='virtual devices (default: num_stages, or the '
                      'size of device_mesh)')
  parser.add_argument('--verbose', action='store_true',
                      help='also show TensorFlow, XLA and Lingvo logs, and '
                      'the XLA computation of each loop')
  parser.add_argument('--tolerance', type=float, default=1e-4,
                      help='largest accepted |partitioned - unpartitioned|')
  return parser


# The arguments are read before TensorFlow loads (--help and usage errors
# answer at once), and the libraries are quieted before they load.
if __name__ == '__main__':
  _Parser().parse_args()
  from gpipe import quiet  # pylint: disable=g-import-not-at-top
  quiet.UnlessVerbose()

# pylint: disable=g-import-not-at-top,g-bad-import-order
import tensorflow as tf

from gpipe import layers
from gpipe.xla import user_layer
from gpipe.xla.user_layer import CheckPartitioning  # the check as a function
from gpipe.xla.user_layer import LoadParams
# pylint: enable=g-import-not-at-top,g-bad-import-order


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The command: checks --params or --model; the exit status (0 OK, 1 a
  failed check, 2 arguments that do not fit the layer)."""
  parser = _Parser()
  args = parser.parse_args(argv)
  if args.model:
    if args.input_shape:
      parser.error('--input_shape goes with --params; a --model has its own '
                   'input generator.')
    return _CheckModel(args)
  if args.model_module:
    parser.error('--model_module goes with --model.')
  if not args.input_shape:
    parser.error('--params needs --input_shape (one per input).')
  try:
    params = LoadParams(args.params)
    user_layer.CheckPipelineParams(params, f'--params {args.params}')
    num_devices = user_layer.CheckDevices(params, args.num_devices)
    layers.ValidateParams(params, args.input_shape[0][0])
  except ValueError as e:
    print(f'check_partitioning: error: {e}', file=sys.stderr)
    return 2
  try:
    report = CheckPartitioning(params, args.input_shape, num_devices)
  except (ValueError, TypeError, tf.errors.OpError) as e:
    print('check_partitioning: error: ' +
          user_layer.DescribeInputError(params, args.input_shape, e),
          file=sys.stderr)
    return 2
  except RuntimeError as e:  # XLA's partitioner or compiler gave up
    return _SayPartitioningFailed(e, args.verbose)
  return _Print(report, args.tolerance, args.verbose)


def _CheckModel(args):
  """main() for --model: the registered model's whole training step."""
  # pylint: disable=g-import-not-at-top,unused-import
  from gpipe.lingvo_support import registered_models
  from gpipe.xla import check_model
  import params.lm  # the registered models
  # pylint: enable=g-import-not-at-top,unused-import
  try:
    registered_models.ImportModules(args.model_module)
    model = check_model.FindModel(args.model)
    num_devices = user_layer.CheckDevices(model.stack_params, args.num_devices)
  except (ValueError, LookupError) as e:
    print(f'check_partitioning: error: {e}', file=sys.stderr)
    return 2
  try:
    report = check_model.CheckModelPartitioning(model, num_devices)
  except ValueError as e:  # e.g. an input generator of dynamic shapes
    print(f'check_partitioning: error: --model {args.model}: '
          f'{user_layer.TensorFlowMessage(e)}', file=sys.stderr)
    return 2
  except RuntimeError as e:  # XLA's partitioner or compiler gave up
    return _SayPartitioningFailed(e, args.verbose)
  return _Print(report, args.tolerance, args.verbose)


def _SayPartitioningFailed(error, verbose):
  """XLA's partitioner or compiler gave up: why, in one line; exit 1."""
  print(f'check_partitioning: error: {user_layer.PartitionerMessage(error)}',
        file=sys.stderr)
  if verbose:
    print(error, file=sys.stderr)
  return 1


def _Print(report, tolerance, verbose=False):
  """Prints the report and its verdict; the exit status."""
  print(report.Summary(verbose))
  problems = report.Problems(tolerance)
  print('\n'.join(problems) if problems else 'OK')
  return 1 if problems else 0


if __name__ == '__main__':
  from gpipe.apps import prompt_exit  # pylint: disable=g-import-not-at-top
  prompt_exit.Exit(main())
