"""The largest LMs that fit: what lets a chip hold twice GPipe's model.

On 16 GiB chips a model of 1.3 billion parameters per chip fills most of
the memory with its float32 weights and their float32 gradients (10 GiB);
what a step holds beside them must stay small. `LargeLMTask` is
`lm_task.PipelinedLMTask` with the three places that grow with the model kept
down:

  * the pipeline runs `backward_schedule='1f1b'` with `stream_io`: its
    activations are bounded by the stages (docs/memory.md);
  * each stage recomputes its blocks one at a time in the backward pass
    (`pod_blocks.BatchMajorStage.remat_blocks`): its blocks' activations
    and bfloat16 weights are never all held at once;
  * one vocab-sized table serves the embedding and the softmax (the
    lookup's gradient made where it arrives, `LookUp`); with
    backward_schedule='1f1b' the pipeline's last stage scores each
    microbatch as it finishes (`PipelinedLayer.FPropWithLoss`), the
    table split by vocab over the model axis (the softmax's max and sum
    cross it as [tokens] vectors), so no forward pass runs before the
    gradient loop; otherwise (and in eval) the softmax and loss run one
    sequence per chip at a time in a loop that recomputes each chunk's
    logits in its backward pass (`gpipe.recurrent`). Either way a chip
    holds the logits of one sequence, not of its whole batch.
"""

import numpy as np

from gpipe import recurrent
from gpipe import sharding
from gpipe.loops import made_after
from gpipe.pipeline import stage_ends
from lingvo import compat as tf
from lingvo.core import py_utils
from params import lm_task
from params import pod_blocks

NestedMap = py_utils.NestedMap


class LargeLMTask(lm_task.PipelinedLMTask):
  """PipelinedLMTask with a tied embedding and a loss chunked by sequence.

  The softmax scores with the token embedding table (transposed) and a
  bias of its own; the loss and accuracy are summed over the chip's
  sequences one per chip at a time (predictions carry the final hidden
  states; `Logits` scores a whole batch where one is wanted, e.g. in
  decoding).
  """

  def __init__(self, params):
    super().__init__(params)
    self.CreateVariable(
        'softmax_bias',
        py_utils.WeightParams([self.params.vocab_size],
                              py_utils.WeightInit.Constant(0.0)))

  def _CreateSoftmax(self):
    """No softmax weight of its own: the embedding table serves."""

  def _Embed(self, theta, ids, positions):
    """Token + position embeddings, float32 (the tokens by LookUp)."""
    x = LookUp(self._TableTheta(theta.emb).wm, ids)
    return x + self.pos_emb.EmbLookup(self._TableTheta(theta.pos_emb),
                                      positions)

  def _ScoreTheta(self, theta):
    """The table [vocab, d] gathered on every chip, and the bias."""
    return NestedMap(table=self._TableTheta(theta.emb).wm,
                     bias=self._OverStageDevices(theta.softmax_bias, 0))

  @staticmethod
  def _Score(score_theta, x):
    """x [..., d] (after the final layer norm) -> float32 logits."""
    return (tf.einsum('...d,vd->...v', x, score_theta.table) +
            score_theta.bias)

  def _Logits(self, theta, x):
    """x [..., d] from the stack -> float32 logits [..., vocab]."""
    return self._Score(self._ScoreTheta(theta), self._FinalNorm(theta, x))

  def _FinalNorm(self, theta, x):
    return self.final_ln.FProp(theta.final_ln, tf.cast(x, tf.float32))

  def ComputePredictions(self, theta, input_batch):
    """Training with backward_schedule='1f1b': the loss's sums, taken at the
    pipeline's last stage (`_LastStageLoss`). Else the final hidden states
    [b, t, d] (split by batch over the stage devices), which the loss
    scores chunk by chunk."""
    if self._ScoresAtLastStage():
      # The vocab-sized weights where they live, split by vocab over every
      # device of the stack; the pipeline gathers one copy for each stage
      # (stage_ends.ForTheLoop) for the embedding and the loss, in the
      # compute dtype (their gradients are summed in float32).
      # The positions (every stage's whole, not split by the model axis)
      # gathered whole first: made whole after the stacking, the gather
      # would move a copy per stage. Cast where they are split, then
      # gathered: a cast marked only whole, XLA's SPMD partitioner gathers
      # the float32 weight and casts it whole (twice the bytes).
      home = NestedMap(
          table=self._InComputeDtype(self._AtHome(theta.emb.wm)),
          positions=sharding.Replicate(self._OverStageDevices(
              self._InComputeDtype(self._OverStageDevices(
                  theta.pos_emb.wm, 0)), 0)),
          bias=self._AtHome(theta.softmax_bias))
      loss = self._LastStageLoss(theta, home, input_batch)
      if self.params.input_dropout_prob:
        return NestedMap(sums=self.stack.FPropWithLoss(
            theta.stack, loss, *self._StackInputs(theta, input_batch)))
      return NestedMap(sums=self.stack.FPropWithLoss(
          theta.stack, loss,
          first_stage=self._FirstStageInput(home, input_batch)))
    x = self._StackOutputs(theta, input_batch)
    return NestedMap(hidden=self._OverStageDevices(
        self._FinalNorm(theta, x), 0))

  def TrafficShape(self, input_specs):
    """PipelinedLMTask's, for the ends made in the loop (training with
    1f1b, no input dropout): per microbatch the embedding's rows and the
    loss's input gradient reduced over the model axis; the tied table
    (each chip its model-axis slice of the vocab, _AtHome) gathered over
    the stage axis in the compute dtype, the positions over every axis
    (cast first, so in the compute dtype too), the bias kept whole (its
    gradient's all-reduce costs what a gather and a reduce-scatter do).
    Each stage differentiates its own copy (stage_ends.ForTheLoop), the
    model axis's devices the same one: their gradients are summed over
    the stage axis alone, in float32 (the pipeline sums a 16-bit copy's
    gradient over its iterations in float32, and the stage ends exchange
    that sum)."""
    shape = super().TrafficShape(input_specs)
    sp = self.params.stack
    if sp.backward_schedule != '1f1b' or self.params.input_dropout_prob:
      return shape
    mesh = np.shape(sp.device_mesh) if sp.device_mesh is not None else (
        sp.num_stages,)
    roles = shape['axis_roles']
    model = mesh[roles['model']] if 'model' in roles else 1
    stage, every = (roles['stage'],), tuple(range(len(mesh)))
    gathered = shape['compute_bytes']  # _InComputeDtype before the gather
    summed = max(gathered, tf.float32.size)
    bias = tf.as_dtype(self.vars.softmax_bias.dtype).size
    return dict(
        shape, end_reductions=2 if model > 1 else 0,
        tables=((self.emb.vars.wm.shape.num_elements() / model, stage,
                 gathered, stage, summed),
                (self.params.vocab_size / model, stage, bias, stage, bias),
                (self.pos_emb.vars.wm.shape.num_elements(), every, gathered,
                 stage, summed)))

  def _ScoresAtLastStage(self):
    """Whether the stack takes the loss at its last stage: in training,
    with backward_schedule='1f1b' (its one gradient loop then scores)."""
    return self.params.stack.backward_schedule == '1f1b' and not self.do_eval

  def _FirstStageInput(self, home, input_batch):
    """The stack's inputs as stage 0 makes them, a microbatch at a time:
    its tokens' rows of the tied table (split by vocab over the model
    axis, the same copy the loss scores with) plus the positions', in the
    stack's dtype, and the paddings."""
    return stage_ends.FirstStageInput(
        self._MicrobatchInputs,
        weights=NestedMap(table=home.table, positions=home.positions),
        inputs=NestedMap(ids=input_batch.ids,
                         paddings=input_batch.paddings))

  def _MicrobatchInputs(self, weights, inputs):
    """(activations [b, t, d], paddings [b, t]) of a microbatch's ids,
    looked up in the compute dtype (the rows' sum over the model axis,
    which splits the table, crosses it so)."""
    seq_len = py_utils.GetShape(inputs.ids)[1]
    table = self._OverModelAxis(self._InComputeDtype(weights.table), 0)
    x = (LookUp(table, inputs.ids) + self._InComputeDtype(
        tf.gather(weights.positions, tf.range(seq_len))))
    return tf.cast(x, self.params.stack_dtype), inputs.paddings

  def _InComputeDtype(self, x):
    """x in the stack body's compute dtype (its fprop_dtype, or float32);
    a weight's gradient comes back through the cast in its own."""
    dtype = self.params.stack.single_stage_body.Get('fprop_dtype')
    return tf.cast(x, dtype or tf.float32)

  def _LastStageLoss(self, theta, home, input_batch):
    """The weighted cross entropy and correct argmaxes of a microbatch, as
    the last stage takes them: final layer norm, the tied table (split by
    vocab over the model axis), the softmax.

    Each position weighs its weight over the batch's sum, so that the sums
    are the batch's means, the task's loss itself: its gradient comes in
    as 1, and the pipeline's gradients need no scaling after the loop (a
    copy of every gradient where XLA does not fuse it away)."""
    weights = _ScoredWeights(input_batch)
    return stage_ends.LastStageLoss(
        self._MicrobatchScores,
        # The final layer norm whole on every chip (two [d] vectors): split
        # by propagation, the stages' copies would gather it.
        weights=NestedMap(final_ln=theta.final_ln.Transform(
            sharding.Replicate), table=home.table, bias=home.bias),
        inputs=NestedMap(labels=input_batch.labels,
                         weights=weights / tf.reduce_sum(weights)),
        differentiated='xent')

  def _MicrobatchScores(self, weights, outputs, inputs):
    """NestedMap(xent, correct): sums over a microbatch's positions, the
    logits computed in the compute dtype (the hidden state's gradient,
    reduced over the model axis, crosses it so), the softmax in float32."""
    hidden = self.final_ln.FProp(weights.final_ln,
                                 tf.cast(outputs[0], tf.float32))
    table = self._OverModelAxis(self._InComputeDtype(weights.table), 0)
    logits = tf.einsum('...d,vd->...v', self._InComputeDtype(hidden), table)
    logits = self._OverModelAxis(
        tf.cast(logits, tf.float32) + self._OverModelAxis(weights.bias, 0),
        2)
    xent, correct = VocabSplitScores(logits, inputs.labels)
    return NestedMap(xent=tf.reduce_sum(xent * inputs.weights),
                     correct=tf.reduce_sum(correct * inputs.weights))

  def _AtHome(self, w):
    """A [vocab, ...] weight as it lives on a PodMesh: split by vocab over
    the model axis (each chip holds its model slice's rows, which its
    stages use) and, a 2-D table, by width over the stage axis (and the
    data axis, with the body's FSDP), so that the pipeline's copy for
    each stage gathers it over those axes alone and reduce-scatters its
    gradient back (stage_ends.ForTheLoop); elsewhere split by vocab over
    every device."""
    sp = self.params.stack
    if sp.pipeline_stage_mesh_dim is None or np.ndim(sp.device_mesh) != 3:
      return self._OverStageDevices(w, 0)
    mapping = [pod_blocks.PodMesh.MODEL_AXIS] + [-1] * (w.shape.rank - 1)
    if w.shape.rank != 2:
      return sharding.MeshSplit(w, sp.device_mesh, mapping)
    if sp.single_stage_body.Get('fsdp_mesh_dim') is None:
      mapping[1] = pod_blocks.PodMesh.STAGE_AXIS
      return sharding.MeshSplit(w, sp.device_mesh, mapping)
    # FSDP: the width over the stage and data axes together (a [model,
    # stages x data] view of the mesh), gathered over both for use.
    mesh = sp.device_mesh
    view = np.transpose(mesh, [pod_blocks.PodMesh.MODEL_AXIS,
                               pod_blocks.PodMesh.STAGE_AXIS,
                               pod_blocks.PodMesh.DATA_AXIS])
    return sharding.MeshSplit(w, view.reshape(view.shape[0], -1), [0, 1])

  def _OverModelAxis(self, x, dim):
    """x split on `dim` over a PodMesh's model axis (if on one)."""
    sp = self.params.stack
    if sp.pipeline_stage_mesh_dim is None or np.ndim(sp.device_mesh) != 3:
      return x
    return sharding.MeshSplit(
        x, sp.device_mesh,
        [pod_blocks.PodMesh.MODEL_AXIS if d == dim else -1
         for d in range(x.shape.rank)])

  def PredictedLogits(self, theta, predictions):
    return self._Score(self._ScoreTheta(theta), predictions.hidden)

  def ComputeLoss(self, theta, predictions, input_batch):
    weights = _ScoredWeights(input_batch)
    num_scored = tf.reduce_sum(weights)
    if 'sums' in predictions:  # means already (_LastStageLoss)
      loss, accuracy = predictions.sums.xent, predictions.sums.correct
    else:
      xent, correct = self._ChunkedScores(theta, predictions.hidden,
                                          input_batch.labels, weights)
      loss, accuracy = xent / num_scored, correct / num_scored
    metrics = {'loss': (loss, num_scored),
               'accuracy': (accuracy, num_scored)}
    metrics.update(py_utils.GetTpuSummaryTensors())
    return metrics, {}

  def _ChunkedScores(self, theta, hidden, labels, weights):
    """(sum of weighted cross entropy, of weighted correct argmaxes),
    one sequence per chip at a time, each chunk's logits recomputed in
    the backward pass."""
    devices = self.NumStackDevices()
    per_device = py_utils.GetShape(hidden)[0] // devices

    def Chunks(x):
      """[b, ...] -> [b / N, N, ...]: chunk j holds each device's j-th."""
      shape = py_utils.GetShape(x)
      x = tf.reshape(x, [devices, per_device] + shape[1:])
      x = tf.transpose(x, [1, 0] + list(range(2, len(shape) + 1)))
      return self._OverStageDevices(x, 1)

    def Chunk(th, state, chunk):
      logits = self._Score(th, chunk.hidden)
      xent = tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=chunk.labels, logits=logits)
      correct = tf.cast(tf.equal(
          tf.argmax(logits, -1, output_type=tf.int32), chunk.labels),
                        tf.float32)
      return NestedMap(
          xent=state.xent + tf.reduce_sum(xent * chunk.weights),
          correct=state.correct + tf.reduce_sum(correct * chunk.weights)), {}

    # Gathered once, outside the loop: the loop's backward accumulates
    # the gathered table's gradient and it is reduce-scattered once,
    # rather than gathered and reduced at every chunk.
    score_theta = self._ScoreTheta(theta)
    zero = tf.zeros([], tf.float32)
    _, final, _ = recurrent.Recurrent(
        score_theta, NestedMap(xent=zero, correct=zero),
        NestedMap(hidden=Chunks(hidden), labels=Chunks(labels),
                  weights=Chunks(weights)),
        Chunk, return_states=False, name='chunked_loss')
    return final.xent, final.correct


def _ScoredWeights(input_batch):
  """Each position's weight in the loss: its own, 0 where padded."""
  return input_batch.weights * (1.0 - input_batch.paddings)


def VocabSplitScores(logits, labels):
  """(cross entropy, 1.0 where the label's logit is the largest), per
  position, of logits [..., vocab] against labels [...].

  Written as reductions over the vocab dim, so that logits split by vocab
  over devices cross them only as [...] vectors (their max, the sum of
  exponentials, the label's logit) and are never gathered.
  """
  logits = tf.cast(logits, tf.float32)
  top = tf.reduce_max(logits, -1)
  total = tf.reduce_sum(tf.exp(logits - tf.stop_gradient(top)[..., None]), -1)
  at_label = tf.reduce_sum(
      logits * tf.one_hot(labels, py_utils.GetShape(logits)[-1],
                          dtype=logits.dtype), -1)
  xent = tf.math.log(total) + tf.stop_gradient(top) - at_label
  correct = tf.cast(tf.equal(at_label, top), tf.float32)
  return xent, correct


def LookUp(table, ids):
  """table [vocab, d] rows at ids [...] -> [..., d], as tf.gather.

  Its gradient is the dense [vocab, d] sum of the looked-up rows'
  gradients, added into zeros made once dy exists (from its first
  element: gpipe.loops.made_after): zeros that depend on nothing would be
  a vocab-sized buffer a scheduler is free to make at the start of the
  step and hold to its end, through the whole pipeline (XLA:CPU does).
  """

  @tf.custom_gradient
  def Run(table):

    def Grad(dy):
      rows = tf.reshape(tf.cast(dy, table.dtype), [-1, table.shape[-1]])
      zero = made_after.ZeroAfter(rows[:1, :1], table.dtype)
      return tf.tensor_scatter_nd_add(
          tf.fill(tf.shape(table), zero), tf.reshape(ids, [-1, 1]), rows)

    return tf.gather(table, ids), Grad

  return Run(table)
