"""The copy task's data: random sequences to copy, a function of the step.

Each sequence is L random tokens, SEP, the same L tokens again; the LM is
scored on the copy (params/lm.py's docstring has the task).
"""

from lingvo import compat as tf
from lingvo.core import base_input_generator
from lingvo.core import py_utils

PAD_ID = 0
SEP_ID = 1
FIRST_TOKEN_ID = 2


class CopyTaskInput(base_input_generator.BaseInputGenerator):
  """Random sequences to copy, a deterministic function of the global step.

  Batch b of step s is the same however training was interrupted and
  resumed, so a restored checkpoint continues on exactly the data it would
  have seen.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('vocab_size', 16, 'Vocabulary, including PAD and SEP.')
    p.Define('copy_length', 8, 'L: tokens to copy; sequences are 2L long.')
    p.Define('data_seed', 1234, 'Seed of the stateless random tokens.')
    p.Define('held_out_batches', 0,
             '0: training data, batch b of global step s (see the class '
             'doc). N > 0: a fixed held-out set of N batches (Dev, Test), '
             'read in turn, cyclically.')
    p.batch_size = 32
    return p

  def __init__(self, params):
    super().__init__(params)
    self.ValidateParams(self.params)
    self._held_out_counter = None  # see _NextHeldOutIndex

  @classmethod
  def ValidateParams(cls, p):
    if p.vocab_size <= FIRST_TOKEN_ID:
      raise ValueError(f'CopyTaskInput: vocab_size={p.vocab_size} leaves no '
                       f'tokens besides PAD and SEP; use at least '
                       f'{FIRST_TOKEN_ID + 1}.')
    if p.copy_length < 1:
      raise ValueError(f'CopyTaskInput: copy_length={p.copy_length} must be '
                       'at least 1.')
    if p.batch_size < 1:
      raise ValueError(f'CopyTaskInput: batch_size={p.batch_size} must be '
                       'at least 1.')
    if p.held_out_batches < 0:
      raise ValueError(f'CopyTaskInput: held_out_batches='
                       f'{p.held_out_batches} must be 0 (training data) or '
                       'the number of held-out batches.')

  @classmethod
  def SequenceLength(cls, p):
    """(tokens a row, what sets it), for the task's checks."""
    return 2 * p.copy_length, '2 * input.copy_length'

  @classmethod
  def VocabSize(cls, p):
    return p.vocab_size

  def _InputBatch(self):
    p = self.params
    if p.held_out_batches:
      index = self._NextHeldOutIndex()
    else:
      index = tf.cast(_GlobalStepOrZero(), tf.int64)
    seed = tf.stack([tf.constant(p.data_seed, tf.int64), index])
    return MakeCopyBatch(seed, p.batch_size, p.copy_length, p.vocab_size)

  def _NextHeldOutIndex(self):
    """0, 1, ..., N - 1, 0, ... one per read (session run, or eager call).

    Any N consecutive reads are the whole held-out set once, whichever batch
    they start from: the evaler and decoder read num_samples = N batches
    per checkpoint. The counter is a local variable (not checkpointed),
    made once per input generator.
    """
    if self._held_out_counter is None:
      self._held_out_counter = tf.Variable(
          tf.constant(0, tf.int64), trainable=False, name='held_out_batch',
          collections=[tf.GraphKeys.LOCAL_VARIABLES])
    taken = self._held_out_counter.assign_add(1, use_locking=True) - 1
    return tf.math.floormod(taken, self.params.held_out_batches)


def MakeCopyBatch(seed, batch_size, copy_length, vocab_size):
  """The copy-task batch for a [2] int64 stateless seed (see module doc)."""
  tokens = tf.random.stateless_uniform([batch_size, copy_length], seed,
                                       minval=FIRST_TOKEN_ID,
                                       maxval=vocab_size, dtype=tf.int32)
  sep = tf.fill([batch_size, 1], SEP_ID)
  ids = tf.concat([tokens, sep, tokens], axis=1)
  seq_len = 2 * copy_length
  weights = tf.concat([tf.zeros([batch_size, copy_length]),
                       tf.ones([batch_size, copy_length])], axis=1)
  return py_utils.NestedMap(
      ids=ids[:, :seq_len],
      labels=ids[:, 1:],
      weights=weights,
      paddings=tf.zeros([batch_size, seq_len]))


def _GlobalStepOrZero():
  step = py_utils.GetGlobalStep()
  return tf.constant(0, tf.int64) if step is None else step
