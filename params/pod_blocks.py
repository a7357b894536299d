"""The pod LM's stage body: batch-major causal Transformer blocks.

A pipeline stage sees activations [batch, time, dim], batch-major, because
the pipeline microbatches along the leading dim. Lingvo's
`batch_major_attention` layers work on that layout directly and project
with einsums ('BTD,DNH->BTNH'), so each weight gradient is one contraction
over batch and time: no per-position [dim, dim] products are built before a
sum, as a broadcasting matmul over a [time, batch, dim] input builds them.

The blocks may compute in bfloat16 (`fprop_dtype`) while weights and
optimizer state stay float32: the stage casts its weights on the way in, so
their gradients leave it float32 and the pipeline accumulates them in
float32. The stage returns activations in the dtype it was given them.
"""

import contextlib
import dataclasses

import numpy as np

from gpipe import sharding
from gpipe.loops import compiled_loops
from gpipe.loops import made_after
from gpipe.loops import remat
from lingvo import compat as tf
# pylint: disable=g-direct-tensorflow-import
from tensorflow.compiler.tf2xla.python import xla as xla_ops
# pylint: enable=g-direct-tensorflow-import
from lingvo.core import base_layer
from lingvo.core import batch_major_attention
from lingvo.core import layers
from lingvo.core import py_utils
from lingvo.core import scatter_update
from params import fsdp


class BlockStage(base_layer.BaseLayer):
  """A pipeline stage of `num_blocks` copies of one block (`block_tpl`).

  Subclasses say how a stage runs its blocks (FProp and, for decoding,
  InitStates and ExtendStep).
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('num_blocks', 1, 'Blocks in one stage.')
    p.Define('block_tpl', None, 'Params of one block.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.num_blocks < 1:
      raise ValueError(f'{type(self).__name__}: num_blocks={p.num_blocks} '
                       'must be at least 1.')
    self.CreateChildren('blocks', [
        p.block_tpl.Copy().Set(name=f'block_{i}') for i in range(p.num_blocks)
    ])


class BatchMajorStage(BlockStage):
  """One pipeline stage: k causal batch-major Transformer blocks.

  FProp: (activations [b, t, d], paddings [b, t]) -> the same. Decoding
  keeps batch-major key/value caches [b, max_len, heads, dim_per_head] per
  block, which the pipeline splits into microbatches like any per-stage
  state.

  Each block is a Lingvo batch-major TransformerLayer; FProp runs its
  self-attention and feed-forward children. Paddings reach the attention as
  a boolean mask (padded keys are never attended to) and the feed-forward
  layer not at all: a padded position's output is never read by a real one,
  and the loss weighs it 0. So no float zero of a microbatch's [b, t] or
  [b, t, d] shape is made inside the stage: TensorFlow's lowering would
  merge it with the pipeline's zeros of that shape outside the stages'
  manual-sharding region, a mix XLA's SPMD partitioner rejects.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
        'remat_blocks', False,
        'Recompute each block in the backward pass from its input: a '
        'stage\'s backward then holds its blocks\' inputs and one block\'s '
        'activations (and its weights cast to fprop_dtype) at a time, not '
        'every block\'s, for one more forward of the stage. The body must '
        'draw no random numbers (no dropout): the recomputation would draw '
        'other ones.')
    p.Define(
        'fsdp_mesh_dim', None,
        'FSDP: a device_mesh axis the blocks\' projection weights (and so '
        'their optimizer slots) are also stored split over, by their model '
        'dim (params/fsdp.py); each block gathers its own whole over it '
        'where it uses them, in the compute dtype, and their gradients go '
        'back split. None: stored as used.')
    return p

  def __init__(self, params):
    if params.fsdp_mesh_dim is not None:
      params = params.Copy().Set(block_tpl=fsdp.StoredSplitOver(
          params.block_tpl, params.fsdp_mesh_dim, params.name))
    super().__init__(params)
    if self.params.fsdp_mesh_dim is not None:
      fsdp.CheckSplits(self.blocks[0], self.params)

  @property
  def _dtype(self):
    return py_utils.FPropDtype(self.params)

  def _InternalGetTheta(self):
    """The blocks' weights as stored (float32), not cast to fprop_dtype.

    Lingvo's layers hand out theta already cast to their fprop_dtype; a
    pipeline would then accumulate the weight gradients over microbatches
    in bfloat16. The stage casts inside instead (`_CastWeights`).
    """
    return self.vars

  def _CastWeights(self, theta):
    """theta in the blocks' dtype; the casts' gradients are float32."""
    dtype = self._dtype
    return theta.Transform(
        lambda w: tf.cast(w, dtype) if w.dtype.is_floating else w)

  def FProp(self, theta, inputs, paddings):
    x = tf.cast(inputs, self._dtype)
    is_padded = tf.greater(paddings, 0.5)
    if not self.params.remat_blocks:
      theta = self._CastWeights(theta)
    for i, (block, block_theta) in enumerate(zip(self.blocks, theta.blocks)):
      if self.params.remat_blocks:
        if i:
          # Stored per iteration under remat_policy='save_checkpoints' (the
          # first is the stage's input, which the loop keeps anyway): the
          # stage's backward then runs each block once, from its input.
          x = remat.Checkpoint(x)
        x = RecomputedInBackward(
            lambda th, x, b=block: self._Block(
                b, self._ForUse(b, self._CastWeights(th)), x, is_padded),
            block_theta, x)
      else:
        x = self._Block(block, self._ForUse(block, block_theta), x,
                        is_padded)
    x = tf.cast(x, inputs.dtype)
    # The pipeline reports it per stage: activation_rms/stage_<i>.
    rms = tf.sqrt(tf.reduce_mean(tf.square(tf.cast(x, tf.float32))))
    py_utils.AddTpuSummaryTensor('activation_rms', rms)
    return x, paddings

  def _ForUse(self, block, block_theta):
    """block_theta (cast) as the block uses it: gathered over
    fsdp_mesh_dim (params/fsdp.py), per block, so that a stage holds one
    block's gathered weights at a time."""
    p = self.params
    if p.fsdp_mesh_dim is None:
      return block_theta
    return fsdp.GatheredForUse(block, block_theta, p.fsdp_mesh_dim,
                               p.device_mesh)

  @staticmethod
  def _Block(block, block_theta, x, is_padded):
    """One block: self-attention, then feed-forward, on x [b, t, d]."""
    shape = py_utils.GetShape(x)
    x, _ = block.self_atten.FProp(block_theta.self_atten, x, None, is_padded)
    # Tokens as rows: a 2-D matmul on every platform (Lingvo projects a
    # 3-D input off TPU with a broadcasting matmul, whose weight gradient
    # is a [batch, in, out] product summed afterwards).
    tokens = tf.reshape(x, [-1, shape[-1]])
    return tf.reshape(block.fflayer.FProp(block_theta.fflayer, tokens, None),
                      shape)

  def InitStates(self, theta, batch_size, max_len):
    """Empty key/value caches of every block, [b, max_len, heads, head_dim]."""
    del theta
    atten = self.blocks[0].self_atten.atten
    zeros = tf.zeros(
        [batch_size, max_len, atten.params.num_heads, atten.dim_per_head],
        self._dtype)
    return py_utils.NestedMap(blocks=[
        py_utils.NestedMap(key=zeros, value=zeros) for _ in self.blocks])

  def ExtendStep(self, theta, x, states, time_step):
    """One position through every block: x [b, d] -> (y [b, d], states).

    Position `time_step` of each block's caches is written; the block
    attends to positions 0..time_step, as its causal FProp does. Lingvo's
    layer keeps its caches time-major, so they are transposed around it.
    """
    theta = self._CastWeights(theta)
    y = tf.cast(x, self._dtype)[:, None, :]
    new_states = []
    # Functional cache writes: an in-place update would alias the caches'
    # buffers, which the pipeline's loop also reads.
    with scatter_update.SetInplaceUpdate(False):
      for block, block_theta, cache in zip(self.blocks, theta.blocks,
                                           states.blocks):
        block_theta = self._ForUse(block, block_theta)
        y, _, cache = block.ExtendStep(block_theta, y, None, None,
                                       cache.Transform(_SwapBatchAndTime),
                                       time_step)
        new_states.append(cache.Transform(_SwapBatchAndTime))
    return (tf.cast(y[:, 0, :], x.dtype),
            py_utils.NestedMap(blocks=new_states))


def RecomputedInBackward(fn, weights, x):
  """fn(weights, x) -> y, whose gradient runs fn again from (weights, x).

  Nothing fn computes is kept for the backward pass but its inputs. Under
  XLA two things are written out so that no compiler has to find them:

    * the recomputation starts behind an optimization barrier on its input
      and on the output gradient dy: it cannot be merged with the forward
      computation, and it cannot run before dy exists (a scheduler free to
      recompute every block of a stage first would hold all their
      activations at once, which is what recomputing was to avoid);
    * fn sees its weights scaled by a 1 computed from its input (in the
      forward) or from dy (in the recomputation): a cast of the weights
      inside fn (to bfloat16, say) is then made where the block runs, once
      per run. With the weights alone it is the same expression in the
      forward and in the recomputation and invariant in the pipeline's
      loops: merged into one, or hoisted out of the loops, it would hold
      every block's cast weights through the whole iteration or loop.
  """
  flat = tf.nest.flatten(weights)
  # The gradient is built later, outside the pipeline's manual region the
  # body runs in: its annotations must say the same as the forward's.
  annotated_as_now = sharding.AnnotationsNow()
  under_xla = compiled_loops.UnderXla

  def Apply(one, flat_weights, x):
    if one is not None:
      flat_weights = [w * tf.cast(one, w.dtype) if w.dtype.is_floating else w
                      for w in flat_weights]
    return fn(tf.nest.pack_sequence_as(weights, flat_weights), x)

  @tf.custom_gradient
  def Run(x, *flat_weights):
    one = OneAfter(x) if under_xla() else None
    y = Apply(one, list(flat_weights), x)

    def Grad(dy):
      x_again, one_again = x, None
      if under_xla():
        # The weights stay out of the barrier: its results are new
        # buffers, and the weights through one would be copied.
        x_again, dy = xla_ops.optimization_barrier(tf.stop_gradient(x), dy)
        # Differentiated from here: the barrier has no gradient (and dy
        # depends on the weights, so it lies between them and y_again).
        x_again, one_again = tf.nest.map_structure(
            tf.stop_gradient, (x_again, OneAfter(dy)))
      inputs = [x_again] + list(flat_weights)
      with annotated_as_now(), _Recomputation():
        y_again = Apply(one_again, inputs[1:], inputs[0])
      grads = tf.gradients(y_again, inputs, grad_ys=dy)
      return [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
              for g, v in zip(grads, inputs)]

    return y, Grad

  return Run(x, *flat)


_recomputations = []  # RecomputedInBackward's recomputations being built


@contextlib.contextmanager
def _Recomputation():
  _recomputations.append(True)
  try:
    yield
  finally:
    _recomputations.pop()


def Recomputing():
  """Whether the function being built runs as RecomputedInBackward's
  recomputation (in the gradient), not as the forward: a value the forward
  computes only to order its work (params/sequence_halves.py) need not be
  computed again there, where it might be all that keeps a collective."""
  return bool(_recomputations)


def OneAfter(t):
  """A float32 1 made once t exists (gpipe.loops.made_after), from t's
  first element alone, sliced before any reshape: flattening a t split
  along a later dim (params/sequence_parallel.py) would gather it whole."""
  rank = t.shape.rank
  return made_after.OneAfter(tf.slice(t, [0] * rank, [1] * rank))


def _SwapBatchAndTime(cache):
  return tf.transpose(cache, [1, 0, 2, 3])


class OutputScaledProjection(batch_major_attention.MultiHeadedProjectionLayer):
  """A heads projection whose output-projection weight starts scaled.

  As the attention's `proj_tpl`: the queries', keys' and values'
  projections are Lingvo's, the post projection (is_output_projection)
  starts at Xavier(output_init_scale).
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('output_init_scale', 1.0,
             'The Xavier scale of the output projection\'s weight.')
    return p

  def _CreateLayerVariables(self):
    p = self.params
    if p.is_output_projection:
      p.params_init = py_utils.WeightInit.Xavier(p.output_init_scale)
    super()._CreateLayerVariables()


def PodBlockParams(model_dim, num_heads, hidden_dim, dropout_prob,
                   fprop_dtype=None, fused_qkv=False, rotary=False,
                   head_dim=None):
  """A pre-LN causal self-attention + feed-forward block, batch-major.

  Pre-LN as it is meant: each sub-layer adds its output to its
  unnormalized input (x + f(LN(x))), so the residual stream carries every
  block's sum, as a deep stack needs (docs/text-depth.md). Dropout is
  Lingvo's deterministic (stateless) kind, seeded by the global
  step: a pipelined body must not draw stateful random numbers (its
  backward pass recomputes the forward), and a resumed run draws the masks
  it would have drawn. Attention logits are scaled by 1/sqrt(head dim).

  rotary: queries and keys rotated by their position (rotary position
  embeddings): every block's attention sees relative positions, where a
  learned position embedding reaches only the first block's input
  (docs/text-depth.md has the runs).

  fused_qkv: the queries, keys and values projected by one einsum (one
  weight `qkv` [d, heads, 3 x head dim]): on a model axis the input's
  gradient is then one reduction, not three (one per projection) that XLA
  sums after reducing each.

  head_dim: each head's width; the attention's then num_heads x head_dim,
  which need not be model_dim (as in MaxText's scaled configs,
  params/published_runs.py). None: model_dim / num_heads.
  """
  p = batch_major_attention.TransformerLayer.Params().Set(
      input_dim=model_dim, output_dim=model_dim, num_heads=num_heads,
      mask_self_atten=True)
  atten_dim = model_dim if head_dim is None else num_heads * head_dim
  p.tr_atten_tpl.Set(hidden_dim=atten_dim, residual_dropout_prob=dropout_prob,
                     add_unnormalized_input=True,  # (Lingvo's default here)
                     atten_dropout_prob=dropout_prob,
                     dropout_tpl=_DeterministicDropout())
  p.tr_atten_tpl.atten_tpl.Set(enable_per_dim_scale=False,
                               dropout_tpl=_DeterministicDropout(),
                               enable_qkv_proj_in_onestep=fused_qkv)
  if rotary:
    p.tr_atten_tpl.atten_tpl.rope_tpl = (
        layers.RotaryPositionalEmbeddingLayer.Params())
  p.tr_fflayer_tpl.Set(hidden_dim=hidden_dim,
                       residual_dropout_prob=dropout_prob,
                       relu_dropout_prob=dropout_prob,
                       residual_dropout_tpl=_DeterministicDropout())
  p.tr_fflayer_tpl.fflayer_tpl.dropout = _DeterministicDropout()
  if fprop_dtype is not None:
    batch_major_attention.TransformerLayer.SetFPropDtype(p, fprop_dtype)
  return p


def ScaleOutputInit(block, scale):
  """Makes PodBlockParams' sub-layers' output projections (the attention's
  post projection, the feed-forward's second layer) start at
  Xavier(scale) instead of Lingvo's Xavier(1); the other weights keep
  theirs. With scale = 1 / sqrt(2 x blocks), as GPT-2 scales them, a deep
  stack's residual stream starts as large as a shallow one's."""
  atten = block.tr_atten_tpl.atten_tpl
  atten.proj_tpl = OutputScaledProjection.Params().Set(
      output_init_scale=scale)
  ff = block.tr_fflayer_tpl.fflayer_tpl
  first = ff.projection[0] if isinstance(ff.projection, list) else (
      ff.projection)
  ff.projection = [first.Copy(), first.Copy().Set(
      params_init=py_utils.WeightInit.Xavier(scale))]
  return block


@dataclasses.dataclass(frozen=True)
class PodMesh:
  """A [stages, data, model] device mesh, GShard's way of splitting a pod.

      axis 0 (stages): the pipeline's stage dim (pipeline_stage_mesh_dim);
          the rotation's collective-permute runs along it.
      axis 1 (data):   the batch; data-parallel replicas hold the same
          weights, and their gradients are summed over it once per step.
      axis 2 (model):  attention heads and the feed-forward hidden dim
          (Megatron-style: the body all-reduces its activations over it).

  An axis of size 1 splits nothing, so one layout serves [S, 1, M] and
  [S, D, M] alike. Device ids run row-major: stage s, replica r, model
  shard m is device (s * data + r) * model + m. With `fsdp` the data axis
  also splits every block's weights and slots (SplitBlockOverMesh): a
  chip stores 1/(stages x data x model) of the stack's weight matrices.
  """
  stages: int
  data: int = 1
  model: int = 1
  # FSDP: the blocks' weights (and their optimizer slots) stored split
  # over the data axis as well, each block gathering its own before use.
  fsdp: bool = False

  STAGE_AXIS = 0
  DATA_AXIS = 1
  MODEL_AXIS = 2

  @property
  def num_devices(self):
    return self.stages * self.data * self.model

  @property
  def device_mesh(self):
    return np.arange(self.num_devices).reshape(self.stages, self.data,
                                               self.model)

  def Describe(self):
    return f'{self.stages} stages x {self.data} data x {self.model} model'


def SplitBlockOverMesh(block):
  """Annotates PodBlockParams for a PodMesh (its device_mesh comes from the
  pipelined layer, as Lingvo copies it to children).

  Weights: the q/k/v/post projections [d, heads, head_dim] split by heads,
  the feed-forward [d, hidden] and [hidden, d] by hidden, over the model
  axis (a stage's fsdp_mesh_dim splits them by d over the data axis too:
  params/fsdp.py). Activations: batch over the data axis; heads and
  hidden over the model axis. Inside a pipeline stage the stage axis is
  manual, so these split only the other two axes.
  """
  data, model = PodMesh.DATA_AXIS, PodMesh.MODEL_AXIS
  atten = block.tr_atten_tpl.atten_tpl
  atten.weight_split_dims_mapping = [-1, model, -1]
  atten.activation_split_dims_mapping.blnh = [data, -1, model, -1]
  atten.activation_split_dims_mapping.bld = [data, -1, -1]
  ff = block.tr_fflayer_tpl.fflayer_tpl
  ff.weight_split_dims_mapping_list = [[-1, model], [model, -1]]
  # The stage runs the feed-forward on tokens as rows ([batch * time, d]).
  ff.activation_split_dims_mapping_list = [[data, model], [data, -1]]
  return block


def PodStageParams(num_blocks, block, fprop_dtype=None, remat_blocks=False,
                   fsdp_mesh_dim=None):
  """BatchMajorStage params: num_blocks copies of `block` (PodBlockParams)."""
  return BatchMajorStage.Params().Set(num_blocks=num_blocks, block_tpl=block,
                                      fprop_dtype=fprop_dtype,
                                      remat_blocks=remat_blocks,
                                      fsdp_mesh_dim=fsdp_mesh_dim)


def _DeterministicDropout():
  return layers.DeterministicDropoutLayer.Params()
