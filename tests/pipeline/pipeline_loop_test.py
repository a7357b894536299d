"""gpipe.pipeline.pipeline_loop with a stand-in for stages: order checks only.

A fake runner computes layer l on microbatch m as y = w * x + (l + 1) and
reports the microbatch id as its aux loss; the reference is a plain Python
loop over the layers for each microbatch. No body layer is involved, so a
failure here is the loop's: schedule, rotation, stage-0 reads, masking.
"""

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import nest
from gpipe.pipeline import iteration
from gpipe.pipeline import loop_io
from gpipe.pipeline import loop_spec
from gpipe.pipeline import pipeline_loop
from gpipe.pipeline import repeats
from gpipe.pipeline import rotation
from gpipe.pipeline import stage_runners
from gpipe import schedule as schedule_lib
from gpipe import sharding
from lingvo.core import py_utils
from tests import sessions

ROWS, DIM = 2, 3


class _FakeRunner(stage_runners.StageRunner):
  """Every stage at once, in NumPy-checkable arithmetic."""

  def CallStages(self, spec, theta, it):
    return _FakeRun(spec, theta, it)


def _FakeRun(spec, theta, it):
  (x,) = it.args
  num_stages = spec.schedule.num_stages
  layer = it.repeat_ids * num_stages + tf.range(num_stages)
  y = theta.w * x + tf.cast(layer + 1, x.dtype)[:, None, None]
  return stage_runners.RunnerResult(
      outputs=(y,), aux=tf.cast(it.mb_ids, tf.float32),
      summaries=[('mb', tf.cast(it.mb_ids, tf.float32),
                  tf.ones([num_stages]))],
      vars=[])


def _Spec(sched, x_mb, remat_policy='recompute'):
  return loop_spec.LoopSpec(
      schedule=sched, body=None, fn_name='FProp', runner=_FakeRunner(),
      repeats=repeats.RepeatsFor(sched.circular_repeat),
      placement=sharding.StagePlacement(sched.num_stages),
      args=nest.TensorLeaves((x_mb,)), states=[], mb_kwargs={},
      kwargs_no_batch={}, base_seed=tf.constant(0, tf.int64),
      global_step=None, var_names=(),
      remat_policy=remat_policy, io_kind=loop_io.WholeIo)


@pytest.mark.parametrize('s,m,r,store', [
    (1, 1, 1, 'recompute'), (2, 3, 1, 'save_dots'), (3, 4, 2, 'recompute'),
    (2, 5, 3, 'save_all'), (4, 2, 2, 'save_dots'), (4, 6, 1, 'save_all')])
def test_loop_runs_every_layer_on_every_microbatch_in_order(s, m, r, store):
  sched = schedule_lib.Schedule(s, m, r)
  x_np = np.random.RandomState(0).uniform(-1, 1, [m, ROWS, DIM])
  with tf.Graph().as_default():
    x = tf.constant(x_np, tf.float32)
    w = tf.constant(0.9)
    res = pipeline_loop.RunReverse(_Spec(sched, x, store),
                                   py_utils.NestedMap(w=w), [x], [], [])
    (out,) = res.outputs
    want = []
    for mb in range(m):
      h = x[mb]
      for layer in range(s * r):
        h = w * h + (layer + 1)
      want.append(h)
    want = tf.stack(want)
    grads = [tf.convert_to_tensor(g)
             for g in tf.gradients(tf.reduce_sum(out * out), [w, x])]
    want_grads = [tf.convert_to_tensor(g) for g in
                  tf.gradients(tf.reduce_sum(want * want), [w, x])]
    weighted, weight = res.summaries['mb']
    with sessions.AsBuilt() as sess:
      got = sess.run(dict(out=out, want=want, grads=grads,
                          want_grads=want_grads, aux=res.aux_loss,
                          weighted=weighted, weight=weight))
  np.testing.assert_allclose(got['out'], got['want'], rtol=1e-6)
  for g, wg in zip(got['grads'], got['want_grads']):
    np.testing.assert_allclose(g, wg, rtol=1e-5)
  # Bubbles add nothing: each microbatch is counted once per layer.
  assert got['aux'] == s * r * sum(range(m))
  assert got['weighted'].shape == (sched.num_iterations, s)
  np.testing.assert_array_equal(got['weight'].sum(axis=0), [m * r] * s)


@pytest.mark.parametrize('split', [True, False])
@pytest.mark.parametrize('shift', [1, -1, 2])
def test_rotate_stages_is_a_roll_and_its_gradient_the_opposite_roll(
    split, shift):
  x_np = np.arange(12.0, dtype=np.float32).reshape(4, 3)
  cot = np.random.RandomState(1).normal(size=[4, 3]).astype(np.float32)
  with tf.Graph().as_default():
    x = tf.constant(x_np)
    y = rotation.RotateStages(x, shift, split)
    (g,) = tf.gradients(y, [x], grad_ys=[cot])
    with sessions.AsBuilt() as sess:
      y_v, g_v = sess.run((y, g))
  np.testing.assert_array_equal(y_v, np.roll(x_np, shift, axis=0))
  np.testing.assert_array_equal(g_v, np.roll(cot, -shift, axis=0))


def test_mask_bubbles_passes_the_input_through_without_gradient():
  with tf.Graph().as_default():
    out = tf.constant([[1.0], [2.0], [3.0]])
    stage_in = tf.constant([[10.0], [20.0], [30.0]])
    valid = tf.constant([True, False, True])
    y = iteration.MaskBubbles(valid, out, stage_in)
    g_out, g_in = tf.gradients(y, [out, stage_in])
    with sessions.AsBuilt() as sess:
      y_v, g_out_v = sess.run((y, g_out))
  np.testing.assert_array_equal(y_v, [[1.0], [20.0], [3.0]])
  np.testing.assert_array_equal(g_out_v, [[1.0], [0.0], [1.0]])
  assert g_in is None


@pytest.mark.parametrize('split', [True, False])
@pytest.mark.parametrize('s,m,r', [(3, 4, 1), (2, 3, 2)])
def test_stage_inputs_follow_the_schedule(s, m, r, split):
  """Stage 0 reads the fresh input where the schedule says; the gradient
  goes to the fresh input from the slots that read it, to the buffer from
  the others (both forms: split over devices or whole)."""
  sched = schedule_lib.Schedule(s, m, r)
  cot = np.random.RandomState(2).normal(size=[s, 2]).astype(np.float32)
  with tf.Graph().as_default():
    rotated = tf.constant(np.arange(2 * s, dtype=np.float32).reshape(s, 2))
    fresh = tf.constant([-1.0, -2.0])
    # Iteration i's row of the loop's tables says where stage 0 reads.
    got = []
    for i in range(sched.num_iterations):
      y = loop_io.WithFreshMicrobatch(
          iteration.RowAt(iteration.Tables(sched.Rows()),
                          tf.constant(i)).reads, rotated, fresh,
          split)
      got.append((y,) + tuple(tf.gradients(y, [fresh, rotated],
                                           grad_ys=[cot])))
    with sessions.AsBuilt() as sess:
      got = sess.run(got)
  for i, (value, d_fresh, d_rotated) in enumerate(got):
    want = np.arange(2 * s, dtype=np.float32).reshape(s, 2)
    want_d_rotated = cot.copy()
    want_d_fresh = np.zeros(2, np.float32)
    if sched.StageZeroReadsInput(i):
      want[0] = [-1.0, -2.0]
      want_d_rotated[0] = 0.0
      want_d_fresh = cot[0]
    np.testing.assert_array_equal(value, want, err_msg=str(i))
    np.testing.assert_array_equal(d_rotated, want_d_rotated, err_msg=str(i))
    np.testing.assert_array_equal(d_fresh, want_d_fresh, err_msg=str(i))
