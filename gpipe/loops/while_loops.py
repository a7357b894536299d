"""The while loops the pipeline builds: exactly n iterations, XLA-friendly.

Every loop of the pipeline (gpipe.recurrent's pair, gpipe.pipeline.one_f_one_b's
forward loop and gradient phases) runs a known number of iterations and is
built here, so that XLA sees its trip count and takes none of its inputs
for compile-time constants.
"""

import contextlib

import tensorflow as tf

from gpipe.loops import compiled_loops
# pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import control_flow_util_v2
from tensorflow.python.ops import while_v2
# pylint: enable=g-direct-tensorflow-import


@contextlib.contextmanager
def _WithoutConstantPropagation(graph):
  """While loops built in `graph` don't make XLA turn inputs into literals.

  TF marks every while loop built for XLA with
  `_xla_propagate_compile_time_consts`; XLA then tries to evaluate *each*
  loop input on the host, before checking whether it is loop-invariant. The
  backward loop's gradient accumulators start as zeros of the stacked
  weights' shapes: a model whose weights exceed host memory would fail to
  lower (RESOURCE_EXHAUSTED allocating the literal), though nothing of the
  kind is ever needed. Our loops use no compile-time constants from outside
  (their lists are reserved outside, their bodies index with the loop
  counter), so only they are exempted: loops the cell builds live in the
  loop body's graph and keep the attribute.
  """
  original = control_flow_util_v2.maybe_propagate_compile_time_consts_in_xla

  def MaybePropagate(op):
    if op.graph is not graph:
      original(op)

  control_flow_util_v2.maybe_propagate_compile_time_consts_in_xla = (
      MaybePropagate)
  try:
    yield
  finally:
    control_flow_util_v2.maybe_propagate_compile_time_consts_in_xla = original


def WhileLoop(body, loop_vars, num_iterations):
  """Runs `body` exactly num_iterations times (a while_v2 loop).

  The loop's only condition is while_v2's own iteration counter against
  `maximum_iterations`: XLA then finds the trip count (cost analysis counts
  the body that often), which it cannot once a second counter is tested.
  The counter also sizes TensorLists built inside the body under XLA.

  In a Session's graph the loop may be one XLA computation
  (gpipe.loops.compiled_loops).
  """

  def Build(initial):
    with _WithoutConstantPropagation(tf.compat.v1.get_default_graph()):
      return while_v2.while_loop(
          lambda *unused: tf.constant(True), body, initial,
          maximum_iterations=num_iterations, return_same_structure=True)

  compiled = compiled_loops.Compiled(Build, loop_vars)
  return Build(loop_vars) if compiled is None else compiled

