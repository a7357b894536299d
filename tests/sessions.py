"""The tests' graph-mode session: the graph run as built.

Grappler's rewrites and the graph optimizer change how fast a graph runs,
not what it computes; on the tests' small graphs they take longer than the
run itself (docs/testing.md, 'Where the time goes'). Where a graph
needs them, a test runs it in a default session: large_lm_test's 1f1b
model, whose loops XLA compiles inside the graph, reads a shape XLA must
know from a tensor only constant folding makes constant. The commands the
tests run as processes (the demo, Lingvo's trainer) keep them, as a
user's run does.
"""

import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2


def AsBuilt(graph=None):
  """A tf.compat.v1.Session on `graph` (default: the default graph) with
  graph optimizations off."""
  return tf.compat.v1.Session(graph=graph, config=tf.compat.v1.ConfigProto(
      graph_options=tf.compat.v1.GraphOptions(
          optimizer_options=tf.compat.v1.OptimizerOptions(
              opt_level=tf.compat.v1.OptimizerOptions.L0),
          rewrite_options=rewriter_config_pb2.RewriterConfig(
              disable_meta_optimizer=True))))
