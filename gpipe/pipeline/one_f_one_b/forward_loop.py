"""The 1f1b forward loop: T iterations that keep no activation.

    for i in 0..T-1:   gpipe.pipeline.iteration.Iterate on the StageCell's
                       forward (gpipe.pipeline.one_f_one_b.cell); the
                       outputs written by the io, the aux loss, summaries
                       and states kept per iteration

Its gradient is not TensorFlow's: gpipe.pipeline.one_f_one_b.pipelined
makes this loop one tf.custom_gradient whose gradient is the gradient loop.
"""

import tensorflow as tf

from gpipe.loops import tensor_lists
from gpipe.loops import while_loops
from gpipe.pipeline.one_f_one_b import cell as cell_lib
from gpipe.pipeline import iteration
from gpipe.pipeline import rotation
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap

# The name scope of the forward loop (the planner tells it from the
# gradient loops by it).
FORWARD_LOOP = 'one_f_one_b_forward'


def ForwardLoop(cell: cell_lib.StageCell, io, theta, held, state_leaves,
                var_values, captures):
  """The T forward iterations, keeping the outputs, the aux loss, the
  summaries and states per iteration, and no activation.

  Args:
    cell: the stage work, traced with its gradient.
    io: the loop io (gpipe.pipeline.loop_io.LoopIo).
    theta: the stage-stacked weights, [S, (R,) ...].
    held: the inputs as io.Hold made them.
    state_leaves: the [T, S, ...] padded per-stage state leaves.
    var_values: the carried non-trainable values, [S, (R,) ...].
    captures: the cell's captured tensors.

  Returns:
    NestedMap(outputs (as io.Outputs takes them), aux [], summaries
    {name: ([T, S], [T, S])}, states [T, S, ...], vars [S, (R,) ...]).
  """
  spec, place = cell.spec, cell.spec.placement
  t = spec.schedule.num_iterations
  states = [place.SplitStages(x, 1) for x in state_leaves]  # [T, S, ...]
  filler = cell.state0.buffer
  extras_spec = cell.graph.extras_spec
  bound = cell.Bind(theta, captures)
  handoff = rotation.HandoffFor(spec.schedule, place)
  carry = NestedMap(
      buffer=handoff.Start(filler),  # [S, mb, ...] per leaf (delayed: 2)
      vars=[place.SplitStages(v) for v in var_values],  # [S, (R,) ...]
      reading=io.StartReading(held),  # the io's ([] unless streamed)
      writing=io.StartWriting(filler),  # the io's
      # TensorLists of T entries, summed or stacked after the loop: a
      # loop-carried scalar is what the partitioner tends to give the
      # body's manual sharding.
      aux=tensor_lists.Reserve(tf.TensorSpec([], tf.float32), t),  # []
      summaries=tf.nest.map_structure(  # ([S], [S]) per name
          lambda s: tensor_lists.Reserve(s, t), extras_spec.summaries),
      states=[tensor_lists.Reserve(s, t)  # [S, ...] per state leaf
              for s in extras_spec.states])

  def Body(i, carry):
    row = iteration.RowAt(cell.tables, i, place)  # [S] per field
    iterated = iteration.Iterate(
        bound, io, handoff, row, held, carry.buffer, carry.vars,
        carry.reading, stage_states=[x[i] for x in states])
    done = iterated.done
    return i + 1, NestedMap(
        buffer=iterated.buffer, vars=done.vars, reading=iterated.reading,
        # The last stage's outputs, where it finishes a microbatch.
        writing=io.Write(carry.writing, row, done.outputs),
        aux=tensor_lists.SetEntry(carry.aux, i, place.ReplicateBookkeeping(
            tf.reduce_sum(done.aux))),
        summaries=tf.nest.map_structure(
            lambda l, v: tensor_lists.SetEntry(l, i, v),
            carry.summaries, done.summaries),
        states=[tensor_lists.SetEntry(l, i, v)
                for l, v in zip(carry.states, done.states)])

  with tf.name_scope(FORWARD_LOOP):
    _, final = while_loops.WhileLoop(Body, [tf.constant(0), carry], t)
  return NestedMap(
      outputs=io.FinishWriting(final.writing, filler),
      aux=place.ReplicateBookkeeping(tf.reduce_sum(
          tensor_lists.Stack(final.aux, tf.TensorSpec([], tf.float32), t))),
      summaries=tf.nest.map_structure(
          lambda l, s: place.SplitStages(tensor_lists.Stack(l, s, t), 1),
          final.summaries, extras_spec.summaries),
      states=[place.SplitStages(tensor_lists.Stack(l, s, t), 1)
              for l, s in zip(final.states, extras_spec.states)],
      vars=final.vars)
