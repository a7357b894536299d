"""The pipelined LM's task: embedding, pipelined stack, softmax, decoding.

A decoder-only Transformer LM whose stack is pipelined, trained to copy a
random sequence (params/lm.py's docstring has the task; the data is
params/copy_task_input.py) or on text (params/text_lm.py's subclass).
params/lm_params.py builds its Params; params/lm.py registers the models.
"""

import math

import numpy as np

from gpipe import layers as gpipe_layers
from gpipe import sharding
from lingvo import compat as tf
from lingvo.core import base_model
from lingvo.core import layers
from lingvo.core import metrics as metrics_lib
from lingvo.core import py_utils
from params import lm_blocks
from params import pod_blocks

class PipelinedLMTask(base_model.BaseTask):
  """Decoder-only LM: embedding -> pipelined Transformer stack -> softmax."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('vocab_size', 16, 'Vocabulary size.')
    p.Define('model_dim', 64, 'Width of the residual stream.')
    p.Define('max_seq_len', 64, 'Longest sequence (learned positions).')
    p.Define('input_dropout_prob', 0.0, 'Dropout on the embeddings.')
    p.Define('stack', None, 'PipelinedLayer params; its single_stage_body '
             'takes and returns (activations [b, t, d], paddings [b, t]).')
    p.Define('depth_scaled_init', False,
             "The batch-major blocks' output projections start at Xavier(1 / "
             'sqrt(2 x blocks)), blocks = the stack\'s num_stages x '
             'circular_repeat x its body\'s num_blocks when the task is '
             "built (pod_blocks.ScaleOutputInit, GPT-2's scaling): a "
             "deeper stack's residual stream starts as large as a "
             "shallower one's.")
    p.Define('stack_dtype', tf.float32,
             'Dtype of the activations entering and leaving the stack: what '
             'the pipeline carries between stages and keeps per iteration. '
             'The stage body may compute in another (its fprop_dtype).')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.ValidateParams(p, p.input)
    init = py_utils.WeightInit.Gaussian(1.0 / math.sqrt(p.model_dim))
    self.CreateChild('emb', layers.SimpleEmbeddingLayer.Params().Set(
        vocab_size=p.vocab_size, embedding_dim=p.model_dim,
        params_init=init))
    self.CreateChild('pos_emb', layers.SimpleEmbeddingLayer.Params().Set(
        vocab_size=p.max_seq_len, embedding_dim=p.model_dim,
        params_init=init))
    self.CreateChild('input_dropout', lm_blocks.DeterministicDropout().Set(
        keep_prob=1.0 - p.input_dropout_prob))
    self.CreateChild('stack', self._StackParams())
    self.CreateChild('final_ln', layers.LayerNorm.Params().Set(
        input_dim=p.model_dim))
    self._CreateSoftmax()

  def _CreateSoftmax(self):
    p = self.params
    self.CreateChild('softmax', layers.SimpleFullSoftmax.Params().Set(
        input_dim=p.model_dim, num_classes=p.vocab_size))

  def _StackParams(self):
    """p.stack, its blocks' output projections scaled by its depth if
    depth_scaled_init."""
    p = self.params
    stack = p.stack.Copy()
    if p.depth_scaled_init:
      body = stack.single_stage_body
      blocks = stack.num_stages * stack.circular_repeat * body.num_blocks
      pod_blocks.ScaleOutputInit(body.block_tpl, 1 / math.sqrt(2 * blocks))
    return stack

  @classmethod
  def ValidateParams(cls, p, input_p):
    """Clear errors for configs that cannot work, before any graph exists.

    Args:
      p: this task's params.
      input_p: the input generator params it will be trained on, or None.

    Raises:
      ValueError: naming the parameter and the fix.
    """
    if p.stack is None:
      raise ValueError('PipelinedLMTask: set p.stack to PipelinedLayer '
                       'params (see CopyLMParams).')
    body = p.stack.single_stage_body
    if p.depth_scaled_init and not (
        body is not None and issubclass(body.cls, pod_blocks.BatchMajorStage)):
      raise ValueError('PipelinedLMTask: depth_scaled_init is for the '
                       'batch-major stage body (pod_blocks.BatchMajorStage); '
                       'set it False or build the stack with batch_major=True.')
    if p.model_dim < 1 or p.vocab_size < 1:
      raise ValueError(f'PipelinedLMTask: model_dim={p.model_dim} and '
                       f'vocab_size={p.vocab_size} must be positive.')
    batch_size = None
    if input_p is not None:
      input_p.cls.ValidateParams(input_p)
      seq_len, length_from = input_p.cls.SequenceLength(input_p)
      if seq_len > p.max_seq_len:
        raise ValueError(f'PipelinedLMTask: sequences of length {seq_len} '
                         f'({length_from}) exceed max_seq_len='
                         f'{p.max_seq_len}; raise max_seq_len.')
      vocab_size = input_p.cls.VocabSize(input_p)
      if vocab_size != p.vocab_size:
        raise ValueError(f'PipelinedLMTask: the input\'s vocabulary of '
                         f'{vocab_size} differs from vocab_size='
                         f'{p.vocab_size}; set both to the same value.')
      batch_size = input_p.batch_size
    if issubclass(p.stack.cls, gpipe_layers.PipelinedLayer):
      # Another pipelined layer with the same Params names (Lingvo's own,
      # planned side by side) checks its own.
      gpipe_layers.ValidateParams(p.stack, batch_size)

  # -- Where the vocab-sized weights and the loss live. ------------------------
  #
  # On a stack whose stages are spread over devices (shard_stages_1d or
  # pipeline_stage_mesh_dim), the rest of the model is spread over every
  # device the stack spans (all of a mesh's, not only one stage axis): the
  # embedding and softmax weights (and so their gradients and optimizer
  # slots) are split by vocab, and each chip embeds and scores its 1/N of
  # the sequences, so the logits [tokens, vocab] are never whole on one
  # chip. On an unsplit stack nothing is annotated.

  def SplitsStages(self):
    """True if the stack spreads its stages over devices."""
    sp = self.params.stack
    return sp.shard_stages_1d or sp.pipeline_stage_mesh_dim is not None

  def NumStackDevices(self):
    """The devices the stack spans: S, a mesh's size, or 1 (unsplit)."""
    sp = self.params.stack
    if sp.shard_stages_1d:
      return sp.num_stages
    if sp.pipeline_stage_mesh_dim is not None:
      return int(np.size(sp.device_mesh))
    return 1

  def _OverStageDevices(self, x, dim):
    """x split on `dim` over every device of the stack, if it is split."""
    sp = self.params.stack
    if sp.shard_stages_1d:
      return sharding.Split(x, dim, sp.num_stages)
    if sp.pipeline_stage_mesh_dim is not None:
      # The mesh's devices in its own order, as one axis.
      return sharding.MeshSplit(
          x, np.reshape(sp.device_mesh, [-1]),
          [0 if d == dim else -1 for d in range(x.shape.rank)])
    return x

  def TrafficShape(self, input_specs):
    """What the least collective traffic of this task's training step
    depends on, in plain numbers: {field: value} of the planner's
    gpipe.plan.traffic_floor.ModelShape, which the planner builds from
    them. Its batch, the activations between stages, two model-axis
    reductions per block and forward pass (pod_blocks.SplitBlockOverMesh's
    Megatron-style split), and the vocab-sized tables split over every
    device of the stack, in their own dtype."""
    p, sp = self.params, self.params.stack
    rows, length = input_specs.ids.shape.as_list()
    body = sp.single_stage_body
    compute = body.Get('fprop_dtype') if 'fprop_dtype' in body else None
    roles = {'stage': 0}
    if sp.pipeline_stage_mesh_dim is not None and np.ndim(sp.device_mesh) == 3:
      roles = {'stage': pod_blocks.PodMesh.STAGE_AXIS,
               'data': pod_blocks.PodMesh.DATA_AXIS,
               'model': pod_blocks.PodMesh.MODEL_AXIS}
    tables = [self.emb.vars.wm, self.pos_emb.vars.wm]
    if 'softmax' in self.children:
      tables += self.softmax.vars.Flatten()
    # Gathered as they are (_TableTheta: float32 weights), each chip's
    # gradient of its own sequences summed over every device.
    axes = (tuple(range(np.ndim(sp.device_mesh)))
            if sp.pipeline_stage_mesh_dim is not None else
            (0,) if sp.shard_stages_1d else ())
    return dict(
        rows=rows, row_elements=length * p.model_dim,
        activation_bytes=tf.as_dtype(p.stack_dtype).size,
        model_reductions=2 * body.Get('num_blocks') if 'num_blocks' in body
        else None,
        checkpoint_reductions=body.Get('num_blocks') if 'num_blocks' in body
        else None,
        compute_bytes=tf.as_dtype(compute or tf.float32).size,
        axis_roles=roles,
        tables=tuple((v.shape.num_elements(), axes,
                      tf.as_dtype(v.dtype).size, axes,
                      tf.as_dtype(v.dtype).size) for v in tables))

  def _TableTheta(self, layer_theta):
    """An embedding table: kept split by rows, looked up gathered.

    Each chip looks up its own sequences in the gathered table, and the
    table's gradient is reduce-scattered back to the split rows; a lookup
    in the split table would give every chip the whole batch's embeddings
    (and their gradient) instead.
    """
    layer_theta = layer_theta.copy()
    wm = self._OverStageDevices(layer_theta.wm, 0)
    layer_theta.wm = sharding.Replicate(wm) if self.SplitsStages() else wm
    return layer_theta

  def _SoftmaxTheta(self, theta):
    """The softmax weight [d, vocab] and bias [vocab], split by vocab."""
    return theta.softmax.Transform(
        lambda w: self._OverStageDevices(w, w.shape.rank - 1))

  def _Embed(self, theta, ids, positions):
    """Token + position embeddings, float32."""
    x = self.emb.EmbLookup(self._TableTheta(theta.emb), ids)
    return x + self.pos_emb.EmbLookup(self._TableTheta(theta.pos_emb),
                                      positions)

  def _Logits(self, theta, x):
    """x [..., d] from the stack -> float32 logits [..., vocab]."""
    x = self.final_ln.FProp(theta.final_ln, tf.cast(x, tf.float32))
    shape = py_utils.GetShape(x)
    logits = self.softmax.Logits(self._SoftmaxTheta(theta),
                                 tf.reshape(x, [-1, shape[-1]]))
    return tf.reshape(logits, shape[:-1] + [-1])

  def _StackInputs(self, theta, input_batch):
    """The stack's inputs: the embedded ids [b, t, d] in the stack's dtype
    (split by batch over the stage devices) and the paddings [b, t]."""
    ids = self._OverStageDevices(input_batch.ids, 0)
    seq_len = py_utils.GetShape(ids)[1]
    x = self._OverStageDevices(self._Embed(theta, ids, tf.range(seq_len)), 0)
    x = self.input_dropout.FProp(theta.input_dropout, x)
    return tf.cast(x, self.params.stack_dtype), input_batch.paddings

  def _StackOutputs(self, theta, input_batch):
    """The embedded ids through the pipelined stack: [b, t, d] (split by
    batch over the stage devices)."""
    x, _ = self.stack.FProp(theta.stack,
                            *self._StackInputs(theta, input_batch))
    return self._OverStageDevices(x, 0)

  def ComputePredictions(self, theta, input_batch):
    """Logits [b, t, vocab] (split by batch over the stage devices)."""
    x = self._StackOutputs(theta, input_batch)
    logits = self._OverStageDevices(self._Logits(theta, x), 0)
    return py_utils.NestedMap(logits=logits)

  def PredictedLogits(self, theta, predictions):
    """The logits [b, t, vocab] of ComputePredictions' predictions."""
    del theta
    return predictions.logits

  # -- Incremental decoding through the pipeline. ----------------------------

  def InitDecodeStates(self, theta, batch_size):
    """Every stage's empty caches, laid out for the pipeline's loop."""
    stack = self.stack
    per_stage, _ = stack.BodyFPropNoMicrobatching(
        theta.stack, 'InitStates', batch_size, self.params.max_seq_len)
    return stack.PadMicrobatches(stack.MicrobatchStates(per_stage))

  def ExtendStep(self, theta, ids, time_step, states):
    """Token ids [b] at position time_step -> (logits [b, vocab], states).

    The stack runs pipelined, every stage extending its own caches of the
    microbatches it works on.
    """
    x = self._Embed(theta, ids, time_step[None])
    x = tf.cast(x, self.params.stack_dtype)
    y, states = self.stack.FPropFn(theta.stack, 'ExtendStep', x,
                                   padded_per_stage_states=[states],
                                   kwargs_no_batch={'time_step': time_step})
    return self._Logits(theta, y), states

  def Decode(self, input_batch):
    """Greedy copies of the batch's prompts, decoded through the pipeline.

    The prompt is the sequence to copy and SEP (the first L + 1 ids); the
    targets are the L tokens after it.

    Returns:
      NestedMap(prompts [b, L + 1], decoded [b, L], targets [b, L]).
    """
    copy_length = py_utils.GetShape(input_batch.ids)[1] // 2
    prompts = input_batch.ids[:, :copy_length + 1]
    return py_utils.NestedMap(
        prompts=prompts,
        decoded=self.GreedyDecode(self.theta, prompts, copy_length),
        targets=input_batch.labels[:, copy_length:])

  def GreedyDecode(self, theta, prompt, num_tokens, pick=None):
    """prompt [b, P] -> the num_tokens greedy continuations [b, num_tokens].

    One ExtendStep per position: the prompt's tokens are fed one by one
    (their predictions ignored), then each argmax is fed back (or what
    pick(logits [b, vocab], position) picks: a sampler).
    """
    batch, prompt_len = py_utils.GetShape(prompt)
    total = prompt_len + num_tokens
    # Positions 0 .. total - 2 are fed (the last token is only predicted).
    max_len = self.params.max_seq_len
    if isinstance(total, int) and total - 1 > max_len:
      raise ValueError(
          f'GreedyDecode: a prompt of {prompt_len} tokens and {num_tokens} '
          f'tokens to decode feed {total - 1} positions, more than the '
          f'model\'s max_seq_len={max_len}. Decode fewer tokens or raise '
          'max_seq_len.')
    ids = tf.pad(prompt, [[0, 0], [0, num_tokens]])
    pick = pick or (lambda logits, t: _Argmax(logits))

    def Step(t, ids, states):
      logits, states = self.ExtendStep(theta, ids[:, t], t, states)
      return t + 1, _WriteColumn(ids, t + 1, pick(logits, t), prompt_len), states

    _, ids, _ = tf.while_loop(
        lambda t, *_: t < total - 1, Step,
        (tf.constant(0), ids, self.InitDecodeStates(theta, batch)))
    return ids[:, prompt_len:]

  def FullSequenceGreedyCheck(self, theta, prompts, decoded):
    """What full-sequence greedy decoding picks after each decoded prefix.

    One causal FProp over prompts + decoded (no caches, no per-stage
    states): position P - 1 + k sees exactly the prefix greedy decoding had
    when it picked token k. The decoded tokens are the model's full-sequence
    greedy decoding iff they equal this argmax at every k (by induction,
    every prefix is then the same).

    Returns:
      (argmax [b, L], margin [b, L]: the top logit minus the runner-up, to
      tell a disagreement from a tie).
    """
    prompt_len = py_utils.GetShape(prompts)[1]
    num_tokens = py_utils.GetShape(decoded)[1]
    ids = tf.concat([prompts, decoded[:, :-1]], axis=1)
    logits = self.PredictedLogits(theta, self.ComputePredictions(
        theta, py_utils.NestedMap(ids=ids,
                                  paddings=tf.zeros(py_utils.GetShape(ids)))))
    picks = logits[:, prompt_len - 1:prompt_len - 1 + num_tokens]
    top2, _ = tf.math.top_k(picks, k=2)
    return _Argmax(picks), top2[..., 0] - top2[..., 1]

  def ComputeLoss(self, theta, predictions, input_batch):
    weights = input_batch.weights * (1.0 - input_batch.paddings)
    xent = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=input_batch.labels, logits=predictions.logits)
    num_scored = tf.reduce_sum(weights)
    loss = tf.reduce_sum(xent * weights) / num_scored
    correct = tf.cast(
        tf.equal(tf.argmax(predictions.logits, -1, output_type=tf.int32),
                 input_batch.labels), tf.float32)
    accuracy = tf.reduce_sum(correct * weights) / num_scored
    metrics = {'loss': (loss, num_scored), 'accuracy': (accuracy, num_scored)}
    # The pipelined stack's per-stage summaries (<name>/stage_<i>).
    metrics.update(py_utils.GetTpuSummaryTensors())
    return metrics, {}

  # -- Lingvo's decoder job (--job=decoder_dev). -------------------------------

  def CreateDecoderMetrics(self):
    return {
        'num_samples_in_batch': metrics_lib.AverageMetric(),
        'token_accuracy': metrics_lib.AverageMetric(),
        'exact_copy_accuracy': metrics_lib.AverageMetric(),
    }

  def PostProcessDecodeOut(self, decode_out_dict, decode_metrics_dict):
    """Scores the greedy copies; returns (prompt, decoded) token lines."""
    decoded = decode_out_dict['decoded']
    targets = decode_out_dict['targets']
    correct = decoded == targets
    batch = len(decoded)
    decode_metrics_dict['num_samples_in_batch'].Update(batch)
    decode_metrics_dict['token_accuracy'].Update(correct.mean(), correct.size)
    decode_metrics_dict['exact_copy_accuracy'].Update(
        correct.all(axis=1).mean(), batch)
    # Keyed by the prompt (Lingvo keeps one value per key over all
    # batches; equal prompts decode to equal tokens).
    return [(' '.join(map(str, prompt)), ' '.join(map(str, tokens)))
            for prompt, tokens in zip(decode_out_dict['prompts'], decoded)]


def _Argmax(logits):
  return tf.argmax(logits, -1, output_type=tf.int32)


def _WriteColumn(ids, column, values, first_writable):
  """ids [b, n] with column `column` set to values [b], if >= first_writable.

  Columns before first_writable (the prompt) are never written.
  """
  width = py_utils.GetShape(ids)[1]
  write = tf.logical_and(
      tf.equal(tf.range(width), column), column >= first_writable)[None]
  return tf.compat.v2.where(write, values[:, None], ids)


def ParameterBytes(task):
  """(total bytes, bytes one device holds) of a built task's variables.

  On a stack that spreads its S stages over devices, each device holds 1/S
  of the stage-stacked body's variables (split on their stage dim; a mesh
  body's own model-axis split is not counted here: the planner measures
  it), 1/N of the embedding tables and softmax (split by vocab over the
  stack's N devices; a dim that does not divide is padded), and the final
  layer norm whole. On an unsplit stack every device holds everything.
  """
  if task.SplitsStages():
    num_stages = task.params.stack.num_stages
    num_devices = task.NumStackDevices()
  else:
    num_stages = num_devices = 1
  # id(variable) -> (dim, devices it is split over)
  split = {id(v): (0, num_stages) for v in task.stack.vars.Flatten()}
  split.update({id(v): (0, num_devices)
                for v in (task.emb.vars.wm, task.pos_emb.vars.wm)})
  if 'softmax' in task.children:
    split.update({id(v): (v.shape.rank - 1, num_devices)
                  for v in task.softmax.vars.Flatten()})
  total = per_device = 0
  for v in task.vars.Flatten():
    shape = v.shape.as_list()
    total += math.prod(shape) * v.dtype.size
    if id(v) in split:
      dim, n = split[id(v)]
      shape[dim] = -(-shape[dim] // n)
    per_device += math.prod(shape) * v.dtype.size
  return total, per_device
