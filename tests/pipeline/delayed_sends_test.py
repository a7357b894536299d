"""delayed_sends=True equals the plain sequential stack, in every loop.

With delayed sends each stage's output is handed on one iteration after it
is made (gpipe.pipeline.rotation.DelayedHandoff; gpipe.schedule's hop of
2). Every case compares the pipelined layer with the references of
tests/pipeline_harness.py (a NumPy loop over the logical layers for the
forward pass, TF autodiff of a plain TF loop for the gradients of every
variable and the input), float32, |err| <= 1e-5 + 1e-5 * |ref|. The sweep
is a pairwise covering (tests/covering.py) of S, the kind of M, R, the
loop (reverse or 1f1b backward, whole or streamed io) and the mode (graph,
jit); the layouts that change what a hand-off carries (several buffer
leaves, stage-split weights, skip_bubbles' phases, per-stage variables)
each meet each backward schedule, io and mode. Partitioned (8 virtual devices on a [4, 2]
mesh), the 1f1b loops here and the reverse loop in
tests/xla/partitioning_test.py equal the step on one device.
"""

import pytest

from tests import covering
from tests import pipeline_harness as harness

Case = harness.Case
MODES = ('graph', 'jit')
# (backward_schedule, stream_io): every loop the hand-off runs in.
_LOOPS = [('reverse', False), ('1f1b', False), ('reverse', True),
          ('1f1b', True)]
_LOOP_IDS = ['reverse', '1f1b', 'reverse-stream_io', '1f1b-stream_io']


def _Case(loop, **kwargs):
  backward_schedule, stream_io = loop
  return Case(backward_schedule=backward_schedule, stream_io=stream_io,
              delayed_sends=True, **kwargs)


def _MicrobatchCounts(num_stages):
  """M in {1, = S, S + 1, 2 S + 1}: fewer, as many and more than a
  circular segment of 2 S holds."""
  return sorted({1, num_stages, num_stages + 1, 2 * num_stages + 1})


_FULL_SWEEP = [(s, m, r, loop, mode) for s in (1, 2, 3, 4)
               for m in _MicrobatchCounts(s) for r in (1, 2, 3)
               for loop in range(len(_LOOPS)) for mode in MODES]
_SWEEP = covering.Pairwise(
    _FULL_SWEEP, (lambda c: c[0], covering.MicrobatchKindOfRow,
                  lambda c: c[2], lambda c: c[3], lambda c: c[4]))


@pytest.mark.parametrize(
    'num_stages,num_microbatches,circular_repeat,loop,mode', _SWEEP,
    ids=[f'S{s}-M{m}-R{r}-{_LOOP_IDS[loop]}-{mode}'
         for s, m, r, loop, mode in _SWEEP])
def test_sweep(num_stages, num_microbatches, circular_repeat, loop, mode):
  harness.CheckCase(
      _Case(_LOOPS[loop], num_stages=num_stages,
            num_microbatches=num_microbatches,
            circular_repeat=circular_repeat, batch=2 * num_microbatches),
      mode)


# What a hand-off carries and where: three buffer leaves (one None),
# weights split over the stages, per-stage variables, and on one device
# the fill and drain phases on half the stages (reverse only).
_LAYOUTS = [
    ('multi', dict(body='multi')),
    ('shard-per_stage_vars', dict(shard_stages_1d=True,
                                  per_stage_vars=True)),
    ('stage_parallel-kwargs', dict(body='stage_parallel', kwargs=True)),
]


# Pairwise over the layout, the backward schedule, stream_io and the mode.
_LAYOUT_ROWS = covering.Pairwise(
    [(i, k, mode) for i in range(len(_LAYOUTS)) for k in range(len(_LOOPS))
     for mode in MODES],
    (lambda c: c[0], lambda c: _LOOPS[c[1]][0], lambda c: _LOOPS[c[1]][1],
     lambda c: c[2]))


@pytest.mark.parametrize('layout,loop,mode', [
    pytest.param(_LAYOUTS[i][1], _LOOPS[k], mode,
                 id=f'{_LAYOUTS[i][0]}-{_LOOP_IDS[k]}-{mode}')
    for i, k, mode in _LAYOUT_ROWS])
def test_layouts(layout, loop, mode):
  harness.CheckCase(
      _Case(loop, num_stages=3, num_microbatches=7, circular_repeat=2,
            batch=14, **layout), mode)


@pytest.mark.parametrize('mode', MODES)
def test_skip_bubbles(mode):
  harness.CheckCase(
      _Case(_LOOPS[0], num_stages=4, num_microbatches=5, batch=10,
            skip_bubbles=True), mode)


@pytest.mark.parametrize('stream_io', [False, True],
                         ids=['1f1b', '1f1b-stream_io'])
def test_partitioned_1f1b_equals_one_device(stream_io):
  """Stages over axis 0 of a [4, 2] mesh (8 devices), each stage's body
  splitting its batch over axis 1."""
  harness.CheckPartitionedStagesOnAMesh(
      _Case(('1f1b', stream_io), num_stages=4, num_microbatches=5,
            circular_repeat=2, batch=20, pipeline_stage_mesh_dim=True).Params(),
      (20, 3, 4), 8)


def test_the_sweep_covers_every_pair():
  assert not covering.Uncovered(
      _SWEEP, _FULL_SWEEP,
      (lambda c: c[0], covering.MicrobatchKindOfRow, lambda c: c[2],
       lambda c: c[3], lambda c: c[4]))
