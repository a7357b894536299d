"""Checks that a pipelined layer partitions as intended, for your params.

    python -m gpipe.check_partitioning --params my_module.PipelineParams \\
        --input_shape 16,128 --num_devices 4

`--params` names a `PipelinedLayer` Params object, or a function returning
one, importable as module.attribute. The check builds one training step of
the layer (forward, a loss, gradients w.r.t. every weight and the input),
partitions it with XLA's SPMD partitioner for N virtual CPU devices, runs it,
and prints:

  * the collectives per kind inside the loop bodies (the forward loop and
    its backward loop) and outside them: a pipeline's buffer shift is one
    collective-permute per carried tensor and iteration; an all-gather or
    all-to-all of the stage-stacked weights means an annotation is wrong;
  * each weight's per-device shape, and the bytes one device holds vs the
    total;
  * the largest difference between the partitioned run and the same step run
    unpartitioned on one device.

Exit status 0 when the partitioned run matches, every stage-stacked weight
is split and none is gathered; 1 when a check fails; 2 when the params, the
device count or the input shapes do not fit the layer (one line says why).
"""

# Before TensorFlow loads, so that the command prints its own lines only.
if __name__ == '__main__':
  from gpipe import quiet  # pylint: disable=g-import-not-at-top
  quiet.UnlessVerbose()

import argparse
import dataclasses
import importlib
import sys

import numpy as np
import tensorflow as tf

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
from gpipe import layers
from gpipe import partitioning
from gpipe import sharding
from lingvo.core import hyperparams
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap


@dataclasses.dataclass
class PipelineStep:
  """One training step of a pipelined layer as a function of arrays.

  fn(*weights, *inputs) returns [*outputs, loss, *d loss/d trainable
  weights, *d loss/d inputs]. Weights (every theta leaf, non-trainable ones
  included) are arguments, not captured variables, so each is one entry
  parameter of the compiled module.
  """
  fn: object
  args: list  # NumPy: the weights' values, then the inputs
  weight_names: list
  grad_names: list  # the trainable weights, in order
  num_inputs: int
  variables: list  # the layer's variables (the step assigns non-trainable)

  @property
  def num_weights(self):
    return len(self.weight_names)

  def ResultNames(self):
    """A name for each of fn's results."""
    return ([f'output {i}' for i in range(self.num_inputs)] + ['loss'] +
            [f'd loss/d {n}' for n in self.grad_names] +
            [f'd loss/d input {i}' for i in range(self.num_inputs)])


def BuildPipelineStep(layer, input_shapes, seed=0):
  """A PipelineStep for `layer` on float32 inputs of `input_shapes`."""
  theta = layer.theta
  names = [name for name, _ in theta.FlattenItems()]
  weights = [tf.convert_to_tensor(v).numpy() for _, v in theta.FlattenItems()]
  variables = dict(layer.vars.FlattenItems())
  trainable = [i for i, n in enumerate(names) if variables[n].trainable]
  rng = np.random.RandomState(seed)
  inputs = [rng.uniform(-1, 1, s).astype(np.float32) for s in input_shapes]
  # The body returns its inputs' structure, so the outputs have the inputs'
  # shapes; a fixed random projection of them is the loss.
  cotangents = [rng.uniform(-1, 1, s).astype(np.float32) for s in input_shapes]

  def Step(*flat):
    w = [tf.convert_to_tensor(t) for t in flat[:len(names)]]
    x = list(flat[len(names):])
    with tf.GradientTape() as tape:
      tape.watch(w + x)
      step_theta = theta.Pack(w)
      # A training step at global step 0 (bodies with dropout read it).
      with py_utils.GlobalStepContext(tf.constant(0, tf.int64)):
        out = layer.FProp(step_theta, *x)
      out = list(out) if isinstance(out, tuple) else [out]
      loss = tf.add_n(
          [tf.reduce_sum(o * c) for o, c in zip(out, cotangents)])
    grads = tape.gradient(loss, [w[i] for i in trainable] + x)
    grads = [tf.convert_to_tensor(g) for g in grads]
    return out + [loss] + grads

  return PipelineStep(
      fn=Step, args=weights + inputs, weight_names=names,
      grad_names=[names[i] for i in trainable], num_inputs=len(inputs),
      variables=layer.vars.Flatten())


@dataclasses.dataclass
class Report:
  """What partitioning a pipelined step gave."""
  run: partitioning.PartitionedRun
  step: PipelineStep
  expected: list  # the step's results run unpartitioned on one device
  num_stages: int

  @property
  def max_abs_diff(self):
    """Largest |partitioned - unpartitioned| over every result."""
    return max(
        float(np.max(np.abs(a - e))) if np.size(e) else 0.0
        for a, e in zip(self.run.outputs, self.expected))

  def WeightShapes(self):
    """[(name, full shape, per-device shape)] for every weight."""
    return [(name, tuple(np.shape(value)), shard)
            for name, value, shard in zip(self.step.weight_names,
                                          self.step.args,
                                          self.run.param_shard_shapes)]

  def WeightBytes(self):
    """(bytes one device holds, total bytes) of the weights."""
    per_device = total = 0
    weights = self.step.args[:self.step.num_weights]
    for value, shard in zip(weights, self.run.param_shard_shapes):
      itemsize = np.asarray(value).dtype.itemsize
      per_device += int(np.prod(shard, dtype=np.int64)) * itemsize
      total += np.asarray(value).nbytes
    return per_device, total

  def GatheredWeights(self):
    """All-gathers and all-to-alls that move a whole weight (or a stage's)."""
    return partitioning.GatheredTensors(
        self.run.collectives,
        [np.shape(w) for w in self.step.args[:self.step.num_weights]])

  def UnsplitWeights(self):
    """Weights every device holds whole although they have a stage dim.

    A stage-stacked weight has a dim of num_stages; held whole, it means
    the stage annotations were lost (or never asked for).
    """
    return [name for name, full, shard in self.WeightShapes()
            if tuple(full) == tuple(shard) and self.num_stages > 1 and
            self.num_stages in full]

  def Problems(self, tolerance):
    """One line per failed check (none: the layer partitions as intended)."""
    problems = []
    if self.max_abs_diff > tolerance:
      problems.append(f'MISMATCH: partitioned and unpartitioned results '
                      f'differ by {self.max_abs_diff:.3g} > {tolerance}.')
    if self.GatheredWeights():
      problems.append('WEIGHTS GATHERED: a stage-stacked weight is moved '
                      'whole between devices; an annotation is wrong.')
    unsplit = self.UnsplitWeights()
    if unsplit:
      problems.append(
          f'WEIGHTS NOT SPLIT: {", ".join(unsplit)} live whole on every '
          'device; the stage dim lost its annotation (shard_stages_1d or '
          'pipeline_stage_mesh_dim).')
    return problems

  def Summary(self):
    lines = [f'Partitioned for {self.run.num_devices} virtual devices.']
    for i, body in enumerate(self.run.loops):
      lines.append(f'  loop {i} ({body}): {_Counts(self.run.LoopCounts(i))}')
    lines.append(f'  outside the loops: {_Counts(self.run.Counts("outside"))}')
    lines.append('Weights (full shape -> per-device shape):')
    for name, full, shard in self.WeightShapes():
      lines.append(f'  {name}: {list(full)} -> {list(shard)}')
    per_device, total = self.WeightBytes()
    lines.append(f'Weight bytes per device: {per_device} of {total} '
                 f'({per_device / max(total, 1):.3f} of the total).')
    gathered = self.GatheredWeights()
    lines.append('Weights gathered or transposed: ' + (
        'none' if not gathered else '; '.join(
            f'{c.kind} {c.shape} from {c.op_name or "?"}' for c in gathered)))
    lines.append(f'Largest |partitioned - unpartitioned|: '
                 f'{self.max_abs_diff:.3g}')
    return '\n'.join(lines)


def _Counts(counts):
  if not counts:
    return 'no collectives'
  return ', '.join(f'{n} {kind}' for kind, n in sorted(counts.items()))


def RunUnpartitioned(step):
  """The step on one device, jit-compiled, as NumPy arrays."""
  compiled = tf.function(step.fn, jit_compile=True, autograph=False)
  return [t.numpy() for t in compiled(*[tf.constant(a) for a in step.args])]


def RunStepPartitioned(step, num_devices):
  """The step partitioned for `num_devices`, its stages in a manual region."""

  def Partitioned(*args):
    with sharding.SpmdPartitioning():
      return step.fn(*args)

  return partitioning.RunPartitioned(
      Partitioned, step.args, num_devices, variables=step.variables)


def CheckPartitioning(layer_params, input_shapes, num_devices, seed=0):
  """Partitions one training step of the layer; returns a Report."""
  with tf.init_scope():
    layer = layer_params.Copy().Instantiate()
  step = BuildPipelineStep(layer, input_shapes, seed)
  expected = RunUnpartitioned(step)
  run = RunStepPartitioned(step, num_devices)
  return Report(run=run, step=step, expected=expected,
                num_stages=layer_params.num_stages)


def LoadParams(spec):
  """Params named by `module.attribute` (an object or a function)."""
  module_name, _, attr = spec.rpartition('.')
  if not module_name:
    raise ValueError(f'--params must be module.attribute, got {spec!r}.')
  try:
    value = getattr(importlib.import_module(module_name), attr)
  except (ImportError, AttributeError) as e:
    raise ValueError(f'--params {spec}: {e}') from None
  value = value() if callable(value) else value
  if not isinstance(value, hyperparams.Params):
    raise ValueError(f'--params {spec} is a {type(value).__name__}, not '
                     'Params.')
  return value


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


def _ParseShape(text):
  try:
    return tuple(int(d) for d in text.split(','))
  except ValueError:
    raise argparse.ArgumentTypeError(
        f'--input_shape must be comma-separated integers, got {text!r}.'
    ) from None


def main(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__.split('\n\n')[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--params', required=True,
                      help='module.attribute: PipelinedLayer Params, or a '
                      'function returning them')
  parser.add_argument('--input_shape', type=_ParseShape, action='append',
                      required=True,
                      help='shape of one input, batch first, e.g. 16,128; '
                      'repeat for several inputs')
  parser.add_argument('--num_devices', type=int, default=None,
                      help='virtual devices (default: num_stages, or the '
                      'size of device_mesh)')
  parser.add_argument('--verbose', action='store_true',
                      help='also show TensorFlow, XLA and Lingvo logs')
  parser.add_argument('--tolerance', type=float, default=1e-4,
                      help='largest accepted |partitioned - unpartitioned|')
  args = parser.parse_args(argv)
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
    shapes = ', '.join(str(list(s)) for s in args.input_shape)
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    print(f'check_partitioning: error: the layer cannot run on inputs of '
          f'shape {shapes}: {first}', file=sys.stderr)
    return 2
  print(report.Summary())
  problems = report.Problems(args.tolerance)
  print('\n'.join(problems) if problems else 'OK')
  return 1 if problems else 0


if __name__ == '__main__':
  sys.exit(main())
