"""The plan command: what it prints, and what it refuses before building.

`python -m gpipe.plan` (gpipe.plan.main) on the small pipelined layer of
plan_test.py (--params tests.plan.plan_test.LayerParams):
  * the JSON fields and the recommendation; the backward schedules and
    stream_io as candidates, and their stored activations, loops, permutes
    and temporaries;
  * a clear error for a --num_devices that does not match the stages, an
    unknown model, a circular repeat that changes the depth;
  * the planner's edges: every candidate skipped (non-zero exit, each
    reason), a candidate skipped while building never said to compile,
    nonsensical numbers and unwritable plot paths refused before anything
    is built, the model's own error reported as an error, an input of the
    wrong shape named in one line;
  * Lingvo's own layer (--pipeline_layer lingvo) built for the same step,
    and its failure in XLA said in one line.
"""

import json
import re
import subprocess

import pytest

import gpipe  # pylint: disable=unused-import
from gpipe import lingvo_compat
from gpipe.lingvo_support import tpu_build
from gpipe.model_step import train_step
from gpipe import plan
from gpipe.plan import candidate as candidate_lib
from gpipe.plan import roofline
import params.lm  # pylint: disable=unused-import  (the registered lm.* models)
from tests.plan import plan_test
from tensorflow.python.compiler.xla.experimental import xla_sharding

DIM, BATCH = plan_test.DIM, plan_test.BATCH
NUM_STAGES, NUM_MICROBATCHES = plan_test.NUM_STAGES, plan_test.NUM_MICROBATCHES


def test_backward_schedules_and_stream_io_as_candidates(capsys):
  """--backward_schedule reverse,1f1b and --stream_io false,true plan the
  four combinations: 1f1b's stored activations are its rings, 2 R S - 1
  stage inputs per device (reverse's the T-row history), its gradient
  runs in three loops with one forward more, and stream_io's inputs,
  outputs and their gradients are 1/S per device, so temp falls."""
  status = plan.main([
      '--params', 'tests.plan.plan_test.LayerParams', '--input_shape',
      f'{BATCH},{DIM}', '--num_devices', str(NUM_STAGES), '--tpu', 'v5e',
      '--hbm_gib', '16', '--num_microbatches', '8', '--backward_schedule',
      'reverse,1f1b', '--stream_io', 'false,true', '--json'])
  assert status == 0
  report = json.loads(capsys.readouterr().out)
  got = {(c['backward_schedule'], c['stream_io']): c
         for c in report['candidates']}
  assert set(got) == {('reverse', False), ('reverse', True),
                      ('1f1b', False), ('1f1b', True)}
  t = NUM_MICROBATCHES + NUM_STAGES - 1
  slot = BATCH // NUM_MICROBATCHES * DIM * 4  # one microbatch's activations
  ring = 2 * NUM_STAGES - 1
  for (schedule, stream_io), c in got.items():
    stored = c['stored_activation_bytes']
    (forward,) = [loop for loop in c['loops'] if loop['role'] == 'forward']
    backward = sorted(loop['iterations'] for loop in c['loops']
                      if loop['role'] == 'backward')
    assert forward['iterations'] == t
    if schedule == 'reverse':
      assert stored == t * slot, (schedule, stream_io, stored)
      assert backward == [t]
    else:
      assert stored == ring * slot, (schedule, stream_io, stored)
      delay = NUM_STAGES - 1
      assert backward == sorted([delay, t - delay, delay])
    # The forward loop's permutes: the buffer, and with stream_io one
    # column of the input stream and one of the output stream.
    assert forward['collectives'] == {'collective-permute': {
        'count': 3 if stream_io else 1, 'bytes': (3 if stream_io else 1) *
        slot}}, forward
    assert c['flops_ratio'] == pytest.approx(1.0, abs=0.02)
  # 1f1b runs the forward once more: 2 of the 4 matmuls of a layer's step
  # (see test_flops_match_a_count_of_the_matmuls) again, 5 / 4.
  ratio = (got[('1f1b', False)]['flops_per_device'] /
           got[('reverse', False)]['flops_per_device'])
  assert 1.15 < ratio < 1.3, ratio
  temp = {k: c['per_device_bytes']['temp'] for k, c in got.items()}
  assert temp[('1f1b', True)] < temp[('reverse', True)] < temp[
      ('reverse', False)], temp
  assert temp[('1f1b', True)] < temp[('1f1b', False)], temp


def test_stream_io_alone_means_true_and_lingvo_clients_plan_defaults_only():
  from gpipe.plan import flags  # pylint: disable=g-import-not-at-top
  _, args = flags.Parse(['--params', 'x.P', '--stream_io'])
  assert args.stream_io == [True]
  _, args = flags.Parse(['--params', 'x.P', '--stream_io', 'false,true'])
  assert args.stream_io == [False, True]
  with pytest.raises(SystemExit):
    flags.Parse(['--params', 'x.P', '--backward_schedule', 'forward'])
  from gpipe.model_step import stacks  # pylint: disable=g-import-not-at-top
  with pytest.raises(stacks.StackError, match=r"plan only those"):
    stacks._OnlyTheDefaultPolicy(  # pylint: disable=protected-access
        plan.Candidate(8, 1, backward_schedule='1f1b'), 'AClient')


def test_plan_command_json(capsys, tmp_path):
  status = plan.main([
      '--params', 'tests.plan.plan_test.LayerParams', '--input_shape',
      f'{BATCH},{DIM}', '--num_devices', str(NUM_STAGES), '--tpu', 'v5e',
      '--hbm_gib', '16', '--num_microbatches', '8,5', '--json', '--plot',
      str(tmp_path / 'plan.png')
  ])
  assert status == 0
  assert (tmp_path / 'plan.png').read_bytes()[:4] == b'\x89PNG'
  report = json.loads(capsys.readouterr().out)
  assert report['num_devices'] == NUM_STAGES
  assert report['total_weight_bytes'] == NUM_STAGES * (DIM * DIM + DIM) * 4
  (candidate,) = report['candidates']
  for key in ('num_microbatches', 'circular_repeat', 'iterations',
              'bubble_fraction', 'per_device_bytes', 'fits',
              'flops_per_device', 'flops_unpartitioned',
              'permute_bytes_per_iteration', 'predicted_step_seconds'):
    assert key in candidate, key
  assert set(candidate['per_device_bytes']) == {'weights', 'optimizer',
                                                'temp', 'peak'}
  assert candidate['iterations'] == NUM_MICROBATCHES + NUM_STAGES - 1
  sizes = [b['bytes'] for b in candidate['largest_buffers']]
  assert sizes and sizes == sorted(sizes, reverse=True)
  assert report['recommended'] == 0
  predicted = candidate['predicted']
  for key in ('compute_seconds', 'bubble_seconds', 'memory_traffic_seconds',
              'memory_traffic_bytes', 'collective_seconds', 'model_flops',
              'mfu', 'overlap', 'hidden_collective_seconds',
              'step_seconds_overlapped', 'mfu_overlapped'):
    assert key in predicted, key
  assert predicted['step_seconds'] == candidate['predicted_step_seconds']
  assert predicted['step_seconds_overlapped'] <= predicted['step_seconds']
  for key in ('xla_cpu_unfused_bytes_accessed_per_device',
              'stored_activation_bytes', 'loop_flops_per_device'):
    assert key in candidate and key in report['measured_by_xla'], key
  assert 'predicted' in report['predicted_by_the_roofline_model']
  # M=5 does not divide the batch of 24: skipped, with the reason.
  (skipped,) = report['skipped']
  assert skipped['num_microbatches'] == 5
  assert '24' in skipped['reason'], skipped
  assert report['tpu']['name'] == 'v5e'


def test_plan_command_rejects_a_device_count_before_compiling(capsys):
  status = plan.main([
      '--params', 'tests.plan.plan_test.LayerParams', '--input_shape',
      f'{BATCH},{DIM}', '--num_devices', '8'
  ])
  err = capsys.readouterr().err
  assert status == 2
  assert '--num_devices 8' in err and 'num_stages=4' in err, err


def test_plan_command_lists_the_registered_models_for_an_unknown_one(capsys):
  assert plan.main(['--model', 'CopyLMSmall', '--num_devices', '4']) == 2
  err = capsys.readouterr().err
  assert ("--model CopyLMSmall: Unknown model 'CopyLMSmall'. Did you mean "
          'lm.CopyLMSmall? Registered: ') in err, err
  assert 'lm.CopyLMPod8x2, ' in err and 'lm.CopyLMSmall' in err


def test_plan_command_rejects_a_circular_repeat_that_changes_depth(capsys):
  status = plan.main([
      '--params', 'tests.plan.plan_test.LayerParams', '--input_shape',
      f'{BATCH},{DIM}', '--circular_repeat', '2', '--json'
  ])
  assert status == 2  # nothing could be planned
  report = json.loads(capsys.readouterr().out)
  assert report['candidates'] == [] and report['recommended'] is None
  assert 'num_blocks' in report['skipped'][0]['reason']


def _Command(*extra):
  return ['--params', 'tests.plan.plan_test.LayerParams', '--input_shape',
          f'{BATCH},{DIM}', *extra]


@pytest.fixture
def nothing_compiled(monkeypatch):
  """Fails whatever tries to build and compile a candidate."""

  def Refuse(*args, **kwargs):
    raise AssertionError('a candidate was built')

  monkeypatch.setattr(candidate_lib, 'PlanCandidate', Refuse)


def test_plan_command_when_every_candidate_is_skipped(capsys,
                                                      nothing_compiled):
  status = plan.main(_Command('--num_microbatches', '5,7'))
  err = capsys.readouterr().err
  assert status == 2
  assert 'every candidate was skipped' in err, err
  for m in (5, 7):
    assert re.search(rf'M={m} R=1 recompute: Batch size 24 .*'
                     rf'num_microbatches={m}', err), err
  assert 'none of the candidates fits' not in err


def test_a_candidate_skipped_while_building_is_never_said_to_compile(
    monkeypatch):
  """A candidate the target refuses while building (e.g. a mesh that would
  split a block) is listed as skipped, with no 'Compiling' line."""

  class _Refusing:

    def Build(self, candidate, depth_param):
      raise plan.PlanError('half a block per stage body')

  monkeypatch.setattr(candidate_lib, 'CheckCandidate', lambda t, c: None)
  said = []
  result = candidate_lib.MakePlan(
      _Refusing(), [plan.Candidate(8, 2)], NUM_STAGES,
      roofline.CHIPS['v5e'], 16 * 2**30, log=said.append)
  assert said == [] and not result.reports
  [(candidate, reason)] = result.skipped
  assert candidate.circular_repeat == 2
  assert reason == 'half a block per stage body'


@pytest.mark.parametrize('flag, value', [
    ('--hbm_gib', '0'), ('--hbm_gib', '-16'), ('--hbm_gib', 'nan'),
    ('--num_devices', '0'), ('--num_devices', '-4'),
])
def test_plan_command_refuses_nonsense_numbers(flag, value, capsys,
                                               nothing_compiled):
  with pytest.raises(SystemExit) as exit_info:
    plan.main(_Command(flag, value))
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert f'argument {flag}: expected' in err and 'above 0' in err, err


def test_links_per_axis_divide_the_bytes_on_the_wire(capsys):
  """The same plan with 1, 2 and 4 links along the stage axis: a
  collective's hops and HBM traffic stay, its bytes on the wire take 1,
  1/2 and 1/4 the time, so c1 - c2 = 2 (c2 - c4) exactly. On a 2x2 v5e
  slice (no dimension closes) the 4 stages span both dimensions: 2 links,
  c2 again."""
  seconds = []
  for extra in ((), ('--links_per_axis', '2'), ('--links_per_axis', '4'),
                ('--slice', '2x2')):
    assert plan.main(_Command('--num_devices', str(NUM_STAGES), '--tpu',
                              'v5e', '--num_microbatches', '8', '--json',
                              *extra)) == 0
    report = json.loads(capsys.readouterr().out)
    (candidate,) = report['candidates']
    assert candidate['links_per_axis'] == (
        [2] if '2x2' in extra else [int(n) for n in extra[1:]])
    seconds.append(candidate['predicted']['collective_seconds'])
  c1, c2, c4, on_slice = seconds
  assert c1 > c2 > c4 > 0
  assert c1 - c2 == pytest.approx(2 * (c2 - c4), rel=1e-9)
  assert on_slice == pytest.approx(c2, rel=1e-12)


def test_plan_command_wants_links_for_each_mesh_axis(capsys,
                                                    nothing_compiled):
  """The layer's stages are on a 1-D mesh: one figure, not three; a slice
  with other devices than the plan's, or beside links given, is refused."""
  assert plan.main(_Command('--links_per_axis', '1,4,1')) == 2
  err = capsys.readouterr().err
  assert ('plan: error: --links_per_axis 1,4,1 gives 3 figures for a mesh '
          'of 1 axes; give one per axis.') in err, err
  with pytest.raises(SystemExit):
    plan.main(_Command('--links_per_axis', '0'))
  assert 'expected positive integers' in capsys.readouterr().err
  assert plan.main(_Command('--slice', '2x2', '--links_per_axis', '2')) == 2
  assert ('--slice and --links_per_axis both say the links: give one.' in
          capsys.readouterr().err)
  assert plan.main(_Command('--slice', '4x2')) == 2
  assert ('plan: error: --slice 4x2: mesh 4 has 4 devices, the slice 4x2 8: '
          "give a mesh of the slice's chips.") in capsys.readouterr().err


@pytest.mark.parametrize('name, why', [
    ('missing/plan.png', 'does not exist'), ('plan.jpg', 'expected a .png'),
])
def test_plan_command_refuses_an_unwritable_plot(name, why, tmp_path, capsys,
                                                 nothing_compiled):
  with pytest.raises(SystemExit) as exit_info:
    plan.main(_Command('--plot', str(tmp_path / name)))
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert 'argument --plot' in err and why in err, err


@pytest.mark.parametrize('params, error', [
    ('TypeErrorLayerParams', 'TypeError: the layer cannot run on inputs of '
     f'shape [{BATCH}, {DIM}]: the body got a wrong argument'),
    ('ShapeErrorLayerParams', 'ValueError: the layer cannot run on inputs of '
     f'shape [{BATCH}, {DIM}]: Dimensions must be equal'),
])
def test_a_model_error_is_an_error_not_a_skipped_candidate(params, error,
                                                           capsys):
  status = plan.main([
      '--params', f'tests.plan.plan_test.{params}', '--input_shape',
      f'{BATCH},{DIM}', '--json'
  ])
  captured = capsys.readouterr()
  assert status == 1
  assert 'M=8 R=1 recompute' in captured.err and error in captured.err, (
      captured.err)
  assert captured.out == ''  # no plan, and not a skipped candidate


def test_an_input_of_the_wrong_shape_is_named_in_one_line(capsys):
  status = plan.main(['--params', 'tests.plan.plan_test.LayerParams',
                      '--input_shape', f'{BATCH},{DIM // 2}'])
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 1
  assert err[-2] == (
      'plan: error: building or compiling M=8 R=1 recompute: ValueError: input 0 '
      f'has shape [{BATCH}, {DIM // 2}]; the stage body takes {DIM} features '
      f'in the last dim, not {DIM // 2} (the layer runs on [{BATCH}, {DIM}])'
  ), err


def test_lingvos_own_layer_is_built_for_the_same_step():
  """--pipeline_layer lingvo builds Lingvo's layer from the same Params,
  its stage weights annotated as on a TPU (the planner lowers as for one)."""
  target = plan.LayerTarget(plan_test.LayerParams(), [(BATCH, DIM)],
                            lingvos_layer=True)
  with tpu_build.AsOnTpu():
    step = target.Build(plan.Candidate(NUM_MICROBATCHES, 1), 'num_blocks')
  (_, stack), = train_step.FindPipelinedLayers(step.root)
  assert type(stack) is lingvo_compat.LingvosOwnLayer()
  assert stack.params.num_stages == NUM_STAGES
  for var in stack.vars.Flatten():
    sharding = xla_sharding.get_op_sharding(var.op)
    assert sharding is not None, var.name


def test_lingvos_own_layer_failing_xla_is_said_in_one_line(capsys):
  """Lingvo's layer does not get through XLA's SPMD partitioner here: the
  plan stops with the abort's own line, not a stack trace."""
  status = plan.main(_Command('--pipeline_layer', 'lingvo', '--json'))
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 1
  assert err[-2].startswith('plan: error: building or compiling M=8 R=1'), err
  assert 'XLA stopped at Check failed' in err[-2], err


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))


def test_a_compile_over_its_time_is_said_with_the_flag_to_give_more(
    capsys, monkeypatch):
  """--compile_timeout_minutes reaches every compile of a candidate; one
  that outlives it is an error of one line naming the flag."""
  given = []

  def SlowCompile(proto, num_devices, aliases=(), timeout=None):
    given.append(timeout)
    raise subprocess.TimeoutExpired(['spmd_worker'], timeout)

  monkeypatch.setattr(candidate_lib.partitioning, 'CompileFromShapes',
                      SlowCompile)
  status = plan.main(_Command('--num_microbatches', '8',
                              '--compile_timeout_minutes', '0.5'))
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 1
  assert given == [30.0], given
  assert err[-2] == (
      'plan: error: building or compiling M=8 R=1 recompute: TimeoutExpired: '
      'the compile took longer than 0.5 minutes: give it more with '
      '--compile_timeout_minutes'), err


def test_the_unpartitioned_compile_over_its_time_is_said_too(capsys,
                                                             monkeypatch):
  """The one-device compile (the unpartitioned step's FLOPs, run when the
  report is printed) that outlives its time: the same one line, no
  traceback."""
  compile_from_shapes = candidate_lib.partitioning.CompileFromShapes

  def SlowOnOneDevice(proto, num_devices, aliases=(), timeout=None):
    if num_devices == 1:
      raise subprocess.TimeoutExpired(['spmd_worker'], timeout)
    return compile_from_shapes(proto, num_devices, aliases, timeout)

  monkeypatch.setattr(candidate_lib.partitioning, 'CompileFromShapes',
                      SlowOnOneDevice)
  for json_flag in ((), ('--json',)):
    status = plan.main(_Command('--num_microbatches', '8',
                                '--compile_timeout_minutes', '2', *json_flag))
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert status == 1, json_flag
    assert err[-2] == (
        'plan: error: building or compiling M=8 R=1 recompute: '
        'TimeoutExpired: the compile took longer than 2 minutes: give it '
        'more with --compile_timeout_minutes'), err
    assert 'Traceback' not in captured.err and captured.out == '', json_flag
