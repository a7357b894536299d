"""backward_schedule='1f1b' and stream_io equal the plain sequential stack.

Every case compares the pipelined layer with the references of
tests/pipeline_harness.py (a NumPy loop over the logical layers for the
forward pass, TF autodiff of a plain TF loop for the gradients of every
variable and the input), float32, |err| <= 1e-5 + 1e-5 * |ref|. The sweeps
cross both Params with the shapes and layouts of layers_test: pairwise
coverings (tests/covering.py), every two settings' values together at
least once.
"""

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from tests import covering
from tests import pipeline_harness as harness

Case = harness.Case
MODES = ('graph', 'jit')
# (backward_schedule, stream_io) pairs beside the default ('reverse', False).
_IO = [('1f1b', False), ('1f1b', True), ('reverse', True)]
_IO_IDS = ['1f1b', '1f1b-stream_io', 'reverse-stream_io']


def _Case(schedule_and_io, **kwargs):
  backward_schedule, stream_io = schedule_and_io
  return Case(backward_schedule=backward_schedule, stream_io=stream_io,
              **kwargs)


def _MicrobatchCounts(num_stages):
  """M in {1, fewer than S, = S, not a multiple of S, more than 2 S}."""
  counts = {1, num_stages, num_stages + 1, 2 * num_stages + 1}
  if num_stages > 2:
    counts.add(num_stages - 1)
  return sorted(counts)


_FULL_SWEEP = [(s, m, r, io) for s in (1, 2, 3, 4) for m in _MicrobatchCounts(s)
               for r in (1, 2, 3) for io in range(len(_IO))]
# Pairwise (covering.py) over S, the kind of M, R and the (schedule, io)
# pair: every two of them together at least once.
_SWEEP_FEATURES = (lambda c: c[0], covering.MicrobatchKindOfRow,
                   lambda c: c[2], lambda c: c[3])
_SWEEP = covering.Pairwise(_FULL_SWEEP, _SWEEP_FEATURES)


@pytest.mark.parametrize(
    'num_stages,num_microbatches,circular_repeat,io', _SWEEP,
    ids=[f'S{s}-M{m}-R{r}-{_IO_IDS[io]}' for s, m, r, io in _SWEEP])
def test_sweep_graph(num_stages, num_microbatches, circular_repeat, io):
  harness.CheckCase(
      _Case(_IO[io], num_stages=num_stages,
            num_microbatches=num_microbatches,
            circular_repeat=circular_repeat, batch=2 * num_microbatches),
      'graph')


_JIT_SWEEP = [(1, 1, 1), (2, 1, 2), (2, 3, 1), (3, 2, 3), (3, 4, 2),
              (4, 4, 1), (4, 9, 2), (3, 5, 1), (2, 4, 3)]


@pytest.mark.parametrize('num_stages,num_microbatches,circular_repeat',
                         _JIT_SWEEP,
                         ids=[f'S{s}-M{m}-R{r}' for s, m, r in _JIT_SWEEP])
def test_sweep_jit(num_stages, num_microbatches, circular_repeat):
  # XLA compiles each case for seconds: the pairs take turns here too.
  index = _JIT_SWEEP.index((num_stages, num_microbatches, circular_repeat))
  harness.CheckCase(
      _Case(_IO[index % len(_IO)], num_stages=num_stages,
            num_microbatches=num_microbatches,
            circular_repeat=circular_repeat, batch=2 * num_microbatches),
      'jit')


def _Covering(cases, features=None):
  """pytest params: (case, (schedule, io) pair, mode) such that every two
  of the case's `features`, the pair and the mode meet at least once
  (covering.py); without features, every case with every pair."""
  full = [(i, io, mode) for i in range(len(cases)) for io in range(len(_IO))
          for mode in MODES]
  case_features = ([lambda r: r[0]] if features is None else
                   [lambda r, f=f: f(cases[r[0]][1]) for f in features])
  rows = covering.Pairwise(full, [lambda r: r[1], lambda r: r[2]] +
                           case_features)
  return [pytest.param(cases[i][1], _IO[io], mode,
                       id=f'{cases[i][0]}-{_IO_IDS[io]}-{mode}')
          for i, io, mode in rows]


# Body kind x per_stage_vars x circular_repeat x shard_stages_1d, M=4 not a
# multiple of S=3; with the (schedule, io) pair and the mode, a pairwise
# covering (9 rows).
_LAYOUTS = [
    (f'{b}{"-per_stage_vars" if p else ""}-R{r}{"-shard" if s else ""}',
     dict(body=b, per_stage_vars=p, circular_repeat=r, shard_stages_1d=s))
    for b, p in (('dense', False), ('dense', True), ('stage_parallel', False))
    for r in (1, 2) for s in (False, True)]


@pytest.mark.parametrize('layout,io,mode', _Covering(
    _LAYOUTS, [lambda c: (c['body'], c['per_stage_vars']),
               lambda c: c['circular_repeat'], lambda c: c['shard_stages_1d']]))
def test_layouts(layout, io, mode):
  harness.CheckCase(
      _Case(io, num_stages=3, num_microbatches=4, batch=8, kwargs=True,
            **layout), mode)


# Each shape carries two of the input and mesh features (a stage mesh dim
# and inputs already microbatched; nested inputs and a microbatch size
# instead of a count), so that every feature still meets every (schedule,
# io) pair and both modes, in 9 builds instead of 15.
_SHAPES = [
    ('stage_mesh_dim-premicrobatched', dict(
        pipeline_stage_mesh_dim=True, num_stages=2, num_microbatches=3,
        premicrobatched=True, circular_repeat=2, batch=6, kwargs=True)),
    ('nested_inputs-microbatch_size', dict(
        body='multi', num_stages=3, num_microbatches=None, microbatch_size=2,
        circular_repeat=2, batch=10)),
    ('kwargs_rank4', dict(num_stages=3, num_microbatches=5,
                          circular_repeat=2, batch=10, kwargs=True,
                          kwargs_no_batch=True, example_shape=(2, 3, 4))),
]


@pytest.mark.parametrize('shape,io,mode', _Covering(_SHAPES))
def test_inputs_and_meshes(shape, io, mode):
  harness.CheckCase(_Case(io, **shape), mode)


# What a ring entry keeps (remat_policy), vectorized stages and one by one:
# every two of policy, body and vectorize_stages together (a stage-parallel
# body is vectorized).
_POLICIES = covering.Pairwise(
    [(policy, body, vectorize)
     for policy in ('save_dots', 'save_all')
     for body in ('dense', 'multi', 'stage_parallel')
     for vectorize in ('auto', 'never')
     if not (body == 'stage_parallel' and vectorize == 'never')],
    [lambda c: c[0], lambda c: c[1], lambda c: c[2]])


@pytest.mark.parametrize(
    'policy,body,vectorize', _POLICIES,
    ids=[f'{p}-{b}-{v}' for p, b, v in _POLICIES])
def test_remat_policies_graph(policy, body, vectorize):
  harness.CheckCase(
      Case(backward_schedule='1f1b', body=body, num_stages=3,
           num_microbatches=4, circular_repeat=2, batch=8,
           remat_policy=policy, vectorize_stages=vectorize), 'graph')


@pytest.mark.parametrize('policy', ['save_dots', 'save_all'])
def test_remat_policies_jit(policy):
  harness.CheckCase(
      Case(backward_schedule='1f1b', stream_io=True, body='multi',
           num_stages=3, num_microbatches=4, circular_repeat=2, batch=8,
           remat_policy=policy), 'jit')


def test_backward_schedule_is_checked():
  p = Case(backward_schedule='forward').Params()
  with pytest.raises(ValueError, match=r"backward_schedule must be one of "
                     r"\('reverse', '1f1b'\), got 'forward'"):
    with tf.Graph().as_default():
      p.Instantiate()
  p = Case(backward_schedule='1f1b', skip_bubbles=True).Params()
  with pytest.raises(ValueError, match=r"skip_bubbles=True and "
                     r"backward_schedule='1f1b' do not combine.*Set "
                     r'skip_bubbles=False'):
    with tf.Graph().as_default():
      p.Instantiate()
  p = Case(stream_io='yes').Params()
  with pytest.raises(ValueError, match=r"stream_io must be True or False, "
                     r"got 'yes'"):
    with tf.Graph().as_default():
      p.Instantiate()


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))


# -- Partitioned over virtual devices: equal to one device, and the loops'
# collectives per iteration (each a collective-permute of one microbatch
# slot: the buffer, its gradient, and with stream_io a column of each
# stream).

_PARTITIONED = [
    # (stream_io, [collective-permutes per iteration of each loop]): the
    # forward loop, then the gradient loop's forward-wave, both-waves and
    # backward-wave phases.
    (False, [1, 1, 2, 1]),
    # Forward: buffer, input stream, output stream; forward wave: buffer,
    # input stream; backward wave: the buffer's gradient, the output
    # gradients' stream, the input gradients' stream.
    (True, [3, 2, 5, 3]),
]


@pytest.mark.parametrize('stream_io,permutes', _PARTITIONED,
                         ids=['1f1b', '1f1b-stream_io'])
def test_partitioned_equals_one_device(stream_io, permutes):
  # Imported here: the partitioning check needs jax, the rest does not.
  from gpipe import check_partitioning  # pylint: disable=g-import-not-at-top
  params = Case(num_stages=4, num_microbatches=6, circular_repeat=2,
                batch=12, shard_stages_1d=True, backward_schedule='1f1b',
                stream_io=stream_io, kwargs=True).Params()
  report = check_partitioning.CheckPartitioning(params, [(12, 3, 4)], 4)
  assert len(report.run.loops) == 4, report.run.loops
  for loop, count in enumerate(permutes):
    assert report.run.LoopCounts(loop) == {'collective-permute': count}, (
        loop, report.run.LoopCounts(loop))
  names = report.step.ResultNames()
  for name, got, want in zip(names, report.run.outputs, report.expected):
    assert np.abs(want).max() > 0, name
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
  assert not report.Problems(1e-5), report.Problems(1e-5)


def test_partitioned_on_a_stage_data_mesh_equals_one_device():
  """Stages over axis 0 of a [2, 2] mesh, each stage's body splitting its
  batch over axis 1: still one collective-permute per stream or buffer
  per iteration, all on the stage axis."""
  harness.CheckPartitionedStagesOnAMesh(
      Case(num_stages=2, num_microbatches=3, circular_repeat=2, batch=12,
           pipeline_stage_mesh_dim=True, backward_schedule='1f1b',
           stream_io=True).Params(), (12, 3, 4), 4)


def test_partitioned_aux_losses_and_summaries_equal_one_device():
  """A body adding an aux loss and a summary in every call, partitioned:
  what the loop keeps of them per iteration stays replicated bookkeeping
  (a loop-carried scalar would take the body's manual sharding, which the
  partitioner cannot hand out of the step)."""
  from gpipe import check_partitioning  # pylint: disable=g-import-not-at-top
  from gpipe import layers  # pylint: disable=g-import-not-at-top
  from tests import reference_bodies  # pylint: disable=g-import-not-at-top
  params = layers.PipelinedLayer.Params().Set(
      name='pipe', num_stages=4, num_microbatches=6, circular_repeat=2,
      shard_stages_1d=True, backward_schedule='1f1b', stream_io=True,
      unroll='never',
      single_stage_body=reference_bodies.TrainingBody.Params().Set(dim=4))
  report = check_partitioning.CheckPartitioning(params, [(12, 4)], 4)
  for name, got, want in zip(report.step.ResultNames(), report.run.outputs,
                             report.expected):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
  assert not report.Problems(1e-5), report.Problems(1e-5)
