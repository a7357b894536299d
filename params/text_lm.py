"""The byte-level text LM: PipelinedLMTask on text, scored in bits per byte.

The copy LM's model (params/lm_task.py: embedding, pipelined stack of causal
Transformer blocks, softmax) over the 257 tokens of params/text_input.py
(256 bytes and EOD), with the recipe that lets it learn more per step as
it gets deeper (`TextLMParams`, docs/text-depth.md). What the text adds:
the loss read as bits per byte (`bits_per_byte`, in training and in
Lingvo's evaler), and decoding by sampling: a held-out prompt (the demo's
starts a `def`), a continuation drawn byte by byte through the pipeline
(one ExtendStep per position, as the copy LM's greedy decoding).

Sampling is deterministic: the byte at position t + 1 is the argmax of
logits / temperature + Gumbel noise drawn from the stateless seed
(decode_seed, t), which samples from softmax(logits / temperature) (the
Gumbel-max trick). A full-sequence FProp over the sampled bytes, with the
same noise at each position, must then pick the same bytes
(`FullSequencePicks`): that is the check that incremental decoding through
the pipeline computes what the model computes.
"""

import math

from lingvo import compat as tf
from lingvo.core import metrics as metrics_lib
from lingvo.core import py_utils
from lingvo.core import schedule
from params import lm_params
from params import lm_task
from params import text_input

LN2 = math.log(2.0)


class TextLMTask(lm_task.PipelinedLMTask):
  """The pipelined LM on bytes of text (see the module docstring)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('decode_prompt_len', 64,
             "Decoding: the held-out window's first bytes given as prompt.")
    p.Define('decode_prompt_line', 'def ',
             "The demo's sample: its prompt is held-out text from the first "
             'line that begins with this (after its indentation); empty, or '
             "no such line: the first held-out window's start.")
    p.Define('decode_num_tokens', 128, 'Decoding: bytes sampled after it.')
    p.Define('decode_temperature', 0.7,
             'Decoding: softmax temperature; 0 decodes greedily.')
    p.Define('decode_seed', 7, 'Decoding: seed of the sampling noise.')
    return p

  def ComputeLoss(self, theta, predictions, input_batch):
    metrics, per_example = super().ComputeLoss(theta, predictions, input_batch)
    loss, num_scored = metrics['loss']
    metrics['bits_per_byte'] = (loss / LN2, num_scored)
    return metrics, per_example

  # -- Sampling through the pipeline. ----------------------------------------

  def Pick(self, logits, position):
    """The byte the sampler takes from logits [b, vocab] at `position` (the
    position fed; the byte goes to position + 1): the argmax of _Ranked."""
    return tf.argmax(self._Ranked(logits, position), -1,
                     output_type=tf.int32)

  def _Ranked(self, logits, position):
    """logits [b, vocab] as the sampler ranks them: EOD never taken, then
    (temperature T > 0) logits / T + Gumbel noise seeded by (decode_seed,
    position)."""
    p = self.params
    logits = logits + tf.one_hot(text_input.EOD_ID, p.vocab_size,
                                 on_value=-1e9, dtype=logits.dtype)
    if not p.decode_temperature:
      return logits
    return self._Perturbed(logits, position)

  def _Perturbed(self, logits, position):
    p = self.params
    seed = tf.stack([tf.constant(p.decode_seed, tf.int32),
                     tf.cast(position, tf.int32)])
    uniform = tf.random.stateless_uniform(py_utils.GetShape(logits), seed,
                                          minval=1e-20, maxval=1.0)
    return logits / p.decode_temperature - tf.math.log(-tf.math.log(uniform))

  def Sample(self, theta, prompt, num_tokens):
    """prompt [b, P] -> num_tokens sampled bytes [b, num_tokens], decoded
    incrementally through the pipelined stack (per-stage caches)."""
    return self.GreedyDecode(theta, prompt, num_tokens, pick=self.Pick)

  def FullSequencePicks(self, theta, prompts, sampled):
    """What the sampler picks after each sampled prefix, from one causal
    full-sequence FProp over prompts + sampled (no caches): equal to
    `sampled` at every position iff the sampled bytes are what the model
    samples (by induction over the prefixes).

    Returns:
      (picks [b, L], margin [b, L]: the top perturbed logit minus the
      runner-up, to tell a disagreement from a tie).
    """
    prompt_len = py_utils.GetShape(prompts)[1]
    num_tokens = py_utils.GetShape(sampled)[1]
    ids = tf.concat([prompts, sampled[:, :-1]], axis=1)
    logits = self.PredictedLogits(theta, self.ComputePredictions(
        theta, py_utils.NestedMap(ids=ids,
                                  paddings=tf.zeros(py_utils.GetShape(ids)))))
    picks, margins = [], []
    for k in range(num_tokens):
      position = prompt_len - 1 + k
      scored = self._Ranked(logits[:, position], position)
      top2, _ = tf.math.top_k(scored, k=2)
      picks.append(tf.argmax(scored, -1, output_type=tf.int32))
      margins.append(top2[:, 0] - top2[:, 1])
    return tf.stack(picks, 1), tf.stack(margins, 1)

  # -- Lingvo's decoder job (--job=decoder_dev). -------------------------------

  def Decode(self, input_batch):
    """Samples continuations of held-out prompts (decode_prompt_len bytes)."""
    p = self.params
    prompts = input_batch.ids[:, :p.decode_prompt_len]
    return py_utils.NestedMap(
        prompts=prompts,
        decoded=self.Sample(self.theta, prompts, p.decode_num_tokens),
        targets=input_batch.labels[:, p.decode_prompt_len - 1:
                                   p.decode_prompt_len - 1 +
                                   p.decode_num_tokens])

  def CreateDecoderMetrics(self):
    return {'num_samples_in_batch': metrics_lib.AverageMetric()}

  def PostProcessDecodeOut(self, decode_out_dict, decode_metrics_dict):
    """(prompt, sampled continuation) as text, one pair per window."""
    decoded = decode_out_dict['decoded']
    decode_metrics_dict['num_samples_in_batch'].Update(len(decoded))
    return [(Text(prompt), Text(tokens))
            for prompt, tokens in zip(decode_out_dict['prompts'], decoded)]


def Text(tokens):
  """Token ids as printable text: the bytes as UTF-8 (bad sequences and
  control characters but new lines and tabs replaced by U+FFFD), EOD as a
  new line."""
  data = bytes(b if b < text_input.NUM_BYTES else 10 for b in tokens)
  return ''.join(c if c.isprintable() or c in '\n\t' else '\ufffd'
                 for c in data.decode('utf-8', errors='replace'))


def TextLMParams(*, seq_len, model_dim, num_heads, hidden_dim,
                 blocks_per_stage, num_stages, circular_repeat,
                 num_microbatches, learning_rate, max_steps,
                 dropout_prob=0.0, warmup=50, decay_steps=None):
  """Task params of the byte-level text LM (without input params).

  The stage body is the batch-major pre-LN block of the pod LMs
  (pod_blocks.PodBlockParams) with rotary position embeddings, its output
  projections scaled by depth (depth_scaled_init): the recipe under which
  a deeper stack learns faster per step (docs/text-depth.md).
  The learning rate ramps up over `warmup` steps, then (with decay_steps)
  decays exponentially to a tenth of itself at step decay_steps.
  """
  p = lm_params.CopyLMParams(
      name='text_lm', vocab_size=text_input.VOCAB_SIZE, model_dim=model_dim,
      num_heads=num_heads, hidden_dim=hidden_dim,
      blocks_per_stage=blocks_per_stage, num_stages=num_stages,
      circular_repeat=circular_repeat, num_microbatches=num_microbatches,
      dropout_prob=dropout_prob, shard_stages_1d=False,
      learning_rate=learning_rate, max_steps=max_steps, max_seq_len=seq_len,
      batch_major=True, rotary=True, task_cls=TextLMTask,
      # On one device the backward pass reads every activation kept, as the
      # plain stack's does: recomputing the attention's softmax over long
      # windows costs more (docs/benchmarks.md, the text LMs' row).
      stack_options=dict(remat_policy='save_all'))
  p.depth_scaled_init = True
  if decay_steps:
    p.train.lr_schedule = schedule.LinearRampupExponentialDecay.Params().Set(
        warmup=warmup, decay_start=warmup + 1, decay_end=decay_steps, min=0.1)
  else:
    p.train.lr_schedule.warmup = warmup
  p.decode_prompt_len = min(p.decode_prompt_len, seq_len // 2)
  p.decode_num_tokens = min(p.decode_num_tokens,
                            seq_len - p.decode_prompt_len + 1)
  return p


def HeldOut(train_p):
  """The held-out set's input params of a training input's params."""
  p = train_p.Copy().Set(split='held_out')
  return p.Set(num_samples=p.held_out_windows)
