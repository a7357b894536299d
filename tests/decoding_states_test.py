"""Where the pipeline keeps per-stage decoding states, and wrong ones refused.

PadMicrobatches puts each stage's state in the slots where the schedule's
table has that stage work on its microbatch; a partitioned decode step
(ExtendStep on 4 virtual devices) keeps each stage's states on its device,
its loop's only communication the buffer's collective-permute; states of
the wrong shape, and unrolled states that are not per-layer lists, raise
errors naming the fix. The decoder is decoding_test.py's.
"""

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
from gpipe import schedule as schedule_lib
from gpipe import sharding
from gpipe.xla import partitioning
from lingvo import compat as tf
from lingvo.core import py_utils
from tests import decoding_test
from tests import sessions

NestedMap = py_utils.NestedMap
_Params = decoding_test.Params
_DIM, _SEQ = decoding_test.DIM, decoding_test.SEQ


# -- Partitioned. --------------------------------------------------------------


@pytest.mark.skipif(not partitioning.IsAvailable(), reason='needs jax')
@pytest.mark.parametrize('circular_repeat', [1, 2])
def test_a_partitioned_decode_step_keeps_states_on_their_stage(
    circular_repeat):
  # 4 stages on 4 virtual devices: the step's only communication in the loop
  # is the buffer's collective-permute; the caches enter and leave split on
  # the stage dim, each device holding its own stage's slots.
  num_stages, num_mb, batch = 4, 4, 8
  with tf.init_scope():
    layer = _Params(num_stages, num_mb, circular_repeat).Set(
        shard_stages_1d=True).Instantiate()
  names = [n for n, _ in layer.theta.FlattenItems()]
  weights = [tf.convert_to_tensor(v).numpy()
             for _, v in layer.theta.FlattenItems()]
  sched = layer.Schedule(num_mb)
  rng = np.random.RandomState(1)
  cache_shape = [sched.num_iterations, num_stages, batch // num_mb, _SEQ,
                 _DIM]
  k, v = (rng.uniform(-1, 1, cache_shape).astype(np.float32) for _ in 'kv')
  x_t = rng.uniform(-1, 1, [batch, _DIM]).astype(np.float32)
  args = weights + [x_t, k, v, np.int32(2)]

  def Step(*flat):
    theta = layer.theta.Pack(list(flat[:len(names)]))
    x, k, v, t = flat[len(names):]
    y, cache = layer.FPropFn(theta, 'ExtendStep', x,
                             padded_per_stage_states=[NestedMap(k=k, v=v)],
                             kwargs_no_batch={'time_step': t})
    return [y, cache.k, cache.v]

  def Partitioned(*flat):
    with sharding.SpmdPartitioning():
      return Step(*flat)

  compiled = tf.function(Step, jit_compile=True, autograph=False)
  expected = [t.numpy() for t in compiled(*[tf.constant(a) for a in args])]
  run = partitioning.RunPartitioned(Partitioned, args, num_stages)
  for got, want in zip(run.outputs, expected):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert run.loops and run.LoopCounts(0) == {'collective-permute': 1}, (
      run.LoopCounts(0))
  assert not {'all-gather', 'all-to-all'} & set(run.Counts())
  num_weights = len(names)
  for shard in run.param_shard_shapes[:num_weights]:
    assert shard[0] == 1  # one stage of every stage-stacked weight
  for shard in (run.param_shard_shapes[num_weights + 1:num_weights + 3] +
                run.output_shard_shapes[1:]):
    assert shard[:2] == (sched.num_iterations, 1), shard


# -- Layout. ------------------------------------------------------------------


@pytest.mark.parametrize('num_stages, num_microbatches, circular_repeat',
                         [(3, 4, 1), (2, 3, 2), (2, 4, 3), (1, 2, 1)])
def test_pad_microbatches_puts_each_state_where_its_stage_works(
    num_stages, num_microbatches, circular_repeat):
  # Slot [i, s] must hold the state of the microbatch stage s works on at
  # iteration i (any repeat), per the schedule's table.
  sched = schedule_lib.Schedule(num_stages, num_microbatches, circular_repeat)
  with tf.Graph().as_default():
    layer = _Params(num_stages, num_microbatches, circular_repeat).Instantiate()
    # state of (microbatch m, stage s) = 10 * m + s
    x = (10 * np.arange(num_microbatches)[:, None] +
         np.arange(num_stages)[None]).astype(np.float32)
    padded = layer.PadMicrobatches(tf.constant(x))
    with sessions.AsBuilt() as sess:
      padded = sess.run(padded)
  assert padded.shape == (sched.num_iterations, num_stages)
  table = sched.Table()
  for i in range(sched.num_iterations):
    for s in range(num_stages):
      if table[i][s] is not None:
        assert padded[i, s] == 10 * table[i][s][0] + s, (i, s)


def test_wrong_state_shape_names_the_fix():
  with tf.Graph().as_default():
    layer = _Params(2, 2, 1).Instantiate()
    x = tf.zeros([4, _DIM])
    bad = NestedMap(k=tf.zeros([2, 2, 2, _SEQ, _DIM]),
                    v=tf.zeros([2, 2, 2, _SEQ, _DIM]))
    with pytest.raises(ValueError, match='PadMicrobatches'):
      layer.FPropFn(layer.theta, 'ExtendStep', x,
                    padded_per_stage_states=[bad],
                    kwargs_no_batch={'time_step': 0})


def test_unrolled_states_must_be_per_layer_lists():
  with tf.Graph().as_default():
    layer = _Params(2, 2, 2, unroll='always').Instantiate()
    cache = layer.body.InitStates(layer.layer_theta(layer.theta, 0, 0), 4)
    with pytest.raises(ValueError, match='list of 4 per-layer states'):
      layer.FPropFn(layer.theta, 'ExtendStep', tf.zeros([4, _DIM]),
                    padded_per_stage_states=[[cache, cache]],
                    kwargs_no_batch={'time_step': 0})


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
