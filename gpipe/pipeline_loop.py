"""The pipeline loop: T iterations over a rotating [S, ...] buffer.

One FProp call of a pipelined layer, in order:

    split     inputs [B, ...] -> [M, B/M, ...]           (gpipe.microbatch)
    loop      for i in 0..T-1:                                (this module)
                stage inputs = rotated buffer, slot 0 maybe microbatch i
                every stage runs once           (gpipe.stage_runners, via
                                                 gpipe.stage_call.CallStage)
                bubbles masked, buffer rotated by one stage
    reassemble  last stage's outputs -> [M, B/M, ...] -> [B, ...]

One iteration, S = 3 (slot s holds what stage s - 1 produced; slot 0 what
the last stage produced, which a linear pipeline drops and a circular one
feeds into its next repeat)::

    buffer   [ y2 | y0 | y1 ]  --stages-->  [ y0' | y1' | y2' ]
               ^ stage 0 reads microbatch i instead when the schedule says
    rotated  [ y2' | y0' | y1' ]  -> next iteration's buffer

On a split stage dim the rotation is one collective-permute. Which stage
works on which microbatch and repeat, and which slots are bubbles, comes
from `gpipe.schedule.Schedule`; the loop and its gradient loop from
`gpipe.recurrent` (what the gradient stores or recomputes: `gpipe.remat`).
"""

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

import tensorflow as tf

from gpipe import microbatch
from gpipe import nest
from gpipe import recurrent
from gpipe import schedule as schedule_lib
from gpipe import sharding
from gpipe import stage_call
from gpipe import stage_runners
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap


@dataclasses.dataclass(frozen=True, eq=False)
class LoopSpec:
  """Everything the loop needs besides the tensors it carries.

  Attributes:
    schedule: which stage works on what, per iteration.
    body: the body layer.
    fn_name: the body method each stage runs.
    run_stages: (spec, theta, IterationStages) -> StagesResult, one of
      gpipe.stage_runners.
    manual_mesh: (device_mesh, mesh_dim) of the manual region run_stages
      runs the body in, or None.
    repeats: the circular-repeat selector (gpipe.repeats).
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
      name of a gpipe.remat policy).
    skip_bubbles: on one device, run the fill and drain iterations on the
      stages that hold their useful work only (Schedule.Phases).
  """
  schedule: schedule_lib.Schedule
  body: stage_call.Body
  fn_name: str
  run_stages: Callable[..., stage_runners.StagesResult]
  manual_mesh: Any
  repeats: Any
  placement: Any
  args: nest.TensorLeaves
  states: Any
  mb_kwargs: Dict[str, Any]
  kwargs_no_batch: Dict[str, Any]
  base_seed: tf.Tensor
  global_step: Optional[tf.Tensor]
  var_names: Tuple[str, ...]
  remat_policy: str
  skip_bubbles: bool = False


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
  """
  outputs: List[tf.Tensor]
  states: List[tf.Tensor]
  aux_loss: tf.Tensor
  summaries: Dict[str, Tuple[tf.Tensor, tf.Tensor]]
  vars: List[tf.Tensor]


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
  place = spec.placement
  sched = spec.schedule
  # Carried: the buffer and the body's non-trainable variables (see
  # gpipe.stage_vars). The microbatches are read inside the loop, row by
  # row (no [T, ...] copy of them); the iteration index comes in as an
  # input and each iteration's aux loss goes out as an extra, summed
  # afterwards: loop-carried scalars are what the partitioner tends to
  # mis-shard. The loop keeps the last stage's output only from the
  # iteration that finishes each microbatch, [M, 1, ...] on the last
  # stage's device, and returns no history of the buffer: the backward
  # loop reads it, nothing else does, so no [T, S, ...] gradient of it is
  # ever made.
  state = NestedMap(
      buffer=[place.SplitStages(microbatch.BubbleFiller(x, sched.num_stages))
              for x in mb_leaves],
      vars=[place.SplitStages(tf.stop_gradient(v)) for v in var_values])
  loop_theta = NestedMap(
      weights=theta,
      microbatches=[place.ReplicateLoopDim(x) for x in mb_leaves])
  # What each stage does in each iteration, a [T, S] table row per
  # iteration: computed once here, not in every iteration.
  inputs = NestedMap(
      iteration=tf.range(sched.num_iterations, dtype=tf.int32),
      rows=StageTables(sched),
      states=[place.SplitStages(x, 1) for x in state_leaves])
  pieces = []
  for phase in _Phases(spec):
    state, extras = _RunPhase(spec, phase, loop_theta, state,
                              _PhaseRows(inputs, phase))
    pieces.append(extras)
  outputs = [place.ReplicateLoopDim(LastStageOutputs(x, place))
             for x in _Concat([e.outputs for e in pieces])]
  summaries = {name: tuple(_Concat([e.summaries[name] for e in pieces]))
               for name in pieces[0].summaries}
  return LoopResult(
      outputs=outputs,
      states=[place.SplitStages(x, 1)
              for x in _Concat([e.states for e in pieces])],
      aux_loss=tf.add_n([tf.reduce_sum(e.aux_loss) for e in pieces]),
      summaries=summaries,
      vars=state.vars)


def _Phases(spec):
  """The loop's phases: one, or with skip_bubbles on one device, the fill
  and drain iterations on the stages that hold their useful slots only
  (Schedule.Phases)."""
  sched = spec.schedule
  if spec.skip_bubbles and stage_runners.RunsAnyStageRange(spec.run_stages):
    return sched.Phases()
  return [schedule_lib.Phase(0, sched.num_iterations, 0, sched.num_stages)]


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


def _RunPhase(spec, phase, loop_theta, state0, inputs):
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
  _, final, extras = recurrent.Recurrent(
      loop_theta, state0, inputs,
      lambda th, st, inp: _Iteration(spec, phase, th, st, inp),
      remat_policy=spec.remat_policy,
      manual_boundary=sharding.ManualBoundary.For(spec.manual_mesh),
      extras_rows={'outputs': rows},
      return_states=False,
      data_state=NestedMap(buffer=[True] * len(state0.buffer),
                           vars=[False] * len(state0.vars)))
  if not done:
    extras.outputs = [x[:0] for x in extras.outputs]
  return final, extras


def _Iteration(spec: LoopSpec, phase, loop_theta, state, inp):
  """One loop iteration: the phase's stages run on their slots."""
  sched = spec.schedule
  place = spec.placement
  per_stage = place.SplitStages  # [S] vectors live with their stages
  it = place.ReplicateBookkeeping(inp.iteration)
  rows = inp.rows.Transform(place.ReplicateBookkeeping)
  stage_in = [
      per_stage(StageInputs(rows.reads, per_stage(buf),
                            place.ReplicateOverStages(
                                microbatch.StageZeroInput(x, sched, it))))
      for buf, x in zip(state.buffer, loop_theta.microbatches)
  ]
  args = spec.args.Rebuild(stage_in)
  num_args = len(args)
  args += tuple(tf.nest.pack_sequence_as(spec.states, inp.states))
  res = _RunStages(spec, StageRange.Of(phase, sched.num_stages),
                   loop_theta.weights, rows, args, list(state.vars))
  valid = per_stage(rows.valid)
  outs, state_outs = res.outputs[:num_args], res.outputs[num_args:]
  new_buffer = [
      per_stage(RotateStages(per_stage(MaskBubbles(valid, o, x))))
      for o, x in zip(spec.args.Of(outs), stage_in)
  ]
  # Bubbles keep the state slots and non-trainable values they found, and
  # their aux losses and summaries are dropped by the same select.
  keep = lambda v: tf.where(valid, v, tf.zeros_like(v))
  aux = tf.constant(0.0, tf.float32)
  if res.aux is not None:
    aux = tf.reduce_sum(keep(res.aux))
  new_state = NestedMap(
      buffer=new_buffer,
      vars=[per_stage(SelectStages(valid, new, old))
            for new, old in zip(res.vars, state.vars)])
  extras = NestedMap(
      outputs=new_buffer,
      aux_loss=place.ReplicateBookkeeping(aux),
      summaries={
          name: (per_stage(keep(value * weight)), per_stage(keep(weight)))
          for name, value, weight in res.summaries
      },
      states=[per_stage(SelectStages(valid, new, old))
              for new, old in zip(tf.nest.flatten(state_outs), inp.states)])
  return new_state, extras


def _RunStages(spec, stages, theta, rows, args, var_values):
  """The run_stages of the range's stages, widened back to all S: the
  others are all bubbles, which the caller masks (their outputs are their
  inputs, their aux losses and summaries zero, their variables kept)."""
  res = spec.run_stages(
      spec, stages.Narrow(theta),
      StagesAt(spec, stages.Narrow(rows), stages.Narrow(args),
               stages.Narrow(var_values), stages.first))
  zeros = lambda x: None if x is None else tf.zeros_like(x[:1])
  return stage_runners.StagesResult(
      outputs=stages.Widen(res.outputs, args),
      aux=stages.WidenWith(res.aux, zeros(res.aux)),
      summaries=[(name, stages.WidenWith(v, zeros(v)),
                  stages.WidenWith(w, zeros(w)))
                 for name, v, w in res.summaries],
      vars=stages.Widen(res.vars, var_values))


@dataclasses.dataclass(frozen=True)
class StageRange:
  """Stages [first, first + count) of num_stages, on the leading dim."""
  first: int
  count: int
  num_stages: int

  @classmethod
  def Of(cls, phase, num_stages):
    return cls(phase.first_stage, phase.num_stages, num_stages)

  @property
  def whole(self):
    return self.count == self.num_stages

  def Narrow(self, tree):
    """Every tensor of tree, [S, ...] -> the range's [count, ...]."""
    if self.whole:
      return tree
    return nest.MapTensors(lambda x: x[self.first:self.first + self.count],
                           tree)

  def Widen(self, tree, full):
    """The range's [count, ...] tensors of tree, the rest of `full` around."""
    if self.whole:
      return tree
    end = self.first + self.count
    return tf.nest.map_structure(
        lambda part, whole: tf.concat([whole[:self.first], part, whole[end:]],
                                      0) if nest.IsTensor(part) else part,
        tree, full, check_types=False)

  def WidenWith(self, part, filler):
    """[count, ...] -> [S, ...], filled with `filler` [1, ...] elsewhere."""
    if part is None or self.whole:
      return part
    tile = lambda n: tf.tile(filler, [n] + [1] * (part.shape.rank - 1))
    after = self.num_stages - self.first - self.count
    return tf.concat([tile(self.first), part, tile(after)], 0)


def LastStageOutputs(finished, place):
  """[M, S, ...] buffers of the iterations that finish each microbatch ->
  [M, ...]: slot 0, which the rotation gave the last stage's output.

  The gradient is the slot's gradient placed in slot 0 of zeros, split
  over the stages like the buffers: each device builds only its own
  [M, 1, ...] part (a plain slice's gradient, a pad of the replicated
  gradient, would be built whole, [M, S, ...], on every device).
  """

  @tf.custom_gradient
  def Slot0(x):

    def Grad(dy):
      num_stages = x.shape.as_list()[1]
      is_slot0 = tf.reshape(tf.equal(tf.range(num_stages), 0),
                            [1, num_stages] + [1] * (x.shape.rank - 2))
      return place.SplitStages(
          tf.where(is_slot0, dy[:, None], tf.zeros([], dy.dtype)), 1)

    return x[:, 0], Grad

  return Slot0(place.SplitStages(finished, 1))


def StageTables(sched):
  """Schedule.StageTables as [T, S] tensors: int32, step seeds int64."""
  dtypes = dict(seed_offset=tf.int64, valid=tf.bool, reads=tf.bool)
  return NestedMap({name: tf.constant(table, dtypes.get(name, tf.int32))
                    for name, table in sched.StageTables().items()})


def RowsAt(sched, iteration):
  """Row `iteration` (a scalar tensor) of StageTables: one iteration's
  work, for callers that drive their own loop."""
  return StageTables(sched).Transform(lambda t: tf.gather(t, iteration))


def StagesAt(spec: LoopSpec, rows, args, var_values, first_stage=0):
  """An iteration's work for the stage runners, from its StageRows.

  Each stage's microbatch (clamped into range on bubbles), repeat and step
  seed; each device takes its own entries of the replicated rows.
  """
  per_stage = spec.placement.SplitStages
  seeds = per_stage(spec.base_seed +
                    tf.cast(rows.seed_offset, spec.base_seed.dtype))
  return stage_runners.IterationStages(
      args=tuple(args), mb_ids=per_stage(rows.microbatch),
      repeat_ids=per_stage(rows.repeat), seeds=seeds,
      var_values=list(var_values), first_stage=first_stage)


def StageInputs(reads, rotated, stage0_input):
  """The stages' inputs: the rotated buffer, stage 0 maybe a fresh input.

  The carried buffer is last iteration's outputs already rotated by one
  stage (see RotateStages): slot s holds what stage s - 1 produced, and
  slot 0 what the last stage produced. Stage 0 takes the fresh microbatch
  whenever the schedule says it reads one: always when linear (the wrapped
  slot is dropped), in the first S iterations of each R * S block when
  circular (otherwise it keeps the wrapped slot: the microbatch's next
  repeat). `reads` ([S] bools, the schedule's StageRow) says where.
  """
  return _SelectFresh(reads, stage0_input, rotated)


def _SelectFresh(reads, fresh, rotated):
  """Slot s of `rotated` ([S, ...]) replaced by `fresh` where reads[s].

  The gradient is written with masks and a contraction over the stage dim
  (an all-reduce when it is split), not TensorFlow's: its sum over the
  broadcast stage dim is a reduce whose zero initial value XLA's lowering
  shares with the stage body's own reductions inside the manual-sharding
  region, and the SPMD partitioner then aborts resharding it (seen with
  1-row microbatches).
  """

  @tf.custom_gradient
  def Select(fresh, rotated):
    mask = tf.reshape(reads, [-1] + [1] * (rotated.shape.rank - 1))
    shape = py_utils.GetShape(rotated)

    def Grad(dy):
      taken = tf.cast(reads, dy.dtype)
      kept = tf.cast(tf.logical_not(mask), dy.dtype)
      return tf.tensordot(taken, dy, axes=[[0], [0]]), dy * kept

    return tf.where(mask, tf.broadcast_to(fresh[None], shape), rotated), Grad

  return Select(fresh, rotated)


@tf.custom_gradient
def RotateStages(x):
  """[S, ...] -> slot s gets slot s - 1, slot 0 gets slot S - 1.

  Along a split stage dim this is exactly one collective-permute once
  partitioned, and so is its gradient, the opposite rotation (written out:
  TensorFlow's gradient of the concat of two slices is two permutes). A
  shift that pads a zero in instead becomes an all-to-all.
  """
  rotated = tf.concat([x[-1:], x[:-1]], axis=0)

  def Grad(dy):
    return tf.concat([dy[1:], dy[:1]], axis=0)

  return rotated, Grad


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
