"""FSDP for the pod blocks: weights stored split finer than they are used.

With `PodMesh(fsdp=True)` (a stage's `fsdp_mesh_dim`) every projection
weight of a block is stored split over the data axis as well as over the
model axis, by its model dim d (`StoredSplitOver`: its
weight_split_dims_mapping names both), so a chip holds 1/(data x model)
of it and of its optimizer slots. Where the
block uses it, the weight is gathered whole over the data axis (each data
replica computes on its own examples with the whole weight), and its
gradient, summed over the replicas, goes back split (the partitioner's
reduce-scatter):

    stored  [d/data, heads/model, h]  --cast to the compute dtype, still
            split--> all-gather over data --> [d, heads/model, h] --> einsum

Both annotations are written out, the cast's too, so that the gather moves
the compute dtype (bfloat16: half the bytes) and no compiler has to choose
between gathering the weight and moving the activations. A block gathers
its own weights only, inside its own call (and again in its recomputation),
so a stage holds one block's gathered weights at a time.
"""

import dataclasses

import numpy as np

from gpipe import sharding
from lingvo.core import py_utils


@dataclasses.dataclass(frozen=True)
class Split:
  """A weight's tensor_split_dims_mapping, as one leaf of a tree."""
  dims: tuple


def StoredSplitOver(block, axis, where):
  """PodBlockParams (split over a PodMesh, pod_blocks.SplitBlockOverMesh)
  with each projection weight stored split over mesh `axis` too, by its
  model dim d: the attention's [d, heads, head_dim] on dim 0, the
  feed-forward's [d, hidden] on dim 0 and [hidden, d] on dim 1. A copy.

  Raises:
    ValueError: the block is not split over a mesh (no mappings to add
      the axis to), or already splits a weight over `axis`.
  """
  block = block.Copy()
  atten = block.tr_atten_tpl.atten_tpl
  ff = block.tr_fflayer_tpl.fflayer_tpl
  mappings = [atten.weight_split_dims_mapping] + list(
      ff.weight_split_dims_mapping_list or [None, None])
  if any(m is None or axis in m for m in mappings):
    raise ValueError(
        f'{where}: fsdp_mesh_dim={axis} adds mesh axis {axis} to the '
        'blocks\' weight splits, but they are '
        f'{mappings}; split the block over the mesh first '
        '(pod_blocks.SplitBlockOverMesh) with another axis for the model.')
  first, second = mappings[1:]
  atten.weight_split_dims_mapping = [axis] + list(mappings[0][1:])
  ff.weight_split_dims_mapping_list = [[axis] + list(first[1:]),
                                       list(second[:1]) + [axis]]
  return block


def StoredSplits(layer):
  """A NestedMap shaped like layer.vars: each projection weight `w` of
  the layer and its descendants as its layer's weight_split_dims_mapping
  stores it (a Split), any other variable None."""
  children = layer.children
  mapping = (layer.params.weight_split_dims_mapping
             if 'weight_split_dims_mapping' in layer.params else None)
  tree = py_utils.NestedMap()
  for name in layer.vars:
    child = children.get(name)
    if isinstance(child, (list, tuple)):
      tree[name] = [StoredSplits(c) for c in child]
    elif child is not None:
      tree[name] = StoredSplits(child)
    else:
      tree[name] = Split(tuple(mapping)) if name == 'w' and mapping else None
  return tree


def GatheredForUse(block, block_theta, axis, device_mesh):
  """block_theta with each weight stored split over mesh `axis` first
  annotated as stored, then whole over `axis` (its other axes kept): the
  all-gather before use."""

  def Gathered(w, split):
    if split is None or axis not in split.dims:
      return w
    stored = sharding.MeshSplit(w, device_mesh, split.dims)
    return sharding.MeshSplit(stored, device_mesh,
                              [-1 if a == axis else a for a in split.dims])

  return block_theta.Pack([
      Gathered(w, split) for w, split in zip(block_theta.Flatten(),
                                             StoredSplits(block).Flatten())])


def CheckSplits(block, p):
  """A one-line ValueError where p.fsdp_mesh_dim (the stage's params `p`)
  cannot split a weight of `block` evenly: each device would hold a
  padded share, not 1/n of it."""
  axis = p.fsdp_mesh_dim
  mesh_shape = np.shape(p.device_mesh) if p.device_mesh is not None else ()
  if not 0 <= axis < len(mesh_shape):
    raise ValueError(
        f'{p.name}: fsdp_mesh_dim={axis} is not an axis of device_mesh '
        f'(shape {list(mesh_shape)}); give the stage a device_mesh with it.')
  devices = mesh_shape[axis]
  for (path, w), split in zip(block.vars.FlattenItems(),
                              StoredSplits(block).Flatten()):
    if split is None or axis not in split.dims:
      continue
    shape = w.shape.as_list()[-len(split.dims):]
    size = shape[split.dims.index(axis)]
    if size % devices:
      raise ValueError(
          f'{p.name}: fsdp_mesh_dim={axis} splits {path} (shape {shape}) '
          f'over {devices} devices, but its dim of {size} is not divisible '
          f'by {devices}; pick a mesh whose axis {axis} divides {size}.')
