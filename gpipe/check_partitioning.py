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
instead (as gpipe.plan takes it; see gpipe.check_model): the step is the
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
import importlib
import importlib.util
import os
import re

import numpy as np
import tensorflow as tf

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
from gpipe import layers
from gpipe import partitioned_step
from lingvo.core import hyperparams
from lingvo.core import py_utils
# pylint: enable=g-import-not-at-top,g-bad-import-order


def CheckPartitioning(layer_params, input_shapes, num_devices, seed=0):
  """Partitions one training step of the layer; a partitioned_step.Report."""
  with tf.init_scope():
    layer = layer_params.Copy().Instantiate()
  step = partitioned_step.BuildPipelineStep(layer, input_shapes, seed)
  expected = partitioned_step.RunUnpartitioned(step)
  run = partitioned_step.RunStepPartitioned(step, num_devices)
  return partitioned_step.Report(
      run=run, step=step, expected=expected,
      num_stages=layer_params.num_stages,
      **partitioned_step.StackMesh(layer_params, num_devices))


def LoadParams(spec):
  """Params named by `spec` (an object, or a function returning one).

  `spec` is `module.attribute` (or `module:attribute`) of an importable
  module, or `path/to/file.py:attribute` of a file anywhere, which is
  imported as `python path/to/file.py` would run it: its directory first on
  sys.path, so it can import the modules beside it.
  """
  source, attr = _SplitSpec(spec)
  try:
    if source.endswith('.py'):
      module = _ImportFile(source)
    else:
      module = importlib.import_module(source)
    value = getattr(module, attr)
  except (ImportError, AttributeError, OSError) as e:
    raise ValueError(f'--params {spec}: {e}') from None
  value = value() if callable(value) else value
  if not isinstance(value, hyperparams.Params):
    raise ValueError(f'--params {spec} is a {type(value).__name__}, not '
                     'Params.')
  return value


def _SplitSpec(spec):
  """(module name or file path, attribute) of a --params value."""
  source, sep, attr = spec.rpartition(':')
  if not sep:
    source, sep, attr = spec.rpartition('.')
  if not (source and attr):
    raise ValueError(f'--params must be module.attribute or '
                     f'path/to/file.py:attribute, got {spec!r}.')
  if spec.endswith('.py') and sep == '.':
    raise ValueError(f'--params {spec} names a file but no attribute: '
                     f'write {spec}:<attribute>.')
  return source, attr


def _ImportFile(path):
  """The module of a Python file, imported once under its file name."""
  path = os.path.abspath(path)
  if not os.path.isfile(path):
    raise ImportError(f'no file {path}')
  name = os.path.splitext(os.path.basename(path))[0]
  loaded = sys.modules.get(name)
  if loaded is not None and getattr(loaded, '__file__', None) == path:
    return loaded
  directory = os.path.dirname(path)
  if directory not in sys.path:
    sys.path.insert(0, directory)
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  if loaded is None:  # a name already taken stays its module's
    sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


def CheckPipelineParams(params, name):
  """Raises ValueError unless `params` are a PipelinedLayer's."""
  cls = getattr(params, 'cls', None)
  if not (isinstance(cls, type) and issubclass(cls, layers.PipelinedLayer)):
    raise ValueError(f'{name} is Params of '
                     f'{getattr(cls, "__name__", cls)}, not of a '
                     'PipelinedLayer.')


def CheckDevices(params, num_devices=None):
  """The device count to partition for, checked against the stage mesh.

  Args:
    params: PipelinedLayer params.
    num_devices: the count asked for, or None for the layer's own: its
      num_stages (shard_stages_1d) or the size of its device_mesh.

  Returns:
    num_devices, or the layer's own count.

  Raises:
    ValueError: when the stages are not split over devices at all, or not
      over num_devices of them, naming the param and the fix.
  """
  p = params
  if not p.shard_stages_1d and p.pipeline_stage_mesh_dim is None:
    raise ValueError(
        'The layer does not split its stages over devices (neither '
        'shard_stages_1d nor pipeline_stage_mesh_dim is set): every device '
        f'would hold all {p.num_stages} stages\' weights. Set '
        'shard_stages_1d=True, or pipeline_stage_mesh_dim with device_mesh.')
  if p.shard_stages_1d:
    own, why = p.num_stages, (f'shard_stages_1d splits the stage dim over '
                              f'num_stages={p.num_stages} devices')
  else:
    own = int(np.asarray(p.device_mesh).size)
    why = f'its device_mesh has {own} devices'
  if num_devices is not None and num_devices != own:
    raise ValueError(f'--num_devices {num_devices} does not match the '
                     f'layer: {why}. Use --num_devices {own}.')
  return own


def DescribeInputError(params, input_shapes, error):
  """One line saying why the layer cannot run on `input_shapes`.

  When the stack, its layers run one after another, runs on the shapes
  with one input's last dim changed to a size taken from TensorFlow's
  message or from the stage body's weights, that input and both sizes are
  named; otherwise TensorFlow's first line, made whole.

  Args:
    params: the PipelinedLayer Params.
    input_shapes: the shapes the layer failed on, one per input.
    error: what running it raised.
  """
  shapes = [list(s) for s in input_shapes]
  found = _ExpectedLastDim(params, shapes, str(error))
  if found:
    i, size = found
    fitting = shapes[i][:-1] + [size]
    return (f'input {i} has shape {shapes[i]}; the stage body takes {size} '
            f'features in the last dim, not {shapes[i][-1]} (the layer runs '
            f'on {fitting})')
  listed = ', '.join(str(s) for s in shapes)
  return (f'the layer cannot run on inputs of shape {listed}: '
          f'{TensorFlowMessage(error)}')


def TensorFlowMessage(error):
  """TensorFlow's message in one line, with the values it lists after it.

  TensorFlow puts the node definition on its first line and the values of
  a failed assertion on the lines after a colon.
  """
  text = str(error).strip()
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  if not lines:
    return type(error).__name__
  first = lines[0]
  node = re.match(r"(.*?) for '\{\{node ([^}]*)\}\}.*' with input shapes: "
                  r'(.*?)\.?$', first)
  if node:
    first = (f'{node[1]} in op {node[2]} (its inputs have shapes '
             f'{node[3]})')
  values = re.findall(r'^([xy]) \((.*?)(?:/[xy])?:\d+\) = *\n(.*)$', text,
                      re.M)
  first = first.rstrip(':. ')
  if values:
    listed = ', '.join(f'{n} = {v.strip()}' for n, _, v in values)
    first += f' ({listed} in {values[0][1]})'
  return first


def PartitionerMessage(error):
  """The one line that says why partitioning failed.

  The partitioning runs in a worker process; when XLA aborts there, its
  fatal log line ("F... file.cc:123] Check failed: ...") says why, below
  many lines of warnings and a stack trace.
  """
  text = str(error)
  fatal = re.search(r'^F\d{4} [\d:.]+ +\d+ ([^\]]+)\] (.*?)\s*$', text,
                    re.M)
  first = text.strip().splitlines()[0].rstrip(':. ') if text.strip() else ''
  if fatal:
    return f'{first}: XLA stopped at {fatal[2]} ({fatal[1]})'
  return first or type(error).__name__


def _ExpectedLastDim(params, shapes, message, most_tries=6):
  """(input index, size) such that the layer runs with that input's last
  dim set to size, or None (also when it runs on `shapes` as they are)."""
  if _RunsUnrolled(params, shapes):
    return None
  # The sizes TensorFlow named: "but are 12 and 8", or an assertion's values.
  said = [int(d) for pair in re.findall(r'but are (\d+) and (\d+)', message)
          for d in pair]
  said += [int(v) for v in re.findall(r'^\[?(\d+)\]?$', message, re.M)]
  sizes = list(dict.fromkeys(said + _BodyWeightDims(params)))
  for i, shape in enumerate(shapes):
    tries = [d for d in sizes if shape and d != shape[-1]][:most_tries]
    for size in tries:
      changed = [list(s) for s in shapes]
      changed[i][-1] = size
      if _RunsUnrolled(params, changed):
        return i, size
  return None


def _RunsUnrolled(params, shapes):
  """Whether the stack, unrolled, builds and runs on zeros of `shapes`
  (TensorFlow's shape inference and the body's own shape assertions)."""
  with tf.Graph().as_default():
    try:
      layer = params.Copy().Set(unroll='always').Instantiate()
      inputs = [tf.zeros(s) for s in shapes]
      with py_utils.GlobalStepContext(tf.constant(0, tf.int64)):
        outputs = layer.FProp(layer.theta, *inputs)
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(outputs)
    except (ValueError, TypeError, tf.errors.OpError):
      return False
  return True


def _BodyWeightDims(params):
  """The sizes of the dims of one stage's weights, in order, once each."""
  with tf.Graph().as_default():
    try:
      layer = params.Copy().Instantiate()
      weights = layer.layer_theta(layer.theta, 0, 0).Flatten()
    except (ValueError, TypeError):
      return []
    dims = [d for w in weights for d in w.shape.as_list() if d]
  return list(dict.fromkeys(dims))


def main(argv=None):
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
    CheckPipelineParams(params, f'--params {args.params}')
    num_devices = CheckDevices(params, args.num_devices)
    layers.ValidateParams(params, args.input_shape[0][0])
  except ValueError as e:
    print(f'check_partitioning: error: {e}', file=sys.stderr)
    return 2
  try:
    report = CheckPartitioning(params, args.input_shape, num_devices)
  except (ValueError, TypeError, tf.errors.OpError) as e:
    print('check_partitioning: error: ' +
          DescribeInputError(params, args.input_shape, e), file=sys.stderr)
    return 2
  except RuntimeError as e:  # XLA's partitioner or compiler gave up
    return _SayPartitioningFailed(e, args.verbose)
  return _Print(report, args.tolerance, args.verbose)


def _CheckModel(args):
  """main() for --model: the registered model's whole training step."""
  from gpipe import check_model  # pylint: disable=g-import-not-at-top
  from gpipe import registered_models  # pylint: disable=g-import-not-at-top
  try:
    registered_models.ImportModules(args.model_module)
    model = check_model.FindModel(args.model)
    num_devices = CheckDevices(model.stack_params, args.num_devices)
  except (ValueError, LookupError) as e:
    print(f'check_partitioning: error: {e}', file=sys.stderr)
    return 2
  try:
    report = check_model.CheckModelPartitioning(model, num_devices)
  except ValueError as e:  # e.g. an input generator of dynamic shapes
    print(f'check_partitioning: error: --model {args.model}: '
          f'{TensorFlowMessage(e)}', file=sys.stderr)
    return 2
  except RuntimeError as e:  # XLA's partitioner or compiler gave up
    return _SayPartitioningFailed(e, args.verbose)
  return _Print(report, args.tolerance, args.verbose)


def _SayPartitioningFailed(error, verbose):
  """XLA's partitioner or compiler gave up: why, in one line; exit 1."""
  print(f'check_partitioning: error: {PartitionerMessage(error)}',
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
  sys.exit(main())
