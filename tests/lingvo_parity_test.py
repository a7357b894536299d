"""Parity of gpipe's PipelinedLayer with Lingvo's own pipelined layer.

`gpipe.layers.PipelinedLayer` (alias `LayerwiseShardablePipelinedLayer`)
reimplements `lingvo.core.gshard_layers.LayerwiseShardablePipelinedLayer`
with the same Params and the same variables, so that Lingvo configs and
checkpoints carry over unchanged. This file checks that promise against the
installed Lingvo itself (not against a re-derivation of it):

1. Variables. For the same Params (num_stages 1..4, per_stage_vars,
   circular_repeat 1 and 2 with shard_stages_1d, single_stage_body and
   stage_parallel_body), both layers, each built in its own tf.Graph, create
   the same variables: same full names (the checkpoint keys), shapes, dtypes,
   trainability and the same `layer.vars` structure (the theta paths).

2. Numbers, where Lingvo's pipelined path runs on this CPU
   (single_stage_body, shard_stages_1d=False, circular_repeat=1). Lingvo's
   layer is built and initialized in one graph, its weights are read and
   loaded by name into gpipe's layer built in a second graph, both get the
   same input, and the forward outputs and the gradients w.r.t. the input and
   every variable must agree (rtol 1e-5, atol 1e-6; in graph mode, where
   our loops are compiled by XLA, atol 1e-6 of each array's largest entry
   above 1: tests/close.py's FLOAT32_TIGHT_AT_SCALE). Graph mode (tf.Graph +
   tf.compat.v1.Session, Lingvo's home) over a pairwise covering of
   num_stages x num_microbatches x per_stage_vars (including microbatch
   counts that are not multiples of num_stages), and microbatch_size,
   inputs that are already microbatched and per-example kwargs; plus two
   configs under TF2 tf.function(jit_compile=True) with tf.GradientTape.
   Both layers run with unroll='never' (Lingvo's default 'eval_only' would
   not pipeline in eval). The forward output is also checked against a
   plain NumPy loop over the layers, so the two cannot agree on a wrong
   answer.

3. Lingvo's limitations on this CPU, recorded so that a change in either
   library shows up: configs where Lingvo's pipelined layer raises
   (circular_repeat=2 with shard_stages_1d, circular_repeat=2 without it,
   stage_parallel_body, a single loop iteration, per-example kwargs with
   bubbles) while gpipe's runs and matches a reference built from Lingvo
   where possible (Lingvo's unroll='always' path, or Lingvo's single-stage
   pipeline with the same stacked weights), and gpipe's own unrolled path.
   Each asserts with pytest.raises that Lingvo still fails.
"""

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import  (before any lingvo import)
import tensorflow as tf
from absl import flags
from gpipe import layers
from lingvo.core import gshard_layers
from lingvo.core import scatter_update
from tests import close
from tests import covering
from tests import reference_bodies
from tests import sessions

_DIM = 4
_BATCH = 12  # Divisible by every microbatch count used here.
_TIME = 3

_GPIPE = layers.PipelinedLayer
_LINGVO = gshard_layers.LayerwiseShardablePipelinedLayer


def _Params(cls, name='pipe', stage_parallel=False, **kwargs):
  """Params of `cls` over a DenseBody (or its stage-parallel twin)."""
  p = cls.Params().Set(name=name, **kwargs)
  if stage_parallel:
    p.stage_parallel_body = (
        reference_bodies.StageParallelDenseBody.Params().Set(
            dim=_DIM, num_stages=p.num_stages))
  else:
    p.single_stage_body = reference_bodies.DenseBody.Params().Set(dim=_DIM)
  return p


def _RelName(layer_name, var_name):
  """'pipe/body/w/var:0' -> 'body/w/var:0' (drops the layer's own name)."""
  assert var_name.startswith(layer_name + '/'), (layer_name, var_name)
  return var_name[len(layer_name) + 1:]


def _SortedVars(layer):
  return sorted(layer.vars.Flatten(), key=lambda v: v.name)


def _Inputs(seed, batch=_BATCH):
  """x, an output cotangent and per-example scale/shift kwargs."""
  rng = np.random.default_rng(seed)
  normal = lambda *s: rng.standard_normal(s).astype(np.float32)
  return dict(
      x=normal(batch, _TIME, _DIM),
      cotangent=normal(batch, _TIME, _DIM),
      scale=normal(batch, _TIME, 1),
      shift=normal(batch, _TIME, _DIM))


def _NpDense(w, b, x, scale=None, shift=None):
  """reference_bodies.DenseBody's math in NumPy."""
  y = np.tanh(np.einsum('...d,de->...e', x, w) + b)
  if scale is not None:
    y = y * scale
  if shift is not None:
    y = y + shift
  return y


def _NpReference(weights, p, x, kwargs):
  """Forward pass of the S * R layers one after another, in NumPy."""
  layer_weights = []
  for r in range(p.circular_repeat):
    for s in range(p.num_stages):
      if p.per_stage_vars:
        w = weights['iter_%05d/body_iter_%05d/w/var:0' % (s, s)]
        b = weights['iter_%05d/body_iter_%05d/b/var:0' % (s, s)]
      else:
        w, b = weights['body/w/var:0'][s], weights['body/b/var:0'][s]
        if p.circular_repeat > 1:
          w, b = w[r], b[r]
      layer_weights.append((w, b))
  y = x
  for w, b in layer_weights:
    y = _NpDense(w, b, y, **kwargs)
  return y


# -----------------------------------------------------------------------------
# 1. Same variables.


def _VariableSpec(params):
  """Builds the layer in a fresh graph; returns what a checkpoint would see."""
  graph = tf.Graph()
  with graph.as_default():
    layer = params.Instantiate()
    global_vars = {
        v.name: (tuple(v.shape.as_list()), v.dtype.base_dtype.name)
        for v in tf.compat.v1.global_variables()
    }
    trainable = sorted(v.name for v in tf.compat.v1.trainable_variables())
    theta_paths = {
        path: (v.name, tuple(v.shape.as_list()))
        for path, v in layer.vars.FlattenItems()
    }
  return global_vars, trainable, theta_paths


_VARIABLE_CONFIGS = (
    [dict(num_stages=s, per_stage_vars=psv, num_microbatches=m)
     for s in (1, 2, 3, 4) for psv in (False, True) for m in (None, 3)] +
    [dict(num_stages=s, per_stage_vars=True, shard_stages_1d=True,
          microbatch_size=2) for s in (2, 3)] +
    [dict(num_stages=s, circular_repeat=2, shard_stages_1d=True,
          num_microbatches=4) for s in (1, 2, 3, 4)] +
    [dict(num_stages=s, stage_parallel=True, num_microbatches=2)
     for s in (1, 2, 3, 4)])


@pytest.mark.parametrize('config', _VARIABLE_CONFIGS, ids=str)
def test_same_variables(config):
  lingvo_spec = _VariableSpec(_Params(_LINGVO, **config))
  gpipe_spec = _VariableSpec(_Params(_GPIPE, **config))
  lingvo_vars, lingvo_trainable, lingvo_theta = lingvo_spec
  gpipe_vars, gpipe_trainable, gpipe_theta = gpipe_spec
  assert gpipe_vars == lingvo_vars
  assert gpipe_trainable == lingvo_trainable
  assert gpipe_theta == lingvo_theta
  # Sanity: the stacked shapes are what the Params ask for.
  s, r = config['num_stages'], config.get('circular_repeat', 1)
  if config.get('per_stage_vars'):
    expected = {'pipe/iter_%05d/body_iter_%05d/w/var:0' % (i, i):
                    (_DIM, _DIM) for i in range(s)}
  else:
    expected = {'pipe/body/w/var:0':
                    (s, r, _DIM, _DIM) if r > 1 else (s, _DIM, _DIM)}
  for name, shape in expected.items():
    assert gpipe_vars[name][0] == shape, (name, gpipe_vars)
  assert len(gpipe_vars) == 2 * len(expected)


# -----------------------------------------------------------------------------
# 2. Same numbers, graph mode.


def _RunGraph(params, inputs, kwarg_names=(), weights=None, seed=1234):
  """Builds `params` in a fresh graph and runs forward and backward.

  Args:
    params: the layer's Params.
    inputs: from _Inputs(); `x` is the layer input.
    kwarg_names: which of inputs' scale/shift to pass as per-example kwargs.
    weights: {relative var name: value} to load; None keeps the seeded init.
    seed: graph-level random seed for the initializers.

  Returns:
    (weights, results): the weights used, by relative name, and a dict with
    'y', 'dx' and 'd/<relative var name>' for every variable.
  """
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.set_random_seed(seed)
    layer = params.Instantiate()
    variables = _SortedVars(layer)
    names = [_RelName(params.name, v.name) for v in variables]
    x = tf.constant(inputs['x'])
    kwargs = {k: tf.constant(inputs[k]) for k in kwarg_names}
    y = layer.FProp(layer.theta, x, **kwargs)
    loss = tf.reduce_sum(y * inputs['cotangent'])
    grads = tf.gradients(loss, [x] + variables)
    assert all(g is not None for g in grads), grads
    # A gradient may come back as IndexedSlices; compare it densely.
    grads = [tf.convert_to_tensor(g) for g in grads]
    with sessions.AsBuilt(graph) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      if weights is not None:
        assert sorted(weights) == names, (sorted(weights), names)
        for name, v in zip(names, variables):
          v.load(weights[name], sess)
      values = sess.run([y] + grads + variables)
  n = len(variables)
  results = {'y': values[0], 'dx': values[1]}
  results.update({'d/' + k: g for k, g in zip(names, values[2:2 + n])})
  return dict(zip(names, values[2 + n:])), results


def _AssertSameResults(gpipe_results, ref_results, what):
  """Ours (loops compiled by XLA) against Lingvo's (op by op)."""
  assert sorted(gpipe_results) == sorted(ref_results)
  for key in sorted(ref_results):
    close.AssertClose(gpipe_results[key], ref_results[key],
                      close.FLOAT32_TIGHT_AT_SCALE, f'{what}: {key}')


def _CheckGraphParity(config, kwarg_names=(), batch=_BATCH, seed=0):
  inputs = _Inputs(seed, batch)
  if config.get('premicrobatched'):
    config = {k: v for k, v in config.items() if k != 'premicrobatched'}
    # Lingvo and gpipe take the leading dim as the microbatch dim (M = 3) when
    # neither num_microbatches nor microbatch_size is set.
    inputs = {k: v.reshape((3, -1) + v.shape[1:]) for k, v in inputs.items()}
  lingvo_p = _Params(_LINGVO, unroll='never', **config)
  gpipe_p = _Params(_GPIPE, unroll='never', **config)
  weights, lingvo_results = _RunGraph(lingvo_p, inputs, kwarg_names)
  gpipe_weights, gpipe_results = _RunGraph(
      gpipe_p, inputs, kwarg_names, weights=weights, seed=999)
  for name in weights:
    np.testing.assert_array_equal(gpipe_weights[name], weights[name])
  _AssertSameResults(gpipe_results, lingvo_results, f'gpipe vs lingvo {config}')
  np_ref = _NpReference(weights, gpipe_p, inputs['x'],
                        {k: inputs[k] for k in kwarg_names})
  close.AssertClose(gpipe_results['y'], np_ref, close.FLOAT32_TIGHT,
                    'gpipe vs NumPy')


# Lingvo's pipeline cannot run S=1, M=1 (see test_lingvo_cannot_run).
_FULL_GRID = [(s, m, per_stage_vars)
              for s in (1, 2, 3, 4) for m in (1, 2, 3, 4)
              for per_stage_vars in (False, True) if (s, m) != (1, 1)]
# Pairwise over (S, the kind of M, per_stage_vars) (covering.py): every S
# with every kind of M (1, fewer than S, = S, S + 1 -- not a multiple --,
# many), each of them with and without per-stage variables: 13 of the
# product's 30.
_GRID_FEATURES = (lambda c: c[0], covering.MicrobatchKindOfRow,
                  lambda c: c[2])
_GRID = covering.Pairwise(_FULL_GRID, _GRID_FEATURES)


@pytest.mark.parametrize('num_stages,num_microbatches,per_stage_vars', _GRID)
def test_graph_parity(num_stages, num_microbatches, per_stage_vars):
  _CheckGraphParity(
      dict(num_stages=num_stages, num_microbatches=num_microbatches,
           per_stage_vars=per_stage_vars),
      seed=10 * num_stages + num_microbatches)


@pytest.mark.parametrize('config', [
    dict(num_stages=2, microbatch_size=4),  # M = 3, not a multiple of S.
    dict(num_stages=3, microbatch_size=6, per_stage_vars=True),  # M = 2.
    dict(num_stages=2, premicrobatched=True),  # Input is already [M=3, ...].
], ids=str)
def test_graph_parity_microbatching_variants(config):
  _CheckGraphParity(config)


def test_graph_parity_per_example_kwargs():
  # With num_stages > 1 Lingvo's kwargs gather fails on CPU (see
  # test_lingvo_cannot_run); with one stage there are no bubbles.
  _CheckGraphParity(
      dict(num_stages=1, num_microbatches=3), kwarg_names=('scale', 'shift'))


# -----------------------------------------------------------------------------
# 2b. Same numbers, TF2 + XLA.


@pytest.fixture
def parsed_flags():
  """Lingvo reads absl flags (--xla_device) when tracing in TF2 mode."""
  marked = not flags.FLAGS.is_parsed()
  if marked:
    flags.FLAGS.mark_as_parsed()
  yield
  if marked:
    flags.FLAGS.unparse_flags()


def _RunJit(layer, variables, x, cotangent):
  """Forward and gradients under tf.function(jit_compile=True), traced as
  written (autograph=False), as Lingvo's own TF2 runners trace its layers;
  gpipe's layer methods are never converted by autograph anyway."""

  @tf.function(jit_compile=True, autograph=False)
  def Step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = layer.FProp(layer.theta, x)
      loss = tf.reduce_sum(y * cotangent)
    return [y] + tape.gradient(loss, [x] + variables)

  # Lingvo's Recurrent uses InplaceUpdate, which XLA:CPU cannot compile.
  with scatter_update.SetInplaceUpdate(False):
    return [t.numpy() for t in Step(tf.constant(x))]


@pytest.mark.parametrize('num_stages,num_microbatches,per_stage_vars',
                         [(2, 3, False), (3, 4, True)])
def test_jit_parity(parsed_flags, num_stages, num_microbatches,
                    per_stage_vars):
  del parsed_flags
  assert tf.executing_eagerly()
  config = dict(num_stages=num_stages, num_microbatches=num_microbatches,
                per_stage_vars=per_stage_vars, unroll='never')
  lingvo_layer = _Params(_LINGVO, name='lingvo_pipe', **config).Instantiate()
  gpipe_layer = _Params(_GPIPE, name='gpipe_pipe', **config).Instantiate()
  lingvo_vars = _SortedVars(lingvo_layer)
  gpipe_vars = _SortedVars(gpipe_layer)
  assert ([_RelName('lingvo_pipe', v.name) for v in lingvo_vars] ==
          [_RelName('gpipe_pipe', v.name) for v in gpipe_vars])
  for lv, gv in zip(lingvo_vars, gpipe_vars):
    assert lv.shape == gv.shape
    gv.assign(lv)  # Copy the weights by position.
  inputs = _Inputs(seed=num_stages)
  lingvo_out = _RunJit(lingvo_layer, lingvo_vars, inputs['x'],
                       inputs['cotangent'])
  gpipe_out = _RunJit(gpipe_layer, gpipe_vars, inputs['x'],
                      inputs['cotangent'])
  names = ['y', 'dx'] + ['d/' + v.name for v in gpipe_vars]
  for name, g, l in zip(names, gpipe_out, lingvo_out):
    close.AssertClose(g, l, close.FLOAT32_TIGHT,
                      f'jit gpipe vs lingvo {config}: {name}')
  weights = {_RelName('gpipe_pipe', v.name): v.numpy() for v in gpipe_vars}
  np_ref = _NpReference(weights, _Params(_GPIPE, **config), inputs['x'], {})
  close.AssertClose(gpipe_out[0], np_ref, close.FLOAT32_TIGHT,
                    'jit gpipe vs NumPy')


# -----------------------------------------------------------------------------
# 3. What Lingvo's pipelined layer cannot run here, and gpipe's can.

# Each case: (pipelined config, per-example kwargs, reference).
# Reference 'lingvo_unrolled': Lingvo's own layer, same Params but
# unroll='always' (its sequential path), same weights.
# Reference 'lingvo_single_stage': Lingvo's pipelined single_stage_body layer
# with the same stacked weights (StageParallelDenseBody with w [S, d, d] and
# b [S, d] computes what S stacked DenseBody stages compute).
_LINGVO_FAILS = {
    # Lingvo: TypeError from xla_sharding (manual_sharding=None) when
    # building the manual-sharding path; it needs an SPMD partitioner.
    'circular_repeat2_shard_stages_1d': (
        dict(num_stages=2, circular_repeat=2, shard_stages_1d=True,
             num_microbatches=4), (), 'lingvo_unrolled'),
    'circular_repeat2_shard_stages_1d_s3_m4': (
        dict(num_stages=3, circular_repeat=2, shard_stages_1d=True,
             num_microbatches=4), (), 'lingvo_unrolled'),
    # Lingvo: AssertionError, circular needs shard_stages_1d (or a mesh dim).
    'circular_repeat2_no_sharding': (
        dict(num_stages=2, circular_repeat=2, num_microbatches=3), (),
        'lingvo_unrolled'),
    # Lingvo: TypeError, _BodyFProp() takes 1 positional argument.
    'stage_parallel_body': (
        dict(num_stages=3, stage_parallel=True, num_microbatches=4), (),
        'lingvo_single_stage'),
    # Lingvo: ValueError, recurrent.Recurrent's single-step shortcut returns
    # 2 values where FPropFn unpacks 3.
    'single_iteration_s1_m1': (
        dict(num_stages=1, num_microbatches=1), (), 'lingvo_unrolled'),
    # Lingvo: InvalidArgumentError at run time, bubble iterations gather
    # kwargs at microbatch ids >= num_microbatches (out of range on CPU).
    'per_example_kwargs_with_bubbles': (
        dict(num_stages=2, num_microbatches=2), ('scale', 'shift'),
        'lingvo_unrolled'),
}


@pytest.mark.parametrize('case', sorted(_LINGVO_FAILS))
def test_lingvo_cannot_run(case):
  config, kwarg_names, reference = _LINGVO_FAILS[case]
  inputs = _Inputs(seed=7)

  # Lingvo's pipelined layer fails (at construction, graph building or run).
  with pytest.raises(Exception):
    _RunGraph(_Params(_LINGVO, unroll='never', **config), inputs, kwarg_names)

  # A reference computed by Lingvo, which fixes the weights.
  if reference == 'lingvo_unrolled':
    ref_p = _Params(_LINGVO, unroll='always', **config)
  else:
    assert reference == 'lingvo_single_stage'
    ref_config = {k: v for k, v in config.items() if k != 'stage_parallel'}
    ref_p = _Params(_LINGVO, unroll='never', **ref_config)
  weights, ref_results = _RunGraph(ref_p, inputs, kwarg_names)

  # gpipe's pipelined layer runs and matches it, and its own unrolled path.
  gpipe_p = _Params(_GPIPE, unroll='never', **config)
  _, gpipe_results = _RunGraph(gpipe_p, inputs, kwarg_names, weights=weights)
  assert np.all(np.isfinite(gpipe_results['y']))
  _AssertSameResults(gpipe_results, ref_results, f'gpipe vs {reference}')
  _, unrolled_results = _RunGraph(
      _Params(_GPIPE, unroll='always', **config), inputs, kwarg_names,
      weights=weights)
  _AssertSameResults(gpipe_results, unrolled_results, 'gpipe vs unrolled')
  if not config.get('stage_parallel'):
    np_ref = _NpReference(weights, gpipe_p, inputs['x'],
                          {k: inputs[k] for k in kwarg_names})
    close.AssertClose(gpipe_results['y'], np_ref, close.FLOAT32_TIGHT,
                      'gpipe vs NumPy')
