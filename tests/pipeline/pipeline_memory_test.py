"""The pipeline's own per-device memory, as XLA's buffer assignment has it.

A whole training step of a pipelined layer whose body is nearly free (a
16-wide dense layer on microbatches of 32 rows: its weights are half a
microbatch's activation) is planned for 4 devices (gpipe.plan: lowered
from shapes, partitioned by XLA's SPMD partitioner, compiled). What is
left is the pipeline's own footprint, against one microbatch's activation
`mb` ([32, 16] float32) and the schedule's T iterations:

  * the largest buffer on a device is at most T x mb: each device's share
    of the stored history (its own stage's buffer slot per iteration, and
    under save_all each stored activation alike); no buffer is
    [T, S, ...] or [M, S, ...] whole on a device;
  * all temporaries together are at most that history (once per stored
    tensor) plus six batches' worth (the batch is M x mb: the layer's
    input and output, the loss and their gradients).

A loop that kept the inputs as a [T, ...] copy on every device, or built
the gradient of its [T, S, ...] history whole (the output slice's
gradient), exceeds both bounds (S x T x mb for the latter).
"""

import pytest

import gpipe  # pylint: disable=unused-import
from gpipe import layers
from gpipe import plan
from gpipe.plan import roofline
from gpipe.xla import hlo_text
from gpipe.xla import partitioning
from tests import reference_bodies

NUM_STAGES = 4
NUM_MICROBATCHES = 8
BATCH = 256
DIM = 16
MB_BYTES = BATCH // NUM_MICROBATCHES * DIM * 4


def _Report(circular_repeat, remat_policy):
  if not partitioning.IsAvailable():
    pytest.fail('jax and jaxlib are needed (they are in the test extra).')
  p = layers.PipelinedLayer.Params().Set(
      name='stack', num_stages=NUM_STAGES,
      single_stage_body=reference_bodies.DenseBody.Params().Set(dim=DIM),
      num_microbatches=NUM_MICROBATCHES, shard_stages_1d=True,
      circular_repeat=circular_repeat, unroll='never')
  result = plan.MakePlan(
      plan.LayerTarget(p, [(BATCH, DIM)]),
      [plan.Candidate(NUM_MICROBATCHES, circular_repeat, remat_policy)],
      NUM_STAGES, roofline.CHIPS['v5e'], 16 * 2**30)
  assert not result.skipped, result.skipped
  return result.reports[0]


@pytest.mark.parametrize('circular_repeat,remat_policy,stored_per_iteration',
                         [(1, 'recompute', 1), (2, 'save_all', 2)])
def test_the_pipelines_own_buffers_are_bounded_per_device(
    circular_repeat, remat_policy, stored_per_iteration):
  report = _Report(circular_repeat, remat_policy)
  iterations = report.schedule.num_iterations
  buffers = hlo_text.LargestBuffers(report.compiled.hlo, 1000)
  largest, largest_type, largest_op = buffers[0]
  assert largest <= iterations * MB_BYTES, (
      f'{largest / MB_BYTES:.1f} microbatch activations in {largest_type} '
      f'({largest_op}); at most T = {iterations}')
  for _, hlo_type, op in buffers:
    for shape in hlo_text.ShapesOf(hlo_type):
      whole_stage_dim = (len(shape) > 2 and shape[1] == NUM_STAGES and
                         shape[0] in (iterations, NUM_MICROBATCHES))
      assert not whole_stage_dim, (hlo_type, op)
  temp = report.per_device_bytes['temp']
  bound = (stored_per_iteration * iterations +
           6 * NUM_MICROBATCHES) * MB_BYTES
  assert temp <= bound, (temp / MB_BYTES, bound / MB_BYTES)
  # The rotation is still one collective-permute per iteration each way.
  forward, backward = report.LoopSummaries()
  for loop in (forward, backward):
    assert loop['collectives']['collective-permute']['count'] == 1, loop
  assert 'all-to-all' not in forward['collectives'], forward


def test_1f1b_with_stream_io_holds_a_bounded_share_whatever_m():
  """backward_schedule='1f1b' with stream_io: a device holds its 1/S of
  the inputs, outputs and their gradients (4/S of the batch), rings of
  2 R S - 1 stage inputs and a few microbatches in flight (2 R S + 8 in
  all), plus what the weights' gradients and update need; twice the
  microbatches (half their size) hold no more. (A batch of 1024 rows of 64: microbatches of 4 and
  8 KiB, large beside the step's few fixed buffers.)"""
  batch, dim = 1024, 64
  batch_bytes = batch * dim * 4
  weights = (dim * dim + dim) * 4  # one stage's, per repeat
  temps = {}
  for r in (1, 2):
    p = layers.PipelinedLayer.Params().Set(
        name='stack', num_stages=NUM_STAGES,
        single_stage_body=reference_bodies.DenseBody.Params().Set(dim=dim),
        num_microbatches=NUM_MICROBATCHES, shard_stages_1d=True,
        circular_repeat=r, unroll='never', backward_schedule='1f1b',
        stream_io=True)
    result = plan.MakePlan(
        plan.LayerTarget(p, [(batch, dim)]),
        [plan.Candidate(m, r) for m in (NUM_MICROBATCHES,
                                        2 * NUM_MICROBATCHES)],
        NUM_STAGES, roofline.CHIPS['v5e'], 16 * 2**30)
    assert not result.skipped, result.skipped
    for report in result.reports:
      m = report.schedule.num_microbatches
      mb = batch_bytes // m
      ring = 2 * r * NUM_STAGES - 1
      assert report.stored_activation_bytes == ring * mb
      temp = report.per_device_bytes['temp']
      bound = (4 * batch_bytes // NUM_STAGES +
               (2 * r * NUM_STAGES + 8) * mb + 4 * r * weights)
      if r > 1:
        # XLA:CPU builds the masked ring a read sums (rings.Ring),
        # which outgrows the 8 spare microbatches when R S is large.
        bound += ring * mb
      assert temp <= bound, (r, m, temp / mb, bound / mb)
      temps[(r, m)] = temp
    assert temps[(r, 2 * NUM_MICROBATCHES)] <= temps[(r, NUM_MICROBATCHES)]


def test_a_bfloat16_ring_keeps_its_entries_in_16_bits():
  """Under XLA a 1f1b ring of bfloat16 entries (gpipe.pipeline.one_f_one_b
  .rings.Ring) keeps them as their 16-bit patterns: what a read picks is the
  entry written, bit for bit, and XLA:CPU's compiled ring is 16-bit, not
  the float32 it would widen bfloat16 to."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from gpipe.pipeline.one_f_one_b import rings  # pylint: disable=g-import-not-at-top
  from gpipe import sharding  # pylint: disable=g-import-not-at-top
  stages, size, width = 3, 5, 7
  rng = np.random.RandomState(0)
  entries = rng.normal(size=[size, stages, width]).astype(np.float32)

  def WriteAndRead(values):
    ring = rings.Ring(tf.TensorSpec([stages, width], tf.bfloat16), size,
                      sharding.StagePlacement(stages))
    assert ring.xla
    held = ring.Empty()
    for slot in range(size):
      held = ring.Write(held, slot, tf.cast(values[slot], tf.bfloat16))
    return held, ring.Read(held, tf.constant([4, 0, 2]))

  run = tf.function(WriteAndRead, jit_compile=True)
  held, read = run(tf.constant(entries))
  assert held.dtype == tf.uint16 and read.dtype == tf.bfloat16
  want = entries.astype(tf.bfloat16.as_numpy_dtype)
  np.testing.assert_array_equal(read.numpy(), want[[4, 0, 2], range(stages)])
  hlo = run.experimental_get_compiler_ir(tf.constant(entries))('optimized_hlo')
  assert f'u16[{stages},{size},{width}]' in hlo
  assert f'f32[{stages},{size},{width}]' not in hlo
