"""A Lingvo model as Lingvo users write it, planned and run on gpipe.

The stack is Lingvo's own `batch_major_attention.PipelinedTransformerLayers`,
unchanged: it builds its pipelined layer (Lingvo's
LayerwiseShardablePipelinedLayer) in its __init__. With gpipe's switch,
`lingvo_compat.UseGpipeInLingvo()`, it builds gpipe's PipelinedLayer
instead, same Params and variables. The planner builds every task that way,
so a model registered in your own module is planned by its registry name,
`<module>.<class>` (Lingvo's convention: the module is imported from the
name):

    python -m gpipe.plan --model examples.lingvo_client_lm.PipelinedTransformerLM \\
        --num_devices 2 --num_microbatches 2,4 --circular_repeat 1,2

M is the client's `num_pipeline_microbatches`, R its `circular_repeat`; R
varies at a fixed depth through its stage's `num_layers`; the remat policy
is gpipe's default (the client passes none).

`GShardUniTransformerLM` is the other kind Lingvo users have: a task its
GShard builder pipelines (`gshard_builder.UniTransformer` with
`num_spmd_pipeline_stages` > 1). The builder places the stage dim nowhere;
the planner builds it with the stages over num_stages devices. M is the
task's `num_spmd_pipeline_microbatches`; R is 1 (the builder has no
circular repeat):

    python -m gpipe.plan --model examples.lingvo_client_lm.GShardUniTransformerLM \\
        --num_devices 2 --num_microbatches 2,4
"""

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
from lingvo import compat as tf
from lingvo import model_registry
from lingvo.core import base_model
from lingvo.core import base_model_params
from lingvo.core import batch_major_attention
from lingvo.core import gshard_builder
from lingvo.core import layers
from lingvo.core import optimizer
from lingvo.core import py_utils
from params import lm


class ClientLMTask(base_model.BaseTask):
  """Embedding -> Lingvo's PipelinedTransformerLayers -> softmax."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('vocab_size', 16, 'Vocabulary size.')
    p.Define('model_dim', 16, 'Width of the residual stream.')
    p.Define('stack', None, 'PipelinedTransformerLayers params.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateChild('emb', layers.SimpleEmbeddingLayer.Params().Set(
        vocab_size=p.vocab_size, embedding_dim=p.model_dim))
    self.CreateChild('stack', p.stack)
    self.CreateChild('softmax', layers.SimpleFullSoftmax.Params().Set(
        input_dim=p.model_dim, num_classes=p.vocab_size))

  def ComputePredictions(self, theta, input_batch):
    x = self.emb.EmbLookup(theta.emb, input_batch.ids)
    x, _ = self.stack.FProp(theta.stack, x, input_batch.paddings)
    shape = py_utils.GetShape(x)
    logits = self.softmax.Logits(theta.softmax,
                                 tf.reshape(x, [-1, shape[-1]]))
    return py_utils.NestedMap(logits=tf.reshape(logits, shape[:-1] + [-1]))

  def ComputeLoss(self, theta, predictions, input_batch):
    xent = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=input_batch.labels, logits=predictions.logits)
    weights = input_batch.weights
    num_scored = tf.reduce_sum(weights)
    loss = tf.reduce_sum(xent * weights) / num_scored
    return {'loss': (loss, num_scored)}, {}


@model_registry.RegisterSingleTaskModel
class PipelinedTransformerLM(base_model_params.SingleTaskModelParams):
  """2 stages of Lingvo's StackedTransformerLayers (2 layers each), 4
  microbatches, the stage dim split over 2 devices (shard_stages_1d)."""

  def Train(self):
    return lm.CopyTaskInput.Params().Set(vocab_size=16, copy_length=4,
                                         batch_size=8)

  def Task(self):
    stage = batch_major_attention.StackedTransformerLayers.Params().Set(
        num_layers=2, mdl_dim=16, hidden_dim=32, num_atten_heads=4,
        dropout_prob=0.0, mask_self_atten=True)
    stack = batch_major_attention.PipelinedTransformerLayers.Params().Set(
        pipeline_stage=stage, num_pipeline_stages=2,
        num_pipeline_microbatches=4, circular_repeat=1, shard_stages_1d=True)
    p = ClientLMTask.Params().Set(name='client_lm', vocab_size=16,
                                  model_dim=16, stack=stack)
    p.train.learning_rate = 1e-3
    p.train.optimizer = optimizer.Adam.Params()
    return p


class CopyTaskTgtInput(lm.CopyTaskInput):
  """The copy task with the fields UniTransformer reads: one segment a row."""

  def _InputBatch(self):
    batch = super()._InputBatch()
    ids = batch.ids
    batch.segment_ids = tf.ones_like(ids)
    batch.segment_pos = tf.broadcast_to(
        tf.range(py_utils.GetShape(ids)[1]), py_utils.GetShape(ids))
    return batch


@model_registry.RegisterSingleTaskModel
class GShardUniTransformerLM(base_model_params.SingleTaskModelParams):
  """Lingvo's GShard UniTransformer (dense builder, relative-bias
  attention, as Lingvo's own test model), 2 pipeline stages of one
  Transformer layer each, 4 microbatches."""

  def Train(self):
    return CopyTaskTgtInput.Params().Set(vocab_size=16, copy_length=4,
                                         batch_size=8)

  def Task(self):
    builder = gshard_builder.DenseBuilder.Params().Set(
        device_mesh_shape=[1, 1], device_mesh=None, dtype=tf.float32,
        relative_attention_type='bias', relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        relative_attention_use_universal_1d_position=True,
        num_devices=1, model_dim=16, attention_num_heads=2, ff_dim=32,
        attention_key_value_dim=8, attention_combine_dims=True,
        dropout_rate=0.0)
    p = gshard_builder.UniTransformer.Params().Set(
        name='gshard_lm', builder=builder, dtype=tf.float32,
        gated_gelu=False, positional_embedding=False, batch_size=8,
        sequence_length=8, max_length=8, vocab_size=16,
        num_transformer_layers=2, num_spmd_pipeline_stages=2,
        num_spmd_pipeline_microbatches=4)
    p.train.learning_rate = 1e-3
    p.train.optimizer = optimizer.Adam.Params()
    return p
