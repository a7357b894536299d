"""Tests for gpipe.recurrent.Recurrent against independent references.

Every toy cell is written once against a small ops namespace so that the same
code runs on TensorFlow tensors and on NumPy arrays. Recurrent's forward values
and gradients are compared with:

  * a plain public `tf.while_loop` with carried state and TensorArray
    accumulation, differentiated by TensorFlow's own autodiff, built in the
    same graph / tf.function as Recurrent;
  * a Python loop unrolled in NumPy (float64) for the forward values, and
    central finite differences of that NumPy loop (float64) for the gradients
    w.r.t. theta, state0, inputs and the tensors the cell captures.

Modes: TF1 graph mode (tf.Graph + tf.compat.v1.Session + tf.gradients) and TF2
`tf.function(jit_compile=True)` + tf.GradientTape.
"""

import functools
import sys
import types
import zlib

import numpy as np
import pytest
import tensorflow as tf

from gpipe import recurrent
from tests import close

_B, _H, _T, _V = 3, 4, 5, 6

# Largest errors seen by _AssertClose, reported at module teardown (run pytest
# with -s to see them).
_MAX_ERR = {  # 'rel' is over the entries with |expected| > 1e-3.
    'vs_while_loop': {'abs': 0.0, 'rel': 0.0},
    'vs_numpy': {'abs': 0.0, 'rel': 0.0},
}

# The ops the toy cells use, for TensorFlow and for NumPy.
_TF = types.SimpleNamespace(
    tanh=tf.tanh,
    sin=tf.sin,
    sum=tf.reduce_sum,
    gather=tf.gather,
    to_float=lambda x: tf.cast(x, tf.float32))
_NP = types.SimpleNamespace(
    tanh=np.tanh,
    sin=np.sin,
    sum=np.sum,
    gather=lambda params, idx: np.take(params, idx, axis=0),
    to_float=lambda x: np.asarray(x, np.float64))


@pytest.fixture(scope='module', autouse=True)
def _report_max_errors():
  yield
  for what, err in _MAX_ERR.items():
    print(f'\n[recurrent_test] largest error {what}: abs={err["abs"]:.3g} '
          f'rel={err["rel"]:.3g}', file=sys.stderr)


def _IsFloat(x):
  dtype = x.dtype
  if isinstance(dtype, tf.DType):
    return dtype.is_floating
  return np.issubdtype(dtype, np.floating)


def _FloatLeaves(structure):
  return [x for x in tf.nest.flatten(structure) if _IsFloat(x)]


def _RecordError(against, actual, expected):
  """Keeps the largest abs/rel errors of passing comparisons (not of the
  expected failures)."""
  diff = np.abs(actual - expected)
  if diff.size:
    err = _MAX_ERR[against]
    err['abs'] = max(err['abs'], float(diff.max()))
    big = np.abs(expected) > 1e-3
    if big.any():
      rel = diff[big] / np.abs(expected[big])
      err['rel'] = max(err['rel'], float(rel.max()))


def _AssertClose(actual, expected, what, against):
  """close.AssertClose(FLOAT32_TIGHT) of two leaves or two structures (the
  same structure; integers of the same dtype), recording the largest errors
  `against` each reference."""
  tf.nest.assert_same_structure(actual, expected)
  for i, (a, e) in enumerate(
      zip(tf.nest.flatten(actual), tf.nest.flatten(expected))):
    a, e = np.asarray(a), np.asarray(e)
    if e.dtype.kind in 'biu':
      assert a.dtype == e.dtype, (what, i, a.dtype, e.dtype)
  close.AssertClose(actual, expected, close.FLOAT32_TIGHT, what,
                    record=functools.partial(_RecordError, against))


# ---------------------------------------------------------------------------
# Toy cells. make_cell(m, outer) -> cell_fn; m is _TF or _NP. outer is
# [theta, state0, inputs, caps], the tensors (arrays) of the enclosing scope,
# which the cell may capture implicitly.
# ---------------------------------------------------------------------------


def _RnnCell(m, outer):
  """(a) tanh(h @ w + x_t + b), with extras."""
  del outer

  def Cell(theta, h, x):
    new_h = m.tanh(h @ theta['w'] + x + theta['b'])
    return new_h, {'y': new_h * theta['b'], 'n': m.sum(new_h * new_h, axis=-1)}

  return Cell


def _NestedCell(m, outer):
  """(b) Dict state with a tuple inside and an int32 counter."""
  del outer

  def Cell(theta, state, inp):
    w, v = theta
    a, count = state['pair']
    scale = 1.0 + 0.1 * m.to_float(count)
    h = m.tanh(state['h'] @ w + inp['x'] * scale + a[:, None] * v)
    new_a = 0.5 * a + m.sum(h * v, axis=-1) * inp['g']
    new_state = {'h': h, 'pair': (new_a, count + 1)}
    return new_state, (h - state['h'], count * 2)

  return Cell


def _CaptureCell(m, outer):
  """(c) Captures outer c, d (not in theta) and a tensor derived from theta."""
  outer_theta, _, _, (c, d) = outer
  u2 = outer_theta['u'] * 2.0  # Computed outside the cell, then captured.

  def Cell(theta, h, x):
    new_h = m.tanh(h @ theta['w'] + x * c + d + 0.1 * (h @ u2))
    return new_h, {'z': new_h * c}

  return Cell


def _AliasCell(m, outer, which):
  """Captures a tensor that is also passed as theta, state0 or inputs."""
  outer_theta, outer_state0, outer_inputs, _ = outer
  captured = {
      'theta': outer_theta['b'],  # What the cell gets as theta['b'].
      'state0': outer_state0,
      'inputs': outer_inputs,
  }[which]

  def Cell(theta, h, x):
    extra = m.sum(captured, axis=0) if which == 'inputs' else captured
    new_h = m.tanh(h @ theta['w'] + x + theta['b'] * extra)
    return new_h, {'y': new_h * theta['b']}

  return Cell


def _ListStateNoExtrasCell(m, outer):
  """(f) A list state, a bare tensor theta, and extras == ()."""
  del outer

  def Cell(w, state, x):
    h1, h2 = state
    n1 = m.tanh(h1 @ w + x)
    n2 = 0.9 * h2 + n1 * h1
    return [n1, n2], ()

  return Cell


def _DictStateNoExtrasCell(m, outer):
  """(f) A dict state, tuple inputs and extras == {}."""
  del outer

  def Cell(theta, state, inp):
    x, y = inp
    h = m.tanh(state['h'] @ theta['w'] + x + m.sin(y)[:, None] * theta['b'])
    return {'h': h}, {}

  return Cell


def _EmbeddingCell(m, outer):
  """A gather on theta (IndexedSlices gradient) driven by int32 inputs."""
  del outer

  def Cell(theta, h, inp):
    ids, x = inp
    e = m.gather(theta['emb'], ids)
    new_h = m.tanh(h @ theta['w'] + e + x)
    return new_h, {'e': e}

  return Cell


_Case = types.SimpleNamespace


def _Rng(name):
  return np.random.default_rng(zlib.crc32(name.encode()))


def _Normal(rng, *shape, scale=0.5):
  return np.asarray(scale * rng.standard_normal(shape), np.float32)


def _MakeCase(name):
  """Returns the case's cell factory and float32 / int32 NumPy data."""
  rng = _Rng(name)
  f = functools.partial(_Normal, rng)
  if name in ('rnn', 'rnn_t1'):
    num = 1 if name == 'rnn_t1' else _T
    return _Case(
        make_cell=_RnnCell,
        theta={'w': f(_H, _H), 'b': f(_H)},
        state0=f(_B, _H),
        inputs=f(num, _B, _H),
        caps=[])
  if name == 'nested':
    return _Case(
        make_cell=_NestedCell,
        theta=(f(_H, _H), f(_H)),
        state0={'h': f(_B, _H), 'pair': (f(_B), np.asarray(3, np.int32))},
        inputs={'x': f(_T, _B, _H), 'g': f(_T, _B)},
        caps=[])
  if name == 'capture':
    return _Case(
        make_cell=_CaptureCell,
        theta={'w': f(_H, _H), 'u': f(_H, _H)},
        state0=f(_B, _H),
        inputs=f(_T, _B, _H),
        caps=[f(_H), np.asarray(0.3, np.float32)])
  if name == 'list_no_extras':
    return _Case(
        make_cell=_ListStateNoExtrasCell,
        theta=f(_H, _H),
        state0=[f(_B, _H), f(_B, _H)],
        inputs=f(_T, _B, _H),
        caps=[])
  if name == 'dict_no_extras':
    return _Case(
        make_cell=_DictStateNoExtrasCell,
        theta={'w': f(_H, _H), 'b': f(_H)},
        state0={'h': f(_B, _H)},
        inputs=(f(_T, _B, _H), f(_T, _B)),
        caps=[])
  if name == 'embedding':
    return _Case(
        make_cell=_EmbeddingCell,
        theta={'emb': f(_V, _H), 'w': f(_H, _H)},
        state0=f(_B, _H),
        inputs=(np.asarray(rng.integers(0, _V, (_T, _B)), np.int32),
                f(_T, _B, _H)),
        caps=[])
  if name.startswith('alias_'):
    return _Case(
        make_cell=functools.partial(_AliasCell, which=name[len('alias_'):]),
        theta={'w': f(_H, _H), 'b': f(_H)},
        state0=f(_B, _H),
        inputs=f(_T, _B, _H),
        caps=[])
  raise ValueError(name)


_CELLS = ('rnn', 'nested', 'capture', 'rnn_t1', 'list_no_extras',
          'dict_no_extras', 'embedding')


def _NumIterations(inputs):
  return tf.nest.flatten(inputs)[0].shape[0]


def _Step(inputs, t):
  return tf.nest.map_structure(lambda x: x[t], inputs)


def _LossTerms(m, outputs, loss_kind):
  """The float tensors the loss sums (with weights), per loss kind."""
  states, final, extras = outputs
  if loss_kind == 'all':  # (d): stacked states, final state and extras.
    return _FloatLeaves(states) + _FloatLeaves(final) + _FloatLeaves(extras)
  if loss_kind == 'states':
    return _FloatLeaves(states)
  if loss_kind == 'final':
    return _FloatLeaves(final)
  if loss_kind == 'extras':
    return _FloatLeaves(extras)
  if loss_kind == 'gather':  # Incoming gradients are IndexedSlices.
    num = _FloatLeaves(states)[0].shape[0]
    idx = [num - 1, 0, num - 1]
    return [
        m.gather(x, idx) for x in _FloatLeaves(states) + _FloatLeaves(extras)
    ]
  raise ValueError(loss_kind)


# ---------------------------------------------------------------------------
# NumPy reference: unrolled Python loop (float64) + central differences.
# ---------------------------------------------------------------------------


def _NumpyRecurrent(theta, state0, inputs, cell_fn):
  state = state0
  all_states, all_extras = [], []
  for t in range(_NumIterations(inputs)):
    state, extras = cell_fn(theta, state, _Step(inputs, t))
    all_states.append(state)
    all_extras.append(extras)
  stack = lambda seq: tf.nest.map_structure(lambda *xs: np.stack(xs), *seq)
  return stack(all_states), state, stack(all_extras)


def _ToFloat64(structure):
  return tf.nest.map_structure(
      lambda x: np.asarray(x, np.float64) if _IsFloat(x) else np.asarray(x),
      structure)


@functools.lru_cache(maxsize=None)
def _NumpyReference(cell, loss_kind):
  """Returns (outputs, loss, grads, weights) from the NumPy reference.

  grads are w.r.t. the float leaves of [theta, state0, inputs, caps], in
  tf.nest order, by central differences in float64.
  """
  case = _MakeCase(cell)
  params = _ToFloat64([case.theta, case.state0, case.inputs, case.caps])

  def Run(p):
    theta, state0, inputs, _ = p
    return _NumpyRecurrent(theta, state0, inputs,
                           case.make_cell(_NP, p))

  outputs = Run(params)
  terms = _LossTerms(_NP, outputs, loss_kind)
  rng = _Rng('weights/' + loss_kind)
  weights = [_Normal(rng, *t.shape, scale=1.0) for t in terms]

  def Loss(p):
    return sum(
        np.sum(w * t) for w, t in zip(weights, _LossTerms(_NP, Run(p),
                                                          loss_kind)))

  flat = tf.nest.flatten(params)
  grads = []
  eps = 1e-6
  for i, leaf in enumerate(flat):
    if not _IsFloat(leaf):
      continue
    grad = np.zeros_like(leaf)
    for idx in np.ndindex(leaf.shape):
      values = []
      for delta in (eps, -eps):
        moved = leaf.copy()
        moved[idx] += delta
        values.append(
            Loss(tf.nest.pack_sequence_as(params, flat[:i] + [moved] +
                                          flat[i + 1:])))
      grad[idx] = (values[0] - values[1]) / (2 * eps)
    grads.append(grad)
  return outputs, Loss(params), grads, weights


# ---------------------------------------------------------------------------
# TensorFlow reference: the public tf.while_loop with TensorArrays.
# ---------------------------------------------------------------------------


def _WhileLoopReference(theta, state0, inputs, cell_fn):
  """Plain tf.while_loop version of Recurrent, differentiated by TF."""
  num = _NumIterations(inputs)
  # Learn the extras' dtypes and shapes from one call outside the loop.
  _, extras_like = cell_fn(theta, state0, _Step(inputs, 0))
  new_ta = lambda x: tf.TensorArray(x.dtype, size=num, element_shape=x.shape)
  state_tas = [new_ta(x) for x in tf.nest.flatten(state0)]
  extras_tas = [new_ta(x) for x in tf.nest.flatten(extras_like)]

  def Body(t, state, state_tas, extras_tas):
    new_state, extras = cell_fn(theta, state, _Step(inputs, t))
    state_tas = [
        ta.write(t, x) for ta, x in zip(state_tas, tf.nest.flatten(new_state))
    ]
    extras_tas = [
        ta.write(t, x) for ta, x in zip(extras_tas, tf.nest.flatten(extras))
    ]
    return t + 1, new_state, state_tas, extras_tas

  _, final, state_tas, extras_tas = tf.while_loop(
      lambda t, *_: t < num,
      Body, (tf.constant(0), state0, state_tas, extras_tas),
      maximum_iterations=num)
  states = tf.nest.pack_sequence_as(state0, [ta.stack() for ta in state_tas])
  extras = tf.nest.pack_sequence_as(extras_like,
                                    [ta.stack() for ta in extras_tas])
  return states, final, extras


def _BuildLoss(impl, case, tensors, weights, loss_kind, remat_policy):
  theta, state0, inputs, _ = tensors
  cell_fn = case.make_cell(_TF, tensors)
  if impl == 'recurrent':
    outputs = recurrent.Recurrent(
        theta,
        state0,
        inputs,
        cell_fn,
        remat_policy=remat_policy)
  else:
    outputs = _WhileLoopReference(theta, state0, inputs, cell_fn)
  terms = _LossTerms(_TF, outputs, loss_kind)
  loss = tf.add_n([tf.reduce_sum(w * x) for w, x in zip(weights, terms)])
  return outputs, loss


def _ToTensors(case, theta_as_variables):
  theta = tf.nest.map_structure(
      tf.Variable if theta_as_variables else tf.constant, case.theta)
  rest = tf.nest.map_structure(tf.constant,
                               [case.state0, case.inputs, case.caps])
  return [theta] + rest


_IMPLS = ('recurrent', 'reference')


def _RunGraphMode(cell, loss_kind, remat_policy, theta_as_variables):
  """TF1: tf.Graph + tf.gradients + Session. Returns {impl: values}."""
  case = _MakeCase(cell)
  weights = _NumpyReference(cell, loss_kind)[-1]
  with tf.Graph().as_default():
    tensors = _ToTensors(case, theta_as_variables)
    xs = _FloatLeaves(tensors)
    w = [tf.constant(x) for x in weights]
    fetches = {}
    for impl in _IMPLS:
      outputs, loss = _BuildLoss(impl, case, tensors, w, loss_kind,
                                 remat_policy)
      grads = tf.gradients(
          loss, xs, unconnected_gradients=tf.UnconnectedGradients.ZERO)
      fetches[impl] = (outputs, loss, [tf.convert_to_tensor(g) for g in grads])
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      return sess.run(fetches)


def _RunJitImpl(impl, cell, loss_kind, remat_policy,
                theta_as_variables):
  """TF2: tf.function(jit_compile=True) + GradientTape. Returns values."""
  case = _MakeCase(cell)
  weights = _NumpyReference(cell, loss_kind)[-1]
  tensors = _ToTensors(case, theta_as_variables)
  w = [tf.constant(x) for x in weights]

  @tf.function(jit_compile=True)
  def Fn(tensors, w):
    xs = _FloatLeaves(tensors)
    with tf.GradientTape() as tape:
      for x in xs:
        if not isinstance(x, tf.Variable):
          tape.watch(x)
      outputs, loss = _BuildLoss(impl, case, tensors, w, loss_kind,
                                 remat_policy)
    grads = tape.gradient(
        loss, xs, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return outputs, loss, [tf.convert_to_tensor(g) for g in grads]

  return tf.nest.map_structure(lambda t: t.numpy(), Fn(tensors, w))


# The reference does not depend on remat_policy: compile it once.
_JitReference = functools.lru_cache(maxsize=None)(
    functools.partial(_RunJitImpl, 'reference', remat_policy=None))


def _RunJitMode(cell, loss_kind, remat_policy, theta_as_variables):
  return {
      'recurrent':
          _RunJitImpl('recurrent', cell, loss_kind, remat_policy,
                      theta_as_variables),
      'reference':
          _JitReference(cell, loss_kind,
                        theta_as_variables=theta_as_variables),
  }


def _CheckAgainstReferences(mode, cell, remat_policy, loss_kind,
                            theta_as_variables=False):
  np_outputs, np_loss, np_grads, _ = _NumpyReference(cell, loss_kind)
  run = _RunGraphMode if mode == 'graph' else _RunJitMode
  got = run(cell, loss_kind, remat_policy, theta_as_variables)
  outputs, loss, grads = got['recurrent']
  ref_outputs, ref_loss, ref_grads = got['reference']

  # Forward.
  _AssertClose(outputs, ref_outputs, 'outputs', 'vs_while_loop')
  _AssertClose(outputs, np_outputs, 'outputs', 'vs_numpy')
  _AssertClose(loss, ref_loss, 'loss', 'vs_while_loop')
  _AssertClose(loss, np_loss, 'loss', 'vs_numpy')
  states, final, _ = outputs
  for s, f in zip(tf.nest.flatten(states), tf.nest.flatten(final)):
    np.testing.assert_array_equal(s[-1], f)

  # Gradients w.r.t. theta, state0, inputs and captures.
  assert len(grads) == len(ref_grads) == len(np_grads)
  for i, (g, ref_g, np_g) in enumerate(zip(grads, ref_grads, np_grads)):
    assert np.any(g != 0), f'grad[{i}] is all zeros'
    _AssertClose(g, ref_g, f'grad[{i}]', 'vs_while_loop')
    _AssertClose(g, np_g, f'grad[{i}]', 'vs_numpy')


_POLICIES = ('recompute', 'save_dots', 'save_all')
_POLICY = pytest.mark.parametrize('remat_policy', _POLICIES)


@pytest.mark.parametrize('cell', _CELLS)
@_POLICY
@pytest.mark.parametrize('mode', ['graph', 'jit'])
def test_matches_while_loop_and_numpy(mode, remat_policy, cell):
  _CheckAgainstReferences(mode, cell, remat_policy, 'all')


@pytest.mark.parametrize('loss_kind', ['states', 'final', 'extras', 'gather'])
@_POLICY
def test_loss_on_part_of_the_outputs(remat_policy, loss_kind):
  # Outputs the loss does not use get None (or IndexedSlices) gradients.
  _CheckAgainstReferences('graph', 'rnn', remat_policy, loss_kind)


@_POLICY
@pytest.mark.parametrize('mode', ['graph', 'jit'])
def test_theta_as_variables(mode, remat_policy):
  _CheckAgainstReferences(
      mode, 'rnn', remat_policy, 'all', theta_as_variables=True)


# Extras kept in rows of their own, and no returned history of the states:
# what the pipeline asks for so that a chip holds [M, ...] outputs and no
# [T, ...] gradient of the buffer history.
_ROWS = recurrent.Rows(index=(-1, 2, 0, -1, 1), num_rows=3)


def _KeptRows(stacked_y):
  """The reference's [T, ...] extra, in the rows _ROWS keeps it in."""
  order = [_ROWS.index.index(r) for r in range(_ROWS.num_rows)]
  return tf.gather(stacked_y, order)


def _RowsLoss(impl, case, tensors, w):
  theta, state0, inputs, _ = tensors
  cell_fn = case.make_cell(_TF, tensors)
  if impl == 'recurrent':
    states, final, extras = recurrent.Recurrent(
        theta, state0, inputs, cell_fn, extras_rows={'y': _ROWS},
        return_states=False)
    assert states is None
    kept = extras['y']
  else:
    _, final, extras = _WhileLoopReference(theta, state0, inputs, cell_fn)
    kept = _KeptRows(extras['y'])
  loss = (tf.reduce_sum(w[0] * final) + tf.reduce_sum(w[1] * kept) +
          tf.reduce_sum(w[2] * extras['n']))
  return (final, kept, extras['n']), loss


@pytest.mark.parametrize('jit', [False, True])
def test_extras_in_rows_and_no_returned_states(jit):
  case = _MakeCase('rnn')
  rng = _Rng('rows')
  weights = [_Normal(rng, _B, _H, scale=1.0),
             _Normal(rng, _ROWS.num_rows, _B, _H, scale=1.0),
             _Normal(rng, _T, _B, scale=1.0)]

  def Run(impl, tensors):
    xs = _FloatLeaves(tensors)
    with tf.GradientTape() as tape:
      tape.watch(xs)
      outputs, loss = _RowsLoss(impl, case, tensors, weights)
    return outputs, loss, tape.gradient(loss, xs)

  got = {}
  for impl in _IMPLS:
    if jit:
      fn = tf.function(functools.partial(Run, impl), jit_compile=True)
      got[impl] = tf.nest.map_structure(
          lambda t: t.numpy(), fn(_ToTensors(case, False)))
    else:
      with tf.Graph().as_default():
        fetches = Run(impl, _ToTensors(case, False))
        with tf.compat.v1.Session() as sess:
          got[impl] = sess.run(fetches)
  (outputs, loss, grads), (ref_outputs, ref_loss, ref_grads) = (
      got['recurrent'], got['reference'])
  assert outputs[1].shape == (_ROWS.num_rows, _B, _H)
  _AssertClose(outputs, ref_outputs, 'outputs', 'vs_while_loop')
  _AssertClose(loss, ref_loss, 'loss', 'vs_while_loop')
  for i, (g, ref_g) in enumerate(zip(grads, ref_grads)):
    assert np.any(g != 0), f'grad[{i}] is all zeros'
    _AssertClose(g, ref_g, f'grad[{i}]', 'vs_while_loop')


def _QueueCell(theta, state, x_t):
  """h' = tanh(h w + q[0] x); the queue rotates by one (invertibly)."""
  h = tf.tanh(tf.einsum('bh,hk->bk', state['h'], theta['w']) +
              state['q'][0] * x_t)
  q = tf.concat([state['q'][1:], state['q'][:1]], 0)
  return {'h': h, 'q': q}, {'y': tf.reduce_sum(h * q[0], -1)}


@pytest.mark.parametrize('jit', [False, True])
def test_undo_recovers_unkept_state_for_the_backward_loop(jit):
  """A state entry kept without history (Undo) gives the gradients the
  kept one does, and a plain while loop's."""
  rng = _Rng('undo')
  queue = 3
  values = dict(w=_Normal(rng, _H, _H), h=_Normal(rng, _B, _H),
                q=_Normal(rng, queue, _B, _H), x=_Normal(rng, _T, _B, _H),
                cot=_Normal(rng, _B, _H, scale=1.0))
  undo = recurrent.Undo(
      unstored={'h': False, 'q': True},
      fn=lambda after, x_t: {'h': after['h'], 'q': tf.concat(
          [after['q'][-1:], after['q'][:-1]], 0)})

  def Run(impl, t):
    theta, state0 = {'w': t['w']}, {'h': t['h'], 'q': t['q']}
    xs = [t['w'], t['h'], t['q'], t['x']]
    with tf.GradientTape() as tape:
      tape.watch(xs)
      if impl == 'reference':
        _, final, extras = _WhileLoopReference(theta, state0, t['x'],
                                               _QueueCell)
      else:
        _, final, extras = recurrent.Recurrent(
            theta, state0, t['x'], _QueueCell, return_states=False,
            undo=undo if impl == 'undo' else None)
      loss = (tf.reduce_sum(final['h'] * t['cot']) +
              tf.reduce_sum(final['q']) + tf.reduce_sum(extras['y']))
    return loss, tape.gradient(loss, xs)

  got = {}
  for impl in ('undo', 'kept', 'reference'):
    if jit:
      fn = tf.function(functools.partial(Run, impl), jit_compile=True)
      got[impl] = tf.nest.map_structure(
          lambda v: v.numpy(),
          fn({k: tf.constant(v) for k, v in values.items()}))
    else:
      with tf.Graph().as_default():
        fetches = Run(impl, {k: tf.constant(v) for k, v in values.items()})
        with tf.compat.v1.Session() as sess:
          got[impl] = sess.run(fetches)
  for impl in ('kept', 'reference'):
    _AssertClose(got['undo'][0], got[impl][0], f'loss vs {impl}',
                 'vs_while_loop')
    for i, (g, ref_g) in enumerate(zip(got['undo'][1], got[impl][1])):
      assert np.any(ref_g != 0), f'grad[{i}] is all zeros'
      _AssertClose(g, ref_g, f'grad[{i}] vs {impl}', 'vs_while_loop')


def test_undo_needs_return_states_false():
  undo = recurrent.Undo(unstored={'h': True}, fn=lambda after, x: after)
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match='pass return_states=False with '
                       'undo'):
      recurrent.Recurrent({}, {'h': tf.zeros([2])}, tf.zeros([3, 2]),
                          lambda th, st, x: (st, {}), undo=undo)


def test_rows_out_of_range_and_unknown_extras_raise():
  with pytest.raises(ValueError, match=r'Rows: every index must be in '
                     r'\[-1, 2\)'):
    recurrent.Rows(index=(0, 2), num_rows=2)
  case = _MakeCase('rnn')
  with tf.Graph().as_default():
    theta, state0, inputs, _ = tensors = _ToTensors(case, False)
    with pytest.raises(ValueError, match=r"extras_rows names \['z'\]"):
      recurrent.Recurrent(theta, state0, inputs, case.make_cell(_TF, tensors),
                          extras_rows={'z': _ROWS})


# A cell may capture the very tensor it also gets as theta, state0 or inputs
# (e.g. attention over all the inputs, or a residual to the initial state);
# the recompute path must count that tensor's gradient once per real use.


@_POLICY
@pytest.mark.parametrize('which', ['theta', 'state0', 'inputs'])
def test_cell_capturing_its_own_theta_state0_or_inputs(which,
                                                       remat_policy):
  """The cell captures the same tensor that it also receives as an argument.

  E.g. w = 0.5, h0 = [1, 2], xs = [[0.1, 0.2]], cell (h, x) -> h * theta +
  x * w with w both theta and captured: d sum(final) / dw = sum(h0) +
  sum(xs[0]) = 3.3, each path once.
  """
  _CheckAgainstReferences('graph', 'alias_' + which, remat_policy,
                          'all')


# ---------------------------------------------------------------------------
# What the recompute saves.
# ---------------------------------------------------------------------------


def _WhileOps(graph):
  return [op for op in graph.get_operations() if op.type in ('While',
                                                             'StatelessWhile')]


def _BodyOpTypes(graph, while_op):
  """The op types in a while loop's body, with repeats."""
  name = while_op.get_attr('body').name
  for fdef in graph.as_graph_def().library.function:
    if fdef.signature.name == name:
      return [node.op for node in fdef.node_def]
  raise AssertionError(f'no function {name}')


# Per policy: (lists the forward loop fills besides the states, forward
# MatMul ops in the backward loop, forward Tanh ops in the backward loop).
# The new state tanh(...) is never recomputed nor stored twice: the loop
# keeps it anyway, and TanhGrad reads it from there.
_WHAT_EACH_POLICY_KEEPS = {
    'recompute': (0, 1, 1),  # h @ w1 and tanh(h @ w1) run again.
    'save_dots': (2, 0, 1),  # h @ w1 and wide @ w2 stored; one tanh again.
    'save_all': (1, 0, 0),  # tanh(h @ w1) stored: nothing runs again.
}


@_POLICY
def test_what_each_policy_stores_and_recomputes(remat_policy):
  """The forward loop stores what the policy says; the backward recomputes
  only the rest.

  Cell: wide = tanh(h @ w1); h' = tanh(wide @ w2 + x). The backward loop
  has the 4 gradient MatMuls and the 2 TanhGrads under every policy, and
  the forward ops it recomputes. Differentiating leaves the forward loop
  as it was built (no accumulators added), and the forward values do not
  change.
  """
  with tf.Graph().as_default() as graph:
    rng = _Rng('memory')
    w1 = tf.constant(_Normal(rng, _H, 16))
    w2 = tf.constant(_Normal(rng, 16, _H))
    h0 = tf.constant(_Normal(rng, _B, _H))
    xs = tf.constant(_Normal(rng, _T, _B, _H))

    def Cell(theta, h, x):
      wide = tf.tanh(h @ theta[0])
      return tf.tanh(wide @ theta[1] + x), {}

    states, final, _ = recurrent.Recurrent(
        (w1, w2), h0, xs, Cell, remat_policy=remat_policy)
    (forward,) = _WhileOps(graph)
    num_forward_outputs = len(forward.outputs)
    loss = tf.reduce_sum(states * states) + tf.reduce_sum(final)
    with tf.compat.v1.Session() as sess:
      forward_value = sess.run(states)
    grads = tf.gradients(loss, [w1, w2, h0, xs])
    backward = [op for op in _WhileOps(graph) if op is not forward]
    assert len(backward) == 1
    backward_ops = _BodyOpTypes(graph, backward[0])
    stored, matmuls, tanhs = _WHAT_EACH_POLICY_KEEPS[remat_policy]
    lists = [t for t in forward.outputs if t.dtype == tf.variant]
    assert len(lists) == 1 + stored  # The states' list, the stored ones.
    assert len(forward.outputs) == num_forward_outputs
    assert backward_ops.count('MatMul') == 4 + matmuls
    assert backward_ops.count('Tanh') == tanhs
    assert backward_ops.count('TanhGrad') == 2
    with tf.compat.v1.Session() as sess:
      grad_values = sess.run(grads)
      np.testing.assert_array_equal(sess.run(states), forward_value)
    assert all(np.all(np.isfinite(g)) and np.any(g != 0) for g in grad_values)


# ---------------------------------------------------------------------------
# Errors.
# ---------------------------------------------------------------------------


def _BadStateCell(kind):
  """A cell whose new state differs from state0 = {'h', 'c': (a, n)}."""

  def Cell(theta, state, x):
    h = tf.tanh(state['h'] @ theta + x)
    a, n = state['c']
    good = {'h': h, 'c': (a + 1.0, n + 1)}
    if kind == 'extra_key':
      return dict(good, z=h), ()
    if kind == 'missing_key':
      return {'h': h}, ()
    if kind == 'list_for_tuple':
      return {'h': h, 'c': [a, n]}, ()
    if kind == 'bare_tensor':
      return h, ()
    if kind == 'float_dtype':
      return dict(good, h=tf.cast(h, tf.float64)), ()
    if kind == 'int_dtype':
      return {'h': h, 'c': (a, tf.cast(n, tf.int64))}, ()
    if kind == 'shape':
      return dict(good, h=h[:, :-1]), ()
    if kind == 'rank':
      return dict(good, h=h[None]), ()
    raise ValueError(kind)

  return Cell


def _CallInMode(mode, fn):
  if mode == 'graph':
    with tf.Graph().as_default():
      return fn()
  return tf.function(fn).get_concrete_function()


def _BadStateArgs():
  w = tf.zeros([_H, _H])
  state0 = {'h': tf.zeros([_B, _H]), 'c': (tf.zeros([_B]), tf.constant(0))}
  return w, state0, tf.zeros([_T, _B, _H])


@pytest.mark.parametrize('kind', [
    'extra_key', 'missing_key', 'list_for_tuple', 'bare_tensor', 'float_dtype',
    'int_dtype', 'shape', 'rank'
])
@_POLICY
@pytest.mark.parametrize('mode', ['graph', 'function'])
def test_cell_changing_the_state_raises(mode, remat_policy, kind):

  def Build():
    w, state0, xs = _BadStateArgs()
    recurrent.Recurrent(
        w,
        state0,
        xs,
        _BadStateCell(kind),
        remat_policy=remat_policy)

  with pytest.raises(ValueError, match='state0'):
    _CallInMode(mode, Build)


@pytest.mark.parametrize('mode', ['graph', 'function'])
def test_good_state_cell_builds(mode):
  # The control for the test above: a cell that keeps state0's structure.

  def Build():
    w, state0, xs = _BadStateArgs()

    def Cell(theta, state, x):
      a, n = state['c']
      return {'h': tf.tanh(state['h'] @ theta + x), 'c': (a + 1.0, n + 1)}, ()

    return recurrent.Recurrent(w, state0, xs, Cell)

  _CallInMode(mode, Build)


@pytest.mark.parametrize('inputs', [
    lambda: {'a': tf.zeros([_T, _B]), 'b': tf.zeros([_T - 1, _B])},
    lambda: (tf.zeros([_T, _B]), tf.zeros([_T + 1])),
    lambda: [tf.zeros([_T, _B]), tf.zeros([1, _B], tf.int32)],
], ids=['dict', 'tuple', 'list_with_int'])
@pytest.mark.parametrize('mode', ['graph', 'function'])
def test_inputs_with_different_leading_dims_raise(mode, inputs):

  def Build():

    def Cell(theta, h, unused_inp):
      return h * theta, ()

    recurrent.Recurrent(tf.ones([]), tf.zeros([_B]), inputs(), Cell)

  with pytest.raises(ValueError, match='leading dim'):
    _CallInMode(mode, Build)


def test_unknown_leading_dim_and_no_inputs_raise():
  cell = lambda theta, h, unused_inp: (h * theta, ())
  with tf.Graph().as_default():
    unknown = tf.compat.v1.placeholder(tf.float32, [None, _B])
    with pytest.raises(ValueError, match='leading dim'):
      recurrent.Recurrent(tf.ones([]), tf.zeros([_B]), unknown, cell)
    with pytest.raises(ValueError, match='at least one input'):
      recurrent.Recurrent(tf.ones([]), tf.zeros([_B]), {}, cell)


def test_dynamic_extras_shape_raises():

  def Cell(theta, h, x):
    new_h = tf.tanh(h * theta + x)
    return new_h, {'positive': tf.boolean_mask(new_h, new_h > 0)}

  with tf.Graph().as_default():
    with pytest.raises(ValueError, match='static shapes'):
      recurrent.Recurrent(
          tf.ones([_H]), tf.zeros([_B, _H]), tf.zeros([_T, _B, _H]), Cell)


@pytest.mark.parametrize('mode', ['graph', 'function'])
def test_reading_a_trainable_variable_inside_the_cell_raises(mode):
  """Recompute cannot return its gradient, so differentiating must fail."""

  def Build():
    v = tf.Variable(tf.ones([_H]))
    h0 = tf.constant(_Normal(_Rng('var'), _B, _H))
    xs = tf.constant(_Normal(_Rng('var'), _T, _B, _H))

    def Cell(theta, h, x):
      return tf.tanh(h * theta * v + x), ()

    with tf.GradientTape() as tape:
      tape.watch(h0)
      _, final, _ = recurrent.Recurrent(tf.ones([]), h0, xs, Cell)
      loss = tf.reduce_sum(final)
    if mode == 'graph':
      return tf.gradients(loss, [h0, v])
    return tape.gradient(loss, [h0, v])

  with pytest.raises(ValueError, match='trainable variables'):
    _CallInMode(mode, Build)


@_POLICY
@pytest.mark.parametrize('jit', [False, True])
def test_a_variable_the_cell_reads_is_read_once_before_the_loop(jit,
                                                              remat_policy):
  """h' = h * v + x_t, v non-trainable. v is assigned between the forward
  pass and the gradient (in program order, under tf.function): both use
  the value the forward pass started with, d sum(h_T) / d h0 = 0.5 ** T,
  as a tf.while_loop differentiated by TensorFlow gives. (Re-read in the
  backward pass it would be 3 ** T.) Under XLA too."""
  v = tf.Variable(0.5, trainable=False)
  h0 = tf.zeros([_B, _H])
  xs = tf.ones([_T, _B, _H])

  @tf.function(jit_compile=jit, autograph=False)
  def Grads():
    with tf.GradientTape(persistent=True) as tape:
      tape.watch(h0)
      cell = lambda theta, h, x: (h * v.read_value() + x, {})
      _, final, _ = recurrent.Recurrent({}, h0, xs, cell,
                                        remat_policy=remat_policy)
      _, ref_final, _ = _WhileLoopReference({}, h0, xs, cell)
      losses = tf.reduce_sum(final), tf.reduce_sum(ref_final)
    v.assign(3.0)
    return [tape.gradient(loss, h0) for loss in losses]

  got, want = Grads()
  np.testing.assert_allclose(want.numpy(), 0.5**_T)
  np.testing.assert_allclose(got.numpy(), want.numpy())


def test_a_cell_writing_a_variable_raises():
  """Re-run by the backward pass it would write twice (or, pruned, never)."""
  with tf.Graph().as_default():
    counter = tf.Variable(0, trainable=False)

    def Cell(theta, h, x):
      with tf.control_dependencies([counter.assign_add(1)]):
        return tf.tanh(h * theta + x), ()

    with pytest.raises(ValueError, match=r'changes variables inside the loop '
                       r'\(AssignAddVariableOp\)\. Carry the value in the '
                       r'state'):
      recurrent.Recurrent(tf.ones([]), tf.zeros([_B, _H]),
                          tf.zeros([_T, _B, _H]), Cell)


@_POLICY
def test_stateful_random_ops_raise_when_differentiated(remat_policy):
  """The backward pass would draw other numbers; the forward alone runs."""
  with tf.Graph().as_default():
    h0 = tf.zeros([_B, _H])

    def Cell(theta, h, x):
      keep = tf.random.uniform([_B, _H]) < 0.5
      return tf.where(keep, tf.tanh(h * theta + x), 0.0), ()

    _, final, _ = recurrent.Recurrent(tf.ones([]), h0, tf.ones([_T, _B, _H]),
                                      Cell, remat_policy=remat_policy)
    with pytest.raises(ValueError, match=r'stateful ops \(RandomUniform.*'
                       r'gradients would be wrong.*DeterministicDropoutLayer'):
      tf.gradients(tf.reduce_sum(final), h0)
    with tf.compat.v1.Session() as sess:
      assert sess.run(final).shape == (_B, _H)


if __name__ == '__main__':
  sys.exit(pytest.main([__file__]))
