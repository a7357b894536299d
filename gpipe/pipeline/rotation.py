"""RotateStages: how the stages hand their work on, each to the next.

    [ y0 | y1 | y2 ]  --RotateStages-->  [ y2 | y0 | y1 ]   slot s <- slot s - 1

The one op that moves data between the stages: the rotating buffer's
hand-off in every iteration (gpipe.pipeline.iteration), the input and
output streams' columns (gpipe.pipeline.streamed_io) and, in the opposite
direction, the 1f1b backward wave's gradients. On a split stage dim a
rotation is one collective-permute, and so is its gradient (the opposite
rotation).

When the buffer's rotation runs is the schedule's hop (gpipe.schedule):
HandoffFor gives the loops an ImmediateHandoff (rotated after the calls
that made it, taken in the next iteration) or, with delayed sends, a
DelayedHandoff (rotated during the next iteration, beside its calls).
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


def HandoffFor(schedule, place, shift=1):
  """The hand-off of the schedule's hop: each stage's output to the stage
  `shift` on (-1: the 1f1b backward wave's gradients, one stage back)."""
  kind = DelayedHandoff if schedule.delayed_sends else ImmediateHandoff
  return kind(place, shift)


class ImmediateHandoff:
  """Hop 1: what the stages made in iteration i, rotated after their calls,
  is what they take in iteration i + 1. The loop carries [S, ...] per
  buffer leaf: the next iteration's stage inputs.

      carried  [ y2 | y0 | y1 ]   = rotate(outputs of i)
  """

  def __init__(self, place, shift=1):
    self._place = place
    self._shift = shift

  def Rotate(self, x):
    """[S, ...] -> RotateStages by the hand-off's shift, on its devices."""
    return self._place.SplitStages(
        RotateStages(x, self._shift, self._place.splits_stage_dim))

  def Start(self, first):
    """The carry before iteration 0, from the first stage inputs [S, ...]."""
    return list(first)

  def Ready(self, carried):
    """What the stages take this iteration, [S, ...] per buffer leaf."""
    return list(carried)

  def Next(self, carried, outputs):
    """The carry after an iteration whose stages made `outputs`."""
    del carried
    return [self.Rotate(o) for o in outputs]


class DelayedHandoff(ImmediateHandoff):
  """Hop 2 (delayed sends): what the stages made in iteration i is rotated
  during iteration i + 1, which neither makes nor takes it, and taken in
  i + 2; so the rotation's permute runs beside i + 1's calls. The loop
  carries twice [S, ...] per buffer leaf: the ready ones, then the ones
  in flight (gpipe.schedule: its hop, the picture)::

      iteration i    take ready_i        rotate in_flight_i -> ready_i+1
                     make y_i  ------->  in_flight_i+1
  """

  def Start(self, first):
    return list(first) + list(first)

  def Ready(self, carried):
    return list(carried[:len(carried) // 2])

  def Next(self, carried, outputs):
    in_flight = carried[len(carried) // 2:]
    return [self.Rotate(x) for x in in_flight] + list(outputs)
