"""layer_by_layer: on one device, each layer on every microbatch at once.

With layer_by_layer=True a one-device call loops over the S x R layers
instead of the pipeline schedule (gpipe.pipeline.layer_by_layer). It must change
nothing but the time and the memory. The layer with it is checked against
the harness's references, which run no gpipe code: S 1..4, M below, at,
not a multiple of and above S, R 1..3, graph mode and jit, kwargs, nested
inputs with None, per-stage variables, sharding annotations, remat
policies, inputs already microbatched (each layout on one of the shapes'
rows); decoding with per-stage caches against the full-sequence stack. Then against the same layer without it on
the layouts of vectorized_stages_test (aux losses, summaries, dropout,
bfloat16). Every one of those checks that the call did run layer by layer.
Last, what runs the pipeline loop instead, and says why.
"""

import logging

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe.pipeline import layer_by_layer
from tests import close
from tests import decoding_test
from tests.pipeline import vectorized_stages_test as vst
from tests import pipeline_harness as harness
from tests import sessions

# (S, M, R, mode, layout): each layout rides on a row of the shapes, so
# one build checks both (the layouts were once rows of their own, each
# another build). The rows without remat_policy run the default, save_dots
# layer by layer.
_SWEEP = [
    (1, 3, 2, 'graph', {}),
    (2, 1, 1, 'graph', {}),
    (2, 3, 2, 'graph', dict(remat_policy='save_all', premicrobatched=True)),
    (3, 4, 1, 'graph', dict(kwargs=True, kwargs_no_batch=True)),
    (3, 7, 2, 'graph', dict(per_stage_vars=True)),
    (4, 4, 3, 'graph', dict(shard_stages_1d=True)),
    (4, 5, 1, 'graph', dict(body='multi', remat_policy='recompute')),
    (2, 3, 3, 'jit', dict(kwargs=True, kwargs_no_batch=True)),
    (3, 4, 2, 'jit', {}),
    (4, 6, 1, 'jit', dict(body='multi', remat_policy='recompute')),
]


def _LayoutId(layout):
  return ''.join(f'-{k}' if v is True else f'-{v}'
                 for k, v in sorted(layout.items()))


def _Check(case, mode):
  res = harness.CheckCase(case, mode)
  layer = res['layer']
  assert layer.layer_by_layer.ran, layer.layer_by_layer.reason
  assert not layer.vectorizing.vectorized  # the pipeline loop never ran


@pytest.mark.parametrize('s,m,r,mode,layout', _SWEEP,
                         ids=[f'S{s}-M{m}-R{r}-{mode}{_LayoutId(l)}'
                              for s, m, r, mode, l in _SWEEP])
def test_equals_the_reference(s, m, r, mode, layout):
  _Check(harness.Case(num_stages=s, num_microbatches=m, circular_repeat=r,
                      batch=2 * m, layer_by_layer=True, **layout), mode)


# The layouts the references above do not cover (aux losses, summaries,
# dropout, bfloat16), graph mode and jit (R3 with kwargs, once a layout
# here too, is a row of the references' sweep).
_UNCHANGED = [
    layout + (mode,) for layout in vst._LAYOUTS  # pylint: disable=protected-access
    for mode in ('graph', 'jit')
    if layout[0] in ('aux-summaries-dropout', 'bfloat16')
    and (mode == 'graph' or layout[0] == 'aux-summaries-dropout')]


@pytest.mark.parametrize('name,params,batch,with_kwargs,mode', _UNCHANGED,
                         ids=[f'{u[0]}-{u[-1]}' for u in _UNCHANGED])
def test_everything_the_layer_gives_is_unchanged(name, params, batch,
                                                 with_kwargs, mode):
  """Outputs, every gradient, aux losses, summaries (per stage), dropout
  masks (the same step seed per layer and microbatch)."""
  # pylint: disable=protected-access
  by_layer, _ = vst._Results(params.Copy().Set(layer_by_layer=True), batch,
                             with_kwargs, mode, 'auto')
  pipelined, _ = vst._Results(params, batch, with_kwargs, mode, 'auto')
  # pylint: enable=protected-access
  assert by_layer['ran_layer_by_layer'], name
  assert not pipelined['ran_layer_by_layer'], name
  # bfloat16: layer by layer sums a weight's gradient over the microbatches
  # inside one matmul (float32 accumulation) where the pipeline adds one
  # bfloat16 gradient per iteration, which moves some elements by a few
  # ulps at the tensor's scale (closer to the float32 gradient: 0.31 % of
  # the largest element off, against the pipeline's 0.38 %).
  tolerance = (close.BFLOAT16_AT_SCALE if params.fprop_dtype == tf.bfloat16
               else close.FLOAT32_TIGHT)
  for key in ('outs', 'grads', 'aux', 'vars'):
    close.AssertClose(by_layer[key], pipelined[key], tolerance,
                      f'{name} {mode}: {key}')
  assert sorted(by_layer['summaries']) == sorted(pipelined['summaries'])
  assert pipelined['summaries'] or 'summaries' not in name
  keys = sorted(pipelined['summaries'])
  close.AssertClose([by_layer['summaries'][k] for k in keys],
                    [pipelined['summaries'][k] for k in keys], tolerance,
                    f'{name} {mode}: summaries')
  assert np.abs(pipelined['aux']).max() > 0 or 'aux' not in name
  assert any(np.abs(g).max() > 0 for g in pipelined['grads']), name


@pytest.mark.parametrize('num_stages,num_microbatches,circular_repeat,mode',
                         [(2, 3, 2, 'graph'), (3, 2, 1, 'graph'),
                          (3, 4, 1, 'graph'), (2, 3, 3, 'graph'),
                          (3, 4, 1, 'jit')])
def test_decoding_with_per_stage_states(num_stages, num_microbatches,
                                        circular_repeat, mode, monkeypatch):
  """FPropFn('ExtendStep') with each layer's caches as per-stage states,
  step after step, against the plain stack on the whole sequence (NumPy,
  on the decoder's weights): outputs and every layer's cache. Layer by
  layer in graph mode; under XLA the pipeline loop (faster there)."""
  ran = []
  run = layer_by_layer.RunLayerByLayer
  monkeypatch.setattr(layer_by_layer, 'RunLayerByLayer',
                      lambda *a: ran.append(1) or run(*a))
  decoding_test.CheckDecoding(num_stages, num_microbatches, circular_repeat,
                              2 * num_microbatches, mode, layer_by_layer=True)
  if mode == 'graph':
    assert ran, 'the decoding steps did not run layer by layer'
  else:
    assert not ran, 'under XLA decoding runs the pipeline loop'


# -- What runs the pipeline loop instead, and says so. -----------------------


def _Lines(caplog):
  return [r.getMessage() for r in caplog.records
          if 'not layer by layer' in r.getMessage()]


def test_non_trainable_state_runs_the_pipeline_loop(caplog):
  """Its variables update microbatch after microbatch: the pipeline loop
  runs, with the same results as without the param, said once."""
  caplog.set_level(logging.INFO)
  name, params, batch, with_kwargs = [
      layout for layout in vst._LAYOUTS  # pylint: disable=protected-access
      if layout[0] == 'non-trainable-state'][0]
  # pylint: disable=protected-access
  got, _ = vst._Results(params.Copy().Set(layer_by_layer=True), batch,
                        with_kwargs, 'graph', 'auto')
  want, _ = vst._Results(params, batch, with_kwargs, 'graph', 'auto')
  # pylint: enable=protected-access
  assert not got['ran_layer_by_layer']
  for key in ('outs', 'grads', 'vars'):
    # Both run the same pipeline loop: within rtol and atol 1e-6.
    close.AssertClose(got[key], want[key],
                      close.Tolerance(rtol=1e-6, atol=1e-6), f'{name}: {key}')
  lines = _Lines(caplog)
  assert len(lines) == 1, lines
  assert 'non-trainable variables' in lines[0], lines
  assert "PipelinedLayer 'pipe'" in lines[0]


def test_a_body_that_cannot_be_vectorized_runs_the_pipeline_loop(caplog):
  """A stateful random op: found once, said once, the pipeline loop from
  then on (which runs it stage by stage, as without the param)."""
  caplog.set_level(logging.INFO)
  # pylint: disable=protected-access
  params = vst._Params(vst._StatefulRandomBody, 'auto').Set(
      layer_by_layer=True)
  x = np.random.RandomState(2).uniform(-1, 1, [4, vst.D]).astype(np.float32)
  with tf.Graph().as_default():
    layer = params.Instantiate()
    y = [layer.FProp(layer.theta, tf.constant(x)) for _ in range(2)]
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      vst._LoadWeights(layer, sess)
      got = sess.run(y)
  want, _, _ = vst._ForwardAndGrad(vst._StatefulRandomBody, 'never',
                                   differentiate=False)
  # pylint: enable=protected-access
  assert not layer.layer_by_layer.ran
  assert 'stateful ops (RandomUniform)' in layer.layer_by_layer.reason
  lines = _Lines(caplog)
  assert len(lines) == 1 and 'RandomUniform' in lines[0], lines
  for value in got:  # (the noise is scaled by 0.0)
    np.testing.assert_allclose(value, want, rtol=1e-6)


def test_vectorize_never_and_stage_parallel_run_the_pipeline_loop():
  for case, why in (
      (harness.Case(num_stages=3, num_microbatches=4, batch=8,
                    vectorize_stages='never', layer_by_layer=True),
       "vectorize_stages='never'"),
      (harness.Case(num_stages=2, num_microbatches=3, batch=6,
                    body='stage_parallel', layer_by_layer=True),
       'stage-parallel body'),
  ):
    layer = harness.CheckCase(case, 'graph')['layer']
    assert not layer.layer_by_layer.ran
    assert why in layer.layer_by_layer.reason


def test_partitioned_it_does_nothing_and_equals_one_device():
  """Partitioned over 4 virtual devices, each runs its stage in the
  pipeline loop (forward and backward: 2, with one permute per iteration
  each), and the step equals the same layer on one device, which runs
  layer by layer."""
  harness.CheckPartitionedEqualsOneDevice(layer_by_layer=True)


@pytest.mark.parametrize('asked,pipeline,by_layer', [
    (dict(), 'recompute', 'save_dots'),
    (dict(remat_policy='recompute'), 'recompute', 'recompute'),
    (dict(remat_policy='save_all'), 'save_all', 'save_all'),
    (dict(store_body_intermediates=True), 'save_all', 'save_all'),
])
def test_the_default_remat_policy_saves_the_dots_layer_by_layer(
    monkeypatch, asked, pipeline, by_layer):
  """remat_policy=None: the pipeline's loop recomputes, the layers' loop
  keeps the dots' outputs; a policy asked for runs in both."""
  used = harness.RecordRematPolicies(monkeypatch)
  for enabled in (False, True):
    with tf.Graph().as_default():
      layer = harness.Case(num_stages=2, num_microbatches=2, batch=4,
                           layer_by_layer=enabled).Params().Set(
                               **asked).Instantiate()
      layer.FProp(layer.theta, tf.ones([4, 3, 4]))
      assert layer.layer_by_layer.ran == enabled
  assert used == [pipeline, by_layer]
