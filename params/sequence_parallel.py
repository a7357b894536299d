"""Sequence-parallel pod blocks: the residual stream split over the model axis.

SplitBlockOverMesh splits a block's matmuls over a PodMesh's model axis
(Megatron's tensor parallelism) and leaves the activations between them
whole on every model shard: each row-parallel matmul (the attention's
output projection, the feed-forward's second layer) ends in an all-reduce,
and the layer norms, residual adds and dropout after it run P times over
the same numbers. Sequence parallelism (Korthikanti et al. 2022) keeps that
stretch split along the sequence (time) instead:

    x [b, t/P, d] --LN--> all-gather over t --> column-parallel matmul
        (q/k/v, or the first feed-forward layer: heads or hidden split)
        ... row-parallel matmul --> reduce-scatter over t --> + x

An all-reduce is a reduce-scatter and an all-gather, so the bytes on the
wire are the same; what lives between the matmuls (the residual stream,
the layer norms' inputs, the blocks' inputs a stage stores for its
backward pass) is 1/P as large. The backward pass mirrors it: a gather's
gradient is reduce-scattered, a scatter's gathered.

Each end is annotated where it happens, forward and backward (custom
gradients give the backward pass its own two annotations), so no sharding
propagation decides either. XLA's SPMD partitioner spells the scatter as an
all-reduce that each device slices to its part of the sequence; XLA's TPU
and GPU compilers turn that pair into one reduce-scatter
(ReduceScatterCreator), XLA:CPU keeps the pair
(gpipe.xla.reduce_scatters.ScatteredElements finds the pairs).

The sequence is split only where it divides by the model axis: one
position at a time (decoding) keeps the whole layout and its all-reduce.
"""

import numpy as np

from gpipe import sharding
from lingvo import compat as tf
from lingvo.core import batch_major_attention
from lingvo.core import gshard_utils
from lingvo.core import layers
from params import pod_blocks

_DATA, _MODEL = pod_blocks.PodMesh.DATA_AXIS, pod_blocks.PodMesh.MODEL_AXIS
_TIME = 1  # of the blocks' activations [batch, time, dim]


def SequenceParallel(stage):
  """PodStageParams whose blocks (already SplitBlockOverMesh's) run
  sequence-parallel on the model axis: the stage's class and its block's
  layer norms, attention and feed-forward templates are swapped for this
  module's (same weights, same numbers)."""
  stage = stage.Copy().Set(cls=SequenceParallelStage)
  block = stage.block_tpl
  for sublayer in (block.tr_atten_tpl, block.tr_fflayer_tpl):
    sublayer.ln_tpl = sublayer.ln_tpl.Copy().Set(cls=GatheredLayerNorm)
  block.tr_atten_tpl.atten_tpl.cls = SequenceSplitAttention
  ff = block.tr_fflayer_tpl.fflayer_tpl
  ff.cls = SequenceSplitFeedForward
  ff.projection = (
      [p.Copy().Set(cls=EinsumProjection) for p in ff.projection]
      if isinstance(ff.projection, list) else
      ff.projection.Copy().Set(cls=EinsumProjection))
  # The hidden layer split by hidden over the model axis, as before; the
  # output left unannotated by the layer: SequenceSplitFeedForward scatters.
  ff.activation_split_dims_mapping_list = [[_DATA, -1, _MODEL], None]
  return stage


class SequenceParallelStage(pod_blocks.BatchMajorStage):
  """BatchMajorStage whose blocks keep their residual stream split along
  the sequence over the model axis (`SequenceParallel` makes its params).

  The stage's input is split where the first block starts (each model
  shard keeps its part: no communication); the blocks' outputs stay split,
  so the pipeline stores and sends 1/P of each where it follows them. The
  feed-forward layer runs on [b, t, d] (einsum projections), not on tokens
  as rows: with the batch over the data axis and time over the model axis,
  a device's tokens are not contiguous rows of [b x t, d].
  """

  @staticmethod
  def _Block(block, block_theta, x, is_padded):
    x = SplitSequence(x, block.params.device_mesh)
    x, _ = block.self_atten.FProp(block_theta.self_atten, x, None, is_padded)
    return block.fflayer.FProp(block_theta.fflayer, x, None)


class GatheredLayerNorm(layers.LayerNorm):
  """A layer norm of the split residual stream, normalizing each device's
  part of the sequence, its output gathered for the column-parallel matmul
  that reads it (`GatherSequence`)."""

  def FProp(self, theta, inputs):
    return GatherSequence(super().FProp(theta, inputs),
                          self.params.device_mesh)


class SequenceSplitAttention(batch_major_attention.MultiHeadedAttention):
  """Multi-headed attention whose output projection's partial sums are
  reduce-scattered along the sequence (`ScatterSequence`) where Lingvo's
  all-reduce them (the `bld` annotation, which decoding keeps)."""

  def _PostProj(self, theta, encoded, eqn=None):
    return ScatterSequence(self.post.FProp(theta.post, encoded, eqn=eqn),
                           self.params.device_mesh)


class SequenceSplitFeedForward(layers.FeedForwardNet):
  """The feed-forward net whose output (the second, row-parallel layer's
  partial sums) is reduce-scattered along the sequence."""

  def FProp(self, theta, inputs, paddings=None):
    return ScatterSequence(super().FProp(theta, inputs, paddings),
                           self.params.device_mesh)


class EinsumProjection(layers.ProjectionLayer):
  """A projection of [b, t, d] activations by one einsum on every platform.

  Lingvo's uses an einsum on TPU only; elsewhere a broadcasting matmul,
  whose weight gradient is a [b, d, out] product summed afterwards. An
  einsum's weight gradient contracts batch and time at once.
  """

  def _ApplyProjectionKernel(self, w, b, inputs, mix_kernel=None):
    if inputs.shape.rank != 3:
      return super()._ApplyProjectionKernel(w, b, inputs, mix_kernel)
    out = tf.einsum('btd,dh->bth', inputs, w)
    if b is not None:
      out += b
    return gshard_utils.MeshSplit(out, self.params.device_mesh,
                                  self.params.activation_split_dims_mapping)


def SplitSequence(x, device_mesh):
  """x [b, t, ...] split: batch over the data axis, time over the model axis.

  Where x is whole on each model shard, each keeps its part (a slice, no
  communication); where its parts are partial sums, the partitioner sums
  them into each device's part (a reduce-scatter).
  """
  if not SplitsSequence(x, device_mesh):
    return x
  return _Annotated(x, device_mesh, {0: _DATA, _TIME: _MODEL})


def GatherSequence(x, device_mesh):
  """x [b, t, ...] split along t -> whole on every model shard (an
  all-gather); its gradient, the column-parallel matmul's partial sums,
  reduce-scattered back to x's split."""
  if not SplitsSequence(x, device_mesh):
    return x
  annotated_as_now = sharding.AnnotationsNow()

  @tf.custom_gradient
  def Gather(x):
    def Grad(dy):
      with annotated_as_now():
        return SplitSequence(dy, device_mesh)

    return _Whole(SplitSequence(x, device_mesh), device_mesh), Grad

  return Gather(x)


def ScatterSequence(x, device_mesh):
  """x [b, t, ...], a row-parallel matmul's output (partial sums on each
  model shard) -> summed and split along t (a reduce-scatter); its
  gradient gathered whole for that matmul's backward. Where the sequence
  cannot be split, x is made whole (an all-reduce)."""
  if not SplitsSequence(x, device_mesh):
    return _Whole(x, device_mesh) if _OnMesh(device_mesh) else x
  annotated_as_now = sharding.AnnotationsNow()

  @tf.custom_gradient
  def Scatter(x):
    def Grad(dy):
      with annotated_as_now():
        return _Whole(SplitSequence(dy, device_mesh), device_mesh)

    return SplitSequence(x, device_mesh), Grad

  return Scatter(x)


def SplitsSequence(x, device_mesh):
  """Whether x [b, t, ...] is split along t: on a PodMesh with a model axis
  of more than one device that divides its (static) time dim."""
  if not _OnMesh(device_mesh) or x.shape.rank is None or x.shape.rank < 2:
    return False
  model = np.shape(device_mesh)[_MODEL]
  time = x.shape[_TIME]
  return model > 1 and time is not None and time % model == 0


def _OnMesh(device_mesh):
  return device_mesh is not None and np.ndim(device_mesh) > _MODEL


def _Whole(x, device_mesh):
  """x [b, ...]: batch over the data axis, whole on every model shard."""
  return _Annotated(x, device_mesh, {0: _DATA})


def _Annotated(x, device_mesh, axes):
  """x annotated with dims -> mesh axes `axes` (the others whole)."""
  mapping = [axes.get(d, -1) for d in range(x.shape.rank)]
  return sharding.MeshSplit(x, device_mesh, mapping)
