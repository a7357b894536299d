"""The pipelined layer partitions as intended on N virtual CPU devices.

Each case lowers one training step (forward, loss, gradients w.r.t. every
weight and the input) to HLO, partitions it with XLA's SPMD partitioner
(jaxlib) and runs it (gpipe.check_partitioning). Checked:
  * the partitioned results equal the same step run unpartitioned on one
    device (which tests/layers_test.py checks against the plain stack);
  * the forward loop and its backward loop each hold exactly one
    collective-permute per carried buffer tensor, and nothing that moves a
    weight (all-gather / all-to-all of a weight's shape) runs anywhere;
  * each device holds one stage of every stage-stacked weight (leading dim
    1), or 1/S of each per-stage variable's split dim.
A negative control shows that a wrong annotation is caught.

Shapes are chosen so no activation has a weight's shape (feature dim 8,
microbatches of 3 rows, or 6 on the 2-D mesh), which the shape-based
weight-movement check relies on, and so every split is even (the runner
places whole shards only); two cases take microbatches of 2 and 1 rows on
purpose (see CASES), where no collective is expected anyway.
"""

import dataclasses

import re
import types

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import check_partitioning
from gpipe import layers
from gpipe import sharding
from gpipe.xla import dependencies
from gpipe.xla import hlo_text
from gpipe.xla import partitioned_step
from gpipe.xla import partitioning
from gpipe.xla import user_layer
from lingvo.core import py_utils
from tests import reference_bodies

DIM = 8


@dataclasses.dataclass(frozen=True)
class Case:
  num_stages: int
  circular_repeat: int = 1
  per_stage_vars: bool = False
  mesh: bool = False  # stages over axis 0 of a [S, 2] mesh; batch over axis 1
  # dense | multi (3 buffer tensors, a None input) | training (dropout, aux
  # loss and summaries inside the manual region) | stateful (a moving average
  # in a non-trainable variable, carried through the loop)
  body: str = 'dense'
  num_microbatches: int = 8
  remat_policy: str = 'recompute'
  rows: int = 0  # rows per microbatch; 0: 3, or 6 on the mesh
  delayed_sends: bool = False  # each hand-off one iteration later


  @property
  def num_devices(self):
    return self.num_stages * (2 if self.mesh else 1)

  @property
  def microbatch_rows(self):
    return self.rows or (6 if self.mesh else 3)

  @property
  def device_mesh(self):
    return np.arange(self.num_devices).reshape(self.num_stages, 2)

  def Params(self, layer_cls=layers.PipelinedLayer):
    if self.mesh:
      body = reference_bodies.MeshDenseBody.Params().Set(
          dim=DIM, device_mesh=self.device_mesh, batch_mesh_dim=1)
    elif self.body == 'multi':
      body = reference_bodies.MultiInputBody.Params().Set(dim=DIM)
    elif self.body == 'training':
      body = reference_bodies.TrainingBody.Params().Set(dim=DIM, keep_prob=0.5)
    elif self.body == 'stateful':
      body = reference_bodies.StatefulBody.Params().Set(dim=DIM,
                                                        with_counter=False)
    else:
      body = reference_bodies.DenseBody.Params().Set(dim=DIM)
    p = layer_cls.Params().Set(
        name='pipe',
        num_stages=self.num_stages,
        num_microbatches=self.num_microbatches,
        circular_repeat=self.circular_repeat,
        per_stage_vars=self.per_stage_vars,
        single_stage_body=body,
        remat_policy=self.remat_policy,
        delayed_sends=self.delayed_sends,
        random_seed=7)
    if self.mesh:
      p.Set(pipeline_stage_mesh_dim=0, device_mesh=self.device_mesh)
    else:
      p.Set(shard_stages_1d=True)
    return p

  def InputShapes(self):
    batch = self.num_microbatches * self.microbatch_rows
    if self.body == 'multi':
      return [(batch, DIM), (batch, DIM), (batch,)]
    return [(batch, DIM)]

  @property
  def num_buffer_tensors(self):
    return len(self.InputShapes())


def _CaseId(case):
  parts = [f'S{case.num_stages}', f'dev{case.num_devices}',
           f'R{case.circular_repeat}']
  if case.per_stage_vars:
    parts.append('per_stage_vars')
  if case.mesh:
    parts.append('mesh4x2' if case.num_stages == 4 else 'mesh')
  if case.body != 'dense':
    parts.append(case.body)
  if case.remat_policy != 'recompute':
    parts.append(case.remat_policy)
  if case.rows:
    parts.append(f'rows{case.rows}')
  if case.delayed_sends:
    parts.append('delayed_sends')
  return '-'.join(parts)


# The dense body's circular cases (S4-dev4-R2, with remat_policy
# 'recompute' and 'save_all') run as the training body's: TrainingBody is
# DenseBody's tanh(x @ w + b) with dropout, an aux loss and a summary added,
# the same weights, and every check below the same.
#
# The plain S4-dev4 and S4-dev8-mesh4x2 cases are not rows of their own:
# every two of their settings meet in other rows (S=4 with the stacked
# dense body in the per-stage and circular rows, R=1 with the mesh in the
# save_dots row, the mesh with remat_policy 'recompute' in its circular
# row, the stacked dense body at R=1 at S=2 and S=8).
CASES = [
    Case(num_stages=2),
    Case(num_stages=8),
    Case(num_stages=4, per_stage_vars=True),
    Case(num_stages=4, circular_repeat=2, per_stage_vars=True),
    Case(num_stages=4, circular_repeat=2, mesh=True),
    Case(num_stages=2, body='multi'),
    Case(num_stages=4, circular_repeat=2, body='training'),
    Case(num_stages=4, circular_repeat=2, body='stateful'),
    # Activations stored per iteration leave the manual region split over
    # the stages and come back per device: no extra communication.
    Case(num_stages=4, mesh=True, remat_policy='save_dots'),
    Case(num_stages=4, circular_repeat=2, body='training',
         remat_policy='save_all'),
    # Zeros and sums of the loop's own bookkeeping shaped like the body's
    # (a [R, 8] bias gradient and [2, 8] microbatches; 1-row microbatches):
    # the partitioner aborted when XLA's lowering shared their constants
    # across the manual region's boundary.
    Case(num_stages=2, circular_repeat=2, rows=2),
    Case(num_stages=2, rows=1),
    # Delayed sends: the rotation's permute of the outputs before, beside
    # the stages' calls (test_delayed_sends_permute_beside_the_calls).
    Case(num_stages=4, circular_repeat=2, delayed_sends=True),
    Case(num_stages=4, mesh=True, body='dense', delayed_sends=True),
]


class _MultiInputLayer(layers.PipelinedLayer):
  """Feeds MultiInputBody its (x, None, NestedMap(a, b)) structure."""

  def FProp(self, theta, x, a, b):
    out = super().FProp(theta, x, None, py_utils.NestedMap(a=a, b=b))
    return out[0], out[2].a, out[2].b


def _Check(case, layer_cls=None):
  if layer_cls is None:
    layer_cls = (_MultiInputLayer if case.body == 'multi' else
                 layers.PipelinedLayer)
  return user_layer.CheckPartitioning(
      case.Params(layer_cls), case.InputShapes(), case.num_devices)


_CHECKED = {}


def _CheckedOnce(case):
  """_Check(case), once per process: the fixture's and the command's."""
  if not partitioning.IsAvailable():
    pytest.fail('jax and jaxlib are needed (they are in the test extra).')
  if case not in _CHECKED:
    _CHECKED[case] = _Check(case)
  return _CHECKED[case]


@pytest.fixture(scope='module', params=CASES, ids=[_CaseId(c) for c in CASES])
def checked(request):
  case = request.param
  return case, _CheckedOnce(case)


def test_partitioned_step_equals_unpartitioned(checked):
  _, report = checked
  names = report.step.ResultNames()
  assert len(report.run.outputs) == len(report.expected) == len(names)
  for name, got, want in zip(names, report.run.outputs, report.expected):
    assert got.shape == want.shape, name
    assert np.abs(want).max() > 0, f'{name} is all zero: nothing checked'
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


def test_each_loop_shifts_each_buffer_tensor_with_one_permute(checked):
  case, report = checked
  run = report.run
  assert len(run.loops) == 2, f'expected forward + backward loop: {run.loops}'
  for loop in range(2):
    counts = run.LoopCounts(loop)
    assert counts.get('collective-permute') == case.num_buffer_tensors, (
        loop, counts)
    assert 'all-to-all' not in counts, (loop, counts)
  # The forward loop needs nothing but the shift.
  assert set(run.LoopCounts(0)) == {'collective-permute'}, run.LoopCounts(0)


def test_summary_labels_each_loop_by_its_role_and_iterations(checked):
  """'loop 0, forward (T iterations)', then its backward loop; XLA's name
  for a loop's computation only with verbose (--verbose)."""
  case, report = checked
  s, m, r = case.num_stages, case.num_microbatches, case.circular_repeat
  h = 2 if case.delayed_sends else 1  # iterations a hop from stage to stage
  # T: M + h (S - 1), or with R > 1 R whole segments of h S microbatches.
  t = (m if r == 1 else r * -(-m // (h * s)) * h * s) + h * (s - 1)
  assert report.LoopLabels() == [f'forward ({t} iterations)',
                                 f'backward ({t} iterations)']
  summary = report.Summary()
  assert (f'  loop 0, forward ({t} iterations), per iteration: '
          f'{case.num_buffer_tensors} collective-permute over stage\n'
          in summary), summary
  assert f'  loop 1, backward ({t} iterations), per iteration: ' in summary
  verbose = report.Summary(verbose=True)
  for i, body in enumerate(report.run.loops):
    assert body not in summary, summary
    assert f'  loop {i}, ' in verbose and f'; XLA body {body}), ' in verbose


def test_delayed_sends_permute_beside_the_calls(checked):
  """In the forward loop's body, every dot of the stages' calls runs
  beside each permute (neither feeds it nor waits for it) with delayed
  sends; without, the dots that make what it sends feed it: what lets the
  hand-off hide."""
  case, report = checked
  run = report.run
  module = dependencies.Module(run.hlo)
  permutes = [c for c in run.collectives
              if c.loop == 0 and c.kind == 'collective-permute']
  assert len(permutes) == case.num_buffer_tensors, permutes
  fed = {}  # permute: the dots that feed it or wait for it
  for c in permutes:
    work = module.Work(c.computation)
    assert work, f'no dot in {c.computation}'
    fed[c.name] = set(work) - module.Beside(c.computation, c.name)
  if case.delayed_sends:
    assert not any(fed.values()), fed
  else:  # a leaf a body passes on undotted is sent beside the dots
    assert any(fed.values()), fed


def test_no_weight_is_gathered(checked):
  case, report = checked
  assert not report.GatheredWeights(), report.Summary()
  all_to_all = [c for c in report.run.collectives if c.kind == 'all-to-all']
  if case.per_stage_vars:
    # The documented reshard: each per-stage variable from its split dim to
    # the stage dim, once forward and once for its gradient, outside loops.
    assert all(c.loop == -1 for c in all_to_all), all_to_all
    assert len(all_to_all) == 2 * len(report.step.weight_names) // (
        case.num_stages), all_to_all
  else:
    assert not all_to_all, report.Summary()


def test_each_device_holds_one_stage_of_the_weights(checked):
  case, report = checked
  for name, full, shard in report.WeightShapes():
    if case.per_stage_vars:
      dim = sharding.LeastPaddingDim(list(full), case.num_stages)
      expected = list(full)
      expected[dim] = -(-full[dim] // case.num_stages)
      assert list(shard) == expected, (name, full, shard)
    else:
      assert shard == (1,) + full[1:], (name, full, shard)
  per_device, total = report.WeightBytes()
  assert per_device <= -(-total // case.num_stages) * 1.5, (per_device, total)


class _ReplicatedWeightsLayer(layers.PipelinedLayer):
  """A wrong annotation: the stacked weights marked replicated."""

  def _LoopTheta(self, theta):
    stacked = super()._LoopTheta(theta)
    return tf.nest.map_structure(sharding.Replicate, stacked)


def test_negative_control_catches_replicated_weights():
  if not partitioning.IsAvailable():
    pytest.fail('jax and jaxlib are needed (they are in the test extra).')
  case = Case(num_stages=4)
  report = _Check(case, _ReplicatedWeightsLayer)
  # The numbers are still right: only the collectives show the mistake.
  assert report.max_abs_diff < 1e-5
  gathered = set()
  for c in report.GatheredWeights():
    gathered.update(hlo_text.ShapesOf(c.shape))
  full_shapes = {full for _, full, _ in report.WeightShapes()}
  assert full_shapes <= gathered, report.Summary()
  assert report.Problems(1e-4)[0].startswith('WEIGHTS GATHERED')


def CliParams():
  return Case(num_stages=2).Params()


def test_check_partitioning_command(monkeypatch, capsys):
  """The command checks the layer its flags name, with the check the
  fixture's case S2-dev2-R1 ran on the same Params, shapes and devices (run
  once per process), and prints its summary and verdict."""
  case = Case(num_stages=2)
  called = []

  def Check(params, input_shapes, num_devices):
    assert params.ToText() == case.Params().ToText()
    assert [tuple(shape) for shape in input_shapes] == case.InputShapes()
    assert num_devices == case.num_devices
    called.append(1)
    return _CheckedOnce(case)

  monkeypatch.setattr(check_partitioning, 'CheckPartitioning', Check)
  status = check_partitioning.main([
      '--params', 'tests.xla.partitioning_test.CliParams', '--input_shape',
      f'24,{DIM}'
  ])
  out = capsys.readouterr().out
  assert status == 0, out
  assert 'Partitioned for 2 virtual devices.' in out
  # 8 microbatches on 2 stages: 8 + 2 - 1 iterations.
  assert ('  loop 0, forward (9 iterations), per iteration: 1 '
          'collective-permute over stage\n') in out, out
  assert '  loop 1, backward (9 iterations), per iteration: ' in out, out
  assert 'body.w: [2, 8, 8] -> [1, 8, 8]' in out
  assert out.strip().endswith('OK')
  assert called


def test_weights_held_whole_are_reported_not_split():
  report = partitioned_step.Report(
      run=types.SimpleNamespace(param_shard_shapes=[(4, 8, 8), (1, 8)]),
      step=partitioned_step.PipelineStep(
          fn=None, weight_names=['body.w', 'body.b'], grad_names=[],
          num_inputs=0, variables=[],
          args=[np.zeros([4, 8, 8]), np.zeros([4, 8])]),
      expected=[], num_stages=4)
  assert report.UnsplitWeights() == ['body.w']


def BodyParams():
  return reference_bodies.DenseBody.Params().Set(dim=DIM)


def UnshardedCliParams():
  return CliParams().Set(shard_stages_1d=False)


@pytest.mark.parametrize('argv, message', [
    (['--params', 'tests.xla.partitioning_test.CliParams', '--num_devices',
      '4'],
     r'--num_devices 4 does not match the layer: shard_stages_1d splits the '
     r'stage dim over num_stages=2 devices. Use --num_devices 2.'),
    (['--params', 'tests.xla.partitioning_test.UnshardedCliParams'],
     r'neither shard_stages_1d nor pipeline_stage_mesh_dim is set.*Set '
     r'shard_stages_1d=True'),
    (['--params', 'tests.xla.partitioning_test.NoSuchParams'],
     r"--params tests.xla.partitioning_test.NoSuchParams: module "
     r"'tests.xla.partitioning_test' has no attribute 'NoSuchParams'"),
    (['--params', 'tests.xla.partitioning_test.BodyParams'],
     r'--params tests.xla.partitioning_test.BodyParams is Params of '
     r'DenseBody, not of a PipelinedLayer.'),
    (['--params', 'tests.xla.partitioning_test.CliParams', '--input_shape',
      '25,8'],
     r'Batch size 25 is not divisible by num_microbatches=\d+'),
    (['--params', 'tests.xla.partitioning_test.CliParams', '--input_shape',
      '24,5'],
     r'input 0 has shape \[24, 5\]; the stage body takes 8 features in the '
     r'last dim, not 5 \(the layer runs on \[24, 8\]\)$'),
    (['--params', 'tests/xla/partitioning_test.py'],
     r'--params tests/xla/partitioning_test.py names a file but no attribute: '
     r'write tests/xla/partitioning_test.py:<attribute>.'),
    (['--params', 'tests/no_such_file.py:CliParams'],
     r'--params tests/no_such_file.py:CliParams: no file .*no_such_file.py$'),
    (['--params', 'tests/xla/partitioning_test.py:CliParams', '--input_shape',
      '24,8,3'],
     r'input 0 has shape \[24, 8, 3\]; the stage body takes 8 features in '
     r'the last dim, not 3'),
])
def test_check_partitioning_command_rejects_in_one_line(capsys, argv,
                                                          message):
  if '--input_shape' not in argv:
    argv = argv + ['--input_shape', f'24,{DIM}']
  status = check_partitioning.main(argv)
  captured = capsys.readouterr()
  assert status == 2, captured
  err = captured.err.strip()
  assert len(err.splitlines()) == 1, err
  assert err.startswith('check_partitioning: error: ')
  assert not err.endswith(':')
  assert re.search(message, err), err
  assert not captured.out


def test_tensorflow_messages_are_made_one_whole_line():
  with tf.Graph().as_default():
    with pytest.raises(tf.errors.InvalidArgumentError) as failed:
      tf.debugging.assert_equal(tf.constant(12), tf.constant(8))
    with pytest.raises(ValueError) as mismatched:
      tf.matmul(tf.zeros([3, 12]), tf.zeros([8, 8]))
  assert str(failed.value).splitlines()[0].endswith(':')  # as TF says it
  line = user_layer.TensorFlowMessage(failed.value)
  assert re.fullmatch(r'Condition x == y did not hold element-wise \(x = 12, '
                      r'y = 8 in \S+\)', line), line
  line = user_layer.TensorFlowMessage(mismatched.value)
  assert '\n' not in line and not line.endswith((':', '.'))
  assert re.search(r'but are 12 and 8 in op \S+ \(its inputs have shapes '
                   r'\[3,12\], \[8,8\]\)$', line), line


def test_an_xla_abort_is_named_in_one_line():
  log = ('Partitioning for 2 devices failed (exit code -6):\n'
         'W1125 06:21:44.134759   18623 sharding_propagation.cc:3132] GSPMD '
         'sharding propagation is going to be deprecated.\n'
         'F1125 06:21:44.139553   18623 hlo_sharding.h:754] Check failed: '
         'IsTiledLeaf() \n*** Check failure stack trace: ***\n'
         '    @     0x7f7af0440634  absl::LogMessage::SendToLog()\n')
  assert user_layer.PartitionerMessage(RuntimeError(log)) == (
      'Partitioning for 2 devices failed (exit code -6): XLA stopped at '
      'Check failed: IsTiledLeaf() (hlo_sharding.h:754)')


_TOY_HLO = """\
HloModule toy

%fused (p0: f32[2]) -> f32[2] {
  %p0 = f32[2]{0} parameter(0)
  ROOT %cp = f32[2]{0} collective-permute(%p0), source_target_pairs={{0,1},{1,0}}
}

%body (arg: (s32[], f32[2])) -> (s32[], f32[2]) {
  %arg = (s32[], f32[2]{0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[2]{0} get-tuple-element(%arg), index=1
  %f = f32[2]{0} fusion(%x), kind=kLoop, calls=%fused
  %ag = f32[4]{0} all-gather(%f), dimensions={0}, metadata={op_name="loop/gather"}
  ROOT %t = (s32[], f32[2]{0}) tuple(%i, %f)
}

%cond (arg: (s32[], f32[2])) -> pred[] {
  %arg = (s32[], f32[2]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[2]) -> f32[2] {
  %x = f32[2]{0} parameter(0)
  %ar-start = f32[2]{0} all-reduce-start(%x), to_apply=%add
  %ar-done = f32[2]{0} all-reduce-done(%ar-start)
  %init = (s32[], f32[2]{0}) tuple(%zero, %ar-done)
  %w = (s32[], f32[2]{0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[2]{0} get-tuple-element(%w), index=1
}
"""


def test_shapes_of_hlo_types():
  assert hlo_text.ShapesOf('f32[1,8,8]{2,1,0}') == [(1, 8, 8)]
  assert hlo_text.ShapesOf('f32[]') == [()]
  assert hlo_text.ShapesOf('(f32[2,3]{1,0}, s32[4]{0})') == [(2, 3), (4,)]


def test_analyze_hlo_finds_collectives_in_and_out_of_loops():
  collectives, loops = hlo_text.AnalyzeHlo(_TOY_HLO)
  assert loops == ['body']
  found = sorted((c.kind, c.loop, c.shape) for c in collectives)
  assert found == [('all-gather', 0, 'f32[4]{0}'),
                   ('all-reduce', -1, 'f32[2]{0}'),
                   ('collective-permute', 0, 'f32[2]{0}')]
  gather = [c for c in collectives if c.kind == 'all-gather'][0]
  assert gather.op_name == 'loop/gather'


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
