"""What XLA's SPMD partitioner makes of a TensorFlow computation, on CPU.

No TPU is needed to check a sharding: the HLO that `tf.function(...,
jit_compile=True)` produces carries every annotation, and XLA's SPMD
partitioner (the one in jaxlib) can partition it for N virtual CPU devices
and run it::

    fn, args --TF--> HLO (+ Sharding custom-calls) --jaxlib, N devices-->
        partitioned per-device HLO + results on N devices

`RunPartitioned` does that (the jaxlib side runs in a worker process, see
`gpipe.xla.spmd_worker` and `gpipe.xla.worker_pool`) and returns the results,
the per-device shapes of the parameters and outputs, and every collective in
the partitioned module, classified as inside a while loop's body or outside
(read off the module's HLO text by `gpipe.xla.hlo_text`). Wrong annotations
are caught by the collectives, not the numbers: an all-gather of a weight
still computes the right result.

`CompileFromShapes` does the same for a module lowered from shapes alone
(`LowerFromShapes`: tf.TensorSpecs, nothing allocated, so a model larger
than host memory works) and compiles it without running: per-device memory
from XLA's buffer assignment, per-device FLOPs from XLA's cost analysis,
every parameter's per-device shape and the collectives.

Needs jax and jaxlib (`python tools/install.py --extra spmd`);
`IsAvailable()` says whether they are installed.
"""

import collections
import dataclasses
import importlib.util
import json
import pathlib
import tempfile

import numpy as np
import tensorflow as tf

from gpipe.xla import hlo_text
from gpipe.xla import worker_pool
from tensorflow.compiler.xla.service import hlo_pb2  # pylint: disable=g-direct-tensorflow-import



def IsAvailable():
  """True if jax and jaxlib are installed (they run the partitioner)."""
  return (importlib.util.find_spec('jax') is not None and
          importlib.util.find_spec('jaxlib') is not None)


@dataclasses.dataclass
class PartitionedRun:
  """The partitioned module, its results and how it splits the tensors."""
  num_devices: int
  outputs: list  # of np.ndarray, full (reassembled) shapes
  param_shard_shapes: list  # per entry parameter, one device's shape
  output_shard_shapes: list
  collectives: list  # of hlo_text.Collective
  loops: list  # of the while loops' body computation names, outer loops only
  hlo: str  # the partitioned per-device module
  # XLA's buffer assignment, bytes per device: temp_size_in_bytes (live
  # intermediates and workspace), argument_, output_ and alias_size_in_bytes.
  memory: dict = dataclasses.field(default_factory=dict)

  def Counts(self, where='all'):
    """{kind: count} over 'all', 'loops' (any loop body) or 'outside'."""
    counts = collections.Counter()
    for c in self.collectives:
      if (where == 'all' or (where == 'loops' and c.loop >= 0) or
          (where == 'outside' and c.loop < 0)):
        counts[c.kind] += 1
    return dict(counts)

  def LoopCounts(self, loop):
    """{kind: count} in the body of while loop `loop` (and what it calls)."""
    return dict(collections.Counter(
        c.kind for c in self.collectives if c.loop == loop))


def LowerFromShapes(fn, specs):
  """Serialized HloModuleProto of fn(*specs) with jit_compile=True.

  `specs` are tf.TensorSpecs: nothing is allocated, whatever their size.
  """
  compiled = tf.function(fn, jit_compile=True, autograph=False)
  return compiled.experimental_get_compiler_ir(*specs)(stage='hlo_serialized')


@dataclasses.dataclass
class CompiledModule:
  """A module compiled (not run) for N devices: what XLA says about it."""
  num_devices: int
  # XLA's buffer assignment, bytes per device: temp_size_in_bytes (live
  # intermediates and workspace), argument_, output_, alias_size_in_bytes.
  memory: dict
  param_shard_shapes: list  # per entry parameter, one device's shape
  output_shard_shapes: list
  # XLA's cost analysis per device, each loop counted per iteration:
  # {'flops', 'bytes accessed'}, or None when a loop's trip count is unknown
  # (cost_error says which).
  cost: dict
  collectives: list  # of hlo_text.Collective
  loops: list  # the outermost while loops' body computation names
  hlo: str  # the partitioned per-device module
  cost_error: str = None

  def Cost(self, key):
    """cost[key] ('flops' or 'bytes accessed'), or a clear error."""
    if self.cost is None:
      raise RuntimeError(f'No per-iteration cost: {self.cost_error}')
    return self.cost[key]

  @property
  def peak_bytes(self):
    """Arguments + outputs + temporaries - what outputs alias, per device."""
    m = self.memory
    return (m['argument_size_in_bytes'] + m['output_size_in_bytes'] +
            m['temp_size_in_bytes'] - m['alias_size_in_bytes'])

  def LoopCollectives(self, loop):
    return [c for c in self.collectives if c.loop == loop]


def CompileFromShapes(proto, num_devices, aliases=(), timeout=1800):
  """Compiles a serialized HloModuleProto for `num_devices`, without running.

  Args:
    proto: the module (e.g. from LowerFromShapes).
    num_devices: virtual devices to partition it for.
    aliases: (output index, parameter index) pairs: outputs that update a
      parameter in place (a training step's new weights), as donated
      buffers do on a TPU.
    timeout: seconds the worker process may take to compile it.

  Returns:
    A CompiledModule.
  """
  _CheckAvailable()
  with tempfile.TemporaryDirectory(prefix='gpipe_spmd_') as workdir:
    work = pathlib.Path(workdir)
    (work / 'module.pb').write_bytes(_WithAliases(proto, aliases))
    config = {'num_devices': num_devices, 'compile_only': True}
    (work / 'config.json').write_text(json.dumps(config))
    worker_pool.RunJob(workdir, num_devices, timeout)
    report = json.loads((work / 'report.json').read_text())
    hlo = (work / 'partitioned.hlo').read_text()
  collectives, loops = hlo_text.AnalyzeHlo(hlo)
  return CompiledModule(
      num_devices=num_devices,
      memory=report['memory'],
      param_shard_shapes=[tuple(s) for s in report['param_shard_shapes']],
      output_shard_shapes=[tuple(s) for s in report['output_shard_shapes']],
      cost=report['cost'],
      cost_error=report.get('cost_error'),
      collectives=collectives,
      loops=loops,
      hlo=hlo)


def CompiledMemory(fn, args, num_devices=1):
  """XLA's buffer assignment of fn(*args) partitioned for `num_devices`.

  Compiles without running; only the arguments' shapes and dtypes matter.
  Returns bytes per device: temp_size_in_bytes (intermediates live at once,
  i.e. activations and workspace), argument_size_in_bytes,
  output_size_in_bytes, alias_size_in_bytes.
  """
  specs = [tf.TensorSpec(np.shape(a), np.asarray(a).dtype) for a in args]
  return CompileFromShapes(LowerFromShapes(fn, specs), num_devices).memory


def _CheckAvailable():
  if not IsAvailable():
    raise RuntimeError(
        'Checking partitioning needs jax and jaxlib: python tools/install.py '
        '--extra spmd in the checkout (or pip install the jax and jaxlib '
        "versions pyproject.toml's spmd extra names).")


def RunPartitioned(fn, args, num_devices, variables=(), timeout=900):
  """Partitions fn(*args) for `num_devices` virtual CPU devices and runs it.

  Args:
    fn: a TensorFlow function of tensors returning a flat list/tuple of
      tensors. Trainable weights should be arguments, not captured variables,
      so that each weight is one entry parameter whose per-device shape the
      run reports.
    args: NumPy arrays, the arguments.
    num_devices: how many virtual devices to partition for.
    variables: variables fn may capture (read or assign) that tf.function
      does not track itself; their current values are passed in.
    timeout: seconds the worker process may take to partition and run it.

  Returns:
    A PartitionedRun.
  """
  _CheckAvailable()
  args = [np.asarray(a) for a in args]
  tensors = [tf.constant(a) for a in args]
  compiled = tf.function(fn, jit_compile=True, autograph=False)
  concrete = compiled.get_concrete_function(*tensors)
  output_shapes = [o.shape.as_list() for o in concrete.outputs]
  # Captured tensors and variables (e.g. ones the step assigns) follow the
  # arguments as entry parameters; their updates follow the outputs.
  args = args + _CapturedValues(concrete, variables)
  # TensorFlow aliases an assigned variable's parameter with its new value;
  # the partitioner may shard the two differently, which aliasing forbids.
  # The check runs the step once, so nothing needs updating in place.
  proto = _WithAliases(
      compiled.experimental_get_compiler_ir(*tensors)(stage='hlo_serialized'),
      ())
  with tempfile.TemporaryDirectory(prefix='gpipe_spmd_') as workdir:
    work = pathlib.Path(workdir)
    (work / 'module.pb').write_bytes(proto)
    np.savez(work / 'inputs.npz', **{f'arg_{i}': a for i, a in enumerate(args)})
    (work / 'config.json').write_text(
        json.dumps({'num_devices': num_devices,
                    'output_shapes': output_shapes}))
    worker_pool.RunJob(workdir, num_devices, timeout)
    report = json.loads((work / 'report.json').read_text())
    results = np.load(work / 'outputs.npz')
    outputs = [results[f'out_{i}'] for i in range(len(results.files))]
    hlo = (work / 'partitioned.hlo').read_text()
  collectives, loops = hlo_text.AnalyzeHlo(hlo)
  return PartitionedRun(
      num_devices=num_devices,
      outputs=outputs,
      param_shard_shapes=[tuple(s) for s in report['param_shard_shapes']],
      output_shard_shapes=[tuple(s) for s in report['output_shard_shapes']],
      collectives=collectives,
      loops=loops,
      hlo=hlo,
      memory=report.get('memory', {}))


def _WithAliases(serialized, aliases):
  """The module with exactly `aliases`: (output index, parameter index)."""
  module = hlo_pb2.HloModuleProto()
  module.ParseFromString(serialized)
  module.ClearField('input_output_alias')
  for output_index, param_index in aliases:
    entry = module.input_output_alias.entries.add()
    entry.output_shape_index.append(output_index)
    entry.parameter_number = param_index
    entry.kind = hlo_pb2.Kind.MAY_ALIAS
  return module.SerializeToString()


def _CapturedValues(concrete, variables):
  """Current values of a concrete function's captured inputs, in order.

  A captured resource is looked up among the function's own variables and
  `variables` (those tf.function does not track, e.g. Lingvo's).
  """
  variables = {
      id(v.handle): v for v in list(concrete.variables) + list(variables)
  }
  values = []
  for captured in concrete.captured_inputs:
    if captured.dtype == tf.resource:
      if id(captured) not in variables:
        raise ValueError(
            f'The function captures a resource ({captured!r}) that is not a '
            'known variable; pass the variable in `variables`.')
      captured = variables[id(captured)]
    values.append(np.asarray(captured.numpy()))
  return values
