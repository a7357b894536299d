"""The pipeline loop: T iterations over a rotating [S, ...] buffer.

One FProp call of a pipelined layer, in order:

    split     inputs [B, ...] -> [M, B/M, ...]           (gpipe.microbatch)
    loop      for i in 0..T-1:                                (this module)
                stage inputs = rotated buffer, stage 0 maybe microbatch i
                every stage runs once, bubbles masked
                                              (gpipe.pipeline.stage_step)
                buffer rotated by one stage   (gpipe.pipeline.rotating_buffer)
    reassemble  last stage's outputs -> [M, B/M, ...] -> [B, ...]

Which stage works on which microbatch and repeat, and which slots are
bubbles, comes from `gpipe.schedule.Schedule`. The backward pass is the
`backward_schedule` param's: 'reverse' runs this module's loop through
`gpipe.recurrent`, whose gradient is a second loop in reverse order over
the buffer each iteration kept (what else it stores or recomputes:
`gpipe.loops.remat`); '1f1b' (`gpipe.pipeline.one_f_one_b`) keeps no buffer per
iteration and runs its gradient in forward order.
"""

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import tensorflow as tf

from gpipe.loops import compiled_loops
from gpipe.pipeline import loop_io
from gpipe.pipeline import nest
from gpipe.pipeline import one_f_one_b
from gpipe.pipeline import rotating_buffer
from gpipe.pipeline import stage_call
from gpipe.pipeline import stage_runners
from gpipe.pipeline import stage_slots
from gpipe.pipeline import stage_step
from gpipe import recurrent
from gpipe import schedule as schedule_lib
from gpipe import sharding
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap


@dataclasses.dataclass(frozen=True, eq=False)
class LoopSpec:
  """Everything the loop needs besides the tensors it carries.

  Attributes:
    schedule: which stage works on what, per iteration.
    body: the body layer.
    fn_name: the body method each stage runs.
    runner: runs every stage of an iteration (a
      gpipe.pipeline.stage_runners.StageRunner, which says what it can do).
    repeats: the circular-repeat selector (gpipe.pipeline.repeats).
    placement: the sharding placement (gpipe.sharding.StagePlacement).
    args: the structure of the microbatched positional inputs.
    states: the structure of the padded per-stage states.
    mb_kwargs: per-example kwargs, [M, ...].
    kwargs_no_batch: kwargs every stage gets whole.
    base_seed: the step seed; (layer, microbatch) gets base_seed +
      Schedule.StepSeedOffset(layer, microbatch).
    global_step: the caller's global step (read before the loop: the
      backward pass recomputes the body outside the caller's context), or
      None.
    var_names: the body's non-trainable variables the loop carries.
    remat_policy: what the forward pass stores for the backward pass (the
      name of a gpipe.loops.remat policy); None: as RematPolicy decides.
    skip_bubbles: on one device, run the fill and drain iterations on the
      stages that hold their useful work only (Schedule.Phases); None:
      where it pays (SkipsBubbles).
    backward_schedule: 'reverse' or '1f1b' (gpipe.pipeline.one_f_one_b).
    stream_io: whether the inputs and outputs are split over the stages
      (gpipe.pipeline.loop_io).
    ring_split_mesh_dim: the mesh axis the 1f1b rings' entries are split
      over too (gpipe.pipeline.stage_slots.SplitRingLayout), or None.
    loss: a gpipe.pipeline.stage_ends.LastStageLoss (its inputs
      microbatched, [M, ...]) the last stage takes, '1f1b' only; None.
    first_stage: a gpipe.pipeline.stage_ends.FirstStageInput (its inputs
      microbatched) stage 0 makes its inputs with, with `loss` only; None.
  """
  schedule: schedule_lib.Schedule
  body: stage_call.Body
  fn_name: str
  runner: stage_runners.StageRunner
  repeats: Any
  placement: Any
  args: nest.TensorLeaves
  states: Any
  mb_kwargs: Dict[str, Any]
  kwargs_no_batch: Dict[str, Any]
  base_seed: tf.Tensor
  global_step: Optional[tf.Tensor]
  var_names: Tuple[str, ...]
  remat_policy: Optional[str]
  skip_bubbles: Optional[bool] = False
  backward_schedule: str = 'reverse'
  stream_io: bool = False
  ring_split_mesh_dim: Optional[int] = None
  loss: Any = None
  first_stage: Any = None


@dataclasses.dataclass(frozen=True, eq=False)
class LoopResult:
  """What the loop produced.

  Attributes:
    outputs: the [M, ...] tensor leaves of the outputs, microbatch order.
    states: the updated padded per-stage state leaves, [T, S, ...].
    aux_loss: the valid calls' aux losses summed over all iterations.
    summaries: {name: (sum of value * weight [T, S], weights [T, S])} of
      every summary the body added, bubbles zeroed.
    vars: the final values of the carried non-trainable variables.
    losses: with spec.loss, its sums over the batch (then no outputs).
  """
  outputs: List[tf.Tensor]
  states: List[tf.Tensor]
  aux_loss: tf.Tensor
  summaries: Dict[str, Tuple[tf.Tensor, tf.Tensor]]
  vars: List[tf.Tensor]
  losses: Any = None


def Run(spec: LoopSpec, theta, mb_leaves, state_leaves,
        var_values) -> LoopResult:
  """Runs the loop.

  Args:
    spec: the LoopSpec.
    theta: the stage-stacked weights, placed.
    mb_leaves: the [M, ...] tensor leaves of the microbatched inputs.
    state_leaves: the [T, S, ...] padded per-stage state leaves.
    var_values: the carried non-trainable values, [S, (R,) ...].
  """
  spec = dataclasses.replace(
      spec, remat_policy=RematPolicy(spec, theta, mb_leaves))
  if spec.backward_schedule == '1f1b':
    return LoopResult(**one_f_one_b.Run(spec, theta, mb_leaves, state_leaves,
                                        var_values))
  return _RunReverse(spec, theta, mb_leaves, state_leaves, var_values)


def _RunReverse(spec, theta, mb_leaves, state_leaves, var_values):
  """The loop whose gradient runs in reverse (gpipe.recurrent)."""
  place = spec.placement
  sched = spec.schedule
  io = loop_io.For(spec)
  native = io.ToNative(mb_leaves)
  filler = io.Filler(native)
  # Carried: the buffer, the body's non-trainable variables (see
  # gpipe.pipeline.stage_vars) and with stream_io the streams. Without, the
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
  return LoopResult(
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
          SlotFlops(spec.schedule, theta, mb_leaves) >=
          MIN_FLOPS_PER_SLOT_TO_SKIP_BUBBLES)


# remat_policy=None keeps the dots' outputs (save_dots) on one device for a
# body whose call on one microbatch takes at least this many FLOPs
# (SlotFlops), rather than running its dots again in the backward loop:
# above it, keeping them measured faster than recomputing; below, within
# the noise, so those bodies keep recomputing
# (docs/benchmarks.md#the-one-device-defaults-against-what-they-replace).
MIN_FLOPS_PER_SLOT_TO_SAVE_DOTS = 2e6


def RematPolicy(spec, theta, mb_leaves):
  """The loop's remat policy: the one the params ask for; None: save_dots
  on one device, with the reverse schedule, for a body of at least
  MIN_FLOPS_PER_SLOT_TO_SAVE_DOTS, else recompute.

  On one device the plain stack the pipeline stands for keeps all of its
  dots' outputs: keeping them costs no more than running unpipelined
  would. Partitioned, a chip's memory is what recomputing saves (and what
  `gpipe.plan` plans for), and 1f1b is chosen to bound memory."""
  if spec.remat_policy is not None:
    return spec.remat_policy
  if (spec.runner.any_stage_range and spec.backward_schedule == 'reverse' and
      SlotFlops(spec.schedule, theta, mb_leaves) >=
      MIN_FLOPS_PER_SLOT_TO_SAVE_DOTS):
    return 'save_dots'
  return 'recompute'


def SlotFlops(sched, theta, mb_leaves):
  """A body call's FLOPs on one microbatch, as if each weight entered one
  multiply-add per row: 2 x rows x one layer's weights, where rows are a
  microbatch's positions (all dims but the first and the features) of its
  largest input. The dots of dense layers, not those between activations
  (attention's scores); an over-estimate for lookups."""
  weights = sum(w.shape.num_elements() or 0 for w in tf.nest.flatten(theta)
                if w.dtype.is_floating) / sched.num_layers
  rows = max([x.shape[1:-1].num_elements() or 0 for x in mb_leaves
              if x.shape.rank and x.shape.rank >= 2] or [1])
  return 2 * rows * weights


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
  rows = recurrent.Rows(tuple(m - first if m >= 0 else -1 for m in finished),
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
      extras_rows={'outputs': rows},
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


def _Iteration(spec: LoopSpec, io, phase, loop_theta, state, inp):
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
      outputs=io.KeptRows(stepped.outputs),  # [S or 1, mb, ...] per leaf
      aux_loss=place.ReplicateBookkeeping(tf.reduce_sum(step.aux)),  # []
      summaries=step.summaries,  # {name: ([S], [S])}
      states=step.states)  # [S, ...] per state leaf
  return new_state, extras
