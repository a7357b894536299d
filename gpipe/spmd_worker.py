"""Partitions and runs one HLO module on N virtual CPU devices, with jaxlib.

Runs in its own process (started by `gpipe.partitioning`), because the number
of virtual devices is fixed when XLA's CPU client starts and because this
side needs no TensorFlow: it reads what the TensorFlow side wrote into a
directory and writes its results back there.

    DIR/module.pb       HloModuleProto (tf.function ... stage='hlo_serialized')
    DIR/inputs.npz      the entry parameters, arg_0 ... arg_{k-1}, full shape
    DIR/config.json     {"num_devices": N, "output_shapes": [[...], ...],
                         "compile_only": false}
  written (with compile_only, only report.json's memory):
    DIR/outputs.npz     the results, out_0 ..., reassembled to full shape
    DIR/report.json     per-device shapes of parameters and outputs, and
                        XLA's buffer assignment sizes per device (memory)
    DIR/partitioned.hlo the partitioned per-device module, as text

Usage: python -m gpipe.spmd_worker DIR
"""

import json
import os
import pathlib
import sys


def _Main(workdir):
  workdir = pathlib.Path(workdir)
  config = json.loads((workdir / 'config.json').read_text())
  num_devices = int(config['num_devices'])
  flags = os.environ.get('XLA_FLAGS', '')
  os.environ['XLA_FLAGS'] = (
      f'{flags} --xla_force_host_platform_device_count={num_devices}').strip()

  # pylint: disable=g-import-not-at-top
  import numpy as np
  import jax
  from jax._src import sharding_impls
  from jax._src.lib import _jax
  from jax._src.lib import xla_client
  # pylint: enable=g-import-not-at-top

  devices = jax.devices('cpu')
  if len(devices) < num_devices:
    raise RuntimeError(
        f'Asked for {num_devices} virtual CPU devices, XLA made {len(devices)}.')
  devices = tuple(devices[:num_devices])

  inputs = np.load(workdir / 'inputs.npz')
  args = [inputs[f'arg_{i}'] for i in range(len(inputs.files))]

  computation = xla_client.XlaComputation((workdir / 'module.pb').read_bytes())
  module = _jax.mlir.xla_computation_to_mlir_module(computation)
  options = xla_client.CompileOptions()
  options.num_replicas = 1
  options.num_partitions = num_devices
  options.device_assignment = xla_client.DeviceAssignment.create(
      np.arange(num_devices).reshape(1, num_devices))
  build = options.executable_build_options
  build.use_spmd_partitioning = True
  # The entry parameters carry no sharding of their own: let the partitioner
  # give them what their first annotated use asks for (a weight split on its
  # stage dim arrives split, as it would live on a TPU).
  build.allow_spmd_sharding_propagation_to_parameters = [True] * len(args)
  build.allow_spmd_sharding_propagation_to_output = [True]
  executable = devices[0].client.compile_and_load(
      module, xla_client.DeviceList(devices), options)
  stats = executable.get_compiled_memory_stats()
  memory = {
      name: int(getattr(stats, name))
      for name in ('temp_size_in_bytes', 'argument_size_in_bytes',
                   'output_size_in_bytes', 'alias_size_in_bytes')
  }
  if config.get('compile_only'):
    (workdir / 'report.json').write_text(json.dumps({'memory': memory}))
    return

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

  param_shard_shapes = [
      list(sharding_impls.GSPMDSharding(devices, s).shard_shape(a.shape))
      for a, s in zip(args, executable.get_parameter_shardings())
  ]
  (workdir / 'report.json').write_text(
      json.dumps({
          'num_devices': num_devices,
          'param_shard_shapes': param_shard_shapes,
          'output_shard_shapes': output_shard_shapes,
          'memory': memory,
      }))
  (workdir / 'partitioned.hlo').write_text(
      executable.hlo_modules()[0].to_string())


if __name__ == '__main__':
  if len(sys.argv) != 2:
    sys.exit(__doc__)
  _Main(sys.argv[1])
