"""The stages vectorized (one computation) and one after another agree.

On one device a PipelinedLayer runs the S stages of an iteration as one
computation vectorized over the stage dim (vectorize_stages='auto', the
default) or one stage after another ('never'). Each case builds the same
layer both ways, with the same weights (the same random_seed), runs the
same inputs, and compares everything the layer gives: outputs, the
gradient of every variable and of the inputs, aux losses, summaries,
non-trainable variables after the step, decoder caches. Layouts: stacked,
per-stage variables, circular, nested inputs with None, per-example and
unbatched kwargs, a body with aux losses, summaries and dropout, one with
non-trainable state, bfloat16, each remat policy; graph mode and jit.

The layers_test and training_semantics sweeps compare the default
(vectorized) layer with references that run no gpipe code; test_*_never
there and below do the same for the stage-by-stage path.

Then the fallback: a body that cannot be vectorized runs stage by stage,
decided once per layer with one log line saying why ('auto'), or is
refused naming the fix ('always').
"""

import copy
import logging

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import layers
from lingvo.core import py_utils
from tests import close
from tests import covering
from tests import decoding_test
from tests import pipeline_harness as harness
from tests import reference_bodies
from tests import sessions

D = 4


def _Dense(**kw):
  return harness.Case(**kw).Params()


def _Training(keep_prob=0.8, **kw):
  return _Dense(**kw).Set(
      single_stage_body=reference_bodies.TrainingBody.Params().Set(
          dim=D, keep_prob=keep_prob))


def _Stateful(**kw):
  return _Dense(**kw).Set(
      single_stage_body=reference_bodies.StatefulBody.Params().Set(dim=D))


# (id, Params, batch, kwargs: scale per example, kwargs_no_batch: shift)
_LAYOUTS = [
    ('stacked-R1-kwargs', _Dense(num_stages=3, num_microbatches=4), 8, True),
    ('per_stage_vars-R2', _Dense(num_stages=3, num_microbatches=4,
                                 circular_repeat=2, per_stage_vars=True), 8,
     False),
    ('stacked-R3-M5', _Dense(num_stages=2, num_microbatches=5,
                             circular_repeat=3), 10, True),
    ('nested-inputs-with-None', _Dense(num_stages=3, num_microbatches=4,
                                       circular_repeat=2, body='multi'), 8,
     False),
    ('aux-summaries-dropout', _Training(num_stages=3, num_microbatches=4,
                                        circular_repeat=2), 8, False),
    ('non-trainable-state', _Stateful(num_stages=2, num_microbatches=3,
                                      circular_repeat=2), 6, False),
    ('bfloat16', _Dense(num_stages=2, num_microbatches=4,
                        circular_repeat=2).Set(fprop_dtype=tf.bfloat16), 8,
     False),
    ('save_dots', _Dense(num_stages=3, num_microbatches=4, circular_repeat=2,
                         remat_policy='save_dots'), 8, True),
    ('save_all', _Dense(num_stages=3, num_microbatches=4, circular_repeat=2,
                        remat_policy='save_all', body='multi'), 8, False),
]


def _Inputs(params, batch, with_kwargs):
  rng = np.random.RandomState(0)
  x = rng.uniform(-1, 1, [batch, 3, D]).astype(np.float32)
  if params.single_stage_body.cls is reference_bodies.MultiInputBody:
    args = (x, None, py_utils.NestedMap(
        a=rng.uniform(-1, 1, [batch, 3, D]).astype(np.float32),
        b=rng.uniform(-1, 1, [batch, 3]).astype(np.float32)))
  else:
    args = (x,)
  kwargs = {}
  if with_kwargs:
    kwargs = dict(scale=rng.uniform(0.5, 1.5, [batch, 3, 1]).astype(
        np.float32))
  return args, kwargs


def _Run(layer, args, kwargs, with_shift, watch=None):
  """Outputs, loss, aux loss and summaries of one FProp of `layer` (at
  global step 7: dropout seeds from it)."""
  dtype = layer.params.fprop_dtype or tf.float32
  args = tf.nest.map_structure(
      lambda v: None if v is None else tf.constant(v, dtype), args)
  if watch:
    for a in tf.nest.flatten(args):
      if a is not None:
        watch(a)
  kwargs = {k: tf.constant(v, dtype) for k, v in kwargs.items()}
  with py_utils.AuxLossContext() as aux, py_utils.TpuSummaryTensorContext(), \
      py_utils.GlobalStepContext(tf.constant(7, tf.int64)):
    if with_shift:
      out = layer.FPropFn(layer.theta, 'FProp', *args,
                          padded_per_stage_states=[],
                          kwargs_no_batch={'shift': tf.constant(0.25)},
                          **kwargs)
    else:
      out = layer.FProp(layer.theta, *args, **kwargs)
    summaries = py_utils.GetTpuSummaryTensors()
  outs = [o for o in tf.nest.flatten(out) if o is not None]
  loss = tf.add_n([tf.reduce_sum(tf.sin(tf.cast(o, tf.float32) * (i + 1.0)))
                   for i, o in enumerate(outs)])
  aux_loss = tf.add_n(aux.aux_losses) if aux.aux_losses else tf.constant(0.)
  return outs, loss + aux_loss, aux_loss, summaries, args


# The default layer's results by (Params' text, batch, kwargs, mode): the
# same layouts' default layer is what skip_bubbles_test and
# layer_by_layer_test compare with too, built once per process.
_DEFAULT_RESULTS = {}


def _Results(params, batch, with_kwargs, mode, vectorize):
  """Everything the layer gives, as NumPy, with vectorize_stages set (the
  default layer's, 'auto', built once per process: a deep copy each time)."""
  params = params.Copy().Set(vectorize_stages=vectorize)
  if vectorize != 'auto':
    return _Build(params, batch, with_kwargs, mode)
  key = (params.ToText(), batch, with_kwargs, mode)
  if key not in _DEFAULT_RESULTS:
    _DEFAULT_RESULTS[key] = _Build(params, batch, with_kwargs, mode)
  return copy.deepcopy(_DEFAULT_RESULTS[key])


def _Build(params, batch, with_kwargs, mode):
  """_Results, built."""
  args_np, kwargs_np = _Inputs(params, batch, with_kwargs)
  with_shift = (with_kwargs and
                params.single_stage_body.cls is reference_bodies.DenseBody)

  def Build(layer, tape=None):
    outs, loss, aux, summaries, args = _Run(
        layer, args_np, kwargs_np, with_shift, tape and tape.watch)
    variables = layer.vars.Flatten()
    trainable = [v for v in variables if v.trainable]
    sources = trainable + [a for a in tf.nest.flatten(args) if a is not None]
    grads = (tape.gradient(loss, sources) if tape else
             tf.gradients(loss, sources))
    return dict(outs=outs, aux=aux, summaries=summaries,
                grads=[tf.convert_to_tensor(g) for g in grads])

  if mode == 'graph':
    with tf.Graph().as_default():
      layer = params.Instantiate()
      fetch = Build(layer)
      with sessions.AsBuilt() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        _LoadWeights(layer, sess)
        res = sess.run(fetch)
        res['vars'] = sess.run(layer.vars.Flatten())
  else:
    layer = params.Instantiate()
    _LoadWeights(layer)

    @tf.function(jit_compile=True)
    def Step():
      with tf.GradientTape() as tape:
        return Build(layer, tape)

    res = tf.nest.map_structure(lambda t: t.numpy(), Step())
    res['vars'] = [v.numpy() for v in layer.vars.Flatten()]
  res['ran_layer_by_layer'] = layer.layer_by_layer.ran
  return res, layer.vectorizing.vectorized


def _LoadWeights(layer, sess=None):
  """The same weights whichever path: a function of each variable's name
  (non-trainable ones near their initial values)."""
  for name, var in layer.vars.FlattenItems():
    rng = np.random.RandomState(sum(map(ord, name)))
    shape = var.shape.as_list()
    if var.dtype.is_integer:
      value = np.zeros(shape, var.dtype.as_numpy_dtype)
    else:
      value = (rng.uniform(-0.6, 0.6, shape) if var.trainable else
               rng.uniform(0.0, 0.2, shape)).astype(var.dtype.as_numpy_dtype)
    if sess is None:
      var.assign(value)
    else:
      var.load(value, sess)


# The layouts in both modes, cut to a pairwise covering (tests/covering.py)
# over the mode and each layout's settings: every setting meets both modes
# (nested-inputs-with-None's settings all meet jit in other rows).
_FULL_AGREE = [(i, mode) for i in range(len(_LAYOUTS))
               for mode in ('graph', 'jit')]
_AGREE_FEATURES = (
    lambda r: r[1],
    lambda r: _LAYOUTS[r[0]][1].single_stage_body.cls.__name__,
    lambda r: _LAYOUTS[r[0]][1].circular_repeat,
    lambda r: _LAYOUTS[r[0]][1].per_stage_vars,
    lambda r: _LAYOUTS[r[0]][3],
    lambda r: str(_LAYOUTS[r[0]][1].fprop_dtype),
    lambda r: _LAYOUTS[r[0]][1].remat_policy)
_AGREE = covering.Pairwise(_FULL_AGREE, _AGREE_FEATURES)


@pytest.mark.parametrize(
    'name,params,batch,with_kwargs,mode',
    [_LAYOUTS[i] + (mode,) for i, mode in _AGREE],
    ids=[f'{mode}-{_LAYOUTS[i][0]}' for i, mode in _AGREE])
def test_vectorized_and_stage_by_stage_agree(name, params, batch, with_kwargs,
                                             mode):
  vec, vectorized = _Results(params, batch, with_kwargs, mode, 'auto')
  seq, _ = _Results(params, batch, with_kwargs, mode, 'never')
  assert vectorized, f'{name}: the default layer did not vectorize'
  for key in ('outs', 'grads', 'aux', 'vars'):
    close.AssertClose(vec[key], seq[key], close.FLOAT32_TIGHT,
                      f'{name} {mode}: {key}')
  assert sorted(vec['summaries']) == sorted(seq['summaries'])
  close.AssertClose([vec['summaries'][k] for k in sorted(seq['summaries'])],
                    [seq['summaries'][k] for k in sorted(seq['summaries'])],
                    close.FLOAT32_TIGHT, f'{name} {mode}: summaries')
  assert any(np.abs(g).max() > 0 for g in seq['grads']), name


@pytest.mark.parametrize('vectorize', ['auto', 'never'])
@pytest.mark.parametrize('mode', ['graph', 'jit'])
def test_decoding_with_per_stage_states_on_both_paths(mode, vectorize):
  """FPropFn('ExtendStep') with each stage's caches as states (S=2, M=3,
  R=2), against the plain stack on the whole sequence, run layer after
  layer in NumPy on the decoder's own weights."""
  decoding_test.CheckDecoding(2, 3, 2, 6, mode, seed=1,
                              vectorize_stages=vectorize)


# Two cases carry the three layouts (kwargs and per-stage variables in
# one build; nested inputs with save_dots), each in both modes.
_NEVER_CASES = [
    harness.Case(num_stages=3, num_microbatches=4, circular_repeat=2, batch=8,
                 kwargs=True, kwargs_no_batch=True, per_stage_vars=True,
                 vectorize_stages='never'),
    harness.Case(num_stages=2, num_microbatches=3, circular_repeat=3, batch=6,
                 body='multi', remat_policy='save_dots',
                 vectorize_stages='never'),
]


@pytest.mark.parametrize('mode', ['graph', 'jit'])
@pytest.mark.parametrize('case', _NEVER_CASES,
                         ids=['kwargs-per_stage_vars', 'multi-save_dots'])
def test_stage_by_stage_equals_the_reference(case, mode):
  """The 'never' path against the harness's references, which run no gpipe
  code (the default path meets them in layers_test)."""
  harness.CheckCase(case, mode)


# -- What cannot be vectorized. ----------------------------------------------


class _StatefulRandomBody(reference_bodies.DenseBody):
  """DenseBody plus noise from a stateful random op (forward use only),
  drawn from [0.25, 0.25]: every draw is 0.25, so the numbers are known."""

  def FProp(self, theta, x):
    return super().FProp(theta, x) + tf.random.uniform(tf.shape(x), 0.25,
                                                       0.25)


class _ShiftedBody(reference_bodies.DenseBody):
  """_StatefulRandomBody's numbers without a random op."""

  def FProp(self, theta, x):
    return super().FProp(theta, x) + 0.25


class _CustomGradientBody(reference_bodies.DenseBody):
  """DenseBody whose tanh input gets a custom (scaled) gradient."""

  def FProp(self, theta, x):

    @tf.custom_gradient
    def HalfGrad(v):
      return tf.identity(v), lambda dy: 0.5 * dy

    return tf.tanh(tf.einsum('...d,de->...e', HalfGrad(x), theta.w) +
                   theta.b)


class _DataDependentCondBody(reference_bodies.DenseBody):
  """A tf.cond whose condition depends on each stage's data."""

  def FProp(self, theta, x):
    y = super().FProp(theta, x)
    return tf.cond(tf.reduce_sum(y) > 0, lambda: y, lambda: -y)


class _PaddedBody(reference_bodies.DenseBody):
  """DenseBody whose output is masked by Lingvo's ApplyPadding, which
  checks that the float padding is 0 or 1 with `tf.Assert` (reached as
  Lingvo's compat module's Assert): TensorFlow guards that check with a
  tf.cond, whose vectorized form XLA cannot compile."""

  def FProp(self, theta, x):
    y = super().FProp(theta, x)
    padding = tf.cast(tf.reduce_sum(x, -1, keepdims=True) > 1e6, x.dtype)
    return py_utils.ApplyPadding(padding, y)


def _Params(body_cls, vectorize):
  return layers.PipelinedLayer.Params().Set(
      name='pipe', num_stages=2, num_microbatches=2, circular_repeat=2,
      vectorize_stages=vectorize, random_seed=5,
      single_stage_body=body_cls.Params().Set(dim=D))


def _ForwardAndGrad(body_cls, vectorize, mode='graph', differentiate=True):
  """(outputs, gradients, layer) of one step, graph mode or jit."""
  x = np.random.RandomState(2).uniform(-1, 1, [4, D]).astype(np.float32)
  if mode == 'graph':
    with tf.Graph().as_default():
      layer = _Params(body_cls, vectorize).Instantiate()
      y = layer.FProp(layer.theta, tf.constant(x))
      grads = (tf.gradients(tf.reduce_sum(tf.sin(y)), layer.vars.Flatten())
               if differentiate else [])
      with sessions.AsBuilt() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        _LoadWeights(layer, sess)
        return sess.run(y), sess.run(grads), layer
  layer = _Params(body_cls, vectorize).Instantiate()
  _LoadWeights(layer)

  @tf.function(jit_compile=True)
  def Step():
    with tf.GradientTape() as tape:
      y = layer.FProp(layer.theta, tf.constant(x))
      loss = tf.reduce_sum(tf.sin(y))
    return y, tape.gradient(loss, layer.vars.Flatten())

  y, grads = Step()
  return y.numpy(), [g.numpy() for g in grads], layer


def _FallbackLines(caplog):
  return [r.getMessage() for r in caplog.records
          if 'runs its stages one after another' in r.getMessage()]


@pytest.mark.parametrize('body_cls,why,differentiate', [
    (_StatefulRandomBody, 'stateful ops (RandomUniform)', False),
    (_CustomGradientBody, 'custom gradients', True),
])
def test_a_body_that_cannot_be_vectorized_runs_stage_by_stage(
    body_cls, why, differentiate, caplog):
  """Once per layer, said in one log line; same numbers as 'never'."""
  caplog.set_level(logging.INFO)
  y, grads, layer = _ForwardAndGrad(body_cls, 'auto',
                                    differentiate=differentiate)
  assert why in layer.vectorizing.reason
  lines = _FallbackLines(caplog)
  assert len(lines) == 1 and why in lines[0], lines
  assert "PipelinedLayer 'pipe'" in lines[0]
  same_numbers = {_StatefulRandomBody: _ShiftedBody}.get(body_cls, body_cls)
  want_y, want_grads, _ = _ForwardAndGrad(same_numbers, 'never',
                                          differentiate=differentiate)
  close.AssertClose(y, want_y, close.FLOAT32_TIGHT, 'outputs')
  close.AssertClose(grads, want_grads, close.FLOAT32_TIGHT, 'gradients')


def test_the_fallback_is_decided_once_per_layer(caplog):
  caplog.set_level(logging.INFO)
  with tf.Graph().as_default():
    layer = _Params(_StatefulRandomBody, 'auto').Instantiate()
    for _ in range(3):
      layer.FProp(layer.theta, tf.zeros([4, D]))
  assert len(_FallbackLines(caplog)) == 1


def test_always_refuses_a_body_it_cannot_vectorize_naming_the_fix():
  with tf.Graph().as_default():
    layer = _Params(_StatefulRandomBody, 'always').Instantiate()
    with pytest.raises(ValueError, match=(
        r"PipelinedLayer 'pipe': vectorize_stages='always', but the body "
        r'draws random numbers with stateful ops \(RandomUniform\).*Set '
        r"vectorize_stages='auto' \(or 'never'\)")):
      layer.FProp(layer.theta, tf.zeros([4, D]))


def test_data_dependent_control_flow_vectorizes_in_graph_mode_only(caplog):
  """Under XLA its vectorized form would have run-time shapes: stage by
  stage there, said why; both equal the stage-by-stage numbers."""
  caplog.set_level(logging.INFO)
  want = _ForwardAndGrad(_DataDependentCondBody, 'never')
  y, grads, layer = _ForwardAndGrad(_DataDependentCondBody, 'auto')
  assert layer.vectorizing.vectorized
  close.AssertClose((y, grads), want[:2], close.FLOAT32_TIGHT, 'graph mode')
  y, grads, layer = _ForwardAndGrad(_DataDependentCondBody, 'auto', 'jit')
  assert 'XLA cannot compile' in layer.vectorizing.reason
  close.AssertClose((y, grads), want[:2], close.FLOAT32_TIGHT, 'jit')


@pytest.mark.parametrize('mode', ['graph', 'jit'])
def test_lingvo_checks_vectorize_as_plain_asserts_also_under_xla(mode):
  """Lingvo's Assert of float data, vectorized, is a plain Assert op (no
  guard), so the stages vectorize under XLA too; equal to stage by stage."""
  want = _ForwardAndGrad(_PaddedBody, 'never', mode)
  y, grads, layer = _ForwardAndGrad(_PaddedBody, 'always', mode)
  assert layer.vectorizing.vectorized and layer.vectorizing.reason is None
  close.AssertClose((y, grads), want[:2], close.FLOAT32_TIGHT, mode)


def test_one_stage_and_partitioned_layers_do_not_vectorize():
  """S=1 has nothing to vectorize; partitioned, each device runs its own
  stage (the manual region), never the vectorized path."""
  from gpipe import sharding  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    layer = _Params(reference_bodies.DenseBody, 'auto').Set(
        num_stages=1).Instantiate()
    layer.FProp(layer.theta, tf.zeros([4, D]))
    assert not layer.vectorizing.vectorized
    layer = _Params(reference_bodies.DenseBody, 'auto').Set(
        name='split', shard_stages_1d=True).Instantiate()
    with sharding.SpmdPartitioning():
      layer.FProp(layer.theta, tf.zeros([4, D]))
    assert not layer.vectorizing.vectorized
    layer.FProp(layer.theta, tf.zeros([4, D]))  # one device: vectorized
    assert layer.vectorizing.vectorized
