"""Pod blocks run on the sequence's two halves: two chains beside each other.

On a model axis (pod_blocks.SplitBlockOverMesh) each block's two
row-parallel matmuls, the attention's output projection and the
feed-forward's second layer, end in an all-reduce, and all that follows
reads its result: residual add, layer norm, the next column-parallel
matmul. Within a block's run the chain

    matmul -> all-reduce -> norm -> matmul -> ... -> all-reduce -> ...

leaves no matrix work that neither feeds a reduction nor waits for it, so
no compute can hide it (gpipe.plan.overlap reads that off the partitioned
module's dependencies). The classic remedy is to overlap by sub-batches: a
stage's microbatch is one sequence, so this stage runs each block on the
sequence's first and second halves (positions [0, t/2) and [t/2, t)) as
two chains of the same matmuls, each on half the rows:

    first half:  LN qkv_1 attention_1 post_1 all-reduce LN ff_1 all-reduce
    second half: LN qkv_2 attention_2 post_2 all-reduce LN ff_2 all-reduce

A position's layer norms, projections and feed-forward layer read that
position only, and a causal attention's first half attends to the first
half only; the second half's attention reads the first half's keys and
values, which exist before the first half's reductions. Left at that, XLA
would merge the halves' reductions into one all-reduce (its all-reduce
combiner merges collectives neither of which waits for the other), which
waits for both halves. So the four reductions of a block run in one
order, first half's attention, second half's, first half's feed-forward,
second half's, then the next block's: the matmul before each (the output
projection, the second feed-forward layer) takes its input times a 1 made
from the reduction before it (gpipe.loops.made_after). The rest of each
chain is free: the second half's projections and attention run beside the
first half's attention reduction, the first half's feed-forward layer
beside the second half's, and so on into the next block. A block's
recomputation in the backward pass (pod_blocks.RecomputedInBackward)
leaves out both feed-forward reductions (its output is not read): it does
not order them, which would make it compute them.

The numbers are the block's (the same sums per position, up to float
rounding). The bytes on the wire are the same (four reductions of half an
activation per block instead of two of a whole one), as are the matmuls'
FLOPs, but for the attention's: the first half's queries are not scored
against the second half's keys, all masked for them, which the whole
block computes and throws away (3/4 of its logits and context FLOPs).
Decoding (ExtendStep, one position) runs the block as it is. Dropout and
rotary embeddings are refused: split, the masks and positions would need
their own bookkeeping.
"""

from lingvo import compat as tf
from lingvo.core import py_utils
from params import pod_blocks

_TIME = 1  # of the blocks' activations [batch, time, dim]


def SequenceHalves(stage):
  """PodStageParams whose blocks run on the sequence's two halves as two
  chains (`SequenceHalvesStage`): the same weights, the same numbers."""
  return stage.Copy().Set(cls=SequenceHalvesStage)


class SequenceHalvesStage(pod_blocks.BatchMajorStage):
  """BatchMajorStage whose blocks run on the sequence's two halves, each
  half's all-reduces beside the other half's matmuls (the module's
  docstring). A sequence of odd (or unknown) length runs whole."""

  def __init__(self, params):
    _CheckBlock(params.block_tpl)
    super().__init__(params)

  @staticmethod
  def _Block(block, block_theta, x, is_padded):
    time = x.shape[_TIME] if x.shape.rank == 3 else None
    if time is None or time % 2:
      return pod_blocks.BatchMajorStage._Block(block, block_theta, x,
                                               is_padded)
    first, second = tf.split(x, 2, axis=_TIME)
    # Each reduction's matmul waits for the reduction before it (`_After`,
    # the module's docstring).
    first, second = _Attention(block.self_atten, block_theta.self_atten,
                               first, second, is_padded)
    ff, ff_theta = block.fflayer, block_theta.fflayer
    first = _FeedForward(ff, ff_theta, first, after=second)
    if pod_blocks.Recomputing():
      # Its output is not read: neither reduction is computed, none ordered.
      second = _FeedForward(ff, ff_theta, second)
    else:
      second = _FeedForward(ff, ff_theta, second, after=first)
    return tf.concat([first, second], axis=_TIME)


def _Attention(layer, theta, first, second, is_padded):
  """The pre-LN causal self-attention sub-layer (a Lingvo
  TransformerAttentionLayer) on the two halves [b, t/2, d]: each half's
  queries, keys and values projected from its own rows, the first half
  attending to itself, the second to both, each its own output projection
  (and reduction) and residual. The first half's output projection waits
  for the second half's input (the block before's last reduction)."""
  # Lingvo's attention in its parts:
  # pylint: disable=protected-access
  atten, atten_theta = layer.atten, theta.atten
  projected = []
  for x in (first, second):
    normed = tf.cast(layer.layer_norm.FProp(theta.layer_norm, x), x.dtype)
    projected.append(atten._HeadsProj(atten_theta, normed, normed, normed))
  (q_1, k_1, v_1), (q_2, k_2, v_2) = projected
  batch, half = py_utils.GetShape(q_1)[:2]
  encoded, _ = atten._DotAtten(
      atten_theta, q_1, k_1, v_1, is_padded[:, :half], None,
      _CausalPadding(batch, half, 0, first.dtype))
  first += atten._PostProj(atten_theta, _After(encoded, second))
  encoded, _ = atten._DotAtten(
      atten_theta, q_2, tf.concat([k_1, k_2], _TIME),
      tf.concat([v_1, v_2], _TIME), is_padded, None,
      _CausalPadding(batch, half, half, first.dtype))
  second += atten._PostProj(atten_theta, _After(encoded, first))
  return first, second


def _FeedForward(layer, theta, x, after=None):
  """A Lingvo TransformerFeedForwardLayer (pre-LN, two projections, the
  residual) on one half [b, t/2, d], its tokens as rows (as
  BatchMajorStage runs it); the second projection waits for `after`."""
  shape = py_utils.GetShape(x)
  rows = tf.reshape(x, [-1, shape[-1]])
  net, net_theta = layer.fflayer, theta.fflayer
  hidden = net.fc[0].FProp(net_theta.fc[0],
                           layer.layer_norm.FProp(theta.layer_norm, rows))
  if after is not None:
    hidden = _After(hidden, after)
  out = net.fc[1].FProp(net_theta.fc[1], hidden)
  return tf.reshape(rows + out * layer.params.residual_weight, shape)


def _After(x, t):
  """x, computable only once t exists: times a 1 made from t's first
  element (gpipe.loops.made_after), not differentiated."""
  return x * tf.cast(tf.stop_gradient(pod_blocks.OneAfter(t)), x.dtype)


def _CausalPadding(batch, rows, offset, dtype):
  """[batch, rows, offset + rows]: 1 where query i (at position offset + i)
  must not see key j, j > offset + i; Lingvo's CausalPadding when
  offset = 0."""
  ones = tf.ones([rows, offset + rows], dtype)
  padding = 1 - tf.linalg.band_part(ones, -1, offset)
  return tf.tile(padding[None], [batch, 1, 1])


def _CheckBlock(block):
  """Raises a one-line ValueError for a block the halves cannot run as it
  runs: anything beyond PodBlockParams' pre-LN causal blocks without
  dropout or rotary embeddings."""
  attention, ff = block.tr_atten_tpl, block.tr_fflayer_tpl
  problems = {
      'dropout': any(p > 0 for p in (
          attention.residual_dropout_prob, attention.atten_dropout_prob,
          ff.residual_dropout_prob, ff.relu_dropout_prob)),
      'rotary embeddings': attention.atten_tpl.rope_tpl is not None,
      'no causal mask': not block.mask_self_atten,
      'a post-LN sub-layer': not (attention.pre_layer_norm and
                                  ff.pre_layer_norm),
      'a normalized residual': not attention.add_unnormalized_input,
  }
  found = [what for what, there in problems.items() if there]
  if found:
    raise ValueError('SequenceHalvesStage runs pre-LN causal blocks '
                     'without dropout or rotary embeddings; its block has '
                     f'{", ".join(found)}.')
