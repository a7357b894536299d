"""params/large_lm.py and the largest registered LMs.

LargeLMTask's loss taken at the pipeline's last stage (backward_schedule
'1f1b'), its chunked loss (reverse) and the stage's per-block
recomputation change no number: the loss and every gradient equal those
of the same model scoring its whole batch at once after the stack's
FProp, its blocks differentiated by TensorFlow (tf.gradients of the plain
forward), at the same weights. Partitioned on a [2 stages, 2 data, 2
model] mesh, the step equals the one-device step.
"""

import functools

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe.apps import trainer
from gpipe.lingvo_support import flags_and_seeds
from gpipe import schedule as schedule_lib
from lingvo.core import base_model
from lingvo.core import py_utils
import params.lm as lm
from params import large_lm
from params import pod_blocks
from gpipe.plan import torus

flags_and_seeds.EnsureFlagsParsed()


class _WholeBatchLoss(large_lm.LargeLMTask):
  """The reference: the whole batch's logits at once, one cross entropy,
  after the stack's FProp."""

  def _ScoresAtLastStage(self):
    return False

  def ComputeLoss(self, theta, predictions, input_batch):
    weights = input_batch.weights * (1.0 - input_batch.paddings)
    logits = self.PredictedLogits(theta, predictions)
    xent = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=input_batch.labels, logits=logits)
    num_scored = tf.reduce_sum(weights)
    return {'loss': (tf.reduce_sum(xent * weights) / num_scored,
                     num_scored)}, {}


def _Cfg(task_cls, remat_blocks, backward_schedule='1f1b', mesh=None,
         remat_policy=None):
  mesh = mesh or pod_blocks.PodMesh(stages=2, model=2)
  task = lm.CopyLMParams(
      vocab_size=11, model_dim=16, num_heads=2, hidden_dim=32,
      blocks_per_stage=2, num_stages=mesh.stages, circular_repeat=1,
      num_microbatches=2, dropout_prob=0.0, shard_stages_1d=False,
      learning_rate=1e-3, max_steps=10, max_seq_len=8, batch_major=True,
      mesh=mesh, remat_blocks=remat_blocks,
      stack_options=dict(backward_schedule=backward_schedule,
                         stream_io=True, remat_policy=remat_policy),
      task_cls=task_cls)
  cfg = base_model.SingleTaskModel.Params(task)
  cfg.input = lm.CopyTaskInput.Params().Set(vocab_size=11, copy_length=4,
                                            batch_size=8)
  return cfg


@functools.lru_cache(maxsize=None)
def _Reference():
  """(loss, gradients, weights) of _WholeBatchLoss at its initial weights:
  the reverse schedule, no block recomputed. Built once per process; each
  case loads these weights into the model under test."""
  return trainer._LossAndGradients(  # pylint: disable=protected-access
      _Cfg(_WholeBatchLoss, False, 'reverse'), None)


@pytest.mark.runs_long
@pytest.mark.parametrize('backward_schedule,remat_policy', [
    ('1f1b', 'save_checkpoints'), ('reverse', None)])
def test_last_stage_or_chunked_loss_and_recomputed_blocks_change_no_number(
    backward_schedule, remat_policy):
  """With 1f1b as the largest LMs train: the blocks' inputs kept per ring
  entry (save_checkpoints), each block run again once in the backward."""
  ref_loss, ref_grads, values = _Reference()
  loss, grads, _ = trainer._LossAndGradients(  # pylint: disable=protected-access
      _Cfg(large_lm.LargeLMTask, True, backward_schedule,
           remat_policy=remat_policy), values)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  assert set(grads) == set(ref_grads)
  assert any('softmax_bias' in name for name in grads)
  assert not any('/softmax/' in name for name in grads)  # one table
  for name, ref in ref_grads.items():
    assert np.abs(ref).max() > 0, name
    np.testing.assert_allclose(grads[name], ref, rtol=1e-5, atol=1e-6,
                               err_msg=name)


def test_recomputed_block_equals_the_block_and_its_gradient():
  """pod_blocks.RecomputedInBackward: the same output and gradients as the
  function differentiated by TensorFlow, under jit too."""
  rng = np.random.RandomState(0)
  w = {'a': rng.normal(size=[4, 4]).astype(np.float32),
       'b': rng.normal(size=[4]).astype(np.float32)}
  x_np = rng.normal(size=[3, 4]).astype(np.float32)

  def Fn(weights, x):
    return tf.tanh(x @ weights['a'] + weights['b']) * x

  def Both(weights, x):
    out = {}
    for name, fn in (('recomputed', lambda w_, x_: pod_blocks.
                      RecomputedInBackward(Fn, w_, x_)), ('plain', Fn)):
      with tf.GradientTape() as tape:
        tape.watch([x] + tf.nest.flatten(weights))
        y = fn(weights, x)
        loss = tf.reduce_sum(y * y)
      out[name] = [y] + tape.gradient(loss, [x] + tf.nest.flatten(weights))
    return out

  const = lambda: ({k: tf.constant(v) for k, v in w.items()},
                   tf.constant(x_np))
  got = tf.function(Both, jit_compile=True)(*const())
  with tf.Graph().as_default():
    fetches = Both(*const())
    with tf.compat.v1.Session() as sess:
      graph_got = sess.run(fetches)
  for result in (got, graph_got):
    result = tf.nest.map_structure(np.asarray, result)
    for a, b in zip(result['recomputed'], result['plain']):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.runs_long
def test_the_last_stage_loss_partitioned_equals_one_device():
  """lm.LargestMeshSmall (1f1b + stream_io, the loss at the last stage,
  the table split by vocab over the model axis there) on 8 virtual
  devices: the loss and every gradient equal the one-device step's."""
  from gpipe.xla import check_model  # pylint: disable=g-import-not-at-top
  from gpipe.xla import partitioning  # pylint: disable=g-import-not-at-top
  if not partitioning.IsAvailable():
    pytest.skip('needs jax')
  model = check_model.FindModel('lm.LargestMeshSmall')
  assert model.stack_params.backward_schedule == '1f1b'
  checked = check_model.CheckModelPartitioning(model, 8)
  names = checked.step.ResultNames()
  for name, got, want in zip(names, checked.run.outputs, checked.expected):
    assert np.abs(want).max() > 0, f'{name} is all zero: nothing checked'
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                               err_msg=name)
  assert checked.Problems(1e-5) == []


@pytest.mark.parametrize('mode', ['graph', 'jit'])
def test_vocab_split_scores_equal_tensorflows(mode):
  """VocabSplitScores: TensorFlow's softmax cross entropy and its
  gradient, and 1 exactly where the label's logit is the largest."""
  rng = np.random.RandomState(5)
  values = rng.normal(size=[2, 3, 7]).astype(np.float32) * 3
  labels = rng.randint(0, 7, [2, 3]).astype(np.int32)
  labels[0] = np.argmax(values[0], -1)  # some right, some (likely) wrong
  logits, labels = tf.constant(values), tf.constant(labels)

  def Both(logits):
    with tf.GradientTape(persistent=True) as tape:
      tape.watch(logits)
      ours, correct = large_lm.VocabSplitScores(logits, labels)
      theirs = tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=labels, logits=logits)
    return (ours, theirs, correct, tape.gradient(ours, logits),
            tape.gradient(theirs, logits))

  if mode == 'jit':
    Both = tf.function(Both, jit_compile=True)
  ours, theirs, correct, d_ours, d_theirs = [t.numpy() for t in Both(logits)]
  np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(d_ours, d_theirs, rtol=1e-6, atol=1e-6)
  want = np.argmax(logits.numpy(), -1) == labels.numpy()
  np.testing.assert_array_equal(correct, want.astype(np.float32))
  assert 0 < want.sum() < want.size


@pytest.mark.parametrize('mode', ['graph', 'jit'])
def test_look_up_and_its_gradient_equal_gather(mode):
  rng = np.random.RandomState(3)
  table = tf.constant(rng.normal(size=[7, 5]).astype(np.float32))
  ids = tf.constant([[1, 6, 1], [0, 3, 1]])  # 1 three times
  dy = tf.constant(rng.normal(size=[2, 3, 5]).astype(np.float32))

  def Both(table):
    with tf.GradientTape(persistent=True) as tape:
      tape.watch(table)
      ours, theirs = large_lm.LookUp(table, ids), tf.gather(table, ids)
    return (ours, theirs, tape.gradient(ours, table, output_gradients=dy),
            tf.convert_to_tensor(tape.gradient(theirs, table,
                                               output_gradients=dy)))

  if mode == 'jit':
    Both = tf.function(Both, jit_compile=True)
  ours, theirs, d_ours, d_theirs = Both(table)
  np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
  np.testing.assert_allclose(d_ours.numpy(), d_theirs.numpy(), rtol=1e-6,
                             atol=1e-6)
  # NumPy: row 1 gets three rows of dy, rows 2, 4 and 5 nothing.
  want = np.zeros([7, 5], np.float32)
  np.add.at(want, ids.numpy().reshape(-1), dy.numpy().reshape(-1, 5))
  np.testing.assert_allclose(d_ours.numpy(), want, rtol=1e-6, atol=1e-6)


def test_the_largest_models_are_as_big_as_they_say():
  """At least twice GPipe's Transformer on 8 and on 32 accelerators (5.3
  B and 21.0 B), with the widths, heads, vocab, sequences, batches and
  bubbles docs/flagships.md states (built on one device in a scratch
  graph; ParameterBytes of the built task)."""
  for name, devices, gpipe_params, batch in (
      ('lm.LargestOn8x16GiB', 8, 5.3e9, 32),
      ('lm.LargestOn32x16GiB', 32, 21.0e9, 256)):
    cls = lm.model_registry.GetClass(name)
    cfg = lm.model_registry.GetParams(name, 'Train')
    stack = cfg.task.stack
    assert cfg.task.model_dim >= 4096
    assert cfg.task.vocab_size == 32000 and cfg.input.copy_length == 512
    assert cfg.input.batch_size >= batch
    assert cls.MESH.num_devices == devices
    block = stack.single_stage_body.block_tpl
    assert block.tr_fflayer_tpl.hidden_dim == 4 * cfg.task.model_dim
    assert cfg.task.model_dim // block.num_heads == 128
    sched = schedule_lib.Schedule(stack.num_stages, stack.num_microbatches,
                                    stack.circular_repeat)
    assert sched.bubble_fraction <= 0.1
    with tf.Graph().as_default(), py_utils.AuxLossContext():
      with tf.compat.v1.variable_scope('x', use_resource=True):
        task = cfg.task.Instantiate()
    total, _ = lm.ParameterBytes(task)
    assert total / 4 >= 2 * gpipe_params, (name, total / 4)


_SMALL_MESH = (2, 1, 4)  # stages, data, model


@pytest.fixture(scope='module')
def small_plan():
  """lm.LargestMeshSmall planned on 8 devices as [2 stages, 4 model].

  (With a data axis the pipeline's loops sum each iteration's weight
  gradients over it, the table's among them: docs/planning.md.)"""
  from gpipe.plan import candidate as candidate_lib  # pylint: disable=g-import-not-at-top
  from gpipe.plan import roofline  # pylint: disable=g-import-not-at-top
  from gpipe.plan import targets  # pylint: disable=g-import-not-at-top
  from gpipe.xla import partitioning  # pylint: disable=g-import-not-at-top
  if not partitioning.IsAvailable():
    pytest.skip('needs jax')
  cls = lm.model_registry.GetClass('lm.LargestMeshSmall')
  plan = candidate_lib.MakePlan(
      targets.ModelTarget('lm.LargestMeshSmall'),
      [targets.Candidate(cls.NUM_MICROBATCHES, 1, 'save_checkpoints',
                         mesh=_SMALL_MESH)],
      cls.MESH.num_devices, roofline.CHIPS['v5e'], 16 * 2**30)
  (report,) = plan.reports
  return cls, report


def test_no_table_sized_collective_runs_in_a_loop(small_plan):
  """The tied table is gathered for the stages once and its gradient
  summed once, outside the pipeline's loops: no collective in a loop
  moves the table, a model slice of it, or its bias (by their shapes)."""
  from gpipe.xla import hlo_text  # pylint: disable=g-import-not-at-top
  cls, report = small_plan
  vocab, dim = cls.VOCAB_SIZE, cls.MODEL_DIM
  rows = {vocab, vocab // _SMALL_MESH[2]}
  table_like = lambda s: (s[-2:] in {(r, dim) for r in rows} or
                          s[-1:] in {(r,) for r in rows})
  shapes = lambda cs: [s for c in cs for s in hlo_text.ShapesOf(c.shape)]
  in_loops = [c for c in report.compiled.collectives if c.loop >= 0]
  assert in_loops and shapes(in_loops)
  assert not [s for s in shapes(in_loops) if table_like(s)], [
      (c.shape, c.op_name) for c in in_loops
      if any(table_like(s) for s in hlo_text.ShapesOf(c.shape))]
  # Outside them: the table's gather and its gradient's reduction.
  outside = [c for c in report.compiled.collectives if c.loop < 0]
  assert [s for s in shapes(outside) if table_like(s)]


def test_the_floors_of_the_small_planned_lm_by_hand(small_plan):
  """The least each axis carries for lm.LargestMeshSmall's step on [2, 1,
  4], by hand: M = 4 microbatches of 16 / 4 rows x 16 tokens x 32 wide,
  float32 (A); each of 2 blocks reduces 2 activations over the 4 model
  devices forward and backward (a ring: 2 x 3/4 of each), one each again
  when recomputed from its stored input (save_checkpoints, a part of its
  own), and the ends 2 per microbatch; the tied table (40 x 32 and its 40
  biases) gathered over the 2 stages, each chip its model quarter, its
  gradient summed over them (each a half); the positions (16 x 32)
  gathered over all 8, their gradient summed over the 2 stages alone
  (the model devices of a stage differentiate the same copy): each chip
  receives the other stage's share of its eighth. All float32, as the
  model gathers and sums them. The step sends no less than any floor."""
  _, report = small_plan
  a = 16 // 4 * 16 * 32 * 4
  ring = 2 * 3 / 4
  table = (40 * 32 + 40) / 4
  floors = {f.axes: f.parts for f in report.traffic_floors}
  assert floors.keys() == {'stage', 'model', 'stage+model'}
  assert floors['stage'] == pytest.approx({
      'activations and their gradients, stage to stage': 2 * 4 * a,
      'tables gathered': 1 / 2 * table * 4,
      'tables\' gradients summed': (table / 2 + 16 * 32 / 8) * 4})
  assert floors['model'] == pytest.approx({
      'the body\'s reductions': 2 * 4 * 4 * ring * a,
      'the recomputed forward\'s reductions': 2 * 4 * ring * a,
      'the ends\' reductions': 2 * 4 * ring * a})
  assert floors['stage+model'] == pytest.approx({
      'tables gathered': 7 / 8 * 16 * 32 * 4})
  ratios = report.FloorsJson()['collective_sent_over_floor']
  assert min(ratios.values()) >= 0.95, ratios
  assert not report.Problems(), report.Problems()


def test_the_rings_split_over_the_model_axis(small_plan):
  """ring_split_mesh_dim: on each chip the rings ([1 stage, 2S - 1 = 3
  slots, ...entry]) hold a quarter (4 model devices) of each entry, split
  on its largest dim: the stage input [4 rows, 16 tokens, 32 wide] on its
  width, the stored block input [64 tokens, 32] on its tokens, the
  stage's [4, 16] position weights on its tokens; no ring holds a whole
  entry, and the backward loops gather entries over the model axis only."""
  import re  # pylint: disable=g-import-not-at-top
  cls, report = small_plan
  assert cls.RING_SPLIT_MESH_DIM == 2
  rings = set(re.findall(r'f32\[1,3,[\d,]*\]', report.compiled.hlo))
  assert rings == {'f32[1,3,4,16,8]', 'f32[1,3,16,32]', 'f32[1,3,4,4]'}, rings
  gathers = [c for c in report.compiled.collectives
             if c.loop >= 0 and c.kind == 'all-gather']
  assert gathers and {c.MeshAxes(_SMALL_MESH) for c in gathers} == {(2,)}, [
      (c.shape, c.MeshAxes(_SMALL_MESH)) for c in gathers]


def test_the_largest_benchmark_knows_each_models_mesh():
  """benchmarks.largest --meshes plans each model on its own mesh first,
  then on others of as many chips."""
  from benchmarks import largest  # pylint: disable=g-import-not-at-top
  for model, devices, _, _, others in largest.MODELS:
    own = largest._OwnMesh(model)  # pylint: disable=protected-access
    assert own == lm.model_registry.GetClass(model).MESH.device_mesh.shape
    assert np.prod(own) == devices, (model, own)
    for mesh in others:
      assert np.prod([int(n) for n in mesh.split('x')]) == devices, mesh
    # Without a pipeline: one stage, the same chips, a row a replica.
    batch = lm.model_registry.GetParams(model, 'Train').input.batch_size
    assert largest.NO_PIPELINE[model]
    for mesh, microbatches in largest.NO_PIPELINE[model]:
      shape = [int(n) for n in mesh.split('x')]
      assert shape[0] == 1 and np.prod(shape) == devices, mesh
      assert microbatches * shape[1] == batch, (mesh, microbatches)
    # Every mesh lies along the model's slice (gpipe.plan.torus refuses
    # one that does not).
    for mesh in [own] + [[int(n) for n in m.split('x')] for m in others] + [
        [int(n) for n in m.split('x')] for m, _ in largest.NO_PIPELINE[model]]:
      assert len(torus.LinksPerAxis(mesh, [int(n) for n in
                                    largest.SLICES[devices].split("x")])) == 3
  # The flagships' mesh twins: the flagship's batch, schedule, depth and
  # optimizer on its own 8 chips; a row a data replica without a pipeline.
  for model, _, _, layouts in largest.FLAGSHIPS:
    assert np.prod(largest._OwnMesh(model)) == 8  # pylint: disable=protected-access
    twin = lm.model_registry.GetParams(model, 'Train')
    own = lm.model_registry.GetParams(model.replace('OnMesh', ''), 'Train')
    assert twin.input.batch_size == own.input.batch_size, model
    assert twin.task.train.optimizer.cls == own.task.train.optimizer.cls
    for name in ('num_stages', 'circular_repeat', 'num_microbatches'):
      assert twin.task.stack.Get(name) == own.task.stack.Get(name), name
    assert (twin.task.stack.single_stage_body.num_blocks ==
            own.task.stack.single_stage_body.num_blocks)
    batch = lm.model_registry.GetParams(model, 'Train').input.batch_size
    assert layouts
    for mesh, microbatches in layouts:
      shape = [int(n) for n in mesh.split('x')]
      assert shape[0] == 1 and np.prod(shape) == 8, mesh
      assert microbatches * shape[1] == batch, (mesh, microbatches)


def test_the_largest_benchmark_checks_the_models_own_mesh(capsys):
  """With --meshes the planner may recommend another mesh (faster, over
  the peak aimed for): the targets are checked on the model's own, and
  the planner's pick is said."""
  from benchmarks import largest  # pylint: disable=g-import-not-at-top
  gib = 2**30

  def Candidate(mesh, peak_gib, mfu):
    return dict(
        mesh_shape=mesh, num_microbatches=256, circular_repeat=1,
        remat_policy='save_checkpoints', backward_schedule='1f1b',
        stream_io=True, stored_activation_bytes=gib, flops_ratio=0.9,
        bubble_fraction=0.03, predicted_step_seconds=10 / mfu, fits=True,
        per_device_bytes=dict(peak=peak_gib * gib, weights=gib,
                              optimizer=0, temp=gib),
        predicted=dict(mfu=mfu, compute_seconds=1, model_compute_seconds=1,
                       bubble_seconds=0, other_compute_seconds=0,
                       memory_traffic_seconds=1, collective_seconds=1,
                       step_seconds=10 / mfu, hidden_collective_seconds=0,
                       step_seconds_overlapped=10 / mfu,
                       mfu_overlapped=mfu, matmul_seconds=1,
                       compute_seconds_calibrated=1,
                       hidden_calibrated_seconds=0,
                       step_seconds_calibrated=10 / mfu, mfu_calibrated=mfu,
                       step_seconds_ceiling=1, mfu_ceiling=mfu),
        collective_bytes_sent_per_step={'model': {'all-reduce': gib}},
        collective_floor_per_step={'model': {'bytes': gib}},
        collective_sent_over_floor={'model': 1.0}, links_per_axis=[1, 2, 1])

  plan = dict(candidates=[Candidate([8, 1, 4], 13.0, 0.50),
                          Candidate([16, 1, 2], 14.6, 0.58)],
              recommended=1, total_weight_bytes=4 * 43e9, num_devices=32,
              tpu=dict(ici_bandwidth=4e11, ici_ports=4))
  checked = largest._Checked(plan, [8, 1, 4])  # pylint: disable=protected-access
  assert checked == 0
  assert largest._Checked(plan, None) == 1  # pylint: disable=protected-access
  checks = {what: (value, ok) for what, value, _, ok in largest._Checks(  # pylint: disable=protected-access
      plan, checked, 32, 42e9)}
  assert checks['peak / 16 GiB'] == (13.0 / 16, True)
  assert checks['predicted MFU (calibrated)'] == (0.50, True)
  largest._PrintChecked(plan, checked)  # pylint: disable=protected-access
  printed = capsys.readouterr().out
  assert 'The planner recommends mesh 16x1x2' in printed
  assert 'Its own mesh: mesh 8x1x4' in printed
  assert 'Links per mesh axis on the 4x8 slice: 1x2x1.' in printed
  # Both candidates in one table, the faster calibrated step first.
  rows = largest._Candidates([plan])  # pylint: disable=protected-access
  assert rows[2].startswith('| 16x1x2 | - | 256 |') and '*' in rows[2]
  assert rows[3].startswith('| 8x1x4 | - | 256 |'), rows
