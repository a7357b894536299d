"""Planning the models users already have: Lingvo's own pipelined clients.

examples/lingvo_client_lm.py registers a task whose stack is Lingvo's
PipelinedTransformerLayers, unchanged; the planner finds its pipelined
layer in the built task (built with gpipe's layer switched in), varies the
client's own M and R, and plans it like one of ours.
"""

import pytest

import gpipe  # pylint: disable=unused-import
from gpipe import layers as gpipe_layers
from gpipe import lingvo_compat
from gpipe.lingvo_support import registered_models
from gpipe.model_step import stacks
from gpipe.model_step import train_step
from gpipe import plan
from gpipe.plan import candidate as candidate_lib
from gpipe.plan import roofline
from gpipe.plan import targets
from gpipe.xla import partitioning

MODEL = 'examples.lingvo_client_lm.PipelinedTransformerLM'


def _Task():
  return registered_models.GetParams(MODEL, 'Train').task


def test_the_client_is_found_and_reshaped_by_its_own_params():
  task = _Task()
  stack = stacks.FindStack(task, 'client task')
  assert isinstance(stack, stacks.LingvoClient) and stack.path == 'stack'
  stack.Reshape(task, targets.Candidate(2, 2), 'num_blocks')
  # M and R are the client's own; the depth S x R x num_layers is kept.
  assert task.stack.num_pipeline_microbatches == 2
  assert task.stack.circular_repeat == 2
  assert task.stack.pipeline_stage.num_layers == 1
  with pytest.raises(stacks.StackError,
                     match='do not split into 2 x 4 stage bodies'):
    stack.Reshape(task, targets.Candidate(2, 4), 'num_blocks')  # 2 % 4


def test_only_gpipes_default_remat_policy_can_be_planned_for_a_client():
  task = _Task()
  with pytest.raises(stacks.StackError,
                     match="remat_policy='save_all'.*plan only that one"):
    stacks.FindStack(task, 'client').Reshape(
        task, targets.Candidate(4, 1, 'save_all'), 'num_blocks')


def test_the_built_clients_stack_params_are_gpipes():
  target = targets.ModelTarget(MODEL)
  p = target.stack_params
  assert issubclass(p.cls, gpipe_layers.PipelinedLayer)
  assert (p.num_stages, p.num_microbatches, p.circular_repeat) == (2, 4, 1)
  assert p.shard_stages_1d


def test_a_task_without_a_pipelined_stack_is_refused_in_one_line():
  task = _Task()
  task.stack = None
  with pytest.raises(stacks.StackError, match='has 0 pipelined stacks'):
    stacks.FindStack(task, 'client task')


def test_the_client_task_is_planned_through_the_switch():
  if not partitioning.IsAvailable():
    pytest.skip('needs jax')
  target = targets.ModelTarget(MODEL)
  result = candidate_lib.MakePlan(
      target, [targets.Candidate(4, 1)], 2, roofline.CHIPS['v5e'], 2**30)
  report, = result.reports
  (_, layer), = train_step.FindPipelinedLayers(report.step.root)
  assert type(layer) is gpipe_layers.PipelinedLayer  # pylint: disable=unidiomatic-typecheck
  for arg, shard in zip(report.step.args, report.compiled.param_shard_shapes):
    if arg.on_stages:
      assert shard[0] == 1 and arg.spec.shape[0] == 2, (arg.name, shard)
  assert report.Problems() == []
  forward = report.LoopSummaries()[0]
  assert forward['by_mesh_axes']['collective-permute over stage'][
      'count'] >= 1


def test_an_unknown_module_is_said_in_one_line(capsys):
  assert plan.main(['--model', 'no_such_pkg.params.Model',
                    '--num_devices', '2']) == 2
  errors = [line for line in capsys.readouterr().err.splitlines()
            if line.startswith('plan: error:')]
  assert len(errors) == 1, errors
  assert errors[0].startswith(
      "plan: error: --model no_such_pkg.params.Model: Unknown model"), errors
  assert ("module no_such_pkg.params cannot be imported "
          "(ModuleNotFoundError: No module named 'no_such_pkg')") in errors[0]


# -- A task Lingvo's GShard builder pipelines (gshard_builder.UniTransformer).

GSHARD_MODEL = 'examples.lingvo_client_lm.GShardUniTransformerLM'


def test_a_gshard_builder_task_is_found_with_its_stages_split():
  """The builder's pipelined layer is built with its stage dim over the
  stages' devices (the builder sets no placement); M is the task's."""
  task = registered_models.GetParams(GSHARD_MODEL, 'Train').task
  stack = stacks.FindStack(task, 'gshard task')
  assert isinstance(stack, stacks.GshardClient) and stack.path == '.'
  p = stack.StackParams(task)
  assert p.cls is lingvo_compat.StagesOverDevicesLayer
  assert p.num_stages == 2 and p.shard_stages_1d
  stack.Reshape(task, targets.Candidate(2, 1), 'num_blocks')
  assert task.num_spmd_pipeline_microbatches == 2


def test_a_gshard_builder_task_plans_only_r1_and_the_default_policy():
  task = registered_models.GetParams(GSHARD_MODEL, 'Train').task
  stack = stacks.FindStack(task, 'gshard task')
  with pytest.raises(stacks.StackError,
                     match='without circular repeats; plan only '
                     'circular_repeat=1'):
    stack.Reshape(task, targets.Candidate(4, 2), 'num_blocks')
  with pytest.raises(stacks.StackError, match='plan only that one'):
    stack.Reshape(task, targets.Candidate(4, 1, 'save_all'), 'num_blocks')


def test_the_gshard_builder_task_is_planned_through_the_switch():
  """Its step, with the softmax weights read from theta (the task's
  read_vars_from_theta), partitions with each stage weight on its device
  and the rotation on the stage axis."""
  if not partitioning.IsAvailable():
    pytest.skip('needs jax')
  target = targets.ModelTarget(GSHARD_MODEL)
  result = candidate_lib.MakePlan(
      target, [targets.Candidate(4, 1), targets.Candidate(4, 2)], 2,
      roofline.CHIPS['v5e'], 2**30)
  report, = result.reports
  (_, reason), = result.skipped
  assert 'plan only circular_repeat=1' in reason
  (_, layer), = train_step.FindPipelinedLayers(report.step.root)
  assert isinstance(layer, lingvo_compat.StagesOverDevicesLayer)
  staged = [(a, s) for a, s in zip(report.step.args,
                                   report.compiled.param_shard_shapes)
            if a.on_stages]
  assert staged
  for arg, shard in staged:
    assert shard[0] == 1 and arg.spec.shape[0] == 2, (arg.name, shard)
  assert report.Problems() == []
  forward = report.LoopSummaries()[0]
  assert set(forward['by_mesh_axes']) == {'collective-permute over stage'}
