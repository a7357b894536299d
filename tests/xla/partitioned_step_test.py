"""partitioned_step.RunUnpartitioned: the one-device step a partitioned one
is checked against.

It runs a step by TensorFlow's own kernels, except where those would give
other numbers than XLA, which runs the partitioned step: random numbers
(dropout) and bfloat16 arithmetic. There it must give XLA's numbers
exactly. Each case first shows that the kernels' numbers do differ, so
that the check is not met by chance.
"""

import types

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe.xla import partitioned_step


def _Dropout(x):
  keep = tf.random.stateless_uniform(tf.shape(x), seed=[3, 4]) < 0.5
  return [tf.where(keep, x * 2.0, tf.zeros_like(x))]


def _InBfloat16(x):
  y = tf.cast(x, tf.bfloat16)
  for _ in range(8):
    y = tf.tanh(y * tf.cast(1.37, tf.bfloat16) + y * y)
  return [tf.cast(y, tf.float32)]


def _Run(fn, args, jit):
  traced = tf.function(fn, jit_compile=jit, autograph=False)
  return [t.numpy() for t in traced(*[tf.constant(a) for a in args])]


@pytest.mark.parametrize('fn', [_Dropout, _InBfloat16])
def test_numbers_only_xla_gives_are_xlas(fn):
  x = np.random.RandomState(0).uniform(-1, 1, [64]).astype(np.float32)
  by_xla = _Run(fn, [x], jit=True)
  by_kernels = _Run(fn, [x], jit=False)
  assert not np.array_equal(by_xla[0], by_kernels[0])
  got = partitioned_step.RunUnpartitioned(types.SimpleNamespace(
      fn=fn, args=[x]))
  np.testing.assert_array_equal(got[0], by_xla[0])
