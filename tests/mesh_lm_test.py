"""The pod LM on a [stages, data, model] device mesh (params.pod_blocks.PodMesh).

lm.CopyLMMeshSmallData, the small version of lm.CopyLMPod8x2x4 on a
[2, 2, 2] mesh:
  * on one CPU (the mesh annotations run as identities) the pipelined model
    equals the unrolled one, loss and every gradient;
  * planned for 8 virtual devices, each device holds 1/(stages x model) of
    the stack's weights and slots (the data replicas hold copies), and the
    collectives run on the axes the mesh gives them: the rotation on the
    stage axis, the body's all-reduces on the model axis.
"""

import dataclasses

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe.apps import trainer
from gpipe import check_partitioning
from gpipe.lingvo_support import flags_and_seeds
from gpipe.lingvo_support import tpu_build
from gpipe import plan
from gpipe.plan import candidate as candidate_lib
from gpipe.plan import cli as plan_cli
from gpipe.plan import flags as plan_flags
from gpipe.plan import roofline
from gpipe.plan import targets
from gpipe.xla import check_model
from gpipe.xla import hlo_text
from gpipe.xla import partitioning
import params.lm as lm
from params import pod_blocks

flags_and_seeds.EnsureFlagsParsed()

MODEL = 'lm.CopyLMMeshSmallData'
MESH = pod_blocks.PodMesh(stages=2, data=2, model=2)
DIM, HEADS, HIDDEN, BATCH, M, R = 32, 4, 48, 12, 3, 2


def _Cfg():
  return lm.model_registry.GetParams(MODEL, 'Train')


def test_the_small_mesh_configs_are_the_pod_ones_in_small():
  """Their mesh, body annotations and sizes: what the tests below assume."""
  for name, mesh in ((MODEL, (2, 2, 2)), ('lm.CopyLMMeshSmall', (2, 1, 2))):
    cfg = lm.model_registry.GetParams(name, 'Train')
    stack = cfg.task.stack
    assert np.shape(stack.device_mesh) == mesh
    assert (stack.num_stages, stack.circular_repeat,
            stack.num_microbatches) == (MESH.stages, R, M)
    assert cfg.input.batch_size == BATCH and cfg.task.model_dim == DIM
    block = stack.single_stage_body.block_tpl
    assert block.tr_atten_tpl.atten_tpl.weight_split_dims_mapping == [
        -1, 2, -1]
    assert block.tr_fflayer_tpl.hidden_dim == HIDDEN


def test_mesh_lm_equals_the_unrolled_model():
  """Circular (R=2), M=3: loss and every variable's gradient."""
  comparison = trainer.CompareWithUnrolled(_Cfg())
  assert comparison.num_variables > 0
  assert comparison.Matches(), comparison.Describe()


def test_mesh_configs_are_registered_with_their_meshes():
  for name, mesh, min_devices in (('lm.CopyLMPod8x4', (8, 1, 4), 32),
                                  ('lm.CopyLMPod8x2x4', (8, 2, 4), 64)):
    cfg = lm.model_registry.GetParams(name, 'Train')
    stack = cfg.task.stack
    assert np.shape(stack.device_mesh) == mesh
    assert np.size(stack.device_mesh) == min_devices
    assert stack.pipeline_stage_mesh_dim == pod_blocks.PodMesh.STAGE_AXIS
    assert not stack.shard_stages_1d
    atten = stack.single_stage_body.block_tpl.tr_atten_tpl.atten_tpl
    assert atten.weight_split_dims_mapping == [-1, 2, -1]


def test_a_mesh_needs_the_batch_major_body():
  with pytest.raises(ValueError, match='batch_major=True'):
    lm.CopyLMParams(
        vocab_size=8, model_dim=8, num_heads=2, hidden_dim=8,
        blocks_per_stage=1, num_stages=2, circular_repeat=1,
        num_microbatches=2, dropout_prob=0.0, shard_stages_1d=False,
        learning_rate=1e-3, max_steps=1, mesh=MESH)



@pytest.fixture(scope='module')
def report():
  if not partitioning.IsAvailable():
    pytest.skip('needs jax')
  plan = candidate_lib.MakePlan(
      targets.ModelTarget(MODEL), [targets.Candidate(M, R)], MESH.num_devices,
      roofline.CHIPS['v5e'], 16 * 2**30)
  return plan.reports[0]


def test_each_device_holds_its_stage_and_model_share(report):
  """Stack weights and Adam slots: 1/(stages x model) per device, the
  heads and the feed-forward width split; nothing replicated that its
  annotation splits; the same figure as the variables' own annotations."""
  assert report.schedule.num_stages == MESH.stages
  stack_args = [(a, tuple(s)) for a, s in
                zip(report.step.args, report.compiled.param_shard_shapes)
                if a.on_stages]
  assert stack_args
  for arg, shard in stack_args:
    full = tuple(arg.spec.shape)
    assert shard[0] == 1 and full[0] == MESH.stages, (arg.name, shard)
    if arg.name.endswith(('query.w', 'key.w', 'value.w', 'post.w')):
      # [S, R, d, heads, head_dim]: heads over the model axis.
      assert shard == (1, R, DIM, HEADS // MESH.model, DIM // HEADS), arg
    if arg.name.endswith('fc[0].w'):
      assert shard == (1, R, DIM, HIDDEN // MESH.model), arg
    if arg.annotated_shard is not None:
      assert np.prod(shard) <= np.prod(arg.annotated_shard), arg
  assert report.Problems() == []


def test_collectives_run_on_their_mesh_axes(report):
  """Per iteration: the rotation is a collective-permute on the stage axis
  only; the body's all-reduces run on the model axis (axis 2, named by
  its role in the LM's mesh)."""
  assert report.mesh_shape == (2, 2, 2) and report.stage_axis == 0
  forward, backward = report.LoopSummaries()
  for loop in (forward, backward):
    by_axes = loop['by_mesh_axes']
    permutes = [k for k in by_axes if k.startswith('collective-permute')]
    assert permutes == ['collective-permute over stage'], by_axes
    assert 'all-reduce over model' in by_axes, by_axes
    # Stage 0's read and its gradient keep the batch where the body wants
    # it: nothing is gathered per iteration.
    assert not [k for k in by_axes if k.startswith('all-gather')], by_axes
  # The forward loop: the rotation and the body's model-axis all-reduces.
  assert set(forward['by_mesh_axes']) == {
      'collective-permute over stage', 'all-reduce over model'}, forward
  assert forward['by_mesh_axes']['collective-permute over stage'][
      'count'] == 2  # the activations and the paddings


def test_each_axis_floor_by_hand(report):
  """The least each mesh axis must carry (gpipe.plan.traffic_floor), from
  the model's shapes by hand, and what the step sends over it. One
  microbatch's activation on a chip: 12 / 3 / 2 rows x 16 tokens x 32
  wide x 4 bytes (float32)."""
  a = BATCH // M // MESH.data * 16 * DIM * 4
  # Trainable weights on one chip: their float32 gradient is reduced over
  # the data axis once (2 replicas: a ring sends it all once).
  trainable = {param for _, param in report.step.aliases
               if report.step.args[param].kind == 'weight'}
  gradients = report._ArgBytes(lambda i, arg: i in trainable)  # pylint: disable=protected-access
  # The vocab-split tables: token and position embeddings, softmax weight
  # and bias, over all 8 chips.
  table = 40 * DIM + 16 * DIM + DIM * 40 + 40
  floors = {f.axes: f.parts for f in report.traffic_floors}
  assert floors.keys() == {'stage', 'model', 'data', 'stage+data+model'}
  # Each of M x R stage calls sends its output and input gradient once.
  assert floors['stage'] == {
      'activations and their gradients, stage to stage': 2 * M * R * a}
  # A block reduces 2 activations forward and 2 backward, and its
  # recomputed forward the first (its last feeds only the output); 2
  # model devices: a ring sends each once.
  assert floors['model'] == pytest.approx({
      'the body\'s reductions': 4 * M * R * a,
      'the recomputed forward\'s reductions': M * R * a})
  assert floors['data'] == {'one gradient reduction': gradients}
  # Gathered in float32 (their own dtype), each chip's gradient of its own
  # sequences summed over all 8 into its eighth.
  assert floors['stage+data+model'] == pytest.approx({
      'tables gathered': 7 / 8 * table * 4,
      'tables\' gradients summed': 7 * table / 8 * 4})
  # What is sent: the loops' per-iteration collectives times their trips,
  # by kind; the model axis's all all-reduces of 2 devices.
  sent = report.sent_per_axis
  model_bytes = sum(loop['by_mesh_axes'].get('all-reduce over model', {})
                    .get('bytes', 0) * loop['iterations']
                    for loop in report.LoopSummaries())
  outside = report.outside_by_mesh_axes.get('all-reduce over model', {})
  assert sent['model'] == {'all-reduce': model_bytes + outside.get('bytes',
                                                                   0)}
  permutes = sum(loop['by_mesh_axes']['collective-permute over stage']
                 ['bytes'] * loop['iterations']
                 for loop in report.LoopSummaries())
  assert sent['stage']['collective-permute'] == permutes


def test_under_split_stage_weights_are_flagged(report):
  """Negative control of the check: a weight whose annotation asks for a
  finer split than the compiled one is a problem, named."""
  args = list(report.step.args)
  i = next(k for k, a in enumerate(args) if a.name.endswith('query.w'))
  shard = tuple(report.compiled.param_shard_shapes[i])
  finer = shard[:-1] + (1,)
  args[i] = type(args[i])(args[i].name, args[i].kind, args[i].spec,
                          args[i].on_stages, finer)

  class _Step:
    pass

  step = _Step()
  step.args = args
  step.aliases = report.step.aliases
  flagged = candidate_lib.CandidateReport(
      candidate=report.candidate, schedule=report.schedule,
      compiled=report.compiled, step=step, chip=report.chip,
      hbm_bytes=report.hbm_bytes, seconds=0.0,
      mesh_shape=report.mesh_shape, stage_axis=report.stage_axis)
  problems = flagged.Problems()
  assert len(problems) == 1 and 'query.w' in problems[0], problems
  assert 'fewer devices than their annotation' in problems[0]


def test_device_groups_read_both_spellings_and_name_axes():
  line = ('%ar = f32[4] all-reduce(%x), channel_id=1, '
          'replica_groups=[4,2]<=[2,2,2]T(0,1,2), to_apply=%add')
  assert hlo_text.DeviceGroups(line) == ((0, 1), (2, 3), (4, 5), (6, 7))
  line = 'replica_groups=[4,2]<=[2,2,2]T(1,2,0)'
  assert hlo_text.DeviceGroups(line) == ((0, 4), (1, 5), (2, 6), (3, 7))
  line = 'source_target_pairs={{0,4},{4,0},{1,5}}'
  pairs = hlo_text.DeviceGroups(line)
  assert pairs == ((0, 4), (4, 0), (1, 5))
  c = hlo_text.Collective('collective-permute', 'f32[2]', 'c', 0,
                              groups=pairs)
  assert c.MeshAxes((2, 2, 2)) == (0,)
  c = hlo_text.Collective('all-reduce', 'f32[2]', 'c', 0,
                              groups=((0, 1), (2, 3), (4, 5), (6, 7)))
  assert c.MeshAxes((2, 2, 2)) == (2,)
  c = hlo_text.Collective('all-gather', 'f32[2]', 'c', 0,
                              groups=((0, 2, 1, 3), (4, 6, 5, 7)))
  assert c.MeshAxes((2, 2, 2)) == (1, 2)
  # No groups named: every device, so every axis of more than one.
  c = hlo_text.Collective('all-gather', 'f32[2]', 'c', 0)
  assert c.MeshAxes((2, 1, 4)) == (0, 2) and c.MeshAxes((8,)) == (0,)
  assert hlo_text.DeviceGroups('%a = f32[2] add(%x, %y)') == ()
  # The mesh-axes spelling: ids row-major over the named axes, a group
  # per setting of the axes not in braces.
  line = ("all-gather(%x), replica_groups=mesh['axis_0'=2,'axis_1'=2,"
          "'axis_2'=2] {'axis_2'}, dimensions={2}")
  assert hlo_text.DeviceGroups(line) == ((0, 1), (2, 3), (4, 5), (6, 7))
  line = "replica_groups=mesh['a'=2,'b'=2,'c'=2] {'a','c'}"
  assert hlo_text.DeviceGroups(line) == ((0, 1, 4, 5), (2, 3, 6, 7))
  line = "replica_groups=mesh['a'=4,'b'=2] {'a':(1)2}"
  with pytest.raises(ValueError, match='sub-axes'):
    hlo_text.DeviceGroups(line)


def test_tf_annotations_reach_the_planners_arguments():
  """The planner reads each variable's own annotation (AnnotatedShard)."""
  from gpipe.model_step import train_step  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default(), tpu_build.AsOnTpu():
    task = _Cfg().task.Instantiate()
    w = task.stack.vars.body.blocks[0].self_atten.atten.query.w
    assert train_step.AnnotatedShard(w) == (1, R, DIM, HEADS // MESH.model,
                                            DIM // HEADS)


# -- python -m gpipe.check_partitioning --model on the small mesh LM. ---------


@pytest.fixture(scope='module')
def checked():
  if not partitioning.IsAvailable():
    pytest.skip('needs jax')
  return check_model.CheckModelPartitioning(check_model.FindModel(MODEL),
                                            MESH.num_devices)


def test_the_model_partitioned_equals_it_on_one_device(checked):
  """The loss and every trainable weight's gradient, 8 devices vs 1."""
  names = checked.step.ResultNames()
  assert names[0] == 'loss' and len(names) == len(checked.expected) > 10
  for name, got, want in zip(names, checked.run.outputs, checked.expected):
    assert np.abs(want).max() > 0, f'{name} is all zero: nothing checked'
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_the_check_finds_each_weight_split_as_annotated(checked):
  """Stack weights 1/stages and their heads or hidden width 1/model per
  device; the vocab-sized weights split over all 8 devices; no problem."""
  shapes = {name: (full, shard)
            for name, full, shard in checked.WeightShapes()}
  full, shard = shapes['stack.body.blocks[0].self_atten.atten.query.w']
  assert full == (MESH.stages, R, DIM, HEADS, DIM // HEADS)
  assert shard == (1, R, DIM, HEADS // MESH.model, DIM // HEADS)
  full, shard = shapes['stack.body.blocks[0].fflayer.fflayer.fc[1].w']
  assert shard == (1, R, HIDDEN // MESH.model, DIM)
  full, shard = shapes['emb.wm']
  assert shard == (-(-full[0] // MESH.num_devices), DIM)
  assert checked.Problems(1e-5) == []
  assert checked.mesh_shape == (2, 2, 2) and checked.stage_axis == 0
  assert checked.CountsByAxes(0)['collective-permute over stage'] == 2


def test_the_check_names_a_weight_split_less_than_annotated(checked):
  """Negative control: an annotation asking for a finer split than the
  run's is a failed check naming the weight."""
  step = checked.step
  i = step.weight_names.index('stack.body.blocks[0].self_atten.atten.key.w')
  annotated = list(step.annotated_shards)
  annotated[i] = (1, R, DIM, 1, DIM // HEADS)
  finer = dataclasses.replace(
      checked, step=dataclasses.replace(step, annotated_shards=annotated))
  problems = finer.Problems(1e-5)
  assert len(problems) == 1, problems
  assert problems[0].startswith('WEIGHTS SPLIT LESS THAN ANNOTATED: '
                                'stack.body.blocks[0].self_atten.atten.key.w')


def test_check_partitioning_command_takes_a_model(checked, monkeypatch,
                                                  capsys):
  """--model prints the check's summary by mesh axis and its verdict."""
  monkeypatch.setattr(check_model, 'CheckModelPartitioning',
                      lambda model, n: checked)
  assert check_partitioning.main(['--model', MODEL]) == 0
  out = capsys.readouterr().out
  assert 'a [2, 2, 2] mesh with the stages on axis 0' in out
  assert '2 collective-permute over stage' in out
  assert out.strip().endswith('OK')


@pytest.mark.parametrize('argv, said', [
    (['--model', 'lm.Nope'], "--model lm.Nope: Unknown model 'lm.Nope'."),
    (['--model', MODEL, '--num_devices', '4'],
     '--num_devices 4 does not match the layer: its device_mesh has 8 '
     'devices. Use --num_devices 8.'),
    (['--model', MODEL, '--model_module', 'no_such_module'],
     '--model_module no_such_module cannot be imported '
     "(ModuleNotFoundError: No module named 'no_such_module')."),
])
def test_check_partitioning_refuses_a_bad_model_in_one_line(argv, said,
                                                            capsys):
  assert check_partitioning.main(argv) == 2
  # (Lingvo's registry prints what it imports; run as a command, those
  # lines are quieted: quiet_test.)
  err = [line for line in capsys.readouterr().err.splitlines()
         if 'error' in line]
  assert len(err) == 1 and err[0].startswith(
      f'check_partitioning: error: {said}'), err


# -- python -m gpipe.plan --mesh: trading stages for other mesh axes. ---------


@pytest.mark.runs_long
def test_plan_trades_stages_for_a_data_axis_at_the_same_depth():
  """Mesh 4x1x2 with R=1: 4 stages of one block (the model's 2 stages x 2
  repeats x 1 block), each stage weight on its 2 devices, split by heads
  over the model axis; 4x2x1 with R=2 would need half a block per stage
  body: skipped, said why. The table shows each candidate's mesh."""
  if not partitioning.IsAvailable():
    pytest.skip('needs jax')
  result = candidate_lib.MakePlan(
      targets.ModelTarget(MODEL),
      [targets.Candidate(M, 1, 'recompute', (4, 1, 2)),
       targets.Candidate(M, 2, 'recompute', (4, 2, 1))],
      MESH.num_devices, roofline.CHIPS['v5e'], 16 * 2**30)
  report, = result.reports
  (skipped, reason), = result.skipped
  assert skipped.mesh == (4, 2, 1)
  assert reason.endswith('4 blocks in all do not split into 4 x 2 stage '
                         'bodies.'), reason
  assert report.mesh_shape == (4, 1, 2) and report.schedule.num_stages == 4
  assert report.Problems() == []
  shards = {a.name: (tuple(a.spec.shape), tuple(s)) for a, s in zip(
      report.step.args, report.compiled.param_shard_shapes) if a.on_stages}
  full, shard = shards['stack.body.blocks[0].self_atten.atten.query.w']
  assert full == (4, DIM, HEADS, DIM // HEADS), full
  assert shard == (1, DIM, HEADS // 2, DIM // HEADS), shard
  # Which candidate a row is: the FLOPs the rows show besides are given
  # here (compiling the step unpartitioned and its forward pass alone for
  # them took 4.5 s; plan_test renders them compiled).
  given = dataclasses.replace(
      report, unpartitioned_flops_fn=lambda: 1e6, model_flops_fn=lambda: 1e6)
  rows = dataclasses.replace(result, reports=[given]).Render().splitlines()
  assert 'mesh' in rows[4].split() and rows[6].split()[0] == '4x1x2', rows


def test_plan_command_makes_a_candidate_per_mesh():
  _, args = plan_flags.Parse(['--model', MODEL, '--mesh', '2x2x2,4x1x2',
                              '--circular_repeat', '1,2'])
  _, num_devices, candidates = plan_cli._Candidates(None, args)  # pylint: disable=protected-access
  assert num_devices == 8
  assert [(c.mesh, c.circular_repeat) for c in candidates] == [
      ((2, 2, 2), 1), ((2, 2, 2), 2), ((4, 1, 2), 1), ((4, 1, 2), 2)]


def _PlanErrors(argv, capsys):
  code = plan.main(argv)
  return code, [line for line in capsys.readouterr().err.splitlines()
                if 'error' in line]


@pytest.mark.parametrize('argv, said', [
    (['--model', MODEL, '--mesh', '2x4'],
     "--mesh 2x4: the model's device_mesh has 3 axes (shape 2x2x2); give 3 "
     'sizes.'),
    (['--model', MODEL, '--mesh', '2x2x4'],
     '--mesh 2x2x4 has 16 devices, not --num_devices 8.'),
    (['--model', 'lm.CopyLMPod8x2', '--mesh', '4x2'],
     '--mesh: the pipelined stack is not placed on a device mesh'),
])
def test_plan_refuses_a_mesh_it_cannot_trade_for(argv, said, capsys):
  code, errors = _PlanErrors(argv, capsys)
  assert code == 2 and len(errors) == 1, errors
  assert errors[0].startswith(f'plan: error: {said}'), errors
