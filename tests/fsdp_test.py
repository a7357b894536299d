"""FSDP and no pipeline: the layouts a user would pick instead of pipelining.

lm.LargestMeshSmallFsdp ([2 stages, 2 data, 2 model], FSDP over the data
axis) and lm.LargestMeshSmallNoPipeline ([1, 4, 2]: one stage, no
pipeline, FSDP and tensor parallelism, as MaxText's runs split a model):
  * partitioned on 8 virtual devices, the loss and every gradient equal
    the same step on one device;
  * each block weight is split 1/(stages x data x model) per device, its
    model dim d over the data axis (params/fsdp.py), and gathered over
    the data axis where a block uses it;
  * planned (the planner's --mesh with a stage axis of 1, Adam), each
    slot is split as its weight;
  * a weight the data axis cannot split evenly, and FSDP without a mesh
    axis, are refused in one line before anything is built.
"""

import collections
import dataclasses

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe.lingvo_support import flags_and_seeds
from gpipe.lingvo_support import tpu_build
from gpipe.plan import candidate as candidate_lib
from gpipe.plan import roofline
from gpipe.plan import targets
from gpipe.xla import check_model
from gpipe.xla import hlo_text
from gpipe.xla import partitioning
import params.lm as lm
from params import fsdp
from params import lm_params
from params import pod_blocks
from tests import close

flags_and_seeds.EnsureFlagsParsed()

DIM, HEADS, HIDDEN, BATCH, SEQ = 32, 4, 128, 16, 16
DATA = pod_blocks.PodMesh.DATA_AXIS


def _Checked(name):
  if not partitioning.IsAvailable():
    raise AssertionError('jax and jaxlib are needed (they are in the test '
                         'extra).')
  return check_model.CheckModelPartitioning(check_model.FindModel(name), 8)


def _Mesh(name):
  return lm.model_registry.GetClass(name).MESH


@pytest.mark.runs_long
@pytest.mark.parametrize('name', ['lm.LargestMeshSmallFsdp',
                                  'lm.LargestMeshSmallNoPipeline'])
def test_partitioned_it_equals_one_device_each_weight_split_and_gathered(
    name):
  """One partitioned step (a compile and a run: each check below reads
  it):
    * the loss and every gradient equal the step on one device;
    * [S, d, heads, head_dim], [S, d, hidden] and [S, hidden, d]: the
      stage dim over the stages, d over the data axis, heads and hidden
      over the model axis; the tied table split over all 8 devices;
    * every block's four projection weights are all-gathered over the
      data axis alone, into the shape the block uses (d whole, heads or
      hidden still split over the model axis): the gather FSDP asks for,
      which the check does not count as a weight moved whole."""
  report = _Checked(name)
  names = report.step.ResultNames()
  assert names[0] == 'loss' and len(names) == len(report.expected) > 10
  for result, got, want in zip(names, report.run.outputs, report.expected):
    assert np.abs(want).max() > 0, f'{name} {result}: all zero'
    close.AssertClose(got, want, close.FLOAT32, f'{name} {result}')
  assert report.Problems(1e-5) == [], report.Problems(1e-5)

  mesh = _Mesh(name)
  d, m = DIM // mesh.data, mesh.model
  shapes = {n: shard for n, _, shard in report.WeightShapes()}
  block = 'stack.body.blocks[0]'
  assert shapes[f'{block}.self_atten.atten.qkv.w'] == (
      1, d, HEADS // m, 3 * DIM // HEADS)
  assert shapes[f'{block}.self_atten.atten.post.w'] == (
      1, d, HEADS // m, DIM // HEADS)
  assert shapes[f'{block}.fflayer.fflayer.fc[0].w'] == (1, d, HIDDEN // m)
  assert shapes[f'{block}.fflayer.fflayer.fc[1].w'] == (1, HIDDEN // m, d)
  assert np.prod(shapes['emb.wm']) * 8 == np.prod(
      report.step.args[report.step.weight_names.index('emb.wm')].shape)

  used = collections.Counter(
      hlo_text.ShapesOf(c.shape)[0] for c in report.run.collectives
      if c.kind == 'all-gather' and c.MeshAxes(report.mesh_shape) == (DATA,))
  for shape in ((DIM, HEADS // m, 3 * DIM // HEADS),
                (DIM, HEADS // m, DIM // HEADS), (DIM, HIDDEN // m),
                (HIDDEN // m, DIM)):
    assert used[shape] >= lm.model_registry.GetClass(
        name).BLOCKS_PER_STAGE, (shape, used)
  assert report.gathered_over == (DATA,)
  assert report.GatheredWeights() == []
  # No pipeline: the microbatches' rows split over the data axis, never
  # the whole batch's activations [1, 16, 16, 32] on a chip.
  if mesh.stages == 1:
    assert f'[{BATCH},{SEQ},{DIM}]' not in report.run.hlo
    assert f'[{BATCH // mesh.data},{SEQ},{DIM}]' in report.run.hlo


@pytest.mark.runs_long
def test_a_stage_axis_of_one_plans_with_every_slot_split_as_its_weight():
  """`gpipe.plan --mesh 1x4x2` of lm.LargestMeshSmallFsdp: one stage of
  all 4 blocks (the depth kept), no pipeline; each Adam slot of a stack
  weight held 1/8 per device as its weight is; nothing flagged."""
  if not partitioning.IsAvailable():
    raise AssertionError('jax and jaxlib are needed.')
  plan = candidate_lib.MakePlan(
      targets.ModelTarget('lm.LargestMeshSmallFsdp'),
      [targets.Candidate(4, 1, 'save_checkpoints', mesh=(1, 4, 2))], 8,
      roofline.CHIPS['v5e'], 16 * 2**30)
  report = plan.reports[0]
  assert report.schedule.num_stages == 1 and not report.Problems()
  shards = dict(zip((a.name for a in report.step.args),
                    report.compiled.param_shard_shapes))
  slots = [a for a in report.step.args
           if a.kind == 'slot' and a.on_stages and
           a.name.rsplit('/', 1)[0].endswith('.w')]
  assert len(slots) == 2 * 4 * 4  # Adam's two, of 4 matrices, 4 blocks
  for slot in slots:
    weight = slot.name.rsplit('/', 1)[0]
    assert tuple(shards[slot.name]) == tuple(shards[weight]), slot.name
    assert np.prod(shards[slot.name]) * 8 == slot.spec.shape.num_elements()


def test_a_data_axis_that_does_not_divide_the_model_dim_is_refused():
  with pytest.raises(ValueError, match=(
      r"CopyLMParams: the mesh's fsdp splits every block weight's "
      r'model_dim=32 over the data axis of 3 devices; pick a model_dim '
      r'divisible by 3')):
    lm_params.CopyLMParams(
        vocab_size=40, model_dim=32, num_heads=4, hidden_dim=48,
        blocks_per_stage=1, num_stages=1, circular_repeat=1,
        num_microbatches=1, dropout_prob=0.0, shard_stages_1d=False,
        learning_rate=1e-3, max_steps=1, batch_major=True,
        mesh=pod_blocks.PodMesh(stages=1, data=3, model=2, fsdp=True))


def test_a_stage_whose_mesh_cannot_split_a_weight_is_refused_when_built():
  """The planner's --mesh may give the data axis a size the params never
  saw: the stage refuses it as it is built, naming the weight."""
  p = lm.model_registry.GetParams('lm.LargestMeshSmallNoPipeline',
                                  'Train').task.stack.single_stage_body
  p.Set(name='stage', device_mesh=np.arange(6).reshape(1, 3, 2))
  with tf.Graph().as_default(), tpu_build.AsOnTpu():
    with pytest.raises(ValueError, match=(
        r'stage: fsdp_mesh_dim=1 splits \S+\.w \(shape \[[\d, ]+\]\) over 3 '
        r'devices, but its dim of 32 is not divisible by 3; pick a mesh whose '
        r'axis 1 divides 32')):
      p.Instantiate()


def test_fsdp_needs_a_block_split_over_a_mesh():
  block = pod_blocks.PodBlockParams(32, 4, 48, 0.0)
  with pytest.raises(ValueError, match=(
      r'stage: fsdp_mesh_dim=1 adds mesh axis 1 to the blocks\' weight '
      r'splits, but they are \[None, None, None\]; split the block over '
      r'the mesh first')):
    fsdp.StoredSplitOver(block, DATA, 'stage')


def test_fsdp_adds_the_data_axis_on_the_model_dim():
  block = pod_blocks.SplitBlockOverMesh(pod_blocks.PodBlockParams(
      32, 4, 48, 0.0))
  split = fsdp.StoredSplitOver(block, DATA, 'stage')
  assert split.tr_atten_tpl.atten_tpl.weight_split_dims_mapping == [
      DATA, 2, -1]
  assert split.tr_fflayer_tpl.fflayer_tpl.weight_split_dims_mapping_list == [
      [DATA, 2], [2, DATA]]
  # A copy: the block itself is unchanged.
  assert block.tr_atten_tpl.atten_tpl.weight_split_dims_mapping == [-1, 2, -1]


def test_the_planner_makes_fsdp_candidates_and_refuses_a_body_without():
  """--fsdp_mesh_dim none,1 on a mesh model: a candidate with FSDP and one
  without, each said; a stage body with no fsdp_mesh_dim is refused as
  its candidates are built, and a stage axis of 1 with --circular_repeat
  2 before anything is."""
  from gpipe.model_step import stacks  # pylint: disable=g-import-not-at-top
  from gpipe.plan import cli as plan_cli  # pylint: disable=g-import-not-at-top
  from gpipe.plan import flags as plan_flags  # pylint: disable=g-import-not-at-top
  _, args = plan_flags.Parse(['--model', 'lm.LargestMeshSmall', '--mesh',
                              '1x4x2,2x2x2', '--fsdp_mesh_dim', 'none,1'])
  _, _, candidates = plan_cli._Candidates(None, args)  # pylint: disable=protected-access
  said = [c.Describe() for c in candidates]
  assert said == [
      'M=4 R=1 save_checkpoints mesh 1x4x2 no fsdp',
      'M=4 R=1 save_checkpoints mesh 1x4x2 fsdp over axis 1',
      'M=4 R=1 save_checkpoints mesh 2x2x2 no fsdp',
      'M=4 R=1 save_checkpoints mesh 2x2x2 fsdp over axis 1'], said
  stack = lm.model_registry.GetParams('lm.LargestMeshSmall',
                                      'Train').task.stack
  stacks.SetSchedule(stack, candidates[1])
  assert stack.single_stage_body.fsdp_mesh_dim == 1
  stacks.SetSchedule(stack, candidates[2])
  assert stack.single_stage_body.fsdp_mesh_dim is None
  copy = lm.model_registry.GetParams('lm.CopyLMSmall', 'Train').task.stack
  with pytest.raises(stacks.StackError, match=(
      r'fsdp_mesh_dim=1: the stage body StageBlocks has no fsdp_mesh_dim '
      r'param; FSDP needs a body that gathers its weights')):
    stacks.SetSchedule(copy, dataclasses.replace(candidates[1], mesh=None))
  _, args = plan_flags.Parse(['--model', 'lm.LargestMeshSmall', '--mesh',
                              '1x4x2', '--circular_repeat', '2'])
  with pytest.raises(targets.PlanError, match=(
      r'--mesh 1x4x2 has a stage axis of 1 device \(no pipeline\), but '
      r'--circular_repeat asks for 2')):
    plan_cli._Candidates(None, args)  # pylint: disable=protected-access
