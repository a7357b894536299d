"""Loops a Session runs as one XLA computation (gpipe.loops.compiled_loops).

In graph mode the pipeline's loops are compiled by default: the results
equal the plain stack's (NumPy forward, TensorFlow's gradients of a plain
loop over the layers) for the schedules, and equal the op-by-op loops'.
Loops XLA would compute differently or cannot compile run op by op.
"""

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import layers
from gpipe.loops import compiled_loops
from gpipe.loops import tensor_lists
from gpipe.loops import while_loops
from lingvo.core import py_utils
from tests import close
from tests import pipeline_harness as harness
from tests import reference_bodies


def _CompiledCalls(graph):
  """Function calls in `graph` that XLA must compile."""
  return [op for op in graph.get_operations()
          if op.type in ('PartitionedCall', 'StatefulPartitionedCall') and
          op.node_def.attr['_XlaMustCompile'].b]


def _TrainingGraphCalls(case):
  with tf.Graph().as_default() as graph:
    layer = case.Params().Instantiate()
    x = tf.ones((case.batch,) + tuple(case.example_shape))
    y = layer.FProp(layer.theta, x)
    tf.gradients(tf.reduce_sum(y * y), layer.vars.Flatten())
    return len(_CompiledCalls(graph))


# -- The pipeline's loops, compiled. -------------------------------------------

_CASES = {
    'S1-M2': dict(num_stages=1, num_microbatches=2),
    'S2-M3-R2': dict(num_stages=2, num_microbatches=3, circular_repeat=2,
                     batch=6),
    'S4-M4': dict(num_stages=4, num_microbatches=4, batch=8),
    'S3-M5-R2-one-by-one': dict(num_stages=3, num_microbatches=5, batch=10,
                                circular_repeat=2, vectorize_stages='never'),
    'S2-M4-1f1b': dict(num_stages=2, num_microbatches=4,
                       backward_schedule='1f1b'),
    'S3-M4-R2-1f1b-stream': dict(num_stages=3, num_microbatches=4,
                                 circular_repeat=2, backward_schedule='1f1b',
                                 stream_io=True),
    'S4-M4-skip': dict(num_stages=4, num_microbatches=4, batch=8,
                       skip_bubbles=True),
}


@pytest.mark.parametrize('name', sorted(_CASES))
def test_compiled_loops_equal_the_plain_stack(name):
  case = harness.Case(compile_loops='auto', **_CASES[name])
  assert _TrainingGraphCalls(case) >= 2, 'the loops were not compiled'
  harness.CheckCase(case, 'graph')


def test_layer_by_layer_loops_run_op_by_op():
  """S x R whole-batch iterations: little to save, XLA's launch to pay."""
  case = harness.Case(num_stages=2, num_microbatches=4, circular_repeat=2,
                      layer_by_layer=True, compile_loops='auto')
  assert _TrainingGraphCalls(case) == 0
  res = harness.CheckCase(case, 'graph')
  assert res['layer'].layer_by_layer.ran


@pytest.mark.parametrize('name', ['S2-M3-R2', 'S2-M4-1f1b'])
def test_compiled_equals_op_by_op(name):
  compiled = harness.RunCase(
      harness.Case(compile_loops='auto', **_CASES[name]), 'graph')
  never = harness.Case(compile_loops='never', **_CASES[name])
  assert _TrainingGraphCalls(never) == 0
  op_by_op = harness.RunCase(never, 'graph')
  close.AssertClose(compiled['out'], op_by_op['out'], close.FLOAT32, 'out')
  for g, r in zip(compiled['grads'], op_by_op['grads']):
    close.AssertClose(g, r, close.FLOAT32, 'gradient')


def test_under_tf_function_the_loops_are_left_to_it():
  """Inside a tf.function the layer builds no call of its own to compile.
  (Built in a graph: an eagerly built layer's variables would outlive the
  test in Lingvo's variable store.)"""
  with tf.Graph().as_default():
    layer = harness.Case(num_stages=2, num_microbatches=2,
                         compile_loops='auto').Params().Instantiate()

    def Step(x):
      return tf.reduce_sum(layer.FProp(layer.theta, x))

    graph = tf.function(Step, autograph=False).get_concrete_function(
        tf.TensorSpec([4, 3, 4], tf.float32)).graph
    assert graph.get_operations()
    assert not _CompiledCalls(graph)


# -- What stays op by op. ------------------------------------------------------


class _StringBody(reference_bodies.DenseBody):
  """DenseBody through a string round trip: no XLA kernel for it."""

  def FProp(self, theta, x, scale=None, shift=None):
    y = super().FProp(theta, x, scale, shift)
    return tf.strings.to_number(tf.strings.as_string(y, precision=9))


def _Pipelined(body, **extra):
  return layers.PipelinedLayer.Params().Set(
      name='compiled', num_stages=2, num_microbatches=2, single_stage_body=body,
      random_seed=1, **extra)


@pytest.mark.parametrize('what', ['dropout', 'bfloat16', 'string ops'])
def test_loops_xla_would_change_or_cannot_compile_run_op_by_op(what):
  body = reference_bodies.TrainingBody.Params().Set(dim=4)
  extra = {}
  if what == 'dropout':
    body.keep_prob = 0.5
  elif what == 'bfloat16':
    extra = dict(fprop_dtype=tf.bfloat16)
  else:
    body = _StringBody.Params().Set(dim=4)
  with tf.Graph().as_default() as graph:
    py_utils.GetOrCreateGlobalStepVar()  # dropout's step seeds read it
    layer = _Pipelined(body, **extra).Instantiate()
    x = tf.ones([4, 4], extra.get('fprop_dtype', tf.float32))
    y = layer.FProp(layer.theta, x)
    grads = tf.gradients(tf.reduce_sum(tf.cast(y, tf.float32)),
                         layer.vars.Flatten())
    assert not _CompiledCalls(graph)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      values = sess.run([y] + grads)
  assert all(np.all(np.isfinite(v.astype(np.float32))) for v in values)


def test_a_bad_value_names_the_param():
  body = reference_bodies.DenseBody.Params().Set(dim=4)
  with tf.Graph().as_default(), pytest.raises(
      ValueError,
      match=r"compile_loops must be one of \('auto', 'never'\), got 'always'"):
    _Pipelined(body, compile_loops='always').Instantiate()


# -- Compiled() on its own: a loop filling a TensorList. ----------------------


def _FillEntries(x, allowed):
  """Entry t of the result: x * t, summed into a carry too."""

  def Body(t, total, entries):
    value = x * tf.cast(t, x.dtype)
    return t + 1, total + value, tensor_lists.SetEntry(entries, t, value)

  with compiled_loops.Allowed(allowed):
    _, total, entries = while_loops.WhileLoop(
        Body, [tf.constant(0), tf.zeros_like(x),
               tensor_lists.Reserve(x, 5)], 5)
  return total, tensor_lists.Stack(entries, x, 5)


@pytest.mark.parametrize('allowed', [True, False])
def test_a_loop_and_its_list_compiled_or_not(allowed):
  x_np = np.arange(6, dtype=np.float32).reshape(2, 3)
  with tf.Graph().as_default() as graph:
    total, entries = _FillEntries(tf.constant(x_np), allowed)
    assert len(_CompiledCalls(graph)) == (1 if allowed else 0)
    with tf.compat.v1.Session() as sess:
      total, entries = sess.run([total, entries])
  expected_entries = np.stack([x_np * t for t in range(5)])
  np.testing.assert_array_equal(entries, expected_entries)
  np.testing.assert_array_equal(total, expected_entries.sum(0))


def test_a_loop_of_dynamic_shape_runs_op_by_op():
  """XLA would take the fed shape for a constant of the computation."""
  with tf.Graph().as_default() as graph:
    x = tf.compat.v1.placeholder(tf.float32, [None, 3])
    total, _ = _FillEntries(x, True)
    assert not _CompiledCalls(graph)
    with tf.compat.v1.Session() as sess:
      got = sess.run(total, {x: np.ones([4, 3], np.float32)})
  np.testing.assert_array_equal(got, np.full([4, 3], 10.0, np.float32))
