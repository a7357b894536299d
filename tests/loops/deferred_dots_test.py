"""Tests for gpipe.loops.deferred_dots and Recurrent(defer_weight_dots=True).

The deferred gradients against a plain Python loop of the same cell
differentiated by TensorFlow (unrolled: no Recurrent, no while loop), in
graph mode and under jit, for each remat policy; and which gradients
`Find` defers, its one contraction checked on every op form it reads
against the sum of that op's results iteration by iteration.
"""

import numpy as np
import pytest
import tensorflow as tf

from gpipe import recurrent
from gpipe.loops import cell_graph
from gpipe.loops import deferred_dots
from gpipe.loops import remat
from tests import close

S, B, D, F, T = 2, 2, 16, 32, 5  # stages, examples, widths, iterations


def _Cell(theta, state, x):
  """A pipeline-like cell: S stages of a residual MLP on B examples each, its
  weights read by an einsum, a batch matmul and a bias add."""
  h = state + x
  act = tf.tanh(tf.einsum('sbd,sdf->sbf', h, theta['w1']) + theta['b'])
  new = state + tf.matmul(act, theta['w2'])
  return new, {'sq': tf.reduce_sum(tf.square(new), axis=[1, 2])}


def _Values(seed=0):
  rng = np.random.default_rng(seed)
  f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
  # Scaled so that every value and gradient stays of order 1.
  theta = {'w1': f32(S, D, F) / 8, 'w2': f32(S, F, D) / 12,
           'b': f32(S, 1, F) / 2}
  return (theta, f32(S, B, D) / 4, f32(T, S, B, D) / 4, f32(T, S, B, D) / 4,
          f32(T, S) / 4)


def _Loss(final_and_extras, outs_cot, sq_cot):
  states, final, extras = final_and_extras
  return (tf.reduce_sum(states * outs_cot) + tf.reduce_sum(final) +
          tf.reduce_sum(extras['sq'] * sq_cot))


def _Unrolled(theta, state0, inputs):
  states, sqs, state = [], [], state0
  for t in range(T):
    state, extras = _Cell(theta, state, inputs[t])
    states.append(state)
    sqs.append(extras['sq'])
  return tf.stack(states), state, {'sq': tf.stack(sqs)}


def _Run(mode, build):
  """{'loss', 'grads'} of the loss of build(theta, state0, inputs), its
  gradients for w1, w2, b, state0 and the inputs."""
  theta_np, state_np, inputs_np, outs_cot, sq_cot = _Values()
  consts = lambda: ({k: tf.constant(v) for k, v in theta_np.items()},
                    tf.constant(state_np), tf.constant(inputs_np))
  wrt = lambda theta, state0, inputs: [theta['w1'], theta['w2'], theta['b'],
                                       state0, inputs]
  loss_of = lambda *args: _Loss(build(*args), outs_cot, sq_cot)
  if mode == 'graph':
    with tf.Graph().as_default():
      args = consts()
      loss = loss_of(*args)
      grads = tf.gradients(loss, wrt(*args))
      with tf.compat.v1.Session() as sess:
        return sess.run({'loss': loss, 'grads': grads})

  @tf.function(jit_compile=True)
  def Step(*args):
    with tf.GradientTape() as tape:
      tape.watch(args)
      loss = loss_of(*args)
    return {'loss': loss, 'grads': tape.gradient(loss, wrt(*args))}

  return tf.nest.map_structure(lambda t: t.numpy(), Step(*consts()))


def _RecordingFind(monkeypatch):
  """The equations deferred_dots.Find defers, as it finds them."""
  found = []
  find = deferred_dots.Find

  def Recording(grad, per_iteration, *limit):
    result = find(grad, per_iteration, *limit)
    if result is not None:
      found.append(result)
    return result

  monkeypatch.setattr(deferred_dots, 'Find', Recording)
  return found


@pytest.mark.parametrize('mode', ['graph', 'jit'])
@pytest.mark.parametrize('policy', ['recompute', 'save_dots', 'save_all'])
def test_deferred_gradients_equal_the_unrolled_loop(mode, policy,
                                                    monkeypatch):
  found = _RecordingFind(monkeypatch)
  deferred = _Run(mode, lambda th, s0, inp: recurrent.Recurrent(
      th, s0, inp, _Cell, remat_policy=policy, defer_weight_dots=True))
  # w1's einsum and w2's batch matmul are deferred; the bias is not a dot.
  assert sorted(d.specs[0].shape[-1] + d.specs[1].shape[-1]
                for d in found) == [D + F, D + F], found
  reference = _Run(mode, _Unrolled)
  close.AssertClose(deferred, reference, close.FLOAT32, f'{mode} {policy}')


_EXAMPLES = 2
# (name, operand shapes, op): each op's gradient-like result of one iteration.
_FORMS = [
    ('einsum', ([_EXAMPLES, D], [_EXAMPLES, F]),
     lambda a, b: tf.einsum('rd,rf->df', a, b)),
    ('matmul-transpose_a', ([_EXAMPLES, D], [_EXAMPLES, F]),
     lambda a, b: tf.matmul(a, b, transpose_a=True)),
    ('matmul-transpose_b', ([D, _EXAMPLES], [F, _EXAMPLES]),
     lambda a, b: tf.matmul(a, b, transpose_b=True)),
    ('batch_matmul-adjoint_a', ([S, _EXAMPLES, D], [S, _EXAMPLES, F]),
     lambda a, b: tf.linalg.matmul(a, b, adjoint_a=True)),
    ('batch_matmul-identity', ([S, D, _EXAMPLES], [S, _EXAMPLES, F]),
     lambda a, b: tf.identity(tf.linalg.matmul(a, b))),
]


def _Traced(shapes, op):
  """(grad, a, b) traced in a graph of their own."""
  with tf.Graph().as_default():
    a, b = (tf.compat.v1.placeholder(tf.float32, s) for s in shapes)
    return op(a, b), a, b


@pytest.mark.parametrize('shapes, op', [f[1:] for f in _FORMS],
                         ids=[f[0] for f in _FORMS])
def test_the_contraction_is_the_sum_over_iterations(shapes, op):
  grad, a, b = _Traced(shapes, op)
  found = deferred_dots.Find(grad, {a.name, b.name})
  assert found is not None
  assert [s.shape.as_list() for s in found.specs] == list(shapes)
  rng = np.random.default_rng(1)
  xs = [rng.normal(size=[T] + s).astype(np.float32) for s in shapes]
  expected = sum(op(tf.constant(x[t]), tf.constant(y[t])).numpy()
                 for x, y in [xs] for t in range(T))
  close.AssertClose(found.Contract(*map(tf.constant, xs)).numpy(), expected,
                    close.FLOAT32_TIGHT)


@pytest.mark.parametrize('shapes, op, per_iteration', [
    # Many examples: the operands of all iterations would cost more than the
    # accumulation saves.
    (([64, D], [64, F]), lambda a, b: tf.einsum('rd,rf->df', a, b), 'ab'),
    # An operand the same every iteration (a weight): nothing to stack.
    (([_EXAMPLES, D], [_EXAMPLES, F]), lambda a, b: tf.einsum('rd,rf->df', a, b),
     'b'),
    # Broadcast batch dims, ellipses, and what is not a dot.
    (([1, _EXAMPLES, D], [S, _EXAMPLES, F]),
     lambda a, b: tf.linalg.matmul(a, b, adjoint_a=True), 'ab'),
    (([S, _EXAMPLES, D], [S, _EXAMPLES, F]),
     lambda a, b: tf.einsum('...rd,...rf->...df', a, b), 'ab'),
    (([D, F], [D, F]), tf.add, 'ab'),
], ids=['many-examples', 'weight-operand', 'broadcast', 'ellipsis', 'add'])
def test_what_is_not_deferred(shapes, op, per_iteration):
  grad, a, b = _Traced(shapes, op)
  names = {t.name for t, key in ((a, 'a'), (b, 'b')) if key in per_iteration}
  assert deferred_dots.Find(grad, names) is None


@pytest.mark.parametrize('shapes, op', [f[1:] for f in _FORMS],
                         ids=[f[0] for f in _FORMS])
def test_without_a_size_limit_one_iterations_dot_is_its_gradient(shapes, op):
  # Many examples: over the limit for keeping every iteration's operands,
  # found without it; ContractOne is the op itself on one iteration's.
  many = [[64 if d == _EXAMPLES else d for d in s] for s in shapes]
  grad, a, b = _Traced(many, op)
  assert deferred_dots.Find(grad, {a.name, b.name}) is None
  found = deferred_dots.Find(grad, {a.name, b.name},
                             max_operands_per_gradient=None)
  assert found is not None
  rng = np.random.default_rng(2)
  x, y = (tf.constant(rng.normal(size=s).astype(np.float32)) for s in many)
  close.AssertClose(found.ContractOne(x, y).numpy(), op(x, y).numpy(),
                    close.FLOAT32_TIGHT)


@pytest.mark.parametrize('split', [False, True])
def test_split_weight_dots_returns_every_dots_operands(split):
  """A cell of 64 examples a stage: defer_weight_dots keeps no operands
  (too large for every iteration), split_weight_dots returns w1's and w2's
  (the bias's gradient is a sum, not a dot); contracted, they and the
  rest equal TensorFlow's gradients of the cell called directly."""
  rows = 64
  rng = np.random.default_rng(3)
  f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
  theta = {'w1': f32(S, D, F) / 8, 'w2': f32(S, F, D) / 12,
           'b': f32(S, 1, F) / 2}
  state, x, dy = f32(S, rows, D), f32(S, rows, D), f32(S, rows, D)
  with tf.Graph().as_default():
    th = {k: tf.constant(v) for k, v in theta.items()}
    cell = cell_graph.CellGraph(
        lambda t, s, i: (_Cell(t, s, i)[0], {}), th, tf.constant(state),
        tf.constant(x[None]), remat.For('recompute'), keeps_new_state=False,
        defer_weight_dots=not split, split_weight_dots=split)
    grads = cell.Backward(tf.nest.flatten(th), [tf.constant(state)],
                          [tf.constant(x)], [], None, [tf.constant(dy)], [],
                          [])
    deferred = cell.DeferredDots()
    names = list(tf.nest.flatten({k: k for k in theta}))
    assert sorted(names[j] for j in deferred) == (['w1', 'w2'] if split
                                                  else [])
    got = [deferred[j].ContractOne(*g) if j in deferred else g
           for j, g in enumerate(grads)]
    flat_th = tf.nest.flatten(th)
    s_in = tf.constant(state)
    new, _ = _Cell(tf.nest.pack_sequence_as(th, flat_th), s_in,
                   tf.constant(x))
    expected = tf.gradients(new, flat_th + [s_in], grad_ys=tf.constant(dy))
    with tf.compat.v1.Session() as sess:
      got, expected = sess.run([got, expected])
  for g, e in zip(got, expected):
    close.AssertClose(g, e, close.FLOAT32)
