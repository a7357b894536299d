"""How the benchmarks measure: timed training steps and XLA's memory."""

import math
import statistics
import time

import numpy as np

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
import tensorflow as tf
from gpipe.xla import partitioning
from lingvo.core import scatter_update

MAX_ROUNDS = 400


def Interleaved(steps, warmup, reps, min_seconds=0.0):
  """Median seconds of each step, timed in rotation: one run of each per
  round, so a slow spell of a shared machine falls on all of them alike and
  their ratios hold from one run of the benchmarks to the next. At least
  `reps` rounds, more where that takes under `min_seconds` (steps under a
  millisecond: a few slow runs shift the median of 15)."""
  for step in steps:
    for _ in range(warmup):
      step.Run()
  began = time.perf_counter()
  for step in steps:
    step.Run()
  one_round = time.perf_counter() - began
  reps = max(reps, min(MAX_ROUNDS, math.ceil(min_seconds / one_round)))
  times = [[] for _ in steps]
  for _ in range(reps):
    for step, took in zip(steps, times):
      began = time.perf_counter()
      step.Run()
      took.append(time.perf_counter() - began)
  for step in steps:
    step.Close()
  return [statistics.median(t) for t in times]


def TrainStep(forward, variables, x):
  """Loss and gradients w.r.t. the variables and the input."""
  y = forward(x)
  loss = tf.reduce_sum(y * y)
  return [loss] + tf.gradients(loss, variables + [x])


class GraphStep:
  """A training step in a tf.Graph run by a Session (Lingvo's home)."""

  def __init__(self, make_layer, forward_of, batch, dim):
    self.graph = tf.Graph()
    with self.graph.as_default():
      began = time.perf_counter()
      layer = make_layer()
      x = tf.constant(np.random.RandomState(0).uniform(
          -1, 1, [batch, dim]).astype(np.float32))
      self.fetch = TrainStep(lambda t: forward_of(layer, layer.theta, t),
                              layer.vars.Flatten(), x)
      self.build_seconds = time.perf_counter() - began
      self.layer = layer
      self.sess = tf.compat.v1.Session(graph=self.graph)
      self.sess.run(tf.compat.v1.global_variables_initializer())

  def Run(self):
    self.sess.run(self.fetch)

  def Close(self):
    self.sess.close()

  def Time(self, warmup, reps):
    return Interleaved([self], warmup, reps)[0]


class JitStep:
  """A training step as tf.function(jit_compile=True), run eagerly."""

  def __init__(self, make_layer, forward_of, batch, dim):
    with tf.init_scope():
      self.layer = make_layer()
    self.x = tf.constant(np.random.RandomState(0).uniform(
        -1, 1, [batch, dim]).astype(np.float32))
    layer = self.layer
    theta = layer.theta
    self.weights = [tf.convert_to_tensor(v) for _, v in theta.FlattenItems()]

    def Step(weights, x):
      with tf.GradientTape() as tape:
        tape.watch(weights + [x])
        y = forward_of(layer, theta.Pack(weights), x)
        loss = tf.reduce_sum(y * y)
      return [loss] + tape.gradient(loss, weights + [x])

    self.fn = tf.function(Step, jit_compile=True, autograph=False)

  def Compile(self):
    """(trace seconds, trace + XLA compile + first run seconds)."""
    began = time.perf_counter()
    with NoInplaceUpdate():
      self.fn.get_concrete_function(self.weights, self.x)
    traced = time.perf_counter() - began
    self.Run()
    return traced, time.perf_counter() - began

  def Run(self):
    with NoInplaceUpdate():
      out = self.fn(self.weights, self.x)
    out[0].numpy()

  def Close(self):
    pass

  def Time(self, warmup, reps):
    return Interleaved([self], warmup, reps)[0]


def NoInplaceUpdate():
  """Lingvo's Recurrent uses InplaceUpdate, which XLA:CPU cannot compile."""
  return scatter_update.SetInplaceUpdate(False)


def Pipelined(layer, theta, x):
  return layer.FProp(theta, x)


def Step(mode, make_layer, forward_of, batch, dim):
  cls = GraphStep if mode == 'graph' else JitStep
  return cls(make_layer, forward_of, batch, dim)




def TempBytes(make_layer, forward_of, batch, dim):
  """XLA's temporary bytes of a jit training step (1 device)."""
  step = JitStep(make_layer, forward_of, batch, dim)
  args = [w.numpy() for w in step.weights] + [step.x.numpy()]
  n = len(step.weights)
  fn = lambda *a: step.fn(list(a[:n]), a[n])
  return partitioning.CompiledMemory(fn, args)['temp_size_in_bytes']


