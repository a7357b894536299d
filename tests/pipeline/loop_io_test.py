"""gpipe.pipeline.loop_io: stage 0's input read in the loop, checked against
the schedule's input iterations (NumPy)."""

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe.pipeline import loop_io
from gpipe import schedule as schedule_lib
from lingvo.core import py_utils


def _Row(sched, i):
  """The schedule's row i as the loops see it: [S] tensors a field."""
  return py_utils.NestedMap({
      name: tf.constant(table[i], dtype) for name, (dtype, table) in
      schedule_lib.FieldTables(sched.Rows()).items()})


def test_a_non_tensor_input_passes_through():
  sched = schedule_lib.Schedule(2, 2)
  assert loop_io.StageZeroInput(None, _Row(sched, 0)) is None


def _StageZeroInputs(x, sched, split=True):
  """StageZeroInput at every iteration, stacked: [T, ...]."""
  return tf.stack([loop_io.StageZeroInput(x, _Row(sched, i), split)
                   for i in range(sched.num_iterations)])


@pytest.mark.parametrize('s,m,r', [(1, 3, 1), (3, 4, 1), (3, 4, 2), (2, 5, 3)])
def test_stage_zero_input_is_each_microbatch_at_its_input_iteration(s, m, r):
  sched = schedule_lib.Schedule(s, m, r)
  x = np.arange(1, m + 1, dtype=np.float32)[:, None] * np.ones([1, 2],
                                                               np.float32)
  read = _StageZeroInputs(tf.constant(x), sched).numpy()
  assert read.shape == (sched.num_iterations, 2)
  # Iterations that read no fresh microbatch get a copy of microbatch 0.
  expected = np.tile(x[:1], [sched.num_iterations, 1])
  for mb in range(m):
    expected[sched.InputIteration(mb)] = x[mb]
  np.testing.assert_array_equal(read, expected)


@pytest.mark.parametrize('split', [True, False])
@pytest.mark.parametrize('s,m,r', [(3, 4, 1), (3, 4, 2), (2, 5, 3)])
def test_stage_zero_input_gradient_goes_to_the_microbatch_read(s, m, r,
                                                               split):
  """Microbatch m's gradient is the cotangent of the iteration that read
  it; the filler copies of microbatch 0 count nothing (both gradient
  forms)."""
  sched = schedule_lib.Schedule(s, m, r)
  x = tf.constant(np.ones([m, 2], np.float32))
  cot = np.random.RandomState(3).normal(
      size=[sched.num_iterations, 2]).astype(np.float32)
  with tf.GradientTape() as tape:
    tape.watch(x)
    total = tf.reduce_sum(_StageZeroInputs(x, sched, split) * cot)
  grad = tf.convert_to_tensor(tape.gradient(total, x))
  want = np.stack([cot[sched.InputIteration(mb)] for mb in range(m)])
  np.testing.assert_array_equal(grad, want)
