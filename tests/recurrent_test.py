"""Tests for gpipe.recurrent.Recurrent against independent references.

Recurrent's forward values and gradients, on the toy cells of
cases.py, are compared with:

  * a plain public `tf.while_loop` with carried state and TensorArray
    accumulation, differentiated by TensorFlow's own autodiff, built in the
    same graph / tf.function as Recurrent;
  * a Python loop unrolled in NumPy (float64) for the forward values, and
    central finite differences of that NumPy loop (float64) for the gradients
    w.r.t. theta, state0, inputs and the tensors the cell captures;

for every cell and remat policy, losses on part of the outputs, theta as
variables, extras kept in entries of their own (Kept), state undone instead of
stored (Undo), and cells capturing their own arguments. What each remat
policy stores and recomputes is in recurrent_remat_test.py; the cells and
inputs Recurrent refuses are in recurrent_errors_test.py.

Modes: TF1 graph mode (tf.Graph + tf.compat.v1.Session + tf.gradients) and TF2
`tf.function(jit_compile=True)` + tf.GradientTape, traced as written
(autograph=False, as the pipelined layer traces Recurrent).
"""

import functools
import sys

import numpy as np
import pytest
import tensorflow as tf

from gpipe import recurrent
from tests import close
from tests import covering
from tests import recurrent_cases as cases
from tests import sessions

_B, _H, _T = cases.B, cases.H, cases.T

# Largest errors seen by _AssertClose, reported at module teardown (run pytest
# with -s to see them).
_MAX_ERR = {  # 'rel' is over the entries with |expected| > 1e-3.
    'vs_while_loop': {'abs': 0.0, 'rel': 0.0},
    'vs_numpy': {'abs': 0.0, 'rel': 0.0},
}


@pytest.fixture(scope='module', autouse=True)
def _report_max_errors():
  yield
  for what, err in _MAX_ERR.items():
    print(f'\n[recurrent_test] largest error {what}: abs={err["abs"]:.3g} '
          f'rel={err["rel"]:.3g}', file=sys.stderr)


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


def _RunGraphMode(cell, loss_kind, remat_policy, theta_as_variables):
  """TF1: tf.Graph + tf.gradients + Session. Returns {impl: values}."""
  case = cases.MakeCase(cell)
  weights = cases.NumpyReference(cell, loss_kind)[-1]
  with tf.Graph().as_default():
    tensors = cases.ToTensors(case, theta_as_variables)
    xs = cases.FloatLeaves(tensors)
    w = [tf.constant(x) for x in weights]
    fetches = {}
    for impl in cases.IMPLS:
      outputs, loss = cases.BuildLoss(impl, case, tensors, w, loss_kind,
                                      remat_policy)
      grads = tf.gradients(
          loss, xs, unconnected_gradients=tf.UnconnectedGradients.ZERO)
      fetches[impl] = (outputs, loss, [tf.convert_to_tensor(g) for g in grads])
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      return sess.run(fetches)


def _RunJitImpl(impl, cell, loss_kind, remat_policy,
                theta_as_variables):
  """TF2: tf.function(jit_compile=True) + GradientTape. Returns values."""
  case = cases.MakeCase(cell)
  weights = cases.NumpyReference(cell, loss_kind)[-1]
  tensors = cases.ToTensors(case, theta_as_variables)
  w = [tf.constant(x) for x in weights]

  @tf.function(jit_compile=True, autograph=False)
  def Fn(tensors, w):
    xs = cases.FloatLeaves(tensors)
    with tf.GradientTape() as tape:
      for x in xs:
        if not isinstance(x, tf.Variable):
          tape.watch(x)
      outputs, loss = cases.BuildLoss(impl, case, tensors, w, loss_kind,
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
  np_outputs, np_loss, np_grads, _ = cases.NumpyReference(cell, loss_kind)
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


_FULL_SWEEP = [(mode, policy, cell) for cell in cases.CELLS
               for policy in cases.POLICIES for mode in ('graph', 'jit')]
# Pairwise (covering.py) over (mode, remat policy, cell): 21 of the
# product's 42. Every cell under every policy, each cell and each policy in
# both modes.
_SWEEP_FEATURES = (lambda r: r[0], lambda r: r[1], lambda r: r[2])
_SWEEP = covering.Pairwise(_FULL_SWEEP, _SWEEP_FEATURES)


@pytest.mark.parametrize('mode,remat_policy,cell', _SWEEP,
                         ids=['-'.join(row) for row in _SWEEP])
def test_matches_while_loop_and_numpy(mode, remat_policy, cell):
  _CheckAgainstReferences(mode, cell, remat_policy, 'all')


@pytest.mark.parametrize('loss_kind', ['states', 'final', 'extras', 'gather'])
@cases.POLICY
def test_loss_on_part_of_the_outputs(remat_policy, loss_kind):
  # Outputs the loss does not use get None (or IndexedSlices) gradients.
  _CheckAgainstReferences('graph', 'rnn', remat_policy, loss_kind)


@cases.POLICY
@pytest.mark.parametrize('mode', ['graph', 'jit'])
def test_theta_as_variables(mode, remat_policy):
  _CheckAgainstReferences(
      mode, 'rnn', remat_policy, 'all', theta_as_variables=True)


# Extras kept in entries of their own, and no returned history of the
# states: what the pipeline asks for so that a chip holds [M, ...] outputs
# and no [T, ...] gradient of the buffer history.
_KEPT = recurrent.Kept(index=(-1, 2, 0, -1, 1), num_kept=3)


def _KeptEntries(stacked_y):
  """The reference's [T, ...] extra, in the entries _KEPT keeps it in."""
  order = [_KEPT.index.index(k) for k in range(_KEPT.num_kept)]
  return tf.gather(stacked_y, order)


def _KeptLoss(impl, case, tensors, w):
  theta, state0, inputs, _ = tensors
  cell_fn = case.make_cell(cases.TF, tensors)
  if impl == 'recurrent':
    states, final, extras = recurrent.Recurrent(
        theta, state0, inputs, cell_fn, kept_extras={'y': _KEPT},
        return_states=False)
    assert states is None
    kept = extras['y']
  else:
    _, final, extras = cases.WhileLoopReference(theta, state0, inputs, cell_fn)
    kept = _KeptEntries(extras['y'])
  loss = (tf.reduce_sum(w[0] * final) + tf.reduce_sum(w[1] * kept) +
          tf.reduce_sum(w[2] * extras['n']))
  return (final, kept, extras['n']), loss


@pytest.mark.parametrize('jit', [False, True])
def test_kept_extras_and_no_returned_states(jit):
  case = cases.MakeCase('rnn')
  rng = cases.Rng('rows')
  weights = [cases.Normal(rng, _B, _H, scale=1.0),
             cases.Normal(rng, _KEPT.num_kept, _B, _H, scale=1.0),
             cases.Normal(rng, _T, _B, scale=1.0)]

  def Run(impl, tensors):
    xs = cases.FloatLeaves(tensors)
    with tf.GradientTape() as tape:
      tape.watch(xs)
      outputs, loss = _KeptLoss(impl, case, tensors, weights)
    return outputs, loss, tape.gradient(loss, xs)

  got = {}
  for impl in cases.IMPLS:
    if jit:
      fn = tf.function(functools.partial(Run, impl), jit_compile=True,
                       autograph=False)
      got[impl] = tf.nest.map_structure(
          lambda t: t.numpy(), fn(cases.ToTensors(case, False)))
    else:
      with tf.Graph().as_default():
        fetches = Run(impl, cases.ToTensors(case, False))
        with sessions.AsBuilt() as sess:
          got[impl] = sess.run(fetches)
  (outputs, loss, grads), (ref_outputs, ref_loss, ref_grads) = (
      got['recurrent'], got['reference'])
  assert outputs[1].shape == (_KEPT.num_kept, _B, _H)
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
  rng = cases.Rng('undo')
  queue = 3
  values = dict(w=cases.Normal(rng, _H, _H), h=cases.Normal(rng, _B, _H),
                q=cases.Normal(rng, queue, _B, _H),
                x=cases.Normal(rng, _T, _B, _H),
                cot=cases.Normal(rng, _B, _H, scale=1.0))
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
        _, final, extras = cases.WhileLoopReference(theta, state0, t['x'],
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
      fn = tf.function(functools.partial(Run, impl), jit_compile=True,
                       autograph=False)
      got[impl] = tf.nest.map_structure(
          lambda v: v.numpy(),
          fn({k: tf.constant(v) for k, v in values.items()}))
    else:
      with tf.Graph().as_default():
        fetches = Run(impl, {k: tf.constant(v) for k, v in values.items()})
        with sessions.AsBuilt() as sess:
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


def test_kept_out_of_range_and_unknown_extras_raise():
  with pytest.raises(ValueError, match=r'Kept: every index must be in '
                     r'\[-1, 2\)'):
    recurrent.Kept(index=(0, 2), num_kept=2)
  case = cases.MakeCase('rnn')
  with tf.Graph().as_default():
    theta, state0, inputs, _ = tensors = cases.ToTensors(case, False)
    with pytest.raises(ValueError, match=r"kept_extras names \['z'\]"):
      recurrent.Recurrent(theta, state0, inputs,
                          case.make_cell(cases.TF, tensors),
                          kept_extras={'z': _KEPT})


# A cell may capture the very tensor it also gets as theta, state0 or inputs
# (e.g. attention over all the inputs, or a residual to the initial state);
# the recompute path must count that tensor's gradient once per real use.


@cases.POLICY
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


if __name__ == '__main__':
  sys.exit(pytest.main([__file__]))
