"""A trained text LM on its held-out text: bits per byte, compressors, a sample.

What the demo prints after training a byte-level LM (params/text_lm.py):

- the model's bits per byte on the held-out windows (the input generator's
  `HeldOutWindows`, each distinct window once), from a checkpoint, in eval
  mode (no dropout), the stack pipelined;
- `gzip -9` and `xz -9` on the same bytes (the windows' scored bytes in
  order, `HeldOutBytes`), with Python's gzip and lzma modules: the bits of
  their output over the bytes of their input;
- a continuation of a held-out prompt sampled through the pipeline one byte
  at a time (the task's `Sample`), checked against the picks of one
  full-sequence FProp over the sampled bytes (`FullSequencePicks`).

The task and its input generator are used through these methods only (no
import of the model zoo).
"""

import dataclasses
import gzip
import lzma
import math
import time

import numpy as np
import tensorflow as tf

from gpipe.lingvo_support import flags_and_seeds
from lingvo.core import cluster_factory
from lingvo.core import py_utils


def BitsPerByte(nats, weights):
  """Bits per scored byte: sum(nats * weights) / sum(weights) / ln 2.

  nats: the cross-entropy of each position (natural log); weights: 1 where
  the label is a byte of text, 0 elsewhere.
  """
  nats, weights = np.asarray(nats, np.float64), np.asarray(weights, np.float64)
  return float((nats * weights).sum() / weights.sum() / math.log(2.0))


def CompressorBitsPerByte(data):
  """{'gzip -9': bits per byte, 'xz -9': bits per byte} of compressing data
  (bytes) whole: 8 x compressed size / size."""
  return {'gzip -9': 8 * len(gzip.compress(data, compresslevel=9)) / len(data),
          'xz -9': 8 * len(lzma.compress(data, preset=9)) / len(data)}


@dataclasses.dataclass
class HeldOutReport:
  """The held-out figures of a checkpoint (see the module docstring)."""
  step: int
  num_bytes: int
  bits_per_byte: float
  compressors: dict  # {'gzip -9': bpb, 'xz -9': bpb} on the same bytes
  prompt: str
  sample: str
  sample_agreement: float  # sampled bytes the full-sequence FProp picks too
  largest_margin_where_different: float  # ~0: a tie, not a disagreement
  seconds: float

  def Agrees(self, tie=1e-4):
    return self.largest_margin_where_different <= tie

  def Describe(self):
    baselines = ', '.join(f'{name} {bpb:.3f}'
                          for name, bpb in self.compressors.items())
    return (f'held-out bits per byte at step {self.step}: '
            f'{self.bits_per_byte:.3f} on {self.num_bytes:,} bytes '
            f'(same bytes: {baselines}) [{self.seconds:.1f} s]\n'
            f'sampled through the pipeline, byte by byte (equal to the '
            f'full-sequence picks: {self.sample_agreement:.3f} of bytes):\n'
            f'--- prompt (held-out) ---\n{self.prompt}\n'
            f'--- sampled continuation ---\n{self.sample}\n---')


def EvaluateHeldOut(cfg, logdir, text, sample=True):
  """The HeldOutReport of the latest checkpoint in logdir.

  Args:
    cfg: the model's params with its held-out input (e.g. 'Test').
    logdir: where the checkpoint is.
    text: token ids [n] -> str (the task module's `Text`).
    sample: also sample a continuation (through the pipeline: the stack
      must not be unrolled); False: the report's sample is empty.
  """
  flags_and_seeds.EnsureFlagsParsed()
  latest = tf.train.latest_checkpoint(logdir)
  if not latest:
    raise ValueError(f'No checkpoint in {logdir} to evaluate.')
  began = time.time()
  graph = tf.Graph()
  with graph.as_default(), cluster_factory.SetEval(True):
    model = cfg.Instantiate()
    task = model.GetTask()
    generator = task.input_generator
    windows = generator.Windows(_Distinct(generator.HeldOutWindows()))
    batch_size = generator.params.batch_size
    holder = tf.compat.v1.placeholder(tf.int32, [batch_size, windows.shape[1]])
    nats = _Nats(task, holder)
    prompt_len = task.params.decode_prompt_len
    prompts = holder[:, :prompt_len]
    if sample:
      sampled = task.Sample(task.theta, prompts,
                            task.params.decode_num_tokens)
      picks, margin = task.FullSequencePicks(task.theta, prompts, sampled)
    else:
      sampled = picks = margin = tf.zeros([batch_size, 0])
    saver = tf.compat.v1.train.Saver()
    with tf.compat.v1.Session(graph=graph) as sess:
      saver.restore(sess, latest)
      step = int(sess.run(model.global_step))
      all_nats, all_weights = [], []
      for rows, count in _Batches(windows, batch_size):
        all_nats.append(sess.run(nats, {holder: rows})[:count])
        all_weights.append(generator.BatchOf(rows[:count]).weights)
      prompt = _Prompt(task, generator)
      rows = np.zeros(py_utils.GetShape(holder), np.int32)
      rows[:, :len(prompt)] = prompt
      sampled_v, picks_v, margin_v = sess.run([sampled, picks, margin],
                                              {holder: rows})
  differ = sampled_v != picks_v
  return HeldOutReport(
      step=step, num_bytes=int(np.concatenate(all_weights).sum()),
      bits_per_byte=BitsPerByte(np.concatenate(all_nats),
                                np.concatenate(all_weights)),
      compressors=CompressorBitsPerByte(generator.HeldOutBytes()),
      prompt=text(prompt), sample=text(sampled_v[0]),
      sample_agreement=float(1 - differ.mean()) if differ.size else 1.0,
      largest_margin_where_different=float(margin_v[differ].max())
      if differ.any() else 0.0,
      seconds=time.time() - began)


def _Prompt(task, generator):
  """The held-out prompt [decode_prompt_len] the sample continues: from the
  first held-out line that begins with the task's decode_prompt_line."""
  p = task.params
  return generator.HeldOutPrompt(p.decode_prompt_len,
                                 p.decode_prompt_line.encode())


def _Nats(task, windows):
  """The task's cross-entropy [b, n] of each label of windows [b, n + 1]."""
  batch = py_utils.NestedMap(ids=windows[:, :-1],
                             paddings=tf.zeros(tf.shape(windows[:, 1:])))
  logits = task.PredictedLogits(task.theta,
                                task.ComputePredictions(task.theta, batch))
  return tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=windows[:, 1:], logits=logits)


def _Distinct(indices):
  """indices without repeats, in their first order."""
  _, first = np.unique(indices, return_index=True)
  return np.asarray(indices)[np.sort(first)]


def _Batches(windows, batch_size):
  """(rows [batch_size, ...], count) of windows in batches: the last batch
  filled up with copies of its first row, only its first `count` real."""
  for begin in range(0, len(windows), batch_size):
    rows = windows[begin:begin + batch_size]
    count = len(rows)
    yield np.concatenate(
        [rows, np.repeat(rows[:1], batch_size - count, axis=0)]), count
