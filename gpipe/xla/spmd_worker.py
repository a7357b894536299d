"""Partitions an HLO module for N virtual CPU devices with jaxlib; may run it.

Runs in its own process (started by `gpipe.xla.worker_pool`), because the
number of virtual devices is fixed when XLA's CPU client starts and because this
side needs no TensorFlow: it reads what the TensorFlow side wrote into a
directory and writes its results back there.

    DIR/module.pb       HloModuleProto (tf.function ... stage='hlo_serialized')
    DIR/config.json     {"num_devices": N, "output_shapes": [[...], ...],
                         "compile_only": false}
    DIR/inputs.npz      the entry parameters, arg_0 ... arg_{k-1}, full shape
                        (only to run; a compile-only module needs none)
  written:
    DIR/report.json     per-device shapes of parameters and outputs, XLA's
                        buffer assignment sizes per device (memory); with
                        compile_only also the cost (flops and bytes accessed
                        per device, each while loop counted trip-count times)
    DIR/partitioned.hlo the partitioned per-device module, as text
    DIR/outputs.npz     the results, out_0 ..., reassembled to full shape
                        (only when run)

Usage: python -m gpipe.xla.spmd_worker DIR
       python -m gpipe.xla.spmd_worker --serve N

With --serve the worker starts XLA's CPU client for N devices once and then
does each DIR it reads from stdin (one per line), writing a line to stdout
when that DIR's results are written (`gpipe.xla.worker_pool` keeps one per
N). Any error ends it, its exit code and stderr saying why, as in one-shot
use.
"""

import json
import os
import pathlib
import re
import sys

_COMPUTATION_RE = re.compile(r'^(ENTRY\s+)?(%?[\w.\-]+)\s.*\{\s*$')
_WHILE_RE = re.compile(r'\swhile\(.*\bbody=%?([\w.\-]+)')
_TRIP_COUNT_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')



def _Main(workdir):
  workdir = pathlib.Path(workdir)
  config = json.loads((workdir / 'config.json').read_text())
  _Job(workdir, config, _Devices(int(config['num_devices'])))


def _Serve(num_devices):
  """Does each directory named on stdin; a line on stdout after each."""
  replies = os.fdopen(os.dup(1), 'w')
  os.dup2(2, 1)  # whatever else prints goes to stderr, not the replies
  devices = _Devices(num_devices)
  for line in sys.stdin:
    workdir = pathlib.Path(line.strip())
    config = json.loads((workdir / 'config.json').read_text())
    if int(config['num_devices']) != num_devices:
      raise RuntimeError(f'{workdir} asks for {config["num_devices"]} '
                         f'devices; this worker has {num_devices}.')
    _Job(workdir, config, devices)
    replies.write('done\n')
    replies.flush()


def _Devices(num_devices):
  """XLA's CPU client made with `num_devices` virtual devices: them."""
  flags = os.environ.get('XLA_FLAGS', '')
  os.environ['XLA_FLAGS'] = (
      f'{flags} --xla_force_host_platform_device_count={num_devices}').strip()

  # pylint: disable=g-import-not-at-top
  import jax
  # pylint: enable=g-import-not-at-top
  # Entry parameters keep their dtype (e.g. an int64 global step).
  jax.config.update('jax_enable_x64', True)

  devices = jax.devices('cpu')
  if len(devices) < num_devices:
    raise RuntimeError(
        f'Asked for {num_devices} virtual CPU devices, XLA made {len(devices)}.')
  return tuple(devices[:num_devices])


def _Job(workdir, config, devices):
  """Compiles (and runs) DIR's module; writes DIR's results."""
  executable, computation = _Compile((workdir / 'module.pb').read_bytes(),
                                     devices)
  report = {
      'num_devices': len(devices),
      'memory': _MemoryStats(executable),
      'param_shard_shapes': _ShardShapes(
          devices, executable.get_parameter_shardings(),
          computation.program_shape().parameter_shapes()),
  }
  hlo = executable.hlo_modules()[0].to_string()
  (workdir / 'partitioned.hlo').write_text(hlo)
  if config.get('compile_only'):
    report['output_shard_shapes'] = _ShardShapes(
        devices, executable.get_output_shardings(),
        _TupleElements(computation.program_shape().result_shape()))
    report['cost'], report['cost_error'] = _CostOrWhyNot(
        devices[0].client, hlo)
  else:
    report['output_shard_shapes'] = _Run(workdir, config, executable, devices)
  (workdir / 'report.json').write_text(json.dumps(report))


def _Compile(proto, devices):
  """Compiles an HloModuleProto for len(devices) partitions (SPMD)."""
  # pylint: disable=g-import-not-at-top
  import numpy as np
  from jax._src.lib import _jax
  from jax._src.lib import xla_client
  # pylint: enable=g-import-not-at-top
  num_devices = len(devices)
  computation = xla_client.XlaComputation(proto)
  num_params = len(computation.program_shape().parameter_shapes())
  module = _jax.mlir.xla_computation_to_mlir_module(computation)
  options = xla_client.CompileOptions()
  options.num_replicas = 1
  options.num_partitions = num_devices
  options.device_assignment = xla_client.DeviceAssignment.create(
      np.arange(num_devices).reshape(1, num_devices))
  build = options.executable_build_options
  build.use_spmd_partitioning = num_devices > 1
  # The entry parameters carry no sharding of their own: let the partitioner
  # give them what their first annotated use asks for (a weight split on its
  # stage dim arrives split, as it would live on a TPU).
  build.allow_spmd_sharding_propagation_to_parameters = [True] * num_params
  build.allow_spmd_sharding_propagation_to_output = [True]
  executable = devices[0].client.compile_and_load(
      module, xla_client.DeviceList(devices), options)
  return executable, computation


def _MemoryStats(executable):
  stats = executable.get_compiled_memory_stats()
  return {
      name: int(getattr(stats, name))
      for name in ('temp_size_in_bytes', 'argument_size_in_bytes',
                   'output_size_in_bytes', 'alias_size_in_bytes',
                   'generated_code_size_in_bytes')
  }


def _TupleElements(shape):
  return shape.tuple_shapes() if shape.is_tuple() else [shape]


def _ShardShapes(devices, op_shardings, shapes):
  """One device's shape of each (full) shape under its sharding."""
  # pylint: disable=g-import-not-at-top
  from jax._src import sharding_impls
  # pylint: enable=g-import-not-at-top
  if op_shardings is None:  # compiled for one device, unpartitioned
    return [list(shape.dimensions()) for shape in shapes]
  return [
      list(sharding_impls.GSPMDSharding(devices, s).shard_shape(
          tuple(shape.dimensions())))
      for s, shape in zip(op_shardings, shapes)
  ]


def LoopAwareCost(client, hlo_text):
  """{'flops', 'bytes accessed'} of a module, loops counted per iteration.

  XLA's cost analysis counts a while loop's body once. Here each loop's
  body is analysed as a module of its own and counted as many times as the
  loop runs, recursively for nested loops:

      total(C) = cost(C) - sum cost(B_w) + sum trips_w * total(B_w)

  over the loops w reached from C, B_w being w's body, run as often as
  XLA's `known_trip_count` annotation says.
  """
  computations, entry = _SplitComputations(hlo_text)
  memo = {}

  def Total(name):
    if name not in memo:
      cost = _ComputationCost(client, computations, name)
      for body, trips in _LoopsReachedFrom(computations, name):
        body_cost = _ComputationCost(client, computations, body)
        body_total = Total(body)
        for key in cost:
          cost[key] += trips * body_total[key] - body_cost[key]
      memo[name] = cost
    return dict(memo[name])

  return Total(entry)


def _SplitComputations(hlo_text):
  """{name: text of that computation}, in module order, and the entry's name."""
  computations, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    match = _COMPUTATION_RE.match(line)
    if match and not line.startswith((' ', '\t')):
      current = match.group(2).lstrip('%')
      if match.group(1):
        entry = current
        line = line[len(match.group(1)):]
      computations[current] = [line]
    elif current is not None:
      computations[current].append(line)
      if line.startswith('}'):
        current = None
  return {k: '\n'.join(v) for k, v in computations.items()}, entry


def _ComputationCost(client, computations, entry):
  """XLA's cost analysis of one computation (and what it calls), as a dict."""
  # pylint: disable=g-import-not-at-top
  from jax._src.lib import xla_client
  import jaxlib._jax as jax_extension
  # pylint: enable=g-import-not-at-top
  parts = ['HloModule cost']
  for name, text in computations.items():
    parts.append('ENTRY ' + text if name == entry else text)
  module = xla_client.hlo.hlo_module_from_text('\n\n'.join(parts))
  cost = jax_extension.hlo_module_cost_analysis(client, module)
  return {key: float(cost.get(key, 0.0)) for key in ('flops',
                                                      'bytes accessed')}


def _LoopsReachedFrom(computations, root):
  """[(body, trip count)] of the while loops reached from root, not nested."""
  loops, seen, todo = [], set(), [root]
  while todo:
    name = todo.pop()
    if name in seen or name not in computations:
      continue
    seen.add(name)
    for line in computations[name].splitlines()[1:]:
      loop = _WHILE_RE.search(line)
      if loop:
        loops.append((loop.group(1), TripCount(line)))
        continue
      todo.extend(
          n.lstrip('%') for n in re.findall(
              r'\b(?:to_apply|calls|true_computation|false_computation)='
              r'(%?[\w.\-]+)', line))
      for group in re.findall(r'branch_computations=\{([^}]*)\}', line):
        todo.extend(n.strip().lstrip('%') for n in group.split(','))
  return loops


class UnknownTripCount(RuntimeError):
  """A while loop without XLA's known_trip_count: its cost is unknown."""


def _CostOrWhyNot(client, hlo_text):
  """(LoopAwareCost, None), or (None, the reason) for a loop of unknown
  trip count (e.g. a plain tf.while_loop): memory stats stay valid."""
  try:
    return LoopAwareCost(client, hlo_text), None
  except UnknownTripCount as e:
    return None, str(e)


def TripCount(while_line):
  """How often a while loop (its HLO instruction line) runs."""
  trips = _TRIP_COUNT_RE.search(while_line)
  if trips:
    return int(trips.group(1))
  op_name = _OP_NAME_RE.search(while_line)
  raise UnknownTripCount(
      'XLA did not find the trip count of the while loop '
      f'{op_name.group(1) if op_name else while_line[:100]!r}; its cost '
      'cannot be counted per iteration.')


def _Run(workdir, config, executable, devices):
  """Places the inputs, runs, writes outputs.npz; returns output shard shapes."""
  # pylint: disable=g-import-not-at-top
  import numpy as np
  import jax
  from jax._src import sharding_impls
  # pylint: enable=g-import-not-at-top
  inputs = np.load(workdir / 'inputs.npz')
  args = [inputs[f'arg_{i}'] for i in range(len(inputs.files))]
  placed = []
  for i, (value, op_sharding) in enumerate(
      zip(args, executable.get_parameter_shardings())):
    sharding = sharding_impls.GSPMDSharding(devices, op_sharding)
    try:
      sharding.shard_shape(value.shape)
    except ValueError as e:
      raise SystemExit(
          f'Entry parameter {i} of shape {list(value.shape)} is split '
          f'unevenly ({e}). The check places whole shards only: use dims '
          'divisible by the number of devices that split them.') from None
    placed.append(jax.device_put(value, sharding))
  results = executable.execute_sharded(placed)
  per_device = results.disassemble_into_single_device_arrays()

  out_shardings = executable.get_output_shardings()
  outputs, output_shard_shapes = {}, []
  # Results beyond the function's outputs are its variables' new values.
  num_outputs = len(config['output_shapes'])
  for i, (shards, op_sharding) in enumerate(
      zip(per_device[:num_outputs], out_shardings)):
    sharding = sharding_impls.GSPMDSharding(devices, op_sharding)
    full_shape = tuple(config['output_shapes'][i])
    whole = np.zeros(full_shape, np.asarray(shards[0]).dtype)
    index_map = sharding.devices_indices_map(full_shape)
    for shard in shards:
      whole[index_map[shard.device]] = np.asarray(shard)
    outputs[f'out_{i}'] = whole
    output_shard_shapes.append(list(np.asarray(shards[0]).shape))
  np.savez(workdir / 'outputs.npz', **outputs)
  return output_shard_shapes


if __name__ == '__main__':
  if len(sys.argv) == 3 and sys.argv[1] == '--serve':
    _Serve(int(sys.argv[2]))
  elif len(sys.argv) == 2:
    _Main(sys.argv[1])
  else:
    sys.exit(__doc__)
