"""skip_bubbles: on one device, filling and draining run on half the stages.

With skip_bubbles=True the loop runs in phases (Schedule.Phases): its first
and last iterations compute only the half of the stages that holds their
useful slots. It must change nothing but the time. The layer with it is
checked against the harness's references, which run no gpipe code: S 1..4
(odd S: halves of uneven size), M below, at, not a multiple of and above S,
R 1..3, graph mode and jit, both stage runners, kwargs, nested inputs
with a None, per-stage variables, sharding annotations, streamed inputs
and outputs (stream_io), remat policies save_dots and save_all, each
layout on one of the shapes' rows. Then against the same layer without it
on the layouts of vectorized_stages_test those do not cover (aux losses,
summaries, dropout, non-trainable state, bfloat16, R3 with kwargs), and
decoding with per-stage states against the full-sequence stack. Finally,
where it applies: one device only (partitioned, the step is one loop and
equals the one-device step's three), and with the default (None) under XLA
for a body of at least a million FLOPs a microbatch; that each phase's loop
defers the weight gradients as the one loop does, and that the deferred
sums equal the references.
"""

import types

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import layers
from gpipe.loops import cell_graph
from gpipe.loops import compiled_loops
from gpipe.loops import deferred_dots
from gpipe.pipeline import loop_choices
from gpipe.pipeline import pipeline_loop
from gpipe.pipeline import stage_runners
from gpipe import schedule
from tests import close
from tests import decoding_test
from tests.pipeline import vectorized_stages_test as vst
from tests import pipeline_harness as harness
from tests import reference_bodies
from tests import sessions

# (S, M, R, mode, vectorize_stages, layout): each layout rides on a row of
# the shapes, so one build checks both (the layouts were once rows of their
# own, each another build).
_SWEEP = [
    (1, 3, 2, 'graph', 'auto', {}),
    # Nested inputs with a None, the default remat policy and save_all.
    (2, 1, 1, 'graph', 'auto', dict(body='multi')),
    (2, 3, 2, 'graph', 'auto', dict(body='multi', remat_policy='save_all')),
    # Sharding annotations on one device: the ranges are slices of them.
    (3, 1, 1, 'graph', 'auto', dict(pipeline_stage_mesh_dim=True)),
    (3, 4, 1, 'graph', 'auto', dict(kwargs=True, kwargs_no_batch=True)),
    (3, 7, 2, 'graph', 'never', dict(per_stage_vars=True)),
    (4, 4, 2, 'graph', 'auto', dict(shard_stages_1d=True, stream_io=True)),
    (4, 5, 1, 'graph', 'never', dict(body='multi', remat_policy='save_dots')),
    (3, 4, 2, 'jit', 'auto', {}),
    (3, 5, 1, 'jit', 'never', {}),
]


def _LayoutId(layout):
  return ''.join(f'-{k}' if v is True else f'-{v}'
                 for k, v in sorted(layout.items()))


@pytest.mark.parametrize('s,m,r,mode,vectorize,layout', _SWEEP,
                         ids=[f'S{s}-M{m}-R{r}-{mode}-{v}{_LayoutId(l)}'
                              for s, m, r, mode, v, l in _SWEEP])
def test_equals_the_reference(s, m, r, mode, vectorize, layout):
  harness.CheckCase(
      harness.Case(num_stages=s, num_microbatches=m, circular_repeat=r,
                   batch=2 * m, vectorize_stages=vectorize,
                   skip_bubbles=True, **layout), mode)


# The layouts the references above do not cover, in graph mode; under jit
# the one with side outputs (aux losses, summaries, dropout).
_UNCHANGED = [layout + ('graph',) for layout in vst._LAYOUTS  # pylint: disable=protected-access
              if layout[0] not in ('stacked-R1-kwargs', 'per_stage_vars-R2',
                                   'save_dots', 'nested-inputs-with-None',
                                   'save_all')] + [
    layout + ('jit',) for layout in vst._LAYOUTS  # pylint: disable=protected-access
    if layout[0] == 'aux-summaries-dropout']


@pytest.mark.parametrize('name,params,batch,with_kwargs,mode', _UNCHANGED,
                         ids=[f'{u[0]}-{u[-1]}' for u in _UNCHANGED])
def test_everything_the_layer_gives_is_unchanged(name, params, batch,
                                                 with_kwargs, mode):
  """Outputs, every gradient, aux losses, summaries, non-trainable
  variables: with and without skip_bubbles (both vectorized)."""
  # pylint: disable=protected-access
  skipping, _ = vst._Results(params.Copy().Set(skip_bubbles=True), batch,
                             with_kwargs, mode, 'auto')
  whole, _ = vst._Results(params, batch, with_kwargs, mode, 'auto')
  # bfloat16: the weight gradients are summed over the phases' loops in
  # another order, which moves some by an ulp (2^-8 relative).
  tolerance = (close.BFLOAT16 if params.fprop_dtype == tf.bfloat16 else
               close.FLOAT32_TIGHT)
  for key in ('outs', 'grads', 'aux', 'vars'):
    close.AssertClose(skipping[key], whole[key], tolerance,
                      f'{name} {mode}: {key}')
  assert sorted(skipping['summaries']) == sorted(whole['summaries'])
  close.AssertClose(
      [skipping['summaries'][k] for k in sorted(whole['summaries'])],
      [whole['summaries'][k] for k in sorted(whole['summaries'])], tolerance,
      f'{name} {mode}: summaries')
  assert any(np.abs(g).max() > 0 for g in whole['grads']), name
  # pylint: enable=protected-access


@pytest.mark.parametrize('num_stages,num_microbatches,circular_repeat,mode',
                         [(2, 3, 2, 'graph'), (3, 2, 1, 'graph'),
                          (3, 2, 1, 'jit')])
def test_decoding_with_per_stage_states(num_stages, num_microbatches,
                                        circular_repeat, mode):
  """FPropFn('ExtendStep') with each stage's caches as states, against the
  plain stack on the whole sequence (NumPy, on the decoder's weights)."""
  decoding_test.CheckDecoding(num_stages, num_microbatches, circular_repeat,
                              2 * num_microbatches, mode, skip_bubbles=True)


def _Spec(skip_bubbles, runner):
  return types.SimpleNamespace(schedule=schedule.Schedule(4, 4),
                               skip_bubbles=skip_bubbles, runner=runner)


def _Phases(skip_bubbles, runner, theta=(), mb_leaves=()):
  spec = _Spec(skip_bubbles, runner)
  spec.skip_bubbles = loop_choices.SkipsBubbles(spec, theta, mb_leaves)
  return pipeline_loop._Phases(spec)  # pylint: disable=protected-access


def test_phases_only_with_the_param_and_a_one_device_runner():
  whole = [schedule.Phase(0, 7, 0, 4)]
  one_device = stage_runners.OneByOne()
  assert _Phases(True, one_device) == schedule.Schedule(4, 4).Phases()
  assert len(_Phases(True, one_device)) == 3
  assert _Phases(False, one_device) == whole
  # Partitioned (each device its stage) and stage-parallel bodies: one loop.
  in_region = stage_runners.InManualRegion((np.arange(4), 0))
  assert _Phases(True, in_region) == whole
  assert _Phases(True, stage_runners.Together()) == whole


def test_call_flops_count_one_layers_weights_on_a_microbatchs_positions():
  """2 x positions x weights of one of the S x R layers; positions: all
  dims of the largest input but the examples and the features."""
  sched = schedule.Schedule(2, 4, 3)
  theta = {'w': tf.zeros([2, 3, 8, 16]), 'b': tf.zeros([2, 3, 16]),
           'step': tf.zeros([2, 3], tf.int32)}
  mb_leaves = [tf.zeros([4, 5, 7, 8]), tf.zeros([4, 5, 2]), tf.zeros([4])]
  assert loop_choices.CallFlops(sched, theta, mb_leaves) == (
      2 * (5 * 7) * (8 * 16 + 16))


@pytest.mark.parametrize('param,under_xla,flops,skips', [
    (None, True, 1e6, True),
    (None, True, 1e6 - 1, False),
    (None, False, 1e9, False),
    (True, False, 1, True),
    (False, True, 1e9, False),
])
def test_none_skips_under_xla_for_a_compute_bound_body(monkeypatch, param,
                                                       under_xla, flops,
                                                       skips):
  assert loop_choices.MIN_FLOPS_PER_CALL_TO_SKIP_BUBBLES == 1e6
  monkeypatch.setattr(compiled_loops, 'UnderXla',
                      lambda: under_xla)
  monkeypatch.setattr(loop_choices, 'CallFlops', lambda *_: flops)
  assert loop_choices.SkipsBubbles(
      _Spec(param, stage_runners.OneByOne()), (), ()) == skips
  # Partitioned: never.
  in_region = stage_runners.InManualRegion((np.arange(4), 0))
  assert not loop_choices.SkipsBubbles(_Spec(param, in_region), (), ())


def _JitLoops(skip_bubbles, dim, run=True):
  """(While loops in a jit training step of S=2, M=2 on microbatches of two
  rows of `dim`, its loss and gradients if `run`: else only traced, not
  compiled)."""
  with tf.init_scope():
    layer = layers.PipelinedLayer.Params().Set(
        name='pipe', num_stages=2, num_microbatches=2,
        skip_bubbles=skip_bubbles,
        single_stage_body=reference_bodies.RowsDenseBody.Params().Set(
            dim=dim)).Instantiate()
  weights = layer.theta.Flatten()
  x = tf.constant(np.random.RandomState(0).uniform(
      -1, 1, [4, dim]).astype(np.float32))

  def Step(weights, x):
    with tf.GradientTape() as tape:
      tape.watch(weights + [x])
      loss = tf.reduce_sum(layer.FProp(layer.theta.Pack(weights), x) ** 2)
    return [loss] + tape.gradient(loss, weights + [x])

  step = tf.function(Step, jit_compile=True, autograph=False)
  graph = step.get_concrete_function(weights, x).graph
  loops = sum(op.type in ('While', 'StatelessWhile')
              for op in graph.get_operations())
  return loops, [t.numpy() for t in step(weights, x)] if run else None


def test_none_skips_bubbles_under_jit_for_a_big_body_only():
  """A 512-wide dense body on two rows (1.05 MFLOPs a call) runs three
  loops under jit with the default, as skip_bubbles=True does, with the
  same results as one loop; a 64-wide one runs one loop."""
  skipping, results = _JitLoops(None, 512)
  assert skipping == _JitLoops(True, 512, run=False)[0] == 6
  whole, whole_results = _JitLoops(False, 512)
  assert whole == 2
  close.AssertClose(results, whole_results, close.FLOAT32_TIGHT, 'jit')
  assert _JitLoops(None, 64, run=False)[0] == 2


class _CountingBody(reference_bodies.DenseBody):
  """DenseBody that counts, in Python, each stage call the graph runs."""

  calls = []

  def FProp(self, theta, x):
    counted = tf.numpy_function(
        lambda v: (_CountingBody.calls.append(1), v)[1], [x], x.dtype)
    counted.set_shape(x.shape)
    return super().FProp(theta, counted)


@pytest.mark.parametrize('s, m, r', [(4, 4, 1), (3, 5, 1), (2, 3, 2)])
def test_the_fill_and_drain_compute_only_the_stages_with_work(s, m, r):
  """A forward step, one stage call after another: the body runs on every
  (iteration, stage) slot without skip_bubbles, and with it on just the
  slots of the schedule's phases (2 x 2 + 3 x 4 + 2 x 2 = 20 of 28 for S=4,
  M=4)."""
  sched = schedule.Schedule(s, m, r)
  counts = {}
  for skip in (False, True):
    with tf.Graph().as_default():
      layer = layers.PipelinedLayer.Params().Set(
          name='pipe', num_stages=s, num_microbatches=m, circular_repeat=r,
          unroll='never', vectorize_stages='never', skip_bubbles=skip,
          single_stage_body=_CountingBody.Params().Set(dim=4)).Instantiate()
      y = layer.FProp(layer.theta, tf.ones([2 * m, 4]))
      with sessions.AsBuilt() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        _CountingBody.calls.clear()
        sess.run(y)
        counts[skip] = len(_CountingBody.calls)
  assert counts[False] == s * sched.num_iterations
  computed = sched.CallsComputed(sched.Phases())
  assert counts[True] == computed < counts[False], (counts, computed)
  if (s, m, r) == (4, 4, 1):
    assert computed == 20


def _Loops(skip_bubbles):
  """While loops in a graph-mode training step of S=4, M=4 (run op by op:
  compiled, each is inside its XLA computation's function)."""
  params = harness.Case(num_stages=4, num_microbatches=4, batch=8,
                        skip_bubbles=skip_bubbles,
                        compile_loops='never').Params()
  with tf.Graph().as_default() as graph:
    layer = params.Instantiate()
    x = tf.ones([8, 3, 4])
    y = layer.FProp(layer.theta, x)
    tf.gradients(tf.reduce_sum(y), layer.vars.Flatten())
    return sum(op.type in ('While', 'StatelessWhile')
               for op in graph.get_operations())


def test_three_loops_forward_and_backward_instead_of_one():
  assert _Loops(False) == 2
  assert _Loops(True) == 6


def test_partitioned_it_does_nothing_and_equals_one_device():
  """Partitioned over 4 virtual devices, each runs its stage in one loop
  (forward and backward: 2, with one permute per iteration each), and the
  step equals the same layer on one device, which runs three phases."""
  harness.CheckPartitionedEqualsOneDevice(skip_bubbles=True)


def _DeferredPerLoop(monkeypatch, skip_bubbles):
  """How many weight gradients each backward loop of a one-device training
  step defers (gpipe.loops.deferred_dots): a 16-wide body on microbatches of
  one row, whose weight's dot reads few rows."""
  deferred = {}
  found = cell_graph.CellGraph.DeferredDots

  def Recording(cell):
    deferred[id(cell)] = len(found(cell))
    return found(cell)

  monkeypatch.setattr(cell_graph.CellGraph, 'DeferredDots', Recording)
  with tf.Graph().as_default():
    layer = layers.PipelinedLayer.Params().Set(
        name='pipe', num_stages=4, num_microbatches=4, compile_loops='never',
        skip_bubbles=skip_bubbles,
        single_stage_body=reference_bodies.RowsDenseBody.Params().Set(
            dim=16)).Instantiate()
    y = layer.FProp(layer.theta, tf.ones([4, 16]))
    tf.gradients(tf.reduce_sum(y), layer.vars.Flatten())
  return sorted(deferred.values())


@pytest.mark.parametrize('skip_bubbles', [False, True])
@pytest.mark.parametrize('mode', ['graph', 'jit'])
def test_deferred_weight_gradients_equal_the_reference(monkeypatch, mode,
                                                       skip_bubbles):
  """Microbatches of one 16-wide row: every loop sums the weight's gradient
  after it (gpipe.loops.deferred_dots), and the step still equals the
  references, outputs and gradients."""
  deferred = []
  find = deferred_dots.Find

  def Recording(grad, per_iteration, *limit):
    found = find(grad, per_iteration, *limit)
    deferred.append(found is not None)
    return found

  monkeypatch.setattr(deferred_dots, 'Find', Recording)
  harness.CheckCase(
      harness.Case(num_stages=4, num_microbatches=5, batch=5,
                   example_shape=(16,), body='dense_rows',
                   skip_bubbles=skip_bubbles), mode)
  assert any(deferred), deferred


def test_every_phase_defers_the_weight_gradients(monkeypatch):
  """Each phase's loop takes the weights of its own stages, so in the fill
  and drain too the weight's gradient is the body's dot, summed after the
  loop, not the gradient of a slice of the weights."""
  assert _DeferredPerLoop(monkeypatch, False) == [1]
  assert _DeferredPerLoop(monkeypatch, True) == [1, 1, 1]
