"""What XLA's SPMD partitioner makes of a TensorFlow computation, on CPU.

No TPU is needed to check a sharding: the HLO that `tf.function(...,
jit_compile=True)` produces carries every annotation, and XLA's SPMD
partitioner (the one in jaxlib) can partition it for N virtual CPU devices
and run it::

    fn, args --TF--> HLO (+ Sharding custom-calls) --jaxlib, N devices-->
        partitioned per-device HLO + results on N devices

`RunPartitioned` does that (the jaxlib side runs in a subprocess, see
`gpipe.spmd_worker`) and returns the results, the per-device shapes of the
parameters and outputs, and every collective in the partitioned module,
classified as inside a while loop's body or outside. Wrong annotations are
caught by the collectives, not the numbers: an all-gather of a weight still
computes the right result.

`CompileFromShapes` does the same for a module lowered from shapes alone
(`LowerFromShapes`: tf.TensorSpecs, nothing allocated, so a model larger
than host memory works) and compiles it without running: per-device memory
from XLA's buffer assignment, per-device FLOPs from XLA's cost analysis,
every parameter's per-device shape and the collectives.

Needs jax and jaxlib (`pip install '.[spmd]'`); `IsAvailable()` says whether
they are installed.
"""

import collections
import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import numpy as np
import tensorflow as tf

from gpipe import spmd_worker
from tensorflow.compiler.xla.service import hlo_pb2  # pylint: disable=g-direct-tensorflow-import

COLLECTIVE_KINDS = ('collective-permute', 'all-gather', 'all-reduce',
                    'all-to-all', 'reduce-scatter', 'collective-broadcast')


def IsAvailable():
  """True if jax and jaxlib are installed (they run the partitioner)."""
  return (importlib.util.find_spec('jax') is not None and
          importlib.util.find_spec('jaxlib') is not None)


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of the partitioned per-device module."""
  kind: str
  shape: str  # its result type, e.g. 'f32[1,2,8]{2,1,0}'
  computation: str
  loop: int  # index into PartitionedRun.loops, or -1 outside every loop
  op_name: str = ''  # the TensorFlow op it was partitioned from
  # The devices that take part together: replica groups (all-reduce,
  # all-gather, ...) or (source, target) pairs (collective-permute).
  groups: tuple = ()

  @property
  def bytes(self):
    """Bytes of its result (a tuple result: all elements), on one device."""
    return TypeBytes(self.shape)

  def MeshAxes(self, mesh_shape):
    """The device-mesh axes it runs along: those on which the devices of
    a group (or a permute's source and target) differ, e.g. (0,) for the
    rotation over a [stages, model] mesh's stage axis. () when it names no
    groups (all devices in one group on a 1-D mesh: (0,))."""
    if not self.groups:
      return tuple(range(len(mesh_shape))) if len(mesh_shape) == 1 else ()
    axes = set()
    for group in self.groups:
      coords = [np.unravel_index(d, mesh_shape) for d in group]
      for axis in range(len(mesh_shape)):
        if len({c[axis] for c in coords}) > 1:
          axes.add(axis)
    return tuple(sorted(axes))


def AxesName(axes, stage_axis=0):
  """'stage', 'axis 2', 'stage+axis 1', ...: mesh axes a collective runs
  along, the pipeline's stage axis by that name."""
  return '+'.join('stage' if a == stage_axis else f'axis {a}'
                  for a in axes) or 'all devices'


def KindOverAxes(collective, mesh_shape, stage_axis=0):
  """'collective-permute over stage', 'all-reduce over axis 2', ..."""
  axes = collective.MeshAxes(mesh_shape)
  return f'{collective.kind} over {AxesName(axes, stage_axis)}'


@dataclasses.dataclass
class PartitionedRun:
  """The partitioned module, its results and how it splits the tensors."""
  num_devices: int
  outputs: list  # of np.ndarray, full (reassembled) shapes
  param_shard_shapes: list  # per entry parameter, one device's shape
  output_shard_shapes: list
  collectives: list  # of Collective
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


def LowerToHlo(fn, args):
  """Serialized HloModuleProto of fn(*args) compiled with jit_compile=True."""
  compiled = tf.function(fn, jit_compile=True, autograph=False)
  return compiled.experimental_get_compiler_ir(*args)(stage='hlo_serialized')


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
  # (cost_error says which); reference_cost: of the reference module
  # compiled for one device (None without one).
  cost: dict
  reference_cost: dict
  collectives: list  # of Collective
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


def CompileFromShapes(proto, num_devices, reference_proto=None, aliases=(),
                      timeout=1800):
  """Compiles a serialized HloModuleProto for `num_devices`, without running.

  Args:
    proto: the module (e.g. from LowerFromShapes).
    num_devices: virtual devices to partition it for.
    reference_proto: optionally another module, compiled for one device
      (e.g. the same step lowered without partitioning) for its cost.
    aliases: (output index, parameter index) pairs: outputs that update a
      parameter in place (a training step's new weights), as donated
      buffers do on a TPU.
    timeout: seconds the compile subprocess may take.

  Returns:
    A CompiledModule.
  """
  _CheckAvailable()
  with tempfile.TemporaryDirectory(prefix='gpipe_spmd_') as workdir:
    work = pathlib.Path(workdir)
    (work / 'module.pb').write_bytes(_WithAliases(proto, aliases))
    config = {'num_devices': num_devices, 'compile_only': True}
    if reference_proto is not None:
      (work / 'reference.pb').write_bytes(_WithAliases(reference_proto, ()))
      config['reference_module'] = 'reference.pb'
    (work / 'config.json').write_text(json.dumps(config))
    _RunWorker(workdir, num_devices, timeout)
    report = json.loads((work / 'report.json').read_text())
    hlo = (work / 'partitioned.hlo').read_text()
  collectives, loops = AnalyzeHlo(hlo)
  return CompiledModule(
      num_devices=num_devices,
      memory=report['memory'],
      param_shard_shapes=[tuple(s) for s in report['param_shard_shapes']],
      output_shard_shapes=[tuple(s) for s in report['output_shard_shapes']],
      cost=report['cost'],
      cost_error=report.get('cost_error'),
      reference_cost=report.get('reference_cost'),
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
        'Checking partitioning needs jax and jaxlib: '
        "pip install 'gpipe[spmd]' (or: pip install jax jaxlib).")


def _RunWorker(workdir, num_devices, timeout):
  env = dict(os.environ)
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  proc = subprocess.run(
      [sys.executable, '-m', spmd_worker.__name__, workdir],
      env=env, capture_output=True, text=True, timeout=timeout, check=False)
  if proc.returncode:
    raise RuntimeError(
        f'Partitioning for {num_devices} devices failed (exit code '
        f'{proc.returncode}):\n{proc.stderr[-4000:]}')


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
    timeout: seconds the partition-and-run subprocess may take.

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
    _RunWorker(workdir, num_devices, timeout)
    report = json.loads((work / 'report.json').read_text())
    results = np.load(work / 'outputs.npz')
    outputs = [results[f'out_{i}'] for i in range(len(results.files))]
    hlo = (work / 'partitioned.hlo').read_text()
  collectives, loops = AnalyzeHlo(hlo)
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


# -----------------------------------------------------------------------------
# Reading HLO text.

_COMPUTATION_RE = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$')
_INSTRUCTION_RE = re.compile(
    r'^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.*?)\s(?P<op>[a-z][a-z0-9\-]*)\(')
_CALLEE_RE = re.compile(
    r'\b(?:body|condition|to_apply|calls|true_computation|false_computation)'
    r'=%?([\w.\-]+)')
_BRANCHES_RE = re.compile(r'branch_computations=\{([^}]*)\}')
_GROUPS_RE = re.compile(
    r'(?:replica_groups|source_target_pairs)=(\{(?:\{[\d,]*\},?)*\}|'
    r'\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)')


def DeviceGroups(line):
  """The device groups of a collective's HLO line, as tuples of ids.

  Reads both spellings: explicit `{{0,1},{2,3}}` (and a permute's
  `source_target_pairs`) and XLA's iota form `[2,2]<=[4]` or
  `[2,4]<=[4,2]T(1,0)` (iota over the bracketed dims, transposed, reshaped
  to [groups, size]).
  """
  match = _GROUPS_RE.search(line)
  if not match:
    return ()
  text = match.group(1)
  if text.startswith('{'):
    return tuple(tuple(int(d) for d in g.split(',') if d)
                 for g in re.findall(r'\{([\d,]*)\}', text[1:-1]))
  shape, dims, perm = re.match(
      r'\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', text).groups()
  ints = lambda t: [int(d) for d in t.split(',')]  # pylint: disable=g-long-lambda
  ids = np.arange(int(np.prod(ints(dims)))).reshape(ints(dims))
  if perm:
    ids = ids.transpose(ints(perm))
  return tuple(tuple(int(d) for d in g) for g in ids.reshape(ints(shape)))
_WHILE_BODY_RE = re.compile(r'\bbody=%?([\w.\-]+)')
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')


def _ParseComputations(hlo_text):
  """{computation name: [instruction lines]}, and the entry's name."""
  computations, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    if not line.startswith((' ', '\t')):
      match = _COMPUTATION_RE.match(line)
      if match:
        current = match.group(1)
        computations[current] = []
        if line.startswith('ENTRY'):
          entry = current
        continue
      if line.startswith('}'):
        current = None
      continue
    if current is not None:
      computations[current].append(line)
  return computations, entry


def ShapesOf(hlo_type):
  """'f32[1,8,8]{2,1,0}' -> [(1, 8, 8)]; a tuple type gives each element's."""
  return [
      tuple(int(d) for d in dims.split(',') if d)
      for dims in re.findall(r'[a-z]\w*\[([\d,]*)\]', hlo_type)
  ]


_DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2,
                'bf16': 2, 's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8,
                'f64': 8, 'c64': 8, 'c128': 16}


def TypeBytes(hlo_type):
  """'f32[1,8,8]{2,1,0}' -> 256; a tuple type: the sum of its elements."""
  total = 0
  for dtype, dims in re.findall(r'([a-z]\w*)\[([\d,]*)\]', hlo_type):
    elements = 1
    for d in dims.split(','):
      if d:
        elements *= int(d)
    total += elements * _DTYPE_BYTES.get(dtype, 4)
  return total


def _Callees(line):
  names = _CALLEE_RE.findall(line)
  for group in _BRANCHES_RE.findall(line):
    names += [n.strip().lstrip('%') for n in group.split(',') if n.strip()]
  return names


def _Walk(computations, root, into_loops):
  """Computations reachable from `root`, and the while bodies on the way.

  With into_loops=False a while instruction is not entered: its body is
  listed, but neither it nor what it calls counts as reached.
  """
  reached, loops, todo = set(), [], [root]
  while todo:
    name = todo.pop()
    if name in reached or name not in computations:
      continue
    reached.add(name)
    for line in computations[name]:
      body = _WHILE_BODY_RE.search(line)
      if body and ' while(' in line:
        loops.append(body.group(1))
        if not into_loops:
          continue
      todo.extend(_Callees(line))
  return reached, loops


def GatheredTensors(collectives, shapes):
  """All-gathers and all-to-alls that move a whole tensor of `shapes`.

  Judged by shape: the collective's result has one of the full shapes, or
  one without its leading stage (and repeat) dims, i.e. some device received
  data that another device owns. Activation shapes that happen to equal a
  weight's shape would be reported too.
  """
  suspects = set()
  for shape in shapes:
    shape = tuple(shape)
    suspects.update(shape[k:] for k in range(min(len(shape), 3)))
  return [
      c for c in collectives
      if c.kind in ('all-gather', 'all-to-all') and
      any(s in suspects for s in ShapesOf(c.shape))
  ]


def OpNameOf(line):
  """The TF op name an HLO instruction's metadata gives, or ''."""
  match = _OP_NAME_RE.search(line)
  return match.group(1) if match else ''


def LoopTripCounts(hlo_text):
  """{while body computation: iterations} (XLA's known_trip_count)."""
  trips = {}
  for line in hlo_text.splitlines():
    body = _WHILE_BODY_RE.search(line)
    if body and ' while(' in line:
      trips[body.group(1)] = spmd_worker.TripCount(line)
  return trips


_NOT_BUFFERS = ('parameter', 'get-tuple-element', 'tuple', 'bitcast', 'while',
                'call', 'conditional', 'constant')


# Instructions that update an operand in place (a loop's stacks and rings,
# written row by row): the buffer is their operand's, already counted.
_IN_PLACE = ('dynamic-update-slice', 'scatter')
_INSTRUCTION_NAME_RE = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=')


def _UpdatesInPlace(line, op):
  if op in _IN_PLACE:
    return True
  name = _INSTRUCTION_NAME_RE.match(line).group(1)
  return op == 'fusion' and any(f'{kind}_fusion' in name or
                                f'_{kind}' in name for kind in _IN_PLACE)


def LargestBuffers(hlo_text, count=5):
  """[(bytes, HLO type, TF op name)]: the largest arrays the module makes.

  One row per TF op (its largest result), biggest first; what fusions keep
  internal is not counted (it is never materialized), nor an in-place
  update of a buffer (a row written into a loop's stack: the stack is
  listed once, where it is made). A hint where the memory goes, not the
  live set at the peak.
  """
  computations, _ = _ParseComputations(hlo_text)
  largest = {}
  for name, lines in computations.items():
    if name.startswith(('fused_', 'wrapped_')):
      continue
    for line in lines:
      match = _INSTRUCTION_RE.match(line)
      if (not match or match.group('op') in _NOT_BUFFERS or
          _UpdatesInPlace(line, match.group('op'))):
        continue
      op_name = _OP_NAME_RE.search(line)
      key = op_name.group(1) if op_name else match.group('type')
      nbytes = TypeBytes(match.group('type'))
      if nbytes > largest.get(key, (0,))[0]:
        largest[key] = (nbytes, match.group('type').split('{')[0], key)
  return sorted(largest.values(), reverse=True)[:count]


def AnalyzeHlo(hlo_text):
  """Finds the collectives of an HLO module and the loops they run in.

  Returns:
    (collectives, loops): a list of Collective, and the body computation
    names of the module's outermost while loops; Collective.loop indexes
    that list (-1: outside every loop). A nested loop counts as part of the
    loop that contains it.
  """
  computations, entry = _ParseComputations(hlo_text)
  _, loops = _Walk(computations, entry, into_loops=False)
  owner = {}
  for index, body in enumerate(loops):
    reached, _ = _Walk(computations, body, into_loops=True)
    for name in reached:
      owner.setdefault(name, index)

  collectives = []
  for name, lines in computations.items():
    for line in lines:
      match = _INSTRUCTION_RE.match(line)
      if not match:
        continue
      op = match.group('op')
      if op.endswith('-done'):
        continue
      kind = op[:-len('-start')] if op.endswith('-start') else op
      if kind in COLLECTIVE_KINDS:
        op_name = _OP_NAME_RE.search(line)
        collectives.append(
            Collective(kind=kind, shape=match.group('type'), computation=name,
                       loop=owner.get(name, -1),
                       op_name=op_name.group(1) if op_name else '',
                       groups=DeviceGroups(line)))
  return collectives, loops
