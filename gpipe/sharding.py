"""XLA sharding annotations for the pipeline.

Every helper always emits its annotation (an `XlaSharding` op, which runs as
an identity where no SPMD partitioner is involved: CPU graph mode, CPU jit),
so the graph that runs on one CPU device is the graph a TPU pod slice would
partition. Nothing here depends on a flag saying "TPU".

What each tensor of the loop gets, with `shard_stages_1d` (the stage dim over
num_stages devices) or `pipeline_stage_mesh_dim` (the stage dim over one axis
of `device_mesh`); `Unplaced` and its two subclasses below decide it, each
line in one of their methods (S stages, M microbatches of mb examples, T loop
iterations, R circular repeats):

  tensor                           annotation          why
  stacked theta [S, (R,) ...]      stage dim split     each device holds 1/S
  per-stage var (per_stage_vars)   least-padding dim   1/S each, resharded to
                                   split               the stage dim once
  microbatched inputs [M, mb, ...] replicated          indexed by the loop
    with stream_io                 dim 0 split         1/S per device, sent to
                                                       stage 0 when due
  stage 0's read [mb, ...]         replicated          then one slot of S
  buffer [S, mb, ...]              stage dim split     shift = 1 permute
  stored stage inputs              stage dim split     no gather in the loop
    ([T, S, mb, ...] 'reverse';
    the rings [S, 2h(RS-1)+1,
    mb, ...] '1f1b')
    with ring_split_mesh_dim       and one dim over    1/n per device, an
                                   that axis           entry gathered to read
  outputs [M, mb, ...]             replicated          leave the pipeline
    with stream_io                 dim 0 split         1/S per device
  loop counters, indices           replicated          kept out of the manual
                                                       region

How the stages run (the body sees one stage, without the stage dim):

  * Partitioned (inside `SpmdPartitioning()`, or when Lingvo's
    `--xla_device=tpu`): the [S, ...] stage inputs and the stacked theta
    enter a *manual* region (`ToManualStage`: full [S, ...] -> per-device
    [...]), the body runs once, and its outputs leave it (`FromManualStage`).
    Each device computes exactly its own stage; the body's own annotations
    (`MeshSplit`) are sub-grouped on the other mesh axes.
  * One device (CPU/GPU, no partitioner): the manual-sharding ops have no
    single-device kernel (TF has no CPU kernel for XlaSpmdFullToShardShape,
    and XLA:CPU rejects the shape change), so the layer runs the S stages of
    an iteration as one computation vectorized over the stage dim
    (`vectorize_stages`), or, for a body that cannot be vectorized, one
    stage after another on its slice. Same annotations around the loop,
    same numbers.
"""

import contextlib
import threading
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import tensorflow as tf

# pylint: disable=g-direct-tensorflow-import
from tensorflow.python.compiler.xla.experimental import xla_sharding
# pylint: enable=g-direct-tensorflow-import
from gpipe import nest
from lingvo.core import gshard_utils
from lingvo.core import py_utils_flags

__all__ = [
    'SpmdPartitioning',
    'IsSpmdPartitioning',
    'MeshSplit',
    'Split',
    'Replicate',
    'CopySharding',
]


class _Stacks(threading.local):

  def __init__(self):
    super().__init__()
    self.partitioning = []
    self.manual_mesh_dims = []
    self.vectorized = 0  # depth of VectorizedOverStages contexts


_STACKS = _Stacks()


@contextlib.contextmanager
def SpmdPartitioning(enabled: bool = True) -> Iterator[None]:
  """Builds graphs for the XLA SPMD partitioner (TPU, or N virtual devices).

  Inside, pipelined layers run their stages in a manual-sharding region, one
  stage per device. Outside, they run the stages one after another, which is
  what a single device without a partitioner can execute. Lingvo's
  `--xla_device=tpu` turns this on too.
  """
  _STACKS.partitioning.append(bool(enabled))
  try:
    yield
  finally:
    _STACKS.partitioning.pop()


def IsSpmdPartitioning() -> bool:
  """True when graphs are being built for the SPMD partitioner."""
  if _STACKS.partitioning:
    return _STACKS.partitioning[-1]
  return py_utils_flags.use_tpu()


def Split(x: tf.Tensor, dim: int, num_devices: int) -> tf.Tensor:
  """Splits `x` along `dim` over `num_devices` devices (other dims whole).

  A dim shorter than num_devices is split too, padded (e.g. the last
  stage's [1, ...] slot of a stage-split buffer stays on its device, the
  others holding padding), where xla_sharding.split would refuse it.
  """
  if not nest.IsTensor(x) or num_devices <= 1:
    return x
  tiles = [1] * (_STACKS.vectorized + x.shape.rank)
  tiles[_STACKS.vectorized + dim] = num_devices
  return xla_sharding.tile(x, np.arange(num_devices).reshape(tiles),
                           use_sharding_op=True)


def Replicate(x: tf.Tensor) -> tf.Tensor:
  """Marks `x` as replicated on every device."""
  if not nest.IsTensor(x):
    return x
  return xla_sharding.replicate(x, use_sharding_op=True)


def CopySharding(source: Any, x: tf.Tensor) -> tf.Tensor:
  """Annotates `x` with the sharding of `source`, if `source` has one.

  `source` is an annotated tensor, or a graph-mode variable whose handle
  carries an `_XlaSharding` attribute (as Lingvo's TPU variables do); use it
  to give a value derived from a weight the weight's own layout.
  """
  if not nest.IsTensor(x):
    return x
  return xla_sharding.copy_sharding(source, x, use_sharding_op=True)


@contextlib.contextmanager
def VectorizedOverStages():
  """Inside, tensors are one stage's, to be vectorized over a leading stage
  dim (gpipe.pipeline.vectorized_stages): every annotation made here (this
  module's and Lingvo's gshard_utils.MeshSplit) gets a leading dim, kept
  whole, so that it fits the vectorized tensor's rank. Vectorized runs
  are for one device, where the annotations split nothing anyway.
  """
  _STACKS.vectorized += 1
  try:
    with gshard_utils.MeshSplitDimPrefixContext(-1):
      yield
  finally:
    _STACKS.vectorized -= 1


def MeshSplit(x: tf.Tensor, device_mesh: Optional[np.ndarray],
              tensor_split_dims_mapping: Sequence[int],
              unspecified_dims: Optional[Sequence[int]] = None) -> tf.Tensor:
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
  if not nest.IsTensor(x):
    return x
  device_mesh = np.asarray(device_mesh)
  mapping = list(tensor_split_dims_mapping)
  if len(mapping) != x.shape.rank:
    raise ValueError(
        f'tensor_split_dims_mapping {mapping} has {len(mapping)} entries but '
        f'the tensor has rank {x.shape.rank}.')
  manual = list(_STACKS.manual_mesh_dims)
  lead = _STACKS.vectorized
  return xla_sharding.mesh_split(
      x,
      device_mesh,
      [-1] * lead + mapping,
      use_sharding_op=True,
      manual_mesh_dims=manual or None,
      unspecified_dims=[d + lead for d in unspecified_dims or []])


def SplitStageDim(x, stage_dim, num_stages, device_mesh=None, mesh_dim=None):
  """Splits the stage dim of `x` over the pipeline's devices.

  With `device_mesh` and `mesh_dim`, the stage dim goes over that mesh axis
  and the other dims stay whole on it; otherwise over `num_stages` devices.
  """
  if not nest.IsTensor(x):
    return x
  if device_mesh is not None and mesh_dim is not None:
    mapping = [-1] * x.shape.rank
    mapping[stage_dim] = mesh_dim
    others = [d for d in range(x.shape.rank) if d != stage_dim]
    return MeshSplit(x, device_mesh, mapping, unspecified_dims=others)
  return Split(x, stage_dim, num_stages)


def StageMesh(num_stages, device_mesh=None, mesh_dim=None):
  """(device_mesh, stage mesh axis): a 1-D mesh of S devices by default."""
  if device_mesh is not None and mesh_dim is not None:
    return np.asarray(device_mesh), mesh_dim
  return np.arange(num_stages), 0


def _StageDimSharding(rank, device_mesh, mesh_dim):
  mapping = [mesh_dim] + [-1] * (rank - 1)
  return xla_sharding.mesh_split_sharding(device_mesh, mapping)


def ToManualStage(x, device_mesh, mesh_dim):
  """[S, ...] (stage dim split) -> [...]: each device's own stage, manual.

  Only the stage mesh axis becomes manual; the other dims stay unspecified,
  so the partitioner keeps whatever sharding they have on the other axes.
  """
  if not nest.IsTensor(x):
    return x
  rank = x.shape.rank
  sharding = _StageDimSharding(rank, device_mesh, mesh_dim)
  manual = xla_sharding.auto_to_manual_spmd_partition(
      x,
      sharding.proto.SerializeToString(),
      single_dim=0,
      unspecified_dims=list(range(1, rank)))
  return tf.squeeze(manual, 0)


def FromManualStage(x, device_mesh, mesh_dim):
  """[...] per device (manual) -> [S, ...] with the stage dim split."""
  if not nest.IsTensor(x):
    return x
  num_stages = device_mesh.shape[mesh_dim]
  full_shape = [num_stages] + x.shape.as_list()
  rank = len(full_shape)
  sharding = _StageDimSharding(rank, device_mesh, mesh_dim)
  return xla_sharding.manual_to_auto_spmd_partition(
      tf.expand_dims(x, 0),
      sharding.proto.SerializeToString(),
      full_shape=full_shape,
      single_dim=0,
      unspecified_dims=list(range(1, rank)))


def BroadcastToManualStage(x, device_mesh, mesh_dim):
  """A value every stage needs whole (e.g. kwargs_no_batch), made manual."""
  if not nest.IsTensor(x):
    return x
  num_stages = device_mesh.shape[mesh_dim]
  stacked = tf.broadcast_to(x[None], [num_stages] + x.shape.as_list())
  return ToManualStage(stacked, device_mesh, mesh_dim)


class ManualBoundary:
  """Moves a manual region's per-device values out of it and back.

  A value computed inside the region (one stage's, per device) that must
  live outside it, e.g. an activation the loop stores for its backward
  pass, leaves as [S, ...] with the stage dim split and comes back as each
  device's own slice. (Left manual, the partitioner would carry the manual
  sharding into the loop's stacks, which it cannot.)
  """

  def __init__(self, device_mesh, mesh_dim):
    self._mesh = (device_mesh, mesh_dim)
    self.num_stages = device_mesh.shape[mesh_dim]

  @classmethod
  def For(cls, mesh):
    """The boundary of a region over mesh = (device_mesh, mesh_dim), or None."""
    return None if mesh is None else cls(*mesh)

  def Out(self, x):
    return FromManualStage(x, *self._mesh)

  def In(self, x):
    return ToManualStage(x, *self._mesh)


@contextlib.contextmanager
def ManualStageRegion(mesh_dim):
  """Inside the body of a manual region: annotations are sub-grouped.

  The stage mesh axis is manual there, so `MeshSplit` (ours and Lingvo's
  gshard_utils.MeshSplit) marks it as such and splits only the other axes.
  """
  _STACKS.manual_mesh_dims.append(mesh_dim)
  try:
    with gshard_utils.ManualMeshDimContext(mesh_dim):
      yield
  finally:
    _STACKS.manual_mesh_dims.pop()


def AnnotationsNow():
  """A context factory that annotates as the code running now does (in a
  manual stage region, vectorized over the stages): for what is built
  later on this code's behalf, e.g. a body's recomputation in its custom
  gradient, which TensorFlow builds outside the region the body ran in."""
  dims, vectorized = list(_STACKS.manual_mesh_dims), _STACKS.vectorized

  @contextlib.contextmanager
  def Again():
    with contextlib.ExitStack() as stack:
      for dim in dims:
        stack.enter_context(ManualStageRegion(dim))
      for _ in range(vectorized):
        stack.enter_context(VectorizedOverStages())
      yield

  return Again


def StagePlacement(num_stages, shard_stages_1d=False, device_mesh=None,
                   mesh_dim=None):
  """Where a pipelined layer puts its tensors, from its sharding params."""
  if shard_stages_1d:
    return OverStageDevices(num_stages)
  if mesh_dim is not None:
    return OverMeshAxis(num_stages, device_mesh, mesh_dim)
  return Unplaced(num_stages)


class Unplaced:
  """No stage sharding asked for: the pipeline's tensors get no annotation.

  The two subclasses place them over S devices or over one axis of a device
  mesh; every site that places a pipeline tensor asks one of these methods,
  so that what each tensor gets (the table above) is decided here alone.
  """

  # (device_mesh, stage mesh axis) of the manual region, or None.
  mesh = None

  def __init__(self, num_stages):
    self.num_stages = num_stages

  @property
  def splits_stage_dim(self):
    """Whether the stage dim is split over devices: placed, in a graph built
    for the SPMD partitioner (elsewhere the annotations do nothing and the
    pipeline runs on one device). Some ops take a cheaper form on a whole
    stage dim (gpipe.pipeline.rotation)."""
    return self.mesh is not None and IsSpmdPartitioning()

  def _SplitOne(self, x, stage_dim):
    del stage_dim
    return x

  def SplitStages(self, tree, stage_dim=0):
    """Every tensor of `tree` split on its stage dim over the stage devices."""
    return tf.nest.map_structure(
        lambda x: self._SplitOne(x, stage_dim) if nest.IsTensor(x) else x, tree)

  def SplitOwnVariable(self, x):
    """One stage's own variable (per_stage_vars): split on its least-padding
    dim, so that each device holds about 1/S of it until it is stacked."""
    if not nest.IsTensor(x):
      return x
    dim = LeastPaddingDim(x.shape.as_list(), self.num_stages)
    if dim is None:
      return x
    return self._SplitOne(x, dim)

  def ReplicateLoopDim(self, x):
    """x ([M, ...] or [T, ...]) whole on every device: the loop indexes it."""
    return x

  def ReplicateOverStages(self, x):
    """One microbatch (no loop dim), the same on every stage: stage 0's
    read before it is broadcast to the stages' slots."""
    return x

  def SpreadLoopDim(self, x):
    """x ([M, ...] or [B, ...]) split over the stages on dim 0: what
    stream_io keeps of the inputs and outputs on each stage's device."""
    return self._SplitOne(x, 0) if nest.IsTensor(x) else x

  def ReplicateBookkeeping(self, x):
    """A loop counter, index vector or scalar, replicated.

    Left unannotated, the partitioner may propagate the body's manual
    sharding into the loop's bookkeeping.
    """
    return x


class OverStageDevices(Unplaced):
  """shard_stages_1d: the stage dim over num_stages devices."""

  @property
  def mesh(self):
    return StageMesh(self.num_stages)

  def _SplitOne(self, x, stage_dim):
    return Split(x, stage_dim, self.num_stages)

  def ReplicateLoopDim(self, x):
    return Replicate(x)

  def ReplicateOverStages(self, x):
    return Replicate(x)

  def ReplicateBookkeeping(self, x):
    return Replicate(x)


class OverMeshAxis(Unplaced):
  """pipeline_stage_mesh_dim: the stage dim over one axis of device_mesh.

  Only the stage axis is decided here: the other axes may split the batch
  or the model dims, which a full replicate would undo, so every
  annotation leaves the other dims to the partitioner.
  """

  def __init__(self, num_stages, device_mesh, mesh_dim):
    super().__init__(num_stages)
    self._device_mesh = device_mesh
    self._mesh_dim = mesh_dim

  @property
  def mesh(self):
    return StageMesh(self.num_stages, self._device_mesh, self._mesh_dim)

  def _SplitOne(self, x, stage_dim):
    return SplitStageDim(x, stage_dim, self.num_stages, self._device_mesh,
                         self._mesh_dim)

  def ReplicateLoopDim(self, x):
    """An [M, mb, ...] tensor with its loop dim and examples whole on every
    device; later dims are left to the other axes (a model axis).

    Rows left open get split by propagation over whichever axis comes
    first, the stage axis included; stage 0's read of them then needs a
    resharding permute on every iteration. Whole examples cost nothing to
    split again inside the stage, where the body's own annotations split
    the batch over a data axis. A stage axis of one device (no pipeline)
    has nothing to split them over: the examples stay open, for the data axis
    to split (whole, every chip would hold the whole batch).
    """
    return self._WholeIn(x, 2 if self.num_stages > 1 else 1)

  def ReplicateOverStages(self, x):
    """Stage 0's read of one microbatch, whole in its examples (as its source,
    ReplicateLoopDim); its gradient is left to the partitioner: a body
    that splits the batch over a data axis gives it split, and
    replicating it would all-gather it on every backward iteration."""
    if not nest.IsTensor(x) or x.shape.rank == 0:
      return x

    @tf.custom_gradient
    def Place(v):
      return self._WholeIn(v, 1 if self.num_stages > 1 else 0), (
          lambda dy: dy)

    return Place(x)

  def _WholeIn(self, x, num_dims):
    """x whole in its first num_dims dims, the others left open."""
    if not nest.IsTensor(x) or x.shape.rank == 0:
      return x
    rank = x.shape.rank
    return MeshSplit(x, self._device_mesh, [-1] * rank,
                     unspecified_dims=list(range(min(num_dims, rank), rank)))

  def ReplicateBookkeeping(self, x):
    return Replicate(x)


def LeastPaddingDim(shape, num_devices):
  """The dim of `shape` that splits over num_devices with least padding.

  A per-stage variable is split on this dim so each device holds about 1/S
  of it; ties go to the larger dim, then the earlier one. Dims smaller than
  num_devices cannot be split; None when no dim can (scalars included).
  """
  candidates = [d for d, size in enumerate(shape) if size >= num_devices]
  if not candidates:
    return None

  def Cost(dim):
    size = shape[dim]
    padding = -(-size // num_devices) * num_devices - size
    return (padding, -size, dim)

  return min(candidates, key=Cost)
