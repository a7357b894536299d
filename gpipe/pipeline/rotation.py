"""RotateStages: how the stages hand their work on, each to the next.

    [ y0 | y1 | y2 ]  --RotateStages-->  [ y2 | y0 | y1 ]   slot s <- slot s - 1

The one op that moves data between the stages: the rotating buffer's
hand-off in every iteration (gpipe.pipeline.iteration), the input and
output streams' columns (gpipe.pipeline.streamed_io) and, in the opposite
direction, the 1f1b backward wave's gradients. On a split stage dim a
rotation is one collective-permute, and so is its gradient (the opposite
rotation).
"""

import tensorflow as tf


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
