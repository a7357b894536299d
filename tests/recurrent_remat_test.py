"""What Recurrent's recompute stores, and what it cannot recompute.

Per remat policy, the forward loop stores what the policy says and the
backward loop recomputes only the rest. A variable the cell reads is read
once, before the loop; a cell that writes a variable, reads a trainable one
or draws stateful random numbers is refused (the backward pass would run it
again and see or draw other values).
"""

import sys

import numpy as np
import pytest
import tensorflow as tf

from gpipe import recurrent
from tests import recurrent_cases as cases
from tests import sessions

_B, _H, _T = cases.B, cases.H, cases.T


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


@cases.POLICY
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
    rng = cases.Rng('memory')
    w1 = tf.constant(cases.Normal(rng, _H, 16))
    w2 = tf.constant(cases.Normal(rng, 16, _H))
    h0 = tf.constant(cases.Normal(rng, _B, _H))
    xs = tf.constant(cases.Normal(rng, _T, _B, _H))

    def Cell(theta, h, x):
      wide = tf.tanh(h @ theta[0])
      return tf.tanh(wide @ theta[1] + x), {}

    states, final, _ = recurrent.Recurrent(
        (w1, w2), h0, xs, Cell, remat_policy=remat_policy)
    (forward,) = _WhileOps(graph)
    num_forward_outputs = len(forward.outputs)
    loss = tf.reduce_sum(states * states) + tf.reduce_sum(final)
    with sessions.AsBuilt() as sess:
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
    with sessions.AsBuilt() as sess:
      grad_values = sess.run(grads)
      np.testing.assert_array_equal(sess.run(states), forward_value)
    assert all(np.all(np.isfinite(g)) and np.any(g != 0) for g in grad_values)


# ---------------------------------------------------------------------------
# What the backward pass cannot recompute: variables and random ops.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('mode', ['graph', 'function'])
def test_reading_a_trainable_variable_inside_the_cell_raises(mode):
  """Recompute cannot return its gradient, so differentiating must fail."""

  def Build():
    v = tf.Variable(tf.ones([_H]))
    h0 = tf.constant(cases.Normal(cases.Rng('var'), _B, _H))
    xs = tf.constant(cases.Normal(cases.Rng('var'), _T, _B, _H))

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
    cases.CallInMode(mode, Build)


@cases.POLICY
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
      _, ref_final, _ = cases.WhileLoopReference({}, h0, xs, cell)
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


@cases.POLICY
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
    with sessions.AsBuilt() as sess:
      assert sess.run(final).shape == (_B, _H)


if __name__ == '__main__':
  sys.exit(pytest.main([__file__]))
