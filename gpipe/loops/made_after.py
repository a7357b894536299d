"""Values that cannot be computed before a given tensor exists.

A scheduler (XLA:CPU's, a TPU's) is free to compute a value as early as its
inputs allow. A buffer of zeros that depends on nothing may then be made at
the start of the step and held to its end; a weight's update free to start
at once holds its temporaries beside every other weight's. Computing the
value from the tensor it should wait for pins it after that tensor:

    zero = 0 x sum(t)                      made once t exists

(t may be a slice: its first element waits for the whole tensor as well,
and reads less.) The one rule for what such a value is: 0 (or 1, or
zeros) exactly when every element of t is finite; NaN otherwise (0 x inf
is NaN, which is also why no compiler folds the product to a constant).
A NaN there shows only in values that are not finite anyway: those
computed from t.
"""

import tensorflow as tf


def ZeroAfter(t, dtype=tf.float32):
  """A scalar 0 of `dtype`, computed from t."""
  return tf.cast(0.0 * tf.reduce_sum(tf.cast(t, tf.float32)), dtype)


def OneAfter(t):
  """A float32 1, computed from t."""
  return 1.0 + ZeroAfter(t)


def ZerosAfter(like, incoming):
  """tf.zeros_like(like), made only once a tensor of `incoming` exists.

  A gradient loop's accumulators start as zeros of the weights' shapes:
  made from the loop's incoming gradients (the smallest floating one),
  they cannot be held through the whole forward pass.
  """
  floats = [g for g in incoming if g is not None and g.dtype.is_floating]
  if not like.dtype.is_floating or not floats:
    return tf.zeros_like(like)
  smallest = min(floats, key=lambda g: g.shape.num_elements() or 0)
  return tf.fill(tf.shape(like), ZeroAfter(smallest, like.dtype))
