"""The pipeline loop with the reverse backward: T iterations over a rotating
[S, mb, ...] buffer, and a gradient loop over them in reverse.

    for i in 0..T-1:       gpipe.pipeline.iteration.Iterate, DirectStages:
                           read, stage inputs, every stage's call (bubbles
                           masked), rotate; the last stage's outputs kept
                           at the iterations that finish a microbatch
    gradient: i = T-1..0   gpipe.recurrent's loop in reverse, over the
                           buffers the forward iterations kept (what else it
                           stores or recomputes: gpipe.loops.remat)

Which stage works on which microbatch and repeat, and which calls are
bubbles, comes from `gpipe.schedule.Schedule`. With skip_bubbles (one
device) the T iterations run as up to three loops (phases), the first and
last on half the stages. backward_schedule='1f1b' runs
gpipe.pipeline.one_f_one_b instead (the layer chooses:
gpipe.layers.PipelinedLayer._RunLoop).
"""

import functools

import tensorflow as tf

from gpipe.pipeline import loop_spec
from gpipe.pipeline import iteration
from gpipe.pipeline import rotation
from gpipe import recurrent
from gpipe import schedule as schedule_lib
from gpipe import sharding
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap


def RunReverse(spec: loop_spec.LoopSpec, theta, mb_leaves, state_leaves,
               var_values) -> loop_spec.LoopResult:
  """The loop whose gradient runs in reverse (gpipe.recurrent).

  Args:
    spec: the LoopSpec, its remat_policy, skip_bubbles and io_kind decided
      (gpipe.pipeline.loop_choices.Decide).
    theta: the stage-stacked weights, placed, [S, (R,) ...] each.
    mb_leaves: the [M, mb, ...] tensor leaves of the microbatched inputs.
    state_leaves: the [T, S, ...] padded per-stage state leaves.
    var_values: the carried non-trainable values, [S, (R,) ...] each.
  """
  place = spec.placement
  sched = spec.schedule
  io = spec.io_kind(spec)
  # The inputs as the io keeps them: [M, mb, ...] per leaf on every device
  # (WholeIo), or [K, S, mb, ...] streams (StreamedIo).
  held = io.Hold(mb_leaves)
  filler = io.Filler(held)  # the first buffer, [S, mb, ...] per leaf
  # Carried: the buffer, the body's non-trainable variables (see
  # gpipe.pipeline.non_trainable_vars) and with stream_io the streams.
  # Without, the microbatches are read inside the loop, one an iteration
  # (no [T, ...] copy of them). Each iteration's row of the schedule comes
  # in as an input and its aux loss goes out as an extra, summed afterwards:
  # loop-carried scalars are what the partitioner tends to mis-shard. The
  # loop keeps the last stage's output only from the iteration that
  # finishes each microbatch, [M, 1, ...] on the last stage's device (or in
  # its stream), and returns
  # no history of the buffer: the backward loop reads it, nothing else
  # does, so no [T, S, ...] gradient of it is ever made.
  microbatches, streams, undo = io.ReverseLoopParts(held, filler)
  handoff = rotation.HandoffFor(sched, place)
  state = NestedMap(
      buffer=handoff.Start(filler),  # [S, mb, ...] per leaf (delayed: 2)
      vars=[place.SplitStages(tf.stop_gradient(v))
            for v in var_values],  # [S, (R,) ...] per variable
      reading=streams.reading,  # with stream_io: [K, S, mb, ...] per leaf
      writing=streams.writing)  # with stream_io: [K, S, mb, ...] per leaf
  # Read by the iterations, not carried: the weights [S, (R,) ...] and,
  # without stream_io, the microbatches [M, mb, ...] per leaf.
  loop_theta = NestedMap(weights=theta, microbatches=microbatches)
  # Sliced per iteration: the schedule's rows ([T, S] per field: computed
  # once here, not in every iteration) and the per-stage states.
  inputs = NestedMap(
      row=iteration.Tables(sched.Rows()),  # [T, S] per field
      states=[place.SplitStages(x, 1) for x in state_leaves])  # [T, S, ...]
  pieces = []
  for phase in _Phases(spec):
    state, extras = _PhaseLoop(spec, io, handoff, undo, phase, loop_theta,
                               state, _PhaseInputs(inputs, phase))
    pieces.append(extras)
  summaries = {name: tuple(_Concat([e.summaries[name] for e in pieces]))
               for name in pieces[0].summaries}
  return loop_spec.LoopResult(
      outputs=io.Outputs(io.ReverseHeldOutputs(
          _Concat([e.outputs for e in pieces]), state.writing)),
      states=[place.SplitStages(x, 1)
              for x in _Concat([e.states for e in pieces])],
      aux_loss=tf.add_n([tf.reduce_sum(e.aux_loss) for e in pieces]),
      summaries=summaries,
      vars=state.vars)


def _Phases(spec):
  """The loop's phases: one, or where it skips bubbles, the fill and drain
  iterations on the stages that hold their useful calls only
  (Schedule.Phases)."""
  sched = spec.schedule
  if spec.skip_bubbles:
    return sched.Phases()
  return [schedule_lib.Phase(0, sched.num_iterations, 0, sched.num_stages)]


def _PhaseInputs(inputs, phase):
  """The phase's iterations of the loop's [T, ...] inputs."""
  if phase.begin == 0 and phase.end == inputs.row.valid.shape[0]:
    return inputs
  return inputs.Transform(lambda x: x[phase.begin:phase.end])


def _Concat(pieces):
  """Per-phase lists of tensors -> one list, each concatenated along dim 0."""
  if len(pieces) == 1:
    return list(pieces[0])
  return [tf.concat(parts, 0) for parts in zip(*pieces)]


def _PhaseLoop(spec, io, handoff, undo, phase, loop_theta, state0, inputs):
  """The phase's iterations as one loop: (final state, extras).

  Microbatches finish in order (Schedule.OutputIteration grows with the
  microbatch), so a phase finishes a run of k consecutive ones: its outputs
  are [k, S, ...] (a loop keeps at least one; a spare one is dropped).
  """
  # Per iteration, the microbatch the last stage finishes, or -1.
  finished = [row[-1].microbatch if row[-1].last_layer else -1
              for row in spec.schedule.Rows()[phase.begin:phase.end]]
  done = [m for m in finished if m >= 0]
  first = done[0] if done else 0
  kept = recurrent.Kept(tuple(m - first if m >= 0 else -1 for m in finished),
                        max(len(done), 1))
  alike = lambda entries, mark: [mark] * len(entries)
  # The phase's loop takes the weights of its stages only: inside, each
  # weight's gradient is then the body's own dot (deferred where it reads
  # few rows) rather than the gradient of a slice of it.
  stages = iteration.StageRange.Of(phase, spec.schedule.num_stages)
  loop_theta = NestedMap(weights=stages.Narrow(loop_theta.weights),
                         microbatches=loop_theta.microbatches)
  _, final, extras = recurrent.Recurrent(
      loop_theta, state0, inputs,
      functools.partial(_Iteration, spec, io, handoff, phase),
      remat_policy=spec.remat_policy,
      manual_boundary=sharding.ManualBoundary.For(spec.runner.manual_mesh),
      kept_extras={'outputs': kept},
      return_states=False,
      # One device: the weights' gradients summed after the loop where
      # their dots read few rows (more memory, which partitioned is not
      # to spare).
      defer_weight_dots=not spec.placement.splits_stage_dim,
      activation_state=NestedMap(buffer=alike(state0.buffer, True),
                                 vars=alike(state0.vars, False),
                                 reading=alike(state0.reading, True),
                                 writing=alike(state0.writing, False)),
      undo=None if undo is None else recurrent.Undo(
          NestedMap(buffer=alike(state0.buffer, False),
                    vars=alike(state0.vars, False),
                    reading=alike(state0.reading, True),
                    writing=alike(state0.writing, True)), undo))
  if not done:
    extras.outputs = [x[:0] for x in extras.outputs]
  return final, extras


def _Iteration(spec: loop_spec.LoopSpec, io, handoff, phase, loop_theta,
               state, inp):
  """One loop iteration (gpipe.pipeline.iteration.Iterate): the phase's
  stages run on their slots, the others pass their input on."""
  place = spec.placement
  calls = iteration.DirectStages(
      spec, iteration.StageRange.Of(phase, spec.schedule.num_stages),
      loop_theta.weights)
  row = inp.row.Transform(place.ReplicateBookkeeping)  # [S] per field
  iterated = iteration.Iterate(
      calls, io, handoff, row, loop_theta.microbatches, state.buffer,
      state.vars, state.reading, stage_states=inp.states)
  done = iterated.done
  writing, kept = io.ReverseLoopOutputs(state.writing, row, done.outputs)
  new_state = NestedMap(
      buffer=iterated.buffer,  # the handoff's carry
      vars=done.vars,  # [S, (R,) ...] per variable
      reading=iterated.reading, writing=writing)  # the io's
  extras = NestedMap(
      outputs=kept,  # [S or 1, mb, ...] per leaf (none with stream_io)
      aux_loss=place.ReplicateBookkeeping(tf.reduce_sum(done.aux)),  # []
      summaries=done.summaries,  # {name: ([S], [S])}
      states=done.states)  # [S, ...] per state leaf
  return new_state, extras
