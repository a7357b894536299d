"""Circular repeats: picking a stage's repeat out of its [R, ...] values.

With circular_repeat R > 1 every stage holds R logical layers, and each of
its variables has an extra [R] dim after the stage dim (Lingvo's layout):

    layer r * S + s  =  repeat r of stage s  =  body/<v>[s, r]

Every place that picks (or writes back) a repeat goes through one of these
two classes. `Linear` (R = 1) has no repeat dim: everything passes through,
so callers need no `if circular`.
"""

import contextlib

import tensorflow as tf

from gpipe.loops import compiled_loops
from lingvo.core import gshard_utils
from lingvo.core import py_utils


def RepeatsFor(circular_repeat):
  """The repeat selector of a layer with this circular_repeat."""
  return Linear() if circular_repeat == 1 else Circular(circular_repeat)


class Linear:
  """No repeats: a stage's values are its one layer's values."""

  count = 1

  def VariablePrefix(self):
    """Context adding the [R] dim to variables created inside: none here."""
    return contextlib.nullcontext()

  def Take(self, value, repeat):
    """value[repeat] (repeat: a Python int or a scalar tensor)."""
    del repeat
    return value

  def Put(self, value, repeat, new):
    """value with [repeat] replaced by `new`."""
    del value, repeat
    return new

  def TakeByOneHot(self, weights, repeat):
    """w[repeat] for every w of a structure of weights, as a sum over R.

    A one-hot sum rather than a gather: its gradient is R scaled copies, not
    a scatter into zeros. Exactly w[repeat] for finite weights.
    """
    del repeat
    return weights

  def TakeFromRS(self, value, repeat_ids):
    """[R, S, ...] -> [S, ...]: stage s's repeat_ids[s] (stage-parallel)."""
    del repeat_ids
    return value

  def TakeFromSR(self, value, repeat_ids):
    """[S, R, ...] -> [S, ...]: stage s's repeat_ids[s], for all stages at
    once (gpipe.pipeline.vectorized_stages).

    Built for what runs it. Under XLA: a one-hot sum over R, which XLA fuses
    with its neighbours. In graph mode: a gather of the S entries, whose
    gradient is written as one select into [S, R, ...] (TensorFlow's own is
    a scatter into zeros); it reads R times less than the one-hot sum, and
    is faster in graph mode and slower under XLA:CPU
    (docs/benchmarks.md#measured-behind-the-codes-choices).
    """
    del repeat_ids
    return value


class Circular(Linear):
  """R > 1 repeats, each stage's values [R, ...]."""

  def __init__(self, count):
    self.count = count

  @contextlib.contextmanager
  def VariablePrefix(self):
    # The [R] dim is never split over devices.
    with gshard_utils.MeshSplitDimPrefixContext(-1):
      with py_utils.VariableShapePrefixContext(self.count):
        yield

  def Take(self, value, repeat):
    if isinstance(repeat, int):
      return value[repeat]
    return tf.gather(value, repeat)

  def Put(self, value, repeat, new):
    hit = tf.equal(tf.range(self.count), repeat)
    hit = tf.reshape(hit, [self.count] + [1] * new.shape.rank)
    return tf.where(hit, new[None], value)

  def TakeByOneHot(self, weights, repeat):
    hot = tf.one_hot(repeat, self.count)

    def Select(w):
      parts = tf.unstack(w, num=self.count)
      return tf.add_n([tf.cast(hot[r], w.dtype) * parts[r]
                       for r in range(self.count)])

    return tf.nest.map_structure(Select, weights)

  def TakeFromRS(self, value, repeat_ids):
    num_stages = value.shape.as_list()[1]
    index = tf.stack([repeat_ids, tf.range(num_stages)], axis=-1)
    return tf.gather_nd(value, index)

  def TakeFromSR(self, value, repeat_ids):
    if compiled_loops.UnderXla():
      hot = tf.one_hot(repeat_ids, self.count, dtype=value.dtype)  # [S, R]
      return tf.reduce_sum(value * self._ForEachStage(hot, value), axis=1)
    return self._GatherFromSR(value, repeat_ids)

  def _GatherFromSR(self, value, repeat_ids):
    """value[s, repeat_ids[s]] for every s, by a gather of S entries."""
    shape = value.shape.as_list()
    num_stages = shape[0]

    @tf.custom_gradient
    def Gather(value):
      flat = tf.reshape(value, [num_stages * self.count] + shape[2:])
      taken = tf.gather(flat, tf.range(num_stages) * self.count + repeat_ids)

      def Grad(dy):
        hit = tf.equal(tf.range(self.count)[None, :], repeat_ids[:, None])
        return tf.where(self._ForEachStage(hit, value), dy[:, None],
                        tf.zeros([], dy.dtype))

      return taken, Grad

    return Gather(value)

  @staticmethod
  def _ForEachStage(hits, value):
    """[S, R] -> [S, R, 1, ...], broadcasting against value [S, R, ...]."""
    return tf.reshape(hits, hits.shape.as_list() + [1] * (value.shape.rank - 2))
