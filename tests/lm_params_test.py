"""The Lingvo model params in params/lm.py, the trainer and the demo.

The copy task's data, the registered params, their checks, the pipelined
model against the unrolled one (at init, causal, decoding step by step),
training, checkpoints, events and held-out decoding (gpipe.apps.trainer),
and the demo. TinyCfg is the small model the lm_*_test.py modules share;
the pod configs' stage body is tested in lm_pod_body_test.py.
"""

import glob
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe.apps import trainer
from gpipe import demo
from gpipe.lingvo_support import flags_and_seeds
from gpipe.pipeline import layer_by_layer
from lingvo import model_registry
from lingvo.core import base_model
from lingvo.core import py_utils
import params.lm as lm
from params import pod_blocks
from tests import sessions

flags_and_seeds.EnsureFlagsParsed()

_ROOT = pathlib.Path(__file__).resolve().parent.parent


def TinyCfg(*, num_stages=2, circular_repeat=1, num_microbatches=3,
            batch_size=6, dropout_prob=0.0, copy_length=3, vocab_size=8,
            learning_rate=3e-3, model_dim=16, max_steps=100,
            shard_stages_1d=False, **body):
  """body: CopyLMParams' batch_major, fprop_dtype, stack_dtype, ..."""
  task = lm.CopyLMParams(
      vocab_size=vocab_size, model_dim=model_dim, num_heads=2, hidden_dim=32,
      blocks_per_stage=1, num_stages=num_stages,
      circular_repeat=circular_repeat, num_microbatches=num_microbatches,
      dropout_prob=dropout_prob, shard_stages_1d=shard_stages_1d,
      learning_rate=learning_rate, max_steps=max_steps,
      max_seq_len=2 * copy_length, **body)
  cfg = base_model.SingleTaskModel.Params(task)
  cfg.input = lm.CopyTaskInput.Params().Set(
      vocab_size=vocab_size, copy_length=copy_length, batch_size=batch_size)
  return cfg


# -- The data. ----------------------------------------------------------------


def test_copy_batch_scores_exactly_the_copied_half():
  length = 5
  with tf.Graph().as_default():
    batch = lm.MakeCopyBatch(tf.constant([3, 7], tf.int64), 4, length, 11)
    with tf.compat.v1.Session() as sess:
      b = sess.run(batch)
  tokens = b.ids[:, :length]
  assert b.ids.shape == b.labels.shape == b.weights.shape == (4, 2 * length)
  assert ((tokens >= lm.FIRST_TOKEN_ID) & (tokens < 11)).all()
  np.testing.assert_array_equal(b.ids[:, length], np.full(4, lm.SEP_ID))
  np.testing.assert_array_equal(b.labels[:, :length - 1], tokens[:, 1:])
  np.testing.assert_array_equal(b.labels[:, length - 1], np.full(4, lm.SEP_ID))
  np.testing.assert_array_equal(b.labels[:, length:], tokens)
  np.testing.assert_array_equal(b.weights[:, :length], 0)
  np.testing.assert_array_equal(b.weights[:, length:], 1)
  np.testing.assert_array_equal(b.paddings, 0)


def test_copy_batch_depends_only_on_the_seed():
  with tf.Graph().as_default():
    seed = tf.compat.v1.placeholder(tf.int64, [2])
    ids = lm.MakeCopyBatch(seed, 4, 6, 50).ids
    with tf.compat.v1.Session() as sess:
      a, b, c = (sess.run(ids, {seed: s}) for s in ([1, 5], [1, 5], [1, 6]))
  np.testing.assert_array_equal(a, b)
  assert (a != c).any()


# -- Registered params. -------------------------------------------------------


def test_registered_models_are_found_by_name():
  for name in ('lm.CopyLMSmall', 'lm.CopyLMPod8x2', 'lm.CopyLMPod8x2Adafactor'):
    cfg = model_registry.GetParams(name, 'Train')
    assert cfg.task.cls is lm.PipelinedLMTask
    assert cfg.input.cls is lm.CopyTaskInput


def test_pod_config_builds_its_graph_on_cpu_and_reports_bytes_per_device():
  # The forward graph only (about 20 s; with the backward pass, about 60 s).
  cfg = model_registry.GetParams('lm.CopyLMPod8x2', 'Train')
  sp = cfg.task.stack
  assert (sp.num_stages, sp.circular_repeat, sp.shard_stages_1d) == (8, 2, True)
  assert sp.single_stage_body.cls is pod_blocks.BatchMajorStage
  assert sp.single_stage_body.fprop_dtype == tf.bfloat16
  with tf.Graph().as_default():
    task = cfg.Instantiate().GetTask()
    metrics, _ = task.FPropDefaultTheta()
    assert metrics['loss'][0].shape.rank == 0
    total, per_device = lm.ParameterBytes(task)
    # Independently of ParameterBytes: from the variables' names and shapes.
    variables = task.vars.Flatten()
  stacked = vocab = replicated = 0
  for v in variables:
    assert v.dtype.base_dtype == tf.float32, v.name
    nbytes = int(np.prod(v.shape.as_list())) * 4
    if '/stack/' in v.name:
      assert v.shape.as_list()[:2] == [8, 2], v.name
      stacked += nbytes
    elif '/final_ln/' in v.name:
      replicated += nbytes
    else:  # embeddings and softmax, split by vocab (rows divide by 8)
      vocab += nbytes
  assert total == stacked + vocab + replicated
  assert per_device == replicated + (stacked + vocab) // 8
  num_params = total // 4
  assert 6e9 < num_params < 8e9, num_params
  print(f'CopyLMPod8x2: {num_params / 1e9:.2f}B parameters, '
        f'{total / 2**30:.1f} GiB; one of 8 devices holds '
        f'{per_device / 2**30:.2f} GiB')


# -- Fail fast. ---------------------------------------------------------------


@pytest.mark.parametrize('change, message', [
    (lambda c: c.input.Set(batch_size=7), 'num_microbatches=3'),
    (lambda c: c.input.Set(copy_length=9), 'max_seq_len'),
    (lambda c: c.input.Set(vocab_size=9), 'vocab_size'),
    (lambda c: c.input.Set(vocab_size=2), 'vocab_size=2'),
    (lambda c: c.task.stack.Set(circular_repeat=0), 'circular_repeat'),
    (lambda c: c.task.stack.Set(shard_stages_1d=True,
                                pipeline_stage_mesh_dim=0), 'shard_stages_1d'),
])
def test_bad_configs_fail_before_any_graph_is_built(change, message):
  cfg = TinyCfg()
  change(cfg)
  with tf.Graph().as_default() as graph:
    with pytest.raises(ValueError, match=message):
      cfg.task.cls.ValidateParams(cfg.task, cfg.input)
    assert not graph.get_operations()


def test_heads_must_divide_the_width():
  with pytest.raises(ValueError, match='num_heads=3'):
    lm.CopyLMParams(vocab_size=8, model_dim=16, num_heads=3, hidden_dim=8,
                    blocks_per_stage=1, num_stages=2, circular_repeat=1,
                    num_microbatches=2, dropout_prob=0.0,
                    shard_stages_1d=False, learning_rate=1e-3,
                    max_steps=10)


def test_demo_rejects_an_unknown_model_and_negative_steps(capsys):
  for argv, message in ((['--model', 'lm.Nope'], 'lm.CopyLMSmall'),
                        (['--steps', '-1'], '--steps')):
    with pytest.raises(SystemExit):
      demo.main(argv)
    assert message in capsys.readouterr().err


# -- Init equivalence. --------------------------------------------------------


def _Compared(cfg, reference, values):
  """trainer.CompareWithUnrolled of `cfg`'s pipelined model against an
  unrolled `reference` = (loss, {name: gradient}) already run at `values`."""
  c = cfg.Copy()
  c.task = trainer.WithoutDropout(c.task)
  c.task.stack.unroll = 'never'
  loss, grads, _ = trainer._LossAndGradients(c, values)  # pylint: disable=protected-access
  ref_loss, ref_grads = reference
  abs_diff = rel_diff = 0.0
  for name, ref in ref_grads.items():
    err = np.abs(grads[name] - ref)
    abs_diff = max(abs_diff, float(err.max()))
    rel_diff = max(rel_diff, float((err / np.maximum(np.abs(ref), 1)).max()))
  return trainer.Comparison(float(loss), float(ref_loss), abs_diff, rel_diff,
                            len(ref_grads))


def test_pipelined_lm_equals_unrolled_at_init():
  """S=2, R=1, M=3 (dropout on, which the comparison turns off): the
  pipelined model's loss and every gradient as the unrolled model's."""
  cfg = TinyCfg(num_stages=2, circular_repeat=1, num_microbatches=3,
                dropout_prob=0.1)
  comparison = trainer.CompareWithUnrolled(cfg)
  assert comparison.num_variables > 0
  assert comparison.Matches(), comparison.Describe()


@pytest.mark.runs_long
def test_circular_lm_on_the_schedule_and_layer_by_layer_equals_unrolled(
    monkeypatch):
  """Circular, S=2, R=2, M=3: the pipelined model run on the schedule, and
  its Transformer blocks run layer by layer (each on all microbatches at
  once), each have the loss and every gradient of the unrolled model at
  the same weights (one unrolled run, the reference of both)."""
  cfg = TinyCfg(num_stages=2, circular_repeat=2, num_microbatches=3,
                dropout_prob=0.1)
  unrolled = cfg.Copy()
  unrolled.task = trainer.WithoutDropout(unrolled.task)
  unrolled.task.stack.unroll = 'always'
  ref_loss, ref_grads, values = trainer._LossAndGradients(unrolled, None)  # pylint: disable=protected-access
  reference = (ref_loss, ref_grads)
  ran = []
  run = layer_by_layer.RunLayerByLayer
  monkeypatch.setattr(layer_by_layer, 'RunLayerByLayer',
                      lambda *a: ran.append(1) or run(*a))
  on_schedule = _Compared(cfg, reference, values)
  assert not ran, 'the schedule ran layer by layer'
  layered = cfg.Copy()
  layered.task.stack.layer_by_layer = True
  by_layer = _Compared(layered, reference, values)
  assert ran, 'the pipelined stack did not run layer by layer'
  for comparison in (on_schedule, by_layer):
    assert comparison.num_variables > 0
    assert comparison.Matches(), comparison.Describe()


def test_without_dropout_zeroes_every_dropout_param():
  p = trainer.WithoutDropout(TinyCfg(dropout_prob=0.3).task)
  seen = []

  def Walk(params):
    for name, value in params.IterParams():
      if hasattr(value, 'IterParams'):
        Walk(value)
      elif name.endswith('dropout_prob') or name == 'keep_prob':
        seen.append((name, value))

  Walk(p)
  assert seen
  assert all(v == (1.0 if n == 'keep_prob' else 0.0) for n, v in seen), seen


# -- Causality and incremental decoding. --------------------------------------


def BuildTask(cfg, unroll, values=None):
  """A fresh graph with the task (stack unroll as given), its variables
  initialized or, given their `values` ({name: value}), loaded, and a
  session running the graph as built."""
  c = cfg.Copy()
  c.task.stack.unroll = unroll
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.random.set_random_seed(1)
    task = c.Instantiate().GetTask()
  sess = sessions.AsBuilt(graph)
  with graph.as_default():
    sess.run(tf.compat.v1.global_variables_initializer())
    if values is not None:
      trainer.LoadValues(sess, task.vars.Flatten(), values)
  return graph, task, sess


def _FullSequenceLogitsFn(graph, task, sess, shape):
  """ids [b, t] -> the task's full-sequence logits, one graph for all."""
  with graph.as_default():
    ids = tf.compat.v1.placeholder(tf.int32, shape)
    logits = task.ComputePredictions(task.theta, py_utils.NestedMap(
        ids=ids, paddings=tf.zeros(shape))).logits
  return lambda ids_np: sess.run(logits, {ids: ids_np})


def test_the_lm_is_causal():
  """Logits at position i do not change when tokens after i do."""
  graph, task, sess = BuildTask(TinyCfg(), 'never')
  logits_of = _FullSequenceLogitsFn(graph, task, sess, [6, 6])
  rng = np.random.RandomState(0)
  ids = rng.randint(2, 8, [6, 6]).astype(np.int32)
  changed = ids.copy()
  changed[:, 3:] = (ids[:, 3:] - 2 + 1) % 6 + 2  # every later token differs
  before, after = logits_of(ids), logits_of(changed)
  sess.close()
  np.testing.assert_allclose(after[:, :3], before[:, :3], rtol=1e-6, atol=1e-6)
  assert np.abs(after[:, 3:] - before[:, 3:]).max() > 1e-3


@pytest.mark.runs_long
@pytest.mark.parametrize(
    'num_stages, circular_repeat, num_microbatches, batch_major', [
        (2, 1, 3, False), (3, 2, 2, False), (4, 2, 6, False),
        (2, 2, 3, True)])
def test_decoding_through_the_pipeline_equals_the_unrolled_model(
    num_stages, circular_repeat, num_microbatches, batch_major):
  """Step-by-step logits (one ExtendStep per position, per-stage caches in
  the pipeline) equal the unrolled model's full-sequence causal logits, and
  the task's greedy Decode equals greedy decoding by full-sequence FProps of
  the unrolled model, token by token. batch_major: the pod configs' body."""
  cfg = TinyCfg(num_stages=num_stages, circular_repeat=circular_repeat,
                num_microbatches=num_microbatches, batch_major=batch_major)
  graph, task, sess = BuildTask(cfg, 'never')
  rng = np.random.RandomState(1)
  ids_np = rng.randint(2, 8, [6, 6]).astype(np.int32)
  with graph.as_default():
    values = trainer.InitialValues(sess, task)
    # One decoding step, run position by position with the states fed back.
    states0 = task.InitDecodeStates(task.theta, 6)
    flat0 = sess.run(tf.nest.flatten(states0))
    holders = [tf.compat.v1.placeholder(x.dtype, x.shape) for x in flat0]
    ids_t = tf.compat.v1.placeholder(tf.int32, [6])
    t = tf.compat.v1.placeholder(tf.int32, [])
    logits, states = task.ExtendStep(
        task.theta, ids_t, t, tf.nest.pack_sequence_as(states0, holders))
    flat, steps = flat0, []
    for position in range(6):
      feed = dict(zip(holders, flat))
      feed.update({ids_t: ids_np[:, position], t: position})
      step_logits, flat = sess.run([logits, tf.nest.flatten(states)], feed)
      steps.append(step_logits)
    # Copy length 3: prompts are the first 4 ids, 3 tokens are decoded.
    decoded = sess.run(task.Decode(py_utils.NestedMap(
        ids=tf.constant(ids_np), labels=tf.constant(ids_np)))).decoded
  sess.close()
  ref_graph, ref_task, ref_sess = BuildTask(cfg, 'always', values)
  reference = _FullSequenceLogitsFn(ref_graph, ref_task, ref_sess, [6, 6])
  np.testing.assert_allclose(np.stack(steps, axis=1), reference(ids_np),
                             rtol=1e-5, atol=1e-5)
  # Greedy reference: full-sequence FProps of the unrolled model.
  seq = np.concatenate([ids_np[:, :4], np.zeros([6, 3], np.int32)], axis=1)
  for k in range(3):
    seq[:, 4 + k] = reference(seq[:, :6])[:, 3 + k].argmax(-1)
  ref_sess.close()
  np.testing.assert_array_equal(decoded, seq[:, 4:])


# -- Training and checkpoints. ------------------------------------------------


def test_training_lowers_the_loss():
  cfg = TinyCfg(learning_rate=1e-2, model_dim=32)
  history = trainer.Train(cfg, steps=80)
  first = np.mean([r.loss for r in history[:5]])
  last = np.mean([r.loss for r in history[-5:]])
  assert last < 0.5 * first, (first, last)


def _EventScalars(logdir):
  """{tag: {step: value}} of the scalars in logdir's event files."""
  tags = {}
  for path in sorted(glob.glob(os.path.join(logdir, 'events.out.tfevents.*'))):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.HasField('simple_value'):
          tags.setdefault(value.tag, {})[event.step] = value.simple_value
        elif value.HasField('image'):
          tags.setdefault(value.tag, {})[event.step] = 'image'
  return tags


@pytest.mark.runs_long
def test_resuming_events_and_decoding_with_dropout(tmp_path):
  """One uninterrupted run (dropout on) owes three things.

  Resuming from its step-3 checkpoint continues as if never stopped. The
  events Train writes are labelled like Lingvo's trainer's (the global step
  after the update). DecodeHeldOut decodes in eval mode, so a model trained
  with dropout decodes without it, incrementally and in the full-sequence
  check alike.
  """
  cfg = TinyCfg(dropout_prob=0.3)
  straight_dir, resumed_dir = str(tmp_path / 'a'), str(tmp_path / 'b')
  straight = trainer.Train(cfg, steps=6, logdir=straight_dir, save_every=3,
                           summary_every=4)
  # Resume from the step-3 checkpoint the uninterrupted run wrote.
  os.makedirs(resumed_dir)
  tf.compat.v1.train.update_checkpoint_state(
      resumed_dir, os.path.join(straight_dir, 'ckpt-3'))
  resumed = trainer.Train(cfg, steps=6, logdir=resumed_dir)
  assert [r.step for r in straight] == list(range(6))
  assert [r.step for r in resumed] == [3, 4, 5]
  np.testing.assert_allclose([r.loss for r in resumed],
                             [r.loss for r in straight[3:]], rtol=1e-6)
  # The losses moved, so equality above is not trivial.
  assert len({round(r.loss, 6) for r in straight}) > 1
  assert tf.train.latest_checkpoint(resumed_dir).endswith('b/ckpt-6')

  tags = _EventScalars(straight_dir)
  assert sorted(tags['loss']) == [1, 4, 6]  # first, every 4th, last
  written = [straight[0], straight[3], straight[5]]
  assert [tags['loss'][r.step + 1] for r in written] == pytest.approx(
      [r.loss for r in written], rel=1e-6)
  assert sorted(tags['step_time_seconds']) == [1, 4, 6]
  assert sorted(tags['accuracy']) == [1, 4, 6]
  stages = sorted(t for t in tags if t.startswith('activation_rms/stage_'))
  assert [t.split('/')[1] for t in stages] == ['stage_0', 'stage_1'], stages
  assert tags['pipeline_schedule'] == {0: 'image'}
  assert trainer.CheckpointStep(straight_dir) == 6

  held_out = TinyCfg(dropout_prob=0.3)
  held_out.input.Set(data_seed=99, held_out_batches=2,
                     num_samples=2 * held_out.input.batch_size)
  decoding = trainer.DecodeHeldOut(held_out, straight_dir)
  assert decoding.num_sequences == 12
  assert decoding.agreement == 1.0, decoding.Describe()
  assert decoding.Agrees()


def test_decoder_output_lines_and_metrics():
  with tf.Graph().as_default():
    task = TinyCfg().Instantiate().GetTask()
  metrics = task.CreateDecoderMetrics()
  lines = task.PostProcessDecodeOut(
      dict(prompts=np.array([[2, 3, 4, 1], [5, 6, 7, 1]]),
           decoded=np.array([[2, 3, 4], [5, 7, 7]]),
           targets=np.array([[2, 3, 4], [5, 6, 7]])), metrics)
  assert lines == [('2 3 4 1', '2 3 4'), ('5 6 7 1', '5 7 7')]
  assert metrics['exact_copy_accuracy'].value == pytest.approx(0.5)
  assert metrics['token_accuracy'].value == pytest.approx(5 / 6)


def test_greedy_decoding_longer_than_the_positions_is_refused():
  with tf.Graph().as_default():
    task = TinyCfg().Instantiate().GetTask()  # max_seq_len 6
    with pytest.raises(ValueError, match=r'GreedyDecode: a prompt of 4 '
                       r'tokens and 4 tokens to decode feed 7 positions, '
                       r"more than the model's max_seq_len=6"):
      task.GreedyDecode(task.theta, tf.ones([6, 4], tf.int32), 4)


@pytest.mark.runs_long
def test_demo_trains_checks_and_draws_the_schedule(tmp_path):
  """Run as a user runs it (python -m, a fresh process): it prints its own
  lines only, none of TensorFlow's or Lingvo's logs. Two steps: a range of
  steps trained, and a resume hint past the checkpoint."""
  out = tmp_path / 'schedule.png'
  env = dict(os.environ)
  env.pop('TF_CPP_MIN_LOG_LEVEL', None)  # as in a user's shell
  run = subprocess.run(
      [sys.executable, '-m', 'gpipe.demo', '--steps', '2', '--logdir',
       str(tmp_path / 'run'), '--out', str(out)],
      cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600,
      check=False)
  assert run.returncode == 0, run.stderr
  assert run.stderr == ''
  text = run.stdout
  assert 'model_imports' not in text
  assert 'pipelined vs unrolled at step 0' in text
  # The check ran on the training model's own weights and first batch: its
  # loss is the loss of training step 0.
  checked = float(re.search(r'loss pipelined ([0-9.]+)', text).group(1))
  first = float(re.search(r'loss ([0-9.]+) -> ', text).group(1))
  assert abs(checked - first) < 1e-4, (checked, first)
  assert 'trained steps 0..1' in text
  # The resume hint trains further than the checkpoint.
  assert f'continue with --logdir {tmp_path / "run"} --steps 4' in text
  # The default model learns text: its held-out figures beside the
  # compressors', and a sample decoded through the pipeline.
  assert re.search(r'held-out bits per byte at step 2: [0-9.]+ on [0-9,]+ '
                   r'bytes \(same bytes: gzip -9 [0-9.]+, xz -9 [0-9.]+\)',
                   text)
  assert 'equal to the full-sequence picks: 1.000 of bytes' in text
  assert '--- sampled continuation ---' in text
  assert re.search(r'training curve \(bits per byte, one batch a step\):\n'
                   r'  step      1 ', text)
  # 4 stages x 2 repeats (circular), 4 microbatches: 3 of 11 iterations.
  assert 'bubble fraction 0.273' in text
  assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  assert os.path.exists(str(tmp_path / 'run' / 'ckpt-2.index'))


@pytest.mark.parametrize('argv, message', [
    (['--steps', '0'], r'--steps must be >= 1'),
    (['--minutes', '0'], r'--minutes must be > 0'),
    (['--logdir', '/proc/gpipe_run'], r'--logdir /proc/gpipe_run: cannot '
     r'create it'),
    (['--out', '/proc/gpipe/schedule.png'], r'--out /proc/gpipe: cannot '
     r'create it'),
    (['--model', 'CopyLMSmall'], r"Unknown model 'CopyLMSmall'. Did you mean "
     r'lm.CopyLMSmall\? Registered: .*lm.CopyLMSmall'),
])
def test_demo_rejects_bad_flags_before_training(capsys, argv, message):
  with pytest.raises(SystemExit) as info:
    demo.main(argv)
  assert info.value.code == 2
  err = capsys.readouterr().err
  assert re.search(message, err), err
  assert 'trained' not in err


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
