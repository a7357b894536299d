"""The tests' one close-assertion, and the tolerances it is used with.

AssertClose(actual, expected, tolerance, what) compares two structures
(tf.nest's: lists, tuples, dicts, NestedMaps) of arrays, tensors or numbers
leaf by leaf: as many leaves, None where expected has None, equal shapes,
integers and booleans equal, and floating values (bfloat16 too, all
compared in float64) within

    |actual - expected| <= atol + rtol * |expected|    elementwise,

np.testing.assert_allclose's test. A Tolerance may also scale atol with the
expected tensor's largest magnitude (atol_of_largest).

Use a named tolerance; a test that needs another one passes its own
Tolerance(...) and says why next to it.
"""

import dataclasses

import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Tolerance:
  """rtol and atol as np.testing.assert_allclose takes them.

  With atol_of_largest, the atol used is max(atol, atol_of_largest *
  max|expected|): an error relative to the tensor's scale, for entries that
  are small differences of large terms.
  """
  rtol: float
  atol: float
  atol_of_largest: float = 0.0

  def Atol(self, expected):
    if not self.atol_of_largest or not expected.size:
      return self.atol
    return max(self.atol,
               self.atol_of_largest * float(np.abs(expected).max()))


# float32 against a reference doing the same math in another order, or in
# float64: a few float32 ulps (1.2e-7) for each of a few ops.
FLOAT32 = Tolerance(rtol=1e-5, atol=1e-5)
# The same with a tenfold smaller floor, for values whose entries near zero
# are computed near zero too (not as differences of large terms): Lingvo's
# own layer against ours, gpipe.recurrent against its references, two of
# the layer's own paths against each other.
FLOAT32_TIGHT = Tolerance(rtol=1e-5, atol=1e-6)
# The same where one side is XLA-compiled and the other TensorFlow's kernels
# (our graph-mode loops, gpipe.loops.compiled_loops, against Lingvo's layer
# op by op): XLA's fused computations add in other orders, so a gradient
# entry that is a small difference of large terms moves by about an ulp of
# those terms (seen: 1.0e-6 on an entry of 2.2e-4, 1.4e-7 of the array's
# largest): an atol of 1e-6 times the largest magnitude once that is above 1.
FLOAT32_TIGHT_AT_SCALE = Tolerance(rtol=1e-5, atol=1e-6, atol_of_largest=1e-6)
# float32 where an entry can be a small difference of large terms, so its
# error is a few ulps of those terms, not of itself: atol 1e-5 times the
# tensor's largest magnitude once that is above 1. Lingvo's GShard pipeline
# (tf.vectorized_map: every stage in one batch) against ours (a stage at a
# time), the same float32 ops on differently shaped batches added up in
# other orders: over the initial weights of seeds 1 to 5, gradient errors
# up to 3.4e-5, at most 4.1e-6 of the array's largest entry (a plain atol
# of 1e-5 fails for some seeds); outputs, aux losses and metrics within
# 1.4e-6; in float64 the dense case agrees exactly. Decoding: float32
# against float64 NumPy through up to 6 attention layers. A 256-wide body
# compiled by XLA against the harness's reference op by op: sums of 256
# products in other orders (1.6e-5 on an entry of 0.16, of a largest 4.2).
# Lingvo's TransformerLayer stack under gpipe against Lingvo's own, layer
# after layer (tests/lingvo_compat_test.py): 2.0e-5 on a gradient entry of
# 0.49, of a largest 16, in one suite run of four.
FLOAT32_AT_SCALE = Tolerance(rtol=1e-5, atol=1e-5, atol_of_largest=1e-5)
# bfloat16 compute (Lingvo's fprop_dtype) on float32 weights: 8 significant
# bits, an ulp is 2^-8 relative; the same sums in another order move some
# elements by an ulp.
BFLOAT16 = Tolerance(rtol=1e-2, atol=1e-6)
# bfloat16 where a sum is accumulated differently (in float32 inside one
# matmul against one bfloat16 add an iteration), which moves some elements
# by a few ulps of the tensor's scale: 2 ulps (2 x 2^-8) of its largest.
BFLOAT16_AT_SCALE = Tolerance(rtol=1e-2, atol=1e-6,
                              atol_of_largest=2 * 2.0**-8)


def AssertClose(actual, expected, tolerance=FLOAT32, what='', record=None):
  """Asserts `actual` matches `expected` (see the module docstring).

  Args:
    actual: a structure of arrays, tensors, numbers or None.
    expected: the same structure.
    tolerance: a Tolerance, for the floating leaves.
    what: said on failure (with the leaf's index when there are several).
    record: if set, called as record(actual, expected) with each floating
      leaf pair that passed, as float64 arrays (for a report of the largest
      errors).
  """
  flat_a, flat_e = tf.nest.flatten(actual), tf.nest.flatten(expected)
  assert len(flat_a) == len(flat_e), (what, len(flat_a), len(flat_e))
  for i, (a, e) in enumerate(zip(flat_a, flat_e)):
    where = f'{what} [{i}]' if len(flat_e) > 1 else what
    if e is None:
      assert a is None, f'{where}: expected None, got {a}'
      continue
    a, e = np.asarray(a), np.asarray(e)
    assert a.shape == e.shape, f'{where}: shape {a.shape} != {e.shape}'
    if e.dtype.kind in 'biu':
      np.testing.assert_array_equal(a, e, err_msg=where)
      continue
    a, e = a.astype(np.float64), e.astype(np.float64)
    np.testing.assert_allclose(a, e, rtol=tolerance.rtol,
                               atol=tolerance.Atol(e), err_msg=where)
    if record is not None:
      record(a, e)
