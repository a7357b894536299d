"""A user's PipelinedLayer Params for the partitioning checks and the planner.

Loaded by name (`module.attribute` or `path/to/file.py:attribute`), checked
against the devices (the stage mesh) and the input shapes before anything
is built, a failure worded in one line that names the fix; and the check
itself as a function (`CheckPartitioning`), which `gpipe.check_partitioning`
runs from the command line.
"""

import importlib
import importlib.util
import os
import re
import sys
from typing import Sequence

import numpy as np
import tensorflow as tf

from gpipe import layers
from gpipe.xla import partitioned_step
from lingvo.core import hyperparams
from lingvo.core import py_utils


def CheckPartitioning(layer_params: hyperparams.Params,
                      input_shapes: Sequence[Sequence[int]],
                      num_devices: int,
                      seed: int = 0) -> partitioned_step.Report:
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


def LoadParams(spec: str) -> hyperparams.Params:
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
