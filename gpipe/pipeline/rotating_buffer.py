"""The pipeline's [S, ...] buffer: one iteration over it, and its ops, each
with its gradient.

One iteration, S = 3 (slot s holds what stage s - 1 produced; slot 0 what
the last stage produced, which a linear pipeline drops and a circular one
feeds into its next repeat)::

    buffer   [ y2 | y0 | y1 ]  --StageInputs: stage 0 maybe reads afresh-->
    stages   [ y0'| y1'| y2']  --MaskBubbles: bubbles pass their input-->
    rotated  [ y2'| y0'| y1']  --RotateStages--> next iteration's buffer

`Step` is that iteration, the one definition the reverse loop
(gpipe.pipeline.pipeline_loop), the 1f1b forward loop and the 1f1b gradient
loop's forward wave (gpipe.pipeline.one_f_one_b) run. On a split stage dim
a rotation is one collective-permute, and so is its gradient (the opposite
rotation); the other ops are per stage, on each device's own slot.
"""

import dataclasses
from typing import Any, Callable, List, Optional

import tensorflow as tf

from lingvo.core import py_utils


@dataclasses.dataclass(frozen=True)
class Stepped:
  """One iteration over the buffer (Step); every list has a tensor per
  buffer leaf.

  Attributes:
    stage_in: [S, mb, ...] what each stage ran on.
    ran: what run_stages returned besides the outputs.
    outputs: [S, mb, ...] what each stage produced (a bubble: its input).
    buffer: [S, mb, ...] the next iteration's buffer, the outputs rotated.
    reading: the loop io's input state after this iteration's read.
    writing: the loop io's output state after this iteration's write (None
      where nothing is written).
  """
  stage_in: List[tf.Tensor]
  ran: Any
  outputs: List[tf.Tensor]
  buffer: List[tf.Tensor]
  reading: List[tf.Tensor]
  writing: Optional[List[tf.Tensor]]


def Step(io, iteration, rows, native, reading, buffer,
         run_stages: Callable, writing=None) -> Stepped:
  """One iteration of the pipeline over its buffer.

  Args:
    io: the loop's inputs and outputs (a gpipe.pipeline.loop_io.LoopInputs; to write, a LoopIo).
    iteration: int32 scalar, the iteration's index i.
    rows: the schedule's table row i (gpipe.pipeline.stage_step.Tables),
      [S] entries each, replicated.
    native: the loop's inputs as io.ToNative made them.
    reading: io's input state (streams; [] where there are none).
    buffer: [S, mb, ...] per leaf, last iteration's outputs rotated.
    run_stages: stage inputs ([S, mb, ...] per leaf) -> (outputs [S, mb,
      ...] per leaf, bubbles masked; anything else the stages made).
    writing: io's output state, or None: the outputs are not written.
  """
  place = io.placement
  fresh, reading = io.Read(native, reading, iteration)  # stage 0's inputs
  stage_in = [place.SplitStages(io.StageInputs(rows.reads,
                                               place.SplitStages(b), f))
              for b, f in zip(buffer, fresh)]  # [S, mb, ...]
  outputs, ran = run_stages(stage_in)  # [S, mb, ...]
  rotated = [place.SplitStages(RotateStages(o, split=place.splits_stage_dim))
             for o in outputs]  # [S, mb, ...]: slot s <- stage s - 1
  if writing is not None:  # the last stage's, where it finishes one
    writing = io.Write(writing, iteration, outputs)
  return Stepped(stage_in=stage_in, ran=ran, outputs=outputs, buffer=rotated,
                 reading=reading, writing=writing)


# The stages' inputs: the rotated buffer, stage 0 maybe a fresh input.
#
# The carried buffer is last iteration's outputs already rotated by one
# stage (see RotateStages): slot s holds what stage s - 1 produced, and slot
# 0 what the last stage produced. Stage 0 takes the fresh microbatch
# whenever the schedule says it reads one: always when linear (the wrapped
# slot is dropped), in the first S iterations of each R * S block when
# circular (otherwise it keeps the wrapped slot: the microbatch's next
# repeat). `reads` ([S] bools, the schedule's StageRow) says where. The
# loop io says which of the two the fresh input is (its StageInputs).


def WithFreshColumn(reads, rotated, column):
  """rotated [S, mb, ...] with slot s replaced by column[s] where reads[s]:
  each stage has its own fresh entry (a stream's column, [S, mb, ...])."""
  mask = tf.reshape(reads, [-1] + [1] * (rotated.shape.rank - 1))
  return tf.where(mask, column, rotated)


def WithFreshMicrobatch(reads, rotated, microbatch, split):
  """rotated [S, mb, ...] with slot s replaced by `microbatch` [mb, ...]
  (every stage's the same) where reads[s]. `split`: whether the stage dim
  is split over devices (the placement's splits_stage_dim)."""
  return _SelectFresh(reads, microbatch, rotated, split)


def _SelectFresh(reads, fresh, rotated, split):
  """Slot s of `rotated` ([S, ...]) replaced by `fresh` where reads[s].

  Split over devices, the gradient is written with masks and a contraction
  over the stage dim (an all-reduce), not TensorFlow's: its sum over the
  broadcast stage dim is a reduce whose zero initial value XLA's lowering
  shares with the stage body's own reductions inside the manual-sharding
  region, and the SPMD partitioner then aborts resharding it (seen with
  1-row microbatches). With the stage dim whole that region does not exist
  and the sum is a plain reduce: XLA:CPU runs the contraction over a
  few stages as a dot, which is cheap
  (docs/benchmarks.md#measured-behind-the-codes-choices).
  """

  @tf.custom_gradient
  def Select(fresh, rotated):
    mask = tf.reshape(reads, [-1] + [1] * (rotated.shape.rank - 1))
    shape = py_utils.GetShape(rotated)

    def Grad(dy):
      kept = tf.cast(tf.logical_not(mask), dy.dtype)
      if split:
        taken = tf.tensordot(tf.cast(reads, dy.dtype), dy, axes=[[0], [0]])
      else:
        taken = tf.reduce_sum(tf.where(mask, dy, tf.zeros_like(dy)), 0)
      return taken, dy * kept

    return tf.where(mask, tf.broadcast_to(fresh[None], shape), rotated), Grad

  return Select(fresh, rotated)


def RotateStages(x, shift=1, split=True):
  """[S, ...] -> slot s gets slot s - shift (mod S): by default each stage
  hands its slot to the next, the last to stage 0; shift=-1 hands each to
  the one before (stage 0's to the last).

  Along a split stage dim (`split`, the placement's splits_stage_dim) this
  is a concat of two slices, exactly one collective-permute once
  partitioned, and so is its gradient, the opposite rotation (written out:
  TensorFlow's gradient of the concat of two slices is two permutes). A
  shift that pads a zero in instead becomes an all-to-all. With the stage
  dim whole (one device) it is a gather of the slots in their new order:
  XLA:CPU fuses a concat of slices with the elementwise ops that make its
  input into one loop that picks an operand per element, slower than a
  gather, which stays a copy of whole slots
  (docs/benchmarks.md#measured-behind-the-codes-choices).
  """
  num_stages = x.shape.as_list()[0]
  shift %= num_stages
  if shift == 0:
    return x
  if split:
    return _ConcatRotate(x, shift)
  return _GatherRotate(x, shift)


def _ConcatRotate(x, shift):

  @tf.custom_gradient
  def Rotate(x):

    def Grad(dy):
      return tf.concat([dy[shift:], dy[:shift]], axis=0)

    return tf.concat([x[-shift:], x[:-shift]], axis=0), Grad

  return Rotate(x)


def _GatherRotate(x, shift):
  """RotateStages on a whole stage dim; the gradient is the opposite
  gather (TensorFlow's own would scatter-add into zeros)."""
  num_stages = x.shape.as_list()[0]
  order = [(s - shift) % num_stages for s in range(num_stages)]
  back = [(s + shift) % num_stages for s in range(num_stages)]

  @tf.custom_gradient
  def Rotate(x):
    return tf.gather(x, order), lambda dy: tf.gather(dy, back)

  return Rotate(x)


def SelectStages(valid, new, old):
  """Per stage slot: new where the stage was valid, old on bubbles."""
  mask = tf.reshape(valid, [-1] + [1] * (new.shape.rank - 1))
  return tf.where(mask, new, old)


def MaskBubbles(valid, out, stage_in):
  """Bubble slots of the [S] stage outputs pass their input through instead.

  Bubbles never compute on zeros: the loop starts from real data
  (microbatch.BubbleFiller) and a bubble hands its own input on, so every
  bubble runs the body on some real microbatch's values. A body that is
  finite on real data (but, say, divides by its input) thus stays finite on
  bubbles, and the select's zero cotangent times a finite local derivative
  keeps the gradients finite too. The pass-through is cut from the gradient.
  """
  mask = tf.reshape(valid, [-1] + [1] * (out.shape.rank - 1))
  return tf.where(mask, out, tf.stop_gradient(stage_in))


def LastStageOutputs(finished, place):
  """[M, S, ...] stage outputs of the iterations that finish each
  microbatch -> [M, ...]: the last stage's slot.

  Taken as a sum over the stage dim of the slot masked (exact: the other
  slots add zeros), which partitions into one all-reduce from the devices'
  own slots; a slice of the last slot would first move it to device 0.
  The gradient is the slot's gradient placed in the last slot of zeros,
  split over the stages like the outputs: each device builds only its own
  [M, 1, ...] part (a plain slice's gradient, a pad of the replicated
  gradient, would be built whole, [M, S, ...], on every device).
  """
  finished = place.SplitStages(finished, 1)
  num_stages = finished.shape.as_list()[1]
  is_last = tf.reshape(tf.equal(tf.range(num_stages), num_stages - 1),
                       [1, num_stages] + [1] * (finished.shape.rank - 2))

  @tf.custom_gradient
  def LastSlot(x):

    def Grad(dy):
      return place.SplitStages(
          tf.where(is_last, dy[:, None], tf.zeros([], dy.dtype)), 1)

    return tf.reduce_sum(tf.where(is_last, x, tf.zeros([], x.dtype)),
                         axis=1), Grad

  return LastSlot(finished)
