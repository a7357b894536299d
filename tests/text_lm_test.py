"""params/text_lm.py and gpipe/apps/held_out_text.py: the byte-level text LM.

Its bits per byte against a NumPy log-softmax of its own logits, sampling
through the pipeline against sampling by full-sequence FProps of the plain
stack, and a short training run on text.
"""

import math

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe.apps import held_out_text
from gpipe.apps import trainer
from gpipe.lingvo_support import flags_and_seeds
from gpipe.lingvo_support import registered_models
from lingvo.core import base_model
from lingvo.core import py_utils
import params.lm  # pylint: disable=unused-import  (registers the models)
from params import text_input
from params import text_lm
from tests import lm_params_test

flags_and_seeds.EnsureFlagsParsed()

_TEXT = (b'def add(a, b):\n  return a + b\n\n'
         b'def sub(a, b):\n  return a - b\n\n') * 8


@pytest.fixture(name='text_files')
def fixture_text_files(tmp_path):
  for i in range(3):
    (tmp_path / f'm{i}.py').write_bytes(_TEXT[i:])
  (tmp_path / 'held.py').write_bytes(_TEXT[::-1])
  return str(tmp_path / '*.py')


def TinyTextCfg(pattern, *, seq_len=16, batch_size=4, learning_rate=3e-3,
                **task):
  p = text_lm.TextLMParams(
      seq_len=seq_len, model_dim=16, num_heads=2, hidden_dim=32,
      blocks_per_stage=1, num_stages=2, circular_repeat=2,
      num_microbatches=2, learning_rate=learning_rate, max_steps=100,
      warmup=5)
  p.Set(**task)
  cfg = base_model.SingleTaskModel.Params(p)
  cfg.input = text_input.TextInput.Params().Set(
      file_pattern=pattern, held_out_patterns=['held.py'], seq_len=seq_len,
      batch_size=batch_size)
  return cfg


def test_bits_per_byte_is_the_numpy_log_softmax_over_scored_bytes(text_files):
  """The task's metric and the demo's arithmetic, against log2 of a NumPy
  softmax of the model's logits, EOD labels left out."""
  cfg = TinyTextCfg(text_files)
  graph, task, sess = lm_params_test.BuildTask(cfg, 'never')
  gen = task.input_generator
  windows = gen.Windows(range(4))
  windows[1, 5] = text_input.EOD_ID  # an EOD label (not scored)
  with graph.as_default():
    batch = py_utils.NestedMap(gen.BatchOf(windows)).Transform(tf.constant)
    predictions = task.ComputePredictions(task.theta, batch)
    metrics, _ = task.ComputeLoss(task.theta, predictions, batch)
    holder = tf.compat.v1.placeholder(tf.int32, windows.shape)
    nats = held_out_text._Nats(task, holder)  # pylint: disable=protected-access
    logits, metric, nats_v = sess.run(
        [predictions.logits, metrics['bits_per_byte'][0], nats],
        {holder: windows})
  sess.close()
  logits = logits.astype(np.float64)
  log2_p = (logits - logits.max(-1, keepdims=True)) / math.log(2)
  log2_p -= np.log2(np.exp2(log2_p).sum(-1, keepdims=True))
  labels = windows[:, 1:]
  bits = -np.take_along_axis(log2_p, labels[..., None], -1)[..., 0]
  scored = labels != text_input.EOD_ID
  want = bits[scored].mean()
  assert metric == pytest.approx(want, rel=1e-5)
  assert held_out_text.BitsPerByte(nats_v, scored) == pytest.approx(
      want, rel=1e-5)


def test_compressor_figures_are_output_bits_over_input_bytes():
  data = _TEXT * 4
  got = held_out_text.CompressorBitsPerByte(data)
  # Repetitive text compresses well; the figures are in bits (8 x bytes).
  assert 0 < got['xz -9'] < 8 and 0 < got['gzip -9'] < 8
  assert got['gzip -9'] * len(data) % 8 == 0


def test_sampling_through_the_pipeline_equals_full_sequence_sampling(
    text_files, temperature=0.7):
  """Bytes sampled one ExtendStep at a time through the pipeline (per-stage
  caches) equal the bytes picked from full-sequence FProps of the plain
  stack (unroll='always') with the same Gumbel noise at each position."""
  cfg = TinyTextCfg(text_files, decode_temperature=temperature,
                    decode_seed=11)
  graph, task, sess = lm_params_test.BuildTask(cfg, 'never')
  prompts_np = task.input_generator.Windows(range(4))[:, :6]
  with graph.as_default():
    values = trainer.InitialValues(sess, task)
    sampled_t = task.Sample(task.theta, tf.constant(prompts_np), 9)
    sampled = sess.run(sampled_t)
  sess.close()
  ref_graph, ref_task, ref_sess = lm_params_test.BuildTask(cfg, 'always',
                                                           values)
  with ref_graph.as_default():
    ids = tf.compat.v1.placeholder(tf.int32, [4, None])
    logits = ref_task.ComputePredictions(ref_task.theta, py_utils.NestedMap(
        ids=ids, paddings=tf.zeros(tf.shape(ids), tf.float32))).logits
    seq = prompts_np
    for position in range(5, 5 + 9):
      column = ref_sess.run(logits, {ids: seq})[:, position].astype(np.float64)
      column[:, text_input.EOD_ID] = -np.inf
      if temperature:
        uniform = ref_sess.run(tf.random.stateless_uniform(
            [4, text_input.VOCAB_SIZE], [11, position], minval=1e-20,
            maxval=1.0))
        column = column / temperature - np.log(-np.log(uniform))
      seq = np.concatenate([seq, column.argmax(-1)[:, None]], axis=1)
  ref_sess.close()
  np.testing.assert_array_equal(sampled, seq[:, 6:])
  assert (sampled < 256).all()


@pytest.mark.runs_long
def test_a_short_training_run_lowers_the_held_out_bits(text_files, tmp_path):
  cfg = TinyTextCfg(text_files, learning_rate=1e-2)
  history = trainer.Train(cfg, steps=25, logdir=str(tmp_path / 'run'))
  first = np.mean([r.loss for r in history[:3]])
  last = np.mean([r.loss for r in history[-3:]])
  assert last < 0.6 * first, (first, last)
  held = cfg.Copy()
  held.input = text_lm.HeldOut(cfg.input).Set(held_out_windows=8)
  report = held_out_text.EvaluateHeldOut(held, str(tmp_path / 'run'),
                                         text_lm.Text)
  assert report.step == 25
  assert report.bits_per_byte < 0.6 * first / math.log(2)
  assert report.Agrees() and report.sample_agreement == 1.0
  assert report.num_bytes > 0 and set(report.compressors) == {'gzip -9',
                                                               'xz -9'}


def test_one_override_points_every_job_at_the_users_files(tmp_path):
  """`--model_params_override='input.file_pattern: ...'` reaches the
  training and the held-out inputs alike (Lingvo's registry applies it to
  every dataset's params), and the held-out files are then split off by
  the path hash (the stdlib's package patterns match none of them)."""
  for i in range(4):
    (tmp_path / f'note{i}.txt').write_bytes(_TEXT[i:] * 2)
  pattern = str(tmp_path / '*.txt')
  # Set and restored by hand: the flag object is shared by every test of
  # the process (monkeypatch's undo deletes an absl flag).
  flags = tf.compat.v1.flags.FLAGS
  before = flags.model_params_override
  flags.model_params_override = f'input.file_pattern: "{pattern}"'
  try:
    train = registered_models.GetParams('lm.TextLMSmall', 'Train').input
    test = registered_models.GetParams('lm.TextLMSmall', 'Test').input
  finally:
    flags.model_params_override = before
  assert train.file_pattern == test.file_pattern == pattern
  assert (train.split, test.split) == ('train', 'held_out')
  assert registered_models.GetParams(
      'lm.TextLMSmall', 'Train').input.file_pattern != pattern
  with tf.Graph().as_default():
    gen = train.Set(seq_len=16).Instantiate()
  assert len(gen.held_out_files) == 1 and len(gen.train_files) == 3


def _StackChange(cfg, repeat):
  """{scale: RMS of (stack(x) - x) / RMS of x} at init, for x of RMS 1 and
  of RMS 30 (one batch: a block mixes positions within an example only):
  what the blocks add to the residual stream, unrolled, R = repeat."""
  c = cfg.Copy()
  c.task.stack.Set(circular_repeat=repeat, unroll='always')
  scales = (1.0, 30.0)
  with tf.Graph().as_default():
    tf.compat.v1.random.set_random_seed(3)
    task = c.task.Instantiate()
    x = tf.concat([s * tf.random.stateless_normal([4, 16, 16], [1, 2])
                   for s in scales], 0)
    y, _ = task.stack.FProp(task.theta.stack, x, tf.zeros([8, 16]))
    rms = lambda t: tf.sqrt(tf.reduce_mean(tf.reshape(tf.square(t),
                                                     [len(scales), -1]), 1))
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      return dict(zip(scales, sess.run(rms(y - x) / rms(x))))


def test_the_recipe_adds_to_the_residual_stream_as_much_at_any_depth(
    text_files):
  """What lets depth help (docs/text-depth.md), at init: each block adds
  to its unnormalized input (a large input passes through almost as it is,
  where a block that re-normalizes its residual, Lingvo's time-major
  default, would replace it), and the blocks' output projections are
  scaled by 1 / sqrt(2 x blocks), so 8 blocks (2 stages x R 4) add about
  what 2 add (unscaled, their sum grows with depth)."""
  cfg = TinyTextCfg(text_files)
  shallow, deep = _StackChange(cfg, 1), _StackChange(cfg, 4)
  assert deep[30.0] < 0.05 and shallow[30.0] < 0.05, (shallow, deep)
  assert deep[1.0] < 1.25 * shallow[1.0], (shallow, deep)
  cfg.task.depth_scaled_init = False
  unscaled = [_StackChange(cfg, r)[1.0] for r in (1, 4)]
  assert unscaled[1] > 1.5 * unscaled[0], unscaled
