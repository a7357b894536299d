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
from gpipe.loops import deferred_dots
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

  def Recording(grad, per_iteration):
    result = find(grad, per_iteration)
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
