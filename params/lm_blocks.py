"""The copy-task LM's stage body of Lingvo's time-major Transformer blocks.

`StageBlocks` runs k of Lingvo's `TransformerLayer`s (causal, with
deterministic dropout: `CausalBlockParams`) on the batch-major tensors the
pipeline microbatches; params/pod_blocks.py has the batch-major blocks of
the pod LMs.
"""

from lingvo import compat as tf
from lingvo.core import layers
from lingvo.core import layers_with_attention
from lingvo.core import py_utils
from params import pod_blocks


class StageBlocks(pod_blocks.BlockStage):
  """One pipeline stage: k causal Transformer blocks, batch-major in and out.

  The pipeline microbatches along the leading (batch) dim, so a stage takes
  and returns ([batch, time, dim], [batch, time]); Lingvo's TransformerLayer
  is time-major, so the stage transposes around its blocks.
  """

  def FProp(self, theta, inputs, paddings):
    x = tf.transpose(inputs, [1, 0, 2])
    time_major_paddings = tf.transpose(paddings)
    for block, block_theta in zip(self.blocks, theta.blocks):
      x, _ = block.FProp(block_theta, x, time_major_paddings)
    # The pipeline reports it per stage: activation_rms/stage_<i>.
    py_utils.AddTpuSummaryTensor('activation_rms',
                                 tf.sqrt(tf.reduce_mean(tf.square(x))))
    return tf.transpose(x, [1, 0, 2]), paddings

  def InitStates(self, theta, batch_size, max_len):
    """Empty key/value caches of every block, batch-major [b, max_len, d].

    Batch-major so that the pipeline can split the batch of each stage's
    state into microbatches (PipelinedLayer.MicrobatchStates).
    """
    del theta
    dim = self.params.block_tpl.source_dim
    zeros = tf.zeros([batch_size, max_len, dim], py_utils.FPropDtype(
        self.params))
    return py_utils.NestedMap(blocks=[
        py_utils.NestedMap(key=zeros, value=zeros) for _ in self.blocks])

  def ExtendStep(self, theta, x, states, time_step):
    """One position through every block: x [b, d] -> (y [b, d], states).

    Position `time_step` of each block's cache is written; the block attends
    to positions 0..time_step, as its causal FProp does.
    """
    new_states = []
    for block, block_theta, cache in zip(self.blocks, theta.blocks,
                                         states.blocks):
      time_major = cache.Transform(lambda c: tf.transpose(c, [1, 0, 2]))
      x, _, updated = block.ExtendStep(block_theta, x, time_major,
                                       t=time_step)
      new_states.append(
          updated.Transform(lambda c: tf.transpose(c, [1, 0, 2])))
    return x, py_utils.NestedMap(blocks=new_states)


def CausalBlockParams(model_dim, num_heads, hidden_dim, dropout_prob):
  """A pre-LN causal self-attention + feed-forward block.

  Both sub-layers add to their unnormalized input (x + f(LN(x))): Lingvo's
  attention sub-layer adds to the normalized one by default
  (add_unnormalized_input=False), which re-normalizes the residual stream
  at every block, and a deeper stack of such blocks learns worse
  (docs/text-depth.md). Dropout is Lingvo's deterministic (stateless)
  kind, seeded by the global step: a run resumed from a checkpoint draws
  the masks it would have drawn had it never stopped.
  """
  p = layers_with_attention.TransformerLayer.Params().Set(
      source_dim=model_dim, output_dim=model_dim, is_decoder=False,
      mask_self_atten=True)  # (the layer overrides tr_atten_tpl.is_masked)
  p.tr_atten_tpl.Set(num_attention_heads=num_heads,
                     add_unnormalized_input=True,
                     residual_dropout_prob=dropout_prob,
                     atten_dropout_prob=dropout_prob,
                     residual_dropout_tpl=DeterministicDropout())
  p.tr_atten_tpl.atten_tpl.atten_dropout_deterministic = True
  p.tr_fflayer_tpl.Set(hidden_dim=hidden_dim,
                       residual_dropout_prob=dropout_prob,
                       relu_dropout_prob=dropout_prob)
  p.tr_fflayer_tpl.fflayer_tpl.dropout = DeterministicDropout()
  p.tr_fflayer_tpl.residual_dropout_tpl = DeterministicDropout()
  return p


def DeterministicDropout():
  return layers.DeterministicDropoutLayer.Params()
