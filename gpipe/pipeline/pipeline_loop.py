"""The pipeline loop with the reverse backward: T iterations over a rotating
[S, ...] buffer, and a gradient loop over them in reverse.

One FProp call of a pipelined layer, in order:

    split     inputs [B, ...] -> [M, mb, ...]              (gpipe.microbatch)
    loop      for i in 0..T-1:                                  (this module)
                one step of the buffer (gpipe.pipeline.rotating_buffer.Step):
                stage inputs [S, mb, ...] = rotated buffer, stage 0 maybe
                microbatch i; every stage runs once, bubbles masked
                (gpipe.pipeline.stage_step); buffer rotated by one stage
    reassemble  last stage's outputs -> [M, mb, ...] -> [B, ...]

Which stage works on which microbatch and repeat, and which slots are
bubbles, comes from `gpipe.schedule.Schedule`. The loop runs through
`gpipe.recurrent`, whose gradient is a second loop in reverse order over
the buffer each iteration kept (what else it stores or recomputes:
`gpipe.loops.remat`). backward_schedule='1f1b' runs gpipe.pipeline.one_f_one_b
instead (the layer chooses: gpipe.layers.PipelinedLayer's RunLoop).
"""

import tensorflow as tf

from gpipe.loops import compiled_loops
from gpipe.pipeline import loop_spec
from gpipe.pipeline import rotating_buffer
from gpipe.pipeline import stage_step
from gpipe import recurrent
from gpipe import schedule as schedule_lib
from gpipe import sharding
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap


def Run(spec: loop_spec.LoopSpec, theta, mb_leaves, state_leaves,
        var_values) -> loop_spec.LoopResult:
  """The loop whose gradient runs in reverse (gpipe.recurrent).

  Args:
    spec: the LoopSpec, its remat_policy decided (WithRematPolicy).
    theta: the stage-stacked weights, placed, [S, (R,) ...] each.
    mb_leaves: the [M, mb, ...] tensor leaves of the microbatched inputs.
    state_leaves: the [T, S, ...] padded per-stage state leaves.
    var_values: the carried non-trainable values, [S, (R,) ...] each.
  """
  place = spec.placement
  sched = spec.schedule
  io = loop_spec.Io(spec)
  native = io.ToNative(mb_leaves)
  filler = io.Filler(native)
  # Carried: the buffer, the body's non-trainable variables (see
  # gpipe.pipeline.non_trainable_vars) and with stream_io the streams. Without, the
  # microbatches are read inside the loop, row by row (no [T, ...] copy of
  # them). The iteration index comes in as an input and each iteration's
  # aux loss goes out as an extra, summed afterwards: loop-carried scalars
  # are what the partitioner tends to mis-shard. The loop keeps the last
  # stage's output only from the iteration that finishes each microbatch,
  # [M, 1, ...] on the last stage's device (or in its stream), and returns
  # no history of the buffer: the backward loop reads it, nothing else
  # does, so no [T, S, ...] gradient of it is ever made.
  read_by_row, streams, undo = io.ReverseLoopParts(native, filler)
  state = NestedMap(
      buffer=filler,
      vars=[place.SplitStages(tf.stop_gradient(v)) for v in var_values],
      reading=streams.reading, writing=streams.writing)
  loop_theta = NestedMap(weights=theta, microbatches=read_by_row)
  # What each stage does in each iteration, a [T, S] table row per
  # iteration: computed once here, not in every iteration.
  inputs = NestedMap(
      iteration=tf.range(sched.num_iterations, dtype=tf.int32),
      rows=stage_step.StageTables(sched),
      states=[place.SplitStages(x, 1) for x in state_leaves])
  pieces = []
  for phase in _Phases(spec, theta, mb_leaves):
    state, extras = _RunPhase(spec, io, undo, phase, loop_theta, state,
                              _PhaseRows(inputs, phase))
    pieces.append(extras)
  summaries = {name: tuple(_Concat([e.summaries[name] for e in pieces]))
               for name in pieces[0].summaries}
  return loop_spec.LoopResult(
      outputs=io.Outputs(io.ReverseNativeOutputs(
          _Concat([e.outputs for e in pieces]), state.writing)),
      states=[place.SplitStages(x, 1)
              for x in _Concat([e.states for e in pieces])],
      aux_loss=tf.add_n([tf.reduce_sum(e.aux_loss) for e in pieces]),
      summaries=summaries,
      vars=state.vars)


def _Phases(spec, theta, mb_leaves):
  """The loop's phases: one, or where it skips bubbles, the fill and drain
  iterations on the stages that hold their useful slots only
  (Schedule.Phases)."""
  sched = spec.schedule
  if SkipsBubbles(spec, theta, mb_leaves):
    return sched.Phases()
  return [schedule_lib.Phase(0, sched.num_iterations, 0, sched.num_stages)]


# skip_bubbles=None turns it on under XLA for a body whose call on one
# microbatch takes at least this many FLOPs (SlotFlops): below, what the
# skipped bubble slots save is within a short step's noise, and every
# body's three loops take longer to trace and compile than one
# (docs/benchmarks.md#the-one-device-defaults-against-what-they-replace).
MIN_FLOPS_PER_SLOT_TO_SKIP_BUBBLES = 1e6


def SkipsBubbles(spec, theta, mb_leaves):
  """Whether the loop runs in phases: only where a runner computes a range
  of the stages (one device), as the skip_bubbles param says; None: under
  XLA (tf.function(jit_compile=True)) for a body of at least
  MIN_FLOPS_PER_SLOT_TO_SKIP_BUBBLES. In a Session it measured no faster,
  and slower for small bodies."""
  if not spec.runner.any_stage_range:
    return False
  if spec.skip_bubbles is not None:
    return spec.skip_bubbles
  return (compiled_loops.UnderXla() and
          loop_spec.SlotFlops(spec.schedule, theta, mb_leaves) >=
          MIN_FLOPS_PER_SLOT_TO_SKIP_BUBBLES)


def _PhaseRows(inputs, phase):
  """The phase's rows of the loop's [T, ...] inputs."""
  if phase.begin == 0 and phase.end == inputs.iteration.shape[0]:
    return inputs
  return inputs.Transform(lambda x: x[phase.begin:phase.end])


def _Concat(pieces):
  """Per-phase lists of tensors -> one list, each concatenated along dim 0."""
  if len(pieces) == 1:
    return list(pieces[0])
  return [tf.concat(parts, 0) for parts in zip(*pieces)]


def _RunPhase(spec, io, undo, phase, loop_theta, state0, inputs):
  """The phase's iterations as one loop: (final state, extras).

  Microbatches finish in order (Schedule.OutputIteration grows with the
  microbatch), so a phase finishes a run of k consecutive ones: its outputs
  are [k, S, ...] (a loop holds at least one row; a spare one is dropped).
  """
  finished = spec.schedule.OutputIndexPerIteration()[phase.begin:phase.end]
  done = [m for m in finished if m >= 0]
  first = done[0] if done else 0
  rows = recurrent.Kept(tuple(m - first if m >= 0 else -1 for m in finished),
                        max(len(done), 1))
  marks = lambda entries, mark: [mark] * len(entries)
  # The phase's loop takes the weights of its stages only: inside, each
  # weight's gradient is then the body's own dot (deferred where it reads
  # few rows) rather than the gradient of a slice of it.
  stages = stage_step.StageRange.Of(phase, spec.schedule.num_stages)
  loop_theta = NestedMap(weights=stages.Narrow(loop_theta.weights),
                         microbatches=loop_theta.microbatches)
  _, final, extras = recurrent.Recurrent(
      loop_theta, state0, inputs,
      lambda th, st, inp: _Iteration(spec, io, phase, th, st, inp),
      remat_policy=spec.remat_policy,
      manual_boundary=sharding.ManualBoundary.For(spec.runner.manual_mesh),
      kept_extras={'outputs': rows},
      return_states=False,
      # One device: the weights' gradients summed after the loop where
      # their dots read few rows (more memory, which partitioned is not
      # to spare).
      defer_weight_dots=not spec.placement.splits_stage_dim,
      data_state=NestedMap(buffer=marks(state0.buffer, True),
                           vars=marks(state0.vars, False),
                           reading=marks(state0.reading, True),
                           writing=marks(state0.writing, False)),
      undo=None if undo is None else recurrent.Undo(
          NestedMap(buffer=marks(state0.buffer, False),
                    vars=marks(state0.vars, False),
                    reading=marks(state0.reading, True),
                    writing=marks(state0.writing, True)), undo))
  if not done:
    extras.outputs = [x[:0] for x in extras.outputs]
  return final, extras


def _Iteration(spec: loop_spec.LoopSpec, io, phase, loop_theta, state, inp):
  """One loop iteration: the phase's stages run on their slots."""
  place = spec.placement
  it = place.ReplicateBookkeeping(inp.iteration)  # i, int32 []
  rows = inp.rows.Transform(place.ReplicateBookkeeping)  # [S] each
  stages = stage_step.StageRange.Of(phase, spec.schedule.num_stages)

  def RunStages(stage_in):  # [S, mb, ...] per leaf
    step = stage_step.Step(spec, stages, loop_theta.weights, rows, stage_in,
                           inp.states, state.vars)
    return step.outputs, step

  stepped = rotating_buffer.Step(io, it, rows, loop_theta.microbatches,
                                 state.reading, state.buffer, RunStages,
                                 writing=state.writing)
  step = stepped.ran
  new_state = NestedMap(
      buffer=stepped.buffer,  # [S, mb, ...] per leaf
      vars=step.vars,  # [S, (R,) ...] per variable
      reading=stepped.reading, writing=stepped.writing)
  extras = NestedMap(
      outputs=io.KeptOutputs(stepped.outputs),  # [S or 1, mb, ...] per leaf
      aux_loss=place.ReplicateBookkeeping(tf.reduce_sum(step.aux)),  # []
      summaries=step.summaries,  # {name: ([S], [S])}
      states=step.states)  # [S, ...] per state leaf
  return new_state, extras
