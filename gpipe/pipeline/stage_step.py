"""One iteration's stage work, as both backward schedules run it.

    rows (gpipe.schedule's table row: each stage's microbatch, repeat,
          step seed, valid)
    stage inputs [S, ...] --Step--> every stage's body call (a stage
          runner), bubbles masked --> outputs [S, ...], the non-trainable
          values, aux losses [S], summaries, per-stage states

The reverse schedule's loop (gpipe.pipeline.pipeline_loop) runs a Step in each
iteration between reading its input and rotating the buffer; the 1f1b
gradient loop (gpipe.pipeline.one_f_one_b) runs the same Step as its cell,
forward and differentiated. A phase of a one-device loop may run a range of the
stages only (StageRange, skip_bubbles): the others are bubbles.
"""

import dataclasses
from typing import Dict, List, Tuple

import tensorflow as tf

from gpipe import nest
from gpipe.pipeline import stage_ends
from gpipe.pipeline import rotating_buffer
from gpipe.pipeline import stage_runners
from gpipe import schedule as schedule_lib
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What the stages of one iteration produced, bubbles masked.

  Attributes:
    outputs: the buffer leaves' outputs [S, ...]; a bubble's is its input.
    vars: the carried non-trainable values; a bubble's are kept.
    aux: float32 [S], each stage's aux losses summed (bubbles: 0).
    summaries: {name: (value * weight [S], weight [S])} (bubbles: 0).
    states: the per-stage state slots [S, ...]; a bubble's are kept.
    losses: with a LastStageLoss (spec.loss), its sums per stage, each
      [S], zero but where a stage ran the last layer; else empty.
    aux_added: whether the body added aux losses (`aux` is zeros if not).
  """
  outputs: List[tf.Tensor]
  vars: List[tf.Tensor]
  aux: tf.Tensor
  summaries: Dict[str, Tuple[tf.Tensor, tf.Tensor]]
  states: List[tf.Tensor]
  losses: NestedMap = dataclasses.field(default_factory=NestedMap)
  aux_added: bool = False


def Step(spec, stages, theta, rows, stage_in, state_slots,
         var_values) -> StepResult:
  """Every stage's call on its input, bubbles masked.

  Args:
    spec: the loop_spec.LoopSpec.
    stages: the StageRange that computes (the others are bubbles).
    theta: the range's stage-stacked weights, [count, ...].
    rows: the iteration's StageTables row, each [S] (replicated).
    stage_in: the buffer leaves' stage inputs, [S, ...] each.
    state_slots: the per-stage state leaves of this iteration, [S, ...].
    var_values: the carried non-trainable values, [S, (R,) ...].
  """
  per_stage = spec.placement.SplitStages  # [S] vectors live with their stages
  if spec.first_stage is not None:  # stage 0 makes its fresh inputs
    stage_in = stage_ends.FirstStageInputs(
        spec.first_stage, stage_in, rows.reads, rows.microbatch, spec.runner,
        spec.placement)
  args = spec.args.Rebuild(stage_in)
  num_args = len(args)
  args += tuple(tf.nest.pack_sequence_as(spec.states, state_slots))
  res = RunStages(spec, stages, theta, rows, args, list(var_values))
  valid = per_stage(rows.valid)
  outs, state_outs = res.outputs[:num_args], res.outputs[num_args:]
  # Bubbles keep the state slots and non-trainable values they found, and
  # their aux losses and summaries are dropped by the same select.
  keep = lambda v: tf.where(valid, v, tf.zeros_like(v))
  aux = tf.zeros([stages.num_stages], tf.float32)
  if res.aux is not None:
    aux = keep(res.aux)
  outputs = [per_stage(rotating_buffer.MaskBubbles(valid, o, x))
             for o, x in zip(spec.args.Of(outs), stage_in)]
  return StepResult(
      outputs=outputs,
      vars=[per_stage(rotating_buffer.SelectStages(valid, new, old))
            for new, old in zip(res.vars, var_values)],
      aux=per_stage(aux),
      summaries={
          name: (per_stage(keep(value * weight)), per_stage(keep(weight)))
          for name, value, weight in res.summaries
      },
      states=[per_stage(rotating_buffer.SelectStages(valid, new, old))
              for new, old in zip(tf.nest.flatten(state_outs), state_slots)],
      losses=_LastStageSums(spec, rows, outputs),
      aux_added=res.aux is not None)


def _LastStageSums(spec, rows, outputs):
  """The LastStageLoss's sums per stage [S] (empty without one): scored
  where a stage ran the last layer on a valid microbatch."""
  if spec.loss is None:
    return NestedMap()
  sched = spec.schedule
  is_last = (rows.valid &
             tf.equal(rows.repeat, sched.circular_repeat - 1) &
             tf.equal(tf.range(sched.num_stages), sched.num_stages - 1))
  built = spec.args.Rebuild(outputs)
  return stage_ends.StageSums(
      spec.loss, built[0] if len(built) == 1 else built, is_last,
      rows.microbatch, spec.runner, spec.placement)


def RunStages(spec, stages, theta, rows, args, var_values):
  """The runner's run of the range's stages on their weights `theta`,
  widened back to all S: the others are all bubbles, which the caller masks (their outputs are their
  inputs, their aux losses and summaries zero, their variables kept)."""
  res = spec.runner.Run(
      spec, theta,
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

  @classmethod
  def All(cls, num_stages):
    return cls(0, num_stages, num_stages)

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


def Tables(rows):
  """A Schedule's rows of works as a NestedMap of [T, S] tensors, a field
  each, of its dtype (gpipe.schedule.FieldTables)."""
  return NestedMap({name: tf.constant(table, dtype) for name, (dtype, table)
                    in schedule_lib.FieldTables(rows).items()})


def StageTables(sched):
  """Schedule.Rows as [T, S] tensors."""
  return Tables(sched.Rows())


def RowsAt(sched, iteration):
  """Row `iteration` (a scalar tensor) of StageTables: one iteration's
  work, for callers that drive their own loop."""
  return StageTables(sched).Transform(lambda t: tf.gather(t, iteration))


def StagesAt(spec, rows, args, var_values, first_stage=0):
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
