"""Einsums vectorized over calls (gpipe.pipeline.vectorized_stages).

An einsum whose one operand differs per call and whose first axis leads
the output too runs once on the call axis merged into that axis (the plain
stack's einsum on the whole batch, which XLA lowers well); every other
einsum is vectorized as TensorFlow's pfor does. Either way each call's
result and gradients equal the einsum run call by call in a Python loop.
"""

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe.pipeline import vectorized_stages
from tests import close
from tests import sessions

CALLS, ROWS, DIM, HIDDEN = 3, 4, 5, 6

# equation, shapes of its operands for one call, which differ per call,
# whether the merged form applies.
_CASES = {
    'shared weights': ('bd,dh->bh', [(ROWS, DIM), (DIM, HIDDEN)],
                       (True, False), True),
    'shared first operand': ('hd,bd->bh', [(HIDDEN, DIM), (ROWS, DIM)],
                             (False, True), True),
    'output in another order': ('bd,dh->hb', [(ROWS, DIM), (DIM, HIDDEN)],
                                (True, False), False),
    'contracted first axis': ('bd,bh->dh', [(ROWS, DIM), (ROWS, HIDDEN)],
                              (True, False), False),
    'both per call': ('bd,dh->bh', [(ROWS, DIM), (DIM, HIDDEN)],
                      (True, True), False),
    'ellipsis': ('...d,dh->...h', [(ROWS, DIM), (DIM, HIDDEN)],
                 (True, False), False),
}


def _Einsums(graph):
  return [op for op in graph.get_operations() if op.type == 'Einsum']


@pytest.mark.parametrize('name', sorted(_CASES))
def test_vectorized_einsum_equals_a_loop_over_calls(name):
  equation, shapes, per_call, merges = _CASES[name]
  rng = np.random.RandomState(0)
  values = [rng.uniform(-1, 1, ((CALLS,) if p else ()) + s).astype(np.float32)
            for s, p in zip(shapes, per_call)]
  with tf.Graph().as_default() as graph:
    operands = [tf.constant(v) for v in values]
    stacked = [o for o, p in zip(operands, per_call) if p]
    shared = [o for o, p in zip(operands, per_call) if not p]

    def OneCall(leaves):
      per, common = iter(leaves), iter(shared)
      args = [next(per) if p else next(common) for p in per_call]
      return [tf.tanh(tf.einsum(equation, *args))]

    before = len(_Einsums(graph))
    (vectorized,) = vectorized_stages._VectorizedMap(  # pylint: disable=protected-access
        OneCall, stacked, CALLS)
    new = _Einsums(graph)[before:]
    looped = tf.stack([
        OneCall([x[c] for x in stacked])[0] for c in range(CALLS)])
    cotangent = tf.constant(rng.uniform(-1, 1, looped.shape.as_list()),
                            tf.float32)
    grads = tf.gradients(vectorized, operands, cotangent)
    looped_grads = tf.gradients(looped, operands, cotangent)
    with sessions.AsBuilt() as sess:
      got, want, g, w = sess.run([vectorized, looped, grads, looped_grads])
  # The einsums made (the one-call trace's, the vectorized one): all of the
  # one call's ranks where the call axis was merged, one with more where
  # the call axis is an operand's own.
  ranks = {op.inputs[0].shape.rank + op.inputs[1].shape.rank for op in new}
  plain = sum(len(s) for s in shapes)
  assert (ranks == {plain}) == merges, (ranks, plain)
  close.AssertClose(got, want, close.FLOAT32_TIGHT, 'outputs')
  close.AssertClose(g, w, close.FLOAT32_TIGHT, 'gradients')
