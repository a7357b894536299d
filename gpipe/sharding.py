"""XLA sharding annotations for the pipeline.

Every helper always emits its annotation (an `XlaSharding` op, which runs as
an identity where no SPMD partitioner is involved: CPU graph mode, CPU jit),
so the graph that runs on one CPU device is the graph a TPU pod slice would
partition. Nothing here depends on a flag saying "TPU".

What each tensor of the loop gets, with `shard_stages_1d` (the stage dim over
num_stages devices) or `pipeline_stage_mesh_dim` (the stage dim over one axis
of `device_mesh`):

  tensor                          annotation            why
  stacked theta [S, (R,) ...]     stage dim split       each device holds 1/S
  stage-0 inputs [T, mb, ...]     replicated (dim 0)    indexed by the loop
  buffer state [S, mb, ...]       stage dim split       shift = 1 permute
  buffer history [T, S, mb, ...]  stage dim (1) split   no gather in the loop
  outputs [M, mb, ...]            replicated (dim 0)    leaves the pipeline
"""

import numpy as np
import tensorflow as tf

# pylint: disable=g-direct-tensorflow-import
from tensorflow.python.compiler.xla.experimental import xla_sharding
# pylint: enable=g-direct-tensorflow-import


def _IsTensor(x):
  return tf.is_tensor(x)


def Split(x, dim, num_devices):
  """Splits `x` along `dim` over `num_devices` devices (other dims whole)."""
  if not _IsTensor(x) or num_devices <= 1:
    return x
  return xla_sharding.split(x, dim, num_devices, use_sharding_op=True)


def Replicate(x):
  """Marks `x` as replicated on every device."""
  if not _IsTensor(x):
    return x
  return xla_sharding.replicate(x, use_sharding_op=True)


def MeshSplit(x, device_mesh, tensor_split_dims_mapping,
              unspecified_dims=None):
  """Splits `x` over an N-D `device_mesh`.

  Args:
    x: a tensor.
    device_mesh: an N-D array of device ids.
    tensor_split_dims_mapping: for each dim of x, the mesh axis that splits it,
      or -1 to keep it whole. Mesh axes no dim uses replicate x.
    unspecified_dims: dims whose sharding the partitioner may choose (their
      mapping entry must be -1): how a partially specified annotation leaves
      room for the body's own annotations on the other mesh axes.

  Returns:
    The annotated tensor.
  """
  if not _IsTensor(x):
    return x
  device_mesh = np.asarray(device_mesh)
  mapping = list(tensor_split_dims_mapping)
  if len(mapping) != x.shape.rank:
    raise ValueError(
        f'tensor_split_dims_mapping {mapping} has {len(mapping)} entries but '
        f'the tensor has rank {x.shape.rank}.')
  return xla_sharding.mesh_split(
      x,
      device_mesh,
      mapping,
      use_sharding_op=True,
      unspecified_dims=list(unspecified_dims or []))


def SplitStageDim(x, stage_dim, num_stages, device_mesh=None, mesh_dim=None):
  """Splits the stage dim of `x` over the pipeline's devices.

  With `device_mesh` and `mesh_dim`, the stage dim goes over that mesh axis
  and the other dims stay whole on it; otherwise over `num_stages` devices.
  """
  if not _IsTensor(x):
    return x
  if device_mesh is not None and mesh_dim is not None:
    mapping = [-1] * x.shape.rank
    mapping[stage_dim] = mesh_dim
    others = [d for d in range(x.shape.rank) if d != stage_dim]
    return MeshSplit(x, device_mesh, mapping, unspecified_dims=others)
  return Split(x, stage_dim, num_stages)
