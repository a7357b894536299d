"""Remat policies: what the forward pass stores per iteration.

The numbers under every policy are checked against independent references
elsewhere (recurrent_test: NumPy and a tf.while_loop; layers_test: the plain
stack). Here: *what* each policy stores, on the one-iteration graph and in a
pipelined layer's forward loop -- activations only, never weights.
"""

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe.loops import cell_graph
from gpipe.loops import remat
from gpipe import recurrent
from tests import pipeline_harness as harness

S, R, D, ROWS = 2, 3, 5, 7


def _CircularCell(theta, state, inputs):
  """A circular stage: picks repeat r's weights, then an MLP on the data.

  theta: w1 [R, D, 2D], w2 [R, 2D, D]; state: x [ROWS, D]; inputs: the
  iteration (int). wide = tanh(x @ w1[r]); x' = x + relu(wide) @ w2[r],
  relu(wide) marked with remat.Checkpoint.
  """
  r = inputs['iteration'] % R
  hot = tf.one_hot(r, R)
  w1 = tf.einsum('r,rdh->dh', hot, theta['w1'], name='select_w1')
  w2 = tf.einsum('r,rhd->hd', hot, theta['w2'], name='select_w2')
  pre = tf.matmul(state, w1, name='dot1')
  wide = tf.tanh(pre, name='wide')
  out = tf.matmul(remat.Checkpoint(tf.nn.relu(wide, name='act')), w2,
                  name='dot2')
  return state + out, {'aux': tf.reduce_sum(wide * wide)}


def _Cell(policy):
  theta = dict(w1=tf.zeros([R, D, 2 * D]), w2=tf.zeros([R, 2 * D, D]))
  state = tf.zeros([ROWS, D])
  inputs = dict(iteration=tf.zeros([4], tf.int32))
  return cell_graph.CellGraph(_CircularCell, theta, state, inputs,
                              remat.For(policy))


def _OpNames(names):
  return sorted(n.split(':')[0] for n in names)


def test_recompute_stores_nothing():
  with tf.Graph().as_default():
    assert _Cell('recompute').stored == []


def test_save_dots_stores_the_data_matmuls_not_the_weight_selections():
  # select_w1/w2 are einsums too, but of weights and the iteration only.
  with tf.Graph().as_default():
    assert _OpNames(_Cell('save_dots').stored) == ['dot1', 'dot2']


def test_save_checkpoints_stores_what_the_cell_marks():
  """The marked relu (its identity followed back to it), nothing else."""
  with tf.Graph().as_default():
    assert _OpNames(_Cell('save_checkpoints').stored) == ['act']


def test_save_all_stores_what_the_gradient_reads_of_the_data():
  """TanhGrad reads wide, ReluGrad and dot2's gradient read act; the
  matmuls' gradients read their inputs: the state (kept by the loop anyway)
  and act, and the selected weights (recomputed)."""
  with tf.Graph().as_default():
    cell = _Cell('save_all')
    assert _OpNames(cell.stored) == ['act', 'wide']
    weight_shapes = {(D, 2 * D), (2 * D, D), (R, D, 2 * D), (R, 2 * D, D)}
    assert not {tuple(s.shape) for s in cell.StoredSpecs()} & weight_shapes


def test_save_all_stores_only_what_the_live_gradient_reads():
  """x' = x + stop_gradient(tanh(x @ w)) * sin(x): tf.gradients also builds
  the product's gradient towards the stop_gradient, which reads sin(x) and
  is then dropped. Only tanh's output is read by what the gradient runs."""

  def Cell(theta, state, inputs):
    del inputs
    wide = tf.tanh(tf.matmul(state, theta), name='wide')
    return state + tf.stop_gradient(wide) * tf.sin(state, name='sin'), {}

  with tf.Graph().as_default():
    cell = cell_graph.CellGraph(Cell, tf.zeros([D, D]), tf.zeros([ROWS, D]),
                                tf.zeros([4, 1]), remat.For('save_all'))
    assert _OpNames(cell.stored) == ['wide']


def test_save_all_stores_a_slice_not_its_larger_source():
  """x' = x + sin((x @ w)[:, :D]): sin's gradient reads the [ROWS, D]
  slice; the matmul's gradient reads x and w. Storing the slice's source,
  the [ROWS, 4D] product, would cost four times as much per iteration."""

  def Cell(theta, state, inputs):
    del inputs
    wide = tf.matmul(state, theta, name='wide')
    part = tf.identity(wide[:, :D], name='part')
    return state + tf.sin(part), {}

  with tf.Graph().as_default():
    cell = cell_graph.CellGraph(
        Cell, tf.zeros([D, 4 * D]), tf.zeros([ROWS, D]),
        dict(iteration=tf.zeros([4], tf.int32)), remat.For('save_all'))
    assert [tuple(s.shape) for s in cell.StoredSpecs()] == [(ROWS, D)]


def test_a_product_of_weights_and_a_non_data_state_is_not_stored():
  """x' = tanh(x @ (w * v)) with v a carried value (e.g. a moving
  statistic), declared no data: w * v has the weights' shape and depends
  only on weights and bookkeeping, so it is recomputed, not stored per
  iteration; with v counted as data it would be stored."""

  def Cell(theta, state, inputs):
    del inputs
    scaled = tf.multiply(theta, state['v'], name='scaled')
    return dict(x=tf.tanh(tf.matmul(state['x'], scaled)), v=state['v']), {}

  def StoredShapes(activation_state):
    with tf.Graph().as_default():
      cell = cell_graph.CellGraph(
          Cell, tf.zeros([D, D]), dict(x=tf.zeros([ROWS, D]),
                                       v=tf.zeros([D, D])),
          dict(iteration=tf.zeros([4], tf.int32)), remat.For('save_all'),
          activation_state=activation_state)
      return sorted(tuple(s.shape) for s in cell.StoredSpecs())

  assert StoredShapes(None) == [(D, D)]
  assert StoredShapes(dict(x=True, v=False)) == []


def test_unknown_policy_names_the_choices():
  with pytest.raises(ValueError, match=r"remat_policy must be one of "
                     r"\('recompute', 'save_checkpoints', 'save_dots', "
                     r"'save_all'\), got 'all'"):
    remat.For('all')


def _TensorListElementShapes(while_op):
  """Element shapes of the TensorLists a While op fills (its stacks)."""
  shapes = []
  for t in while_op.inputs:
    if t.op.type == 'TensorListReserve':
      shape = tf.get_static_value(t.op.inputs[0])
      shapes.append(tuple(int(d) for d in np.atleast_1d(shape)))
  return shapes


@pytest.mark.parametrize('vectorize', ['auto', 'never'])
@pytest.mark.parametrize('policy', ['recompute', 'save_dots', 'save_all'])
def test_a_circular_pipeline_stores_no_weights_per_iteration(policy,
                                                             vectorize):
  """S=2, R=2 DenseBody (w [5, 5]) on [2, 3, 5] microbatches.

  The forward loop's stacks are the buffer, the stacked outputs and the
  stored activations: none has a weight's shape. save_dots and save_all
  store each stage's tanh input or output ([2, 3, 5] a stage: 60 elements
  for the two stages, as two stacks stage by stage or one [2, 2, 3, 5]
  vectorized), recompute nothing more. (Compiled, the loop makes the same
  stacks inside its XLA computation: gpipe.loops.compiled_loops.)
  """
  case = harness.Case(num_stages=2, num_microbatches=4, circular_repeat=2,
                      batch=8, example_shape=(3, D), remat_policy=policy,
                      vectorize_stages=vectorize, compile_loops='never')
  with tf.Graph().as_default() as graph:
    layer = case.Params().Instantiate()
    x = tf.ones([8, 3, D])
    y = layer.FProp(layer.theta, x)
    tf.gradients(tf.reduce_sum(y * y), layer.vars.Flatten())
    loops = [op for op in graph.get_operations()
             if op.type in ('While', 'StatelessWhile')]
    forward = [op for op in loops if 'gradients' not in op.name]
    assert len(forward) == 1
    shapes = _TensorListElementShapes(forward[0])
  assert all(s[-2:] != (D, D) for s in shapes), shapes
  elements = lambda stacks: sum(int(np.prod(s)) for s in stacks)
  stored = elements(shapes) - elements(_BaselineShapes(vectorize))
  per_stage = 2 * 3 * D
  assert stored == {'recompute': 0, 'save_dots': 2 * per_stage,
                    'save_all': 2 * per_stage}[policy], shapes


_BASELINE = {}


def _BaselineShapes(vectorize):
  """The recompute loop's stacks (computed once a path)."""
  if vectorize not in _BASELINE:
    case = harness.Case(num_stages=2, num_microbatches=4, circular_repeat=2,
                        batch=8, example_shape=(3, D),
                        vectorize_stages=vectorize,
                        compile_loops='never')
    with tf.Graph().as_default() as graph:
      layer = case.Params().Instantiate()
      y = layer.FProp(layer.theta, tf.ones([8, 3, D]))
      tf.gradients(tf.reduce_sum(y), layer.vars.Flatten())
      (forward,) = [op for op in graph.get_operations()
                    if op.type in ('While', 'StatelessWhile') and
                    'gradients' not in op.name]
      _BASELINE[vectorize] = _TensorListElementShapes(forward)
  return _BASELINE[vectorize]


def test_policies_give_the_same_numbers_bit_for_bit():
  """The stored values are those the recomputation makes: identical."""
  rng = np.random.RandomState(0)
  w1 = rng.normal(size=[R, D, 2 * D]).astype(np.float32) * 0.3
  w2 = rng.normal(size=[R, 2 * D, D]).astype(np.float32) * 0.3
  x0 = rng.normal(size=[ROWS, D]).astype(np.float32)
  results = {}
  with tf.Graph().as_default():
    theta = dict(w1=tf.constant(w1), w2=tf.constant(w2))
    h0 = tf.constant(x0)
    for policy in remat.POLICIES:
      states, _, extras = recurrent.Recurrent(
          theta, h0, dict(iteration=tf.range(5)), _CircularCell,
          remat_policy=policy)
      loss = tf.reduce_sum(tf.sin(states)) + tf.reduce_sum(extras['aux'])
      results[policy] = [states] + tf.gradients(loss, [theta['w1'],
                                                       theta['w2'], h0])
    with tf.compat.v1.Session() as sess:
      values = sess.run(results)
  for policy in ('save_checkpoints', 'save_dots', 'save_all'):
    for got, want in zip(values[policy], values['recompute']):
      np.testing.assert_array_equal(got, want)
