"""gpipe.microbatch: layout changes checked against NumPy index arithmetic."""

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import microbatch
from gpipe import schedule as schedule_lib


@pytest.mark.parametrize('batch,num_mb', [(6, 1), (6, 2), (6, 3), (6, 6),
                                          (8, 4)])
def test_to_microbatches_interleaves_rows_and_round_trips(batch, num_mb):
  x = np.arange(batch * 3, dtype=np.float32).reshape(batch, 3)
  mb = microbatch.ToMicrobatches(tf.constant(x), num_mb).numpy()
  assert mb.shape == (num_mb, batch // num_mb, 3)
  for m in range(num_mb):
    # Microbatch m holds rows m, m + M, m + 2M, ...: the batch dim is split
    # as [B/M, M] so that a batch sharding lands on the B/M dim.
    np.testing.assert_array_equal(mb[m], x[m::num_mb])
  back = microbatch.ToBatch(tf.constant(mb)).numpy()
  np.testing.assert_array_equal(back, x)


def test_non_tensors_pass_through():
  assert microbatch.ToMicrobatches(None, 2) is None
  assert microbatch.ToBatch(None) is None


@pytest.mark.parametrize('s,m,r', [(1, 3, 1), (3, 4, 1), (3, 4, 2), (2, 5, 3)])
def test_states_by_layer_read_and_write_each_calls_slot(s, m, r):
  sched = schedule_lib.Schedule(s, m, r)
  rng = np.random.RandomState(0)
  old = rng.normal(size=[sched.num_iterations, s, 2]).astype(np.float32)
  new = rng.normal(size=[s * r, m, 2]).astype(np.float32)
  # Reading: UnpadStates, layer-major.
  np.testing.assert_array_equal(
      microbatch.ReadStatesByLayer(tf.constant(old), sched).numpy(),
      microbatch.UnpadStates(tf.constant(old), sched).numpy().swapaxes(0, 1))
  # Writing: each call's slot, the bubbles' slots kept.
  got = microbatch.WriteStatesByLayer(tf.constant(old), tf.constant(new),
                                      sched).numpy()
  expected = old.copy()
  for mb in range(m):
    for layer in range(s * r):
      expected[sched.LayerIteration(mb, layer), layer % s] = new[layer, mb]
  np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize('batch,num_mb,mb_size,expected', [
    (8, 4, None, (4, True)),
    (8, None, 2, (4, True)),
    (8, None, None, (8, False)),
])
def test_resolve_num_microbatches(batch, num_mb, mb_size, expected):
  assert microbatch.ResolveNumMicrobatches(batch, num_mb, mb_size) == expected


def test_resolve_num_microbatches_errors():
  with pytest.raises(ValueError, match=r'Batch size 10 is not divisible by '
                     r'num_microbatches=4.*\[1, 2, 5, 10\]'):
    microbatch.ResolveNumMicrobatches(10, 4, None)
  with pytest.raises(ValueError, match=r'microbatch_size=3'):
    microbatch.ResolveNumMicrobatches(10, None, 3)
  with pytest.raises(ValueError, match=r'Set only one of num_microbatches'):
    microbatch.ResolveNumMicrobatches(10, 2, 5)


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
