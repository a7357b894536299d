"""Tests for gpipe.lingvo_support.lingvo_ops (custom ops, pure-TF fallback)."""

import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from gpipe.lingvo_support import lingvo_ops

# Must run before anything imports lingvo.core.
lingvo_ops.EnsureLingvoOps()

# pylint: disable=g-import-not-at-top,wrong-import-position
from lingvo.core import ops as lingvo_core_ops
from lingvo.core import py_utils
from lingvo.core import py_utils_flags
from lingvo.core import recurrent
# pylint: enable=g-import-not-at-top,wrong-import-position

_ROOT = pathlib.Path(__file__).resolve().parents[2]

_NEEDS_FALLBACK = pytest.mark.skipif(
    not lingvo_ops.UsingFallback(),
    reason="lingvo's x_ops.so loaded, so the real ops are in use and the "
    'pure-TF fallback is not active')


def test_state_is_consistent_and_idempotent():
  using = lingvo_ops.UsingFallback()
  assert lingvo_ops.EnsureLingvoOps() == using
  assert lingvo_ops.USING_FALLBACK == using
  gen_x_ops = sys.modules.get('lingvo.core.ops.gen_x_ops')
  if using:
    assert lingvo_ops.LoadError()
    assert gen_x_ops is not None
    assert lingvo_core_ops.assert_shape_match is gen_x_ops.assert_shape_match
  else:
    assert lingvo_ops.LoadError() is None


def test_asserts_are_enabled():
  # Otherwise HasShape and assert_same_dim0 skip the ops under test.
  assert py_utils_flags.enable_asserts()


def _HasShapeGraph(expected_shape):
  """Returns (graph, placeholder, HasShape output) with an unknown shape."""
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, shape=None)
    y = py_utils.HasShape(x, expected_shape)
  return graph, x, y


def test_has_shape_matching_graph_mode():
  graph, x, y = _HasShapeGraph([2, -1])
  value = np.arange(10, dtype=np.float32).reshape(2, 5)
  with tf.compat.v1.Session(graph=graph) as sess:
    np.testing.assert_array_equal(sess.run(y, {x: value}), value)
    value = np.ones((2, 1), np.float32)
    np.testing.assert_array_equal(sess.run(y, {x: value}), value)


@pytest.mark.parametrize('bad_shape', [(3, 5), (5, 2), (2, 5, 1), (2,)])
def test_has_shape_mismatch_fails_at_run_time(bad_shape):
  graph, x, y = _HasShapeGraph([2, -1])  # Building the graph must not raise.
  with tf.compat.v1.Session(graph=graph) as sess:
    with pytest.raises(tf.errors.InvalidArgumentError, match='LINGVO ASSERT'):
      sess.run(y, {x: np.zeros(bad_shape, np.float32)})


def test_has_shape_with_tensor_expected_shape():
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, shape=None)
    ref = tf.compat.v1.placeholder(tf.float32, shape=None)
    y = py_utils.HasShape(x, tf.shape(ref))
  with tf.compat.v1.Session(graph=graph) as sess:
    ones = np.ones((3, 4), np.float32)
    np.testing.assert_array_equal(sess.run(y, {x: ones, ref: ones}), ones)
    with pytest.raises(tf.errors.InvalidArgumentError):
      sess.run(y, {x: ones, ref: np.ones((4, 3), np.float32)})


def test_assert_shape_match_in_tf_function():
  seen = []

  @tf.function(input_signature=[tf.TensorSpec([None, None], tf.float32)])
  def Guarded(x):
    op = lingvo_core_ops.assert_shape_match(tf.shape(x), [2, -1], msg='fn')
    seen.append(op)
    with tf.control_dependencies([op]):
      return tf.identity(x) * 2.0

  value = np.ones((2, 3), np.float32)
  np.testing.assert_array_equal(Guarded(value).numpy(), 2.0 * value)
  assert len(seen) == 1 and isinstance(seen[0], tf.Operation)
  with pytest.raises(tf.errors.InvalidArgumentError, match='fn'):
    Guarded(np.ones((3, 3), np.float32))


def test_assert_same_dim0_in_tf_function():
  seen = []

  @tf.function(input_signature=[
      tf.TensorSpec(None, tf.float32),
      tf.TensorSpec(None, tf.float32)
  ])
  def Guarded(a, b):
    op = lingvo_core_ops.assert_same_dim0([a, b], msg='fn0')
    seen.append(op)
    with tf.control_dependencies([op]):
      return tf.identity(a)

  Guarded(np.ones((2, 3), np.float32), np.ones((2,), np.float32))
  assert len(seen) == 1 and isinstance(seen[0], tf.Operation)
  with pytest.raises(tf.errors.InvalidArgumentError, match='fn0'):
    Guarded(np.ones((2, 3), np.float32), np.ones((3,), np.float32))


@_NEEDS_FALLBACK
def test_assert_same_dim0_graph_mode():
  graph = tf.Graph()
  with graph.as_default():
    a = tf.compat.v1.placeholder(tf.float32, shape=None)
    b = tf.compat.v1.placeholder(tf.int32, shape=None)
    c = tf.compat.v1.placeholder(tf.float32, shape=None)
    op = lingvo_core_ops.assert_same_dim0([a, b, c], msg='same-dim0')
    assert isinstance(op, tf.Operation)
  with tf.compat.v1.Session(graph=graph) as sess:
    sess.run(op, {a: np.zeros((4, 2)), b: np.zeros(4), c: np.zeros((4, 1, 1))})
    for bad_b in (np.zeros(5), np.zeros(()), np.zeros((3, 4))):
      with pytest.raises(tf.errors.InvalidArgumentError, match='same-dim0'):
        sess.run(op, {a: np.zeros((4, 2)), b: bad_b, c: np.zeros((4, 1))})


@_NEEDS_FALLBACK
def test_shapes_known_while_building_are_checked_then_or_at_run_time():
  """Shapes known to match need no run-time check (a no-op); shapes known
  not to match still build, and fail when run, as the real op does."""
  graph = tf.Graph()
  with graph.as_default():
    x = tf.zeros([2, 3])
    matching = lingvo_core_ops.assert_shape_match(tf.shape(x), [2, -1])
    also = lingvo_core_ops.assert_shape_match([2, tf.constant(3)], [-1, 3])
    wrong = lingvo_core_ops.assert_shape_match(tf.shape(x), [2, 4], msg='wr')
    shorter = lingvo_core_ops.assert_shape_match(tf.shape(x), [2], msg='sh')
  assert [op.type for op in matching.control_inputs] == ['NoOp']
  assert [op.type for op in also.control_inputs] == ['NoOp']
  with tf.compat.v1.Session(graph=graph) as sess:
    sess.run([matching, also])
    for op, msg in ((wrong, 'wr'), (shorter, 'sh')):
      with pytest.raises(tf.errors.InvalidArgumentError, match=msg):
        sess.run(op)


def test_ensure_lingvo_ops_before_lingvo_is_imported():
  """As documented: EnsureLingvoOps() first, then lingvo (in a process of
  its own, where nothing imported lingvo yet). Looking lingvo up runs
  gpipe's import hook, which calls EnsureLingvoOps() again, re-entered."""
  program = ('from gpipe.lingvo_support import lingvo_ops\n'
             'using = lingvo_ops.EnsureLingvoOps()\n'
             'from lingvo.core import py_utils\n'
             'print(using == lingvo_ops.UsingFallback())\n'
             'from gpipe.apps import prompt_exit\n'
             'prompt_exit.Exit(0)\n')
  done = subprocess.run([sys.executable, '-c', program], cwd=_ROOT,
                        capture_output=True, text=True, timeout=120,
                        check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.split() == ['True']


@_NEEDS_FALLBACK
def test_fallback_asserts_eager():
  assert lingvo_core_ops.assert_shape_match([2, 3], [-1, 3]) is None
  assert lingvo_core_ops.assert_same_dim0([tf.zeros([2]), tf.zeros([2, 7])
                                          ]) is None
  with pytest.raises(tf.errors.InvalidArgumentError, match='eager-msg'):
    lingvo_core_ops.assert_shape_match([2, 3], [2, 4], msg='eager-msg')
  with pytest.raises(tf.errors.InvalidArgumentError, match='eager-msg'):
    lingvo_core_ops.assert_same_dim0([tf.zeros([2]), tf.zeros([3])],
                                     msg='eager-msg')


@_NEEDS_FALLBACK
def test_other_ops_raise_not_implemented():
  # Looking an op up must work (lingvo's ops/__init__ does it at import).
  for name, op in [('beam_search_step_v2', lingvo_core_ops.beam_search_step),
                   ('pack_sequences', lingvo_core_ops.pack_sequences)]:
    assert callable(op)
    with pytest.raises(NotImplementedError) as info:
      op(tf.zeros([1]))
    message = str(info.value)
    assert "'%s'" % name in message
    assert lingvo_ops.LoadError() in message
  gen_x_ops = sys.modules['lingvo.core.ops.gen_x_ops']
  with pytest.raises(AttributeError):
    gen_x_ops.__no_such_dunder__  # pylint: disable=pointless-statement


def _CumSumCell(theta, state0, inputs):
  del theta  # Unused.
  return py_utils.NestedMap(total=state0.total + inputs.x), py_utils.NestedMap()


def _RecurrentGraph():
  """Builds a cumulative sum via lingvo Recurrent over unknown-shape inputs."""
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, shape=[None, 3])
    y = tf.compat.v1.placeholder(tf.float32, shape=[None, 3])
    inputs = py_utils.NestedMap(x=x, y=y)
    state0 = py_utils.NestedMap(total=tf.zeros([3]))
    acc, final = recurrent.Recurrent(py_utils.NestedMap(), state0, inputs,
                                     _CumSumCell)
  return graph, x, y, acc.total, final.total


def test_recurrent_cumsum_graph_mode():
  graph, x, y, acc, final = _RecurrentGraph()
  if lingvo_ops.UsingFallback():
    # Recurrent's _SeqLen check went through the fallback op (it is built
    # inside one of Recurrent's functions, hence the function library).
    graph_def = graph.as_graph_def()
    names = [n.name for n in graph_def.node]
    for fn in graph_def.library.function:
      names += [n.name for n in fn.node_def]
    assert any(n.startswith('AssertSameDim0/') for n in names)
  xs = np.random.RandomState(0).uniform(size=(4, 3)).astype(np.float32)
  with tf.compat.v1.Session(graph=graph) as sess:
    acc_v, final_v = sess.run([acc, final], {x: xs, y: xs})
    np.testing.assert_allclose(acc_v, np.cumsum(xs, axis=0), rtol=1e-6)
    np.testing.assert_allclose(final_v, xs.sum(axis=0), rtol=1e-6)
    # Inputs with different sequence lengths trip assert_same_dim0.
    with pytest.raises(tf.errors.InvalidArgumentError, match='_SeqLen'):
      sess.run(acc, {x: xs, y: xs[:3]})


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
