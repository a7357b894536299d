"""Toy cells, their data and the independent references of Recurrent's tests.

Every toy cell is written once against a small ops namespace (TF or NP) so
that the same code runs on TensorFlow tensors and on NumPy arrays. The
references (recurrent_test.py, recurrent_remat_test.py and
recurrent_errors_test.py use them):

  * WhileLoopReference: a plain public `tf.while_loop` with carried state
    and TensorArray accumulation, differentiated by TensorFlow's own
    autodiff, built in the same graph / tf.function as Recurrent;
  * NumpyReference: a Python loop unrolled in NumPy (float64) for the
    forward values, and central finite differences of that NumPy loop
    (float64) for the gradients w.r.t. theta, state0, inputs and the tensors
    the cell captures.
"""

import functools
import types
import zlib

import numpy as np
import pytest
import tensorflow as tf

from gpipe import recurrent

B, H, T, V = 3, 4, 5, 6

# The ops the toy cells use, for TensorFlow and for NumPy.
TF = types.SimpleNamespace(
    tanh=tf.tanh,
    sin=tf.sin,
    sum=tf.reduce_sum,
    gather=tf.gather,
    to_float=lambda x: tf.cast(x, tf.float32))
NP = types.SimpleNamespace(
    tanh=np.tanh,
    sin=np.sin,
    sum=np.sum,
    gather=lambda params, idx: np.take(params, idx, axis=0),
    to_float=lambda x: np.asarray(x, np.float64))


def _IsFloat(x):
  dtype = x.dtype
  if isinstance(dtype, tf.DType):
    return dtype.is_floating
  return np.issubdtype(dtype, np.floating)


def FloatLeaves(structure):
  return [x for x in tf.nest.flatten(structure) if _IsFloat(x)]


# ---------------------------------------------------------------------------
# Toy cells. make_cell(m, outer) -> cell_fn; m is TF or NP. outer is
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


def Rng(name):
  return np.random.default_rng(zlib.crc32(name.encode()))


def Normal(rng, *shape, scale=0.5):
  return np.asarray(scale * rng.standard_normal(shape), np.float32)


def MakeCase(name):
  """Returns the case's cell factory and float32 / int32 NumPy data."""
  rng = Rng(name)
  f = functools.partial(Normal, rng)
  if name in ('rnn', 'rnn_t1'):
    num = 1 if name == 'rnn_t1' else T
    return _Case(
        make_cell=_RnnCell,
        theta={'w': f(H, H), 'b': f(H)},
        state0=f(B, H),
        inputs=f(num, B, H),
        caps=[])
  if name == 'nested':
    return _Case(
        make_cell=_NestedCell,
        theta=(f(H, H), f(H)),
        state0={'h': f(B, H), 'pair': (f(B), np.asarray(3, np.int32))},
        inputs={'x': f(T, B, H), 'g': f(T, B)},
        caps=[])
  if name == 'capture':
    return _Case(
        make_cell=_CaptureCell,
        theta={'w': f(H, H), 'u': f(H, H)},
        state0=f(B, H),
        inputs=f(T, B, H),
        caps=[f(H), np.asarray(0.3, np.float32)])
  if name == 'list_no_extras':
    return _Case(
        make_cell=_ListStateNoExtrasCell,
        theta=f(H, H),
        state0=[f(B, H), f(B, H)],
        inputs=f(T, B, H),
        caps=[])
  if name == 'dict_no_extras':
    return _Case(
        make_cell=_DictStateNoExtrasCell,
        theta={'w': f(H, H), 'b': f(H)},
        state0={'h': f(B, H)},
        inputs=(f(T, B, H), f(T, B)),
        caps=[])
  if name == 'embedding':
    return _Case(
        make_cell=_EmbeddingCell,
        theta={'emb': f(V, H), 'w': f(H, H)},
        state0=f(B, H),
        inputs=(np.asarray(rng.integers(0, V, (T, B)), np.int32),
                f(T, B, H)),
        caps=[])
  if name.startswith('alias_'):
    return _Case(
        make_cell=functools.partial(_AliasCell, which=name[len('alias_'):]),
        theta={'w': f(H, H), 'b': f(H)},
        state0=f(B, H),
        inputs=f(T, B, H),
        caps=[])
  raise ValueError(name)


CELLS = ('rnn', 'nested', 'capture', 'rnn_t1', 'list_no_extras',
         'dict_no_extras', 'embedding')


def _NumIterations(inputs):
  return tf.nest.flatten(inputs)[0].shape[0]


def _Step(inputs, t):
  return tf.nest.map_structure(lambda x: x[t], inputs)


def _LossTerms(m, outputs, loss_kind):
  """The float tensors the loss sums (with weights), per loss kind."""
  states, final, extras = outputs
  if loss_kind == 'all':  # (d): stacked states, final state and extras.
    return FloatLeaves(states) + FloatLeaves(final) + FloatLeaves(extras)
  if loss_kind == 'states':
    return FloatLeaves(states)
  if loss_kind == 'final':
    return FloatLeaves(final)
  if loss_kind == 'extras':
    return FloatLeaves(extras)
  if loss_kind == 'gather':  # Incoming gradients are IndexedSlices.
    num = FloatLeaves(states)[0].shape[0]
    idx = [num - 1, 0, num - 1]
    return [
        m.gather(x, idx) for x in FloatLeaves(states) + FloatLeaves(extras)
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
def NumpyReference(cell, loss_kind):
  """Returns (outputs, loss, grads, weights) from the NumPy reference.

  grads are w.r.t. the float leaves of [theta, state0, inputs, caps], in
  tf.nest order, by central differences in float64.
  """
  case = MakeCase(cell)
  params = _ToFloat64([case.theta, case.state0, case.inputs, case.caps])

  def Run(p):
    theta, state0, inputs, _ = p
    return _NumpyRecurrent(theta, state0, inputs,
                           case.make_cell(NP, p))

  outputs = Run(params)
  terms = _LossTerms(NP, outputs, loss_kind)
  rng = Rng('weights/' + loss_kind)
  weights = [Normal(rng, *t.shape, scale=1.0) for t in terms]

  def Loss(p):
    return sum(
        np.sum(w * t) for w, t in zip(weights, _LossTerms(NP, Run(p),
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


def WhileLoopReference(theta, state0, inputs, cell_fn):
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


def BuildLoss(impl, case, tensors, weights, loss_kind, remat_policy):
  theta, state0, inputs, _ = tensors
  cell_fn = case.make_cell(TF, tensors)
  if impl == 'recurrent':
    outputs = recurrent.Recurrent(
        theta,
        state0,
        inputs,
        cell_fn,
        remat_policy=remat_policy)
  else:
    outputs = WhileLoopReference(theta, state0, inputs, cell_fn)
  terms = _LossTerms(TF, outputs, loss_kind)
  loss = tf.add_n([tf.reduce_sum(w * x) for w, x in zip(weights, terms)])
  return outputs, loss


def ToTensors(case, theta_as_variables):
  theta = tf.nest.map_structure(
      tf.Variable if theta_as_variables else tf.constant, case.theta)
  rest = tf.nest.map_structure(tf.constant,
                               [case.state0, case.inputs, case.caps])
  return [theta] + rest


IMPLS = ('recurrent', 'reference')

# Every remat policy, as a pytest parametrization of `remat_policy`.
POLICIES = ('recompute', 'save_dots', 'save_all')
POLICY = pytest.mark.parametrize('remat_policy', POLICIES)


def CallInMode(mode, fn):
  """fn() in a tf.Graph ('graph') or traced by tf.function ('function')."""
  if mode == 'graph':
    with tf.Graph().as_default():
      return fn()
  return tf.function(fn).get_concrete_function()

