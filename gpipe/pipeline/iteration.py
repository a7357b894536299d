"""One iteration of the pipeline loop, read top to bottom.

Every loop of the pod's schedule runs this iteration: the reverse loop
(gpipe.pipeline.pipeline_loop), the 1f1b forward loop and the 1f1b
gradient loop's forward wave (gpipe.pipeline.one_f_one_b). They hand it
data: the io (how stage 0 reads: gpipe.pipeline.loop_io) and what runs
the stages' calls (`calls`: DirectStages, run where the iteration is
traced, or the 1f1b loops' cell, traced once on its own). S = 3; slot s
of the buffer holds what stage s - 1 made, slot 0 what the last stage
made (a linear pipeline drops it, a circular one feeds it to the
microbatch's next repeat)::

    buffer        [ y2 | y0 | y1 ]   carried in, [S, mb, ...] per leaf
    1 read        io.Read: stage 0's fresh input (row i says which)
    2 stage in    io.StageInputs: [ x  | y0 | y1 ], x where row.reads
    3 run         calls.Apply -> RunStages: every stage's call, a bubble's
                  output its input (MaskBubbles)
    outputs       [ y0'| y1'| y2']
    4 hand on     handoff.Next (rotation): slot s <- stage s - 1
    buffer        [ y2'| y0'| y1']   carried out

The loop that runs the iteration takes the outputs on from there (the last
stage's, where it finishes a microbatch: Iterate's docstring says how each
loop does).

With delayed sends the buffer carries the outputs one iteration longer:
step 4 rotates the previous iteration's outputs, beside step 3's calls,
and keeps this iteration's in flight (rotation.DelayedHandoff).

The row (what each stage does at iteration i: its microbatch, repeat, step
seed, whether it is a bubble, whether it reads) is gpipe.schedule's, as
[S] tensors (Tables).
"""

import dataclasses
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from gpipe import nest
from gpipe.pipeline import stage_runners
from gpipe import schedule as schedule_lib
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap


def Iterate(calls, io, handoff, row, held, buffer, var_values, reading,
            stage_states=()) -> 'IterationResult':
  """One iteration over the buffer: read, stage inputs, run, hand on.

  The loop that runs it hands the outputs on (done.outputs): the 1f1b
  forward loop writes them (io.Write), the reverse loop gives them to its
  io (io.ReverseLoopOutputs), the 1f1b gradient loop's forward wave drops
  them.

  Args:
    calls: runs the stages' calls: DirectStages, or the 1f1b loops' cell
      (gpipe.pipeline.one_f_one_b.cell.BoundCell); its Apply gives
      MaskedStages.
    io: how stage 0 reads (gpipe.pipeline.loop_io: a LoopInputs).
    handoff: how the outputs reach the next stages (rotation.HandoffFor
      the schedule), which also says what `buffer` holds.
    row: the schedule's row of the iteration (Tables), [S] per field,
      replicated.
    held: the loop's inputs as io.Hold made them.
    buffer: the handoff's carry: [S, mb, ...] per leaf, the last
      iteration's outputs rotated (delayed: and then those in flight).
    var_values: [S, (R,) ...] per carried non-trainable variable.
    reading: io's input state ([] where it has none).
    stage_states: the per-stage state leaves of iteration i, [S, ...].
  """
  place = io.placement
  fresh, reading = io.Read(held, reading, row)  # stage 0's, per leaf
  stage_in = [place.SplitStages(io.StageInputs(row.reads,
                                               place.SplitStages(b), f))
              for b, f in zip(handoff.Ready(buffer), fresh)]  # [S, mb, ...]
  done = calls.Apply(stage_in, var_values, row, stage_states)
  buffer = handoff.Next(buffer, done.outputs)  # [S, mb, ...] per leaf
  return IterationResult(stage_in=stage_in, done=done, buffer=buffer,
                         reading=reading)


@dataclasses.dataclass(frozen=True)
class IterationResult:
  """One iteration (Iterate); every list has a tensor per buffer leaf.

  Attributes:
    stage_in: [S, mb, ...] what each stage ran on.
    done: what the stages did (MaskedStages).
    buffer: the next iteration's buffer (the handoff's carry):
      done.outputs rotated, or (delayed) the last ones rotated and these.
    reading: the io's input state after this iteration's read.
  """
  stage_in: List[tf.Tensor]
  done: 'MaskedStages'
  buffer: List[tf.Tensor]
  reading: List[tf.Tensor]


@dataclasses.dataclass(frozen=True)
class DirectStages:
  """The stages' calls run where the iteration is traced, no cell of their
  own (the reverse loop: its cell is the whole iteration, which
  gpipe.recurrent differentiates).

  Attributes:
    spec: the loop_spec.LoopSpec.
    stages: the StageRange that computes (the others are bubbles).
    theta: the range's stage-stacked weights, [count, (R,) ...].
  """
  spec: object
  stages: 'StageRange'
  theta: object

  def Apply(self, stage_in, var_values, row,
            stage_states) -> 'MaskedStages':
    return RunStages(self.spec, self.stages, self.theta, row, stage_in,
                     stage_states, var_values)


# -- 3: every stage's call, bubbles masked.


@dataclasses.dataclass(frozen=True)
class MaskedStages:
  """What the stages of one iteration did, bubbles masked.

  Attributes:
    outputs: [S, mb, ...] per buffer leaf; a bubble's is its input.
    vars: [S, (R,) ...] the carried non-trainable values; a bubble's kept.
    aux: float32 [S], each stage's aux losses summed (bubbles: 0).
    summaries: {name: (value * weight [S], weight [S])} (bubbles: 0).
    states: the per-stage state slots [S, ...]; a bubble's are kept.
    losses: with a LastStageLoss (the 1f1b ScoringCell's), its sums per
      stage, each [S], zero but where a stage ran the last layer; else
      empty.
    aux_added: whether the body added aux losses (`aux` is zeros if not).
    stored: what the remat policy keeps for the backward wave (the 1f1b
      cell's, asked for), else None.
  """
  outputs: List[tf.Tensor]
  vars: List[tf.Tensor]
  aux: Optional[tf.Tensor]
  summaries: Dict[str, Tuple[tf.Tensor, tf.Tensor]]
  states: List[tf.Tensor]
  losses: NestedMap = dataclasses.field(default_factory=NestedMap)
  aux_added: bool = False
  stored: Optional[List[tf.Tensor]] = None


def RunStages(spec, stages, theta, row, stage_in, stage_states,
              var_values) -> MaskedStages:
  """Every stage's call on its input, bubbles masked.

  Args:
    spec: the loop_spec.LoopSpec.
    stages: the StageRange that computes (the others are bubbles).
    theta: the range's stage-stacked weights, [count, ...].
    row: the schedule's row of the iteration (Tables), [S] per field,
      replicated.
    stage_in: the buffer leaves' stage inputs, [S, ...] each.
    stage_states: the per-stage state leaves of this iteration, [S, ...].
    var_values: the carried non-trainable values, [S, (R,) ...].
  """
  per_stage = spec.placement.SplitStages  # [S] vectors live with their stages
  args = spec.args.Rebuild(stage_in)
  num_args = len(args)
  args += tuple(tf.nest.pack_sequence_as(spec.states, stage_states))
  res = _RunRange(spec, stages, theta, row, args, list(var_values))
  valid = per_stage(row.valid)
  outs, state_outs = res.outputs[:num_args], res.outputs[num_args:]
  # Bubbles keep the state slots and non-trainable values they found, and
  # their aux losses and summaries are dropped by the same select.
  keep = lambda v: tf.where(valid, v, tf.zeros_like(v))
  aux = tf.zeros([stages.num_stages], tf.float32)
  if res.aux is not None:
    aux = keep(res.aux)
  outputs = [per_stage(MaskBubbles(valid, o, x))
             for o, x in zip(spec.args.Of(outs), stage_in)]
  return MaskedStages(
      outputs=outputs,
      vars=[per_stage(SelectStages(valid, new, old))
            for new, old in zip(res.vars, var_values)],
      aux=per_stage(aux),
      summaries={
          name: (per_stage(keep(value * weight)), per_stage(keep(weight)))
          for name, value, weight in res.summaries
      },
      states=[per_stage(SelectStages(valid, new, old))
              for new, old in zip(tf.nest.flatten(state_outs), stage_states)],
      aux_added=res.aux is not None)


def _RunRange(spec, stages, theta, row, args, var_values):
  """The runner's run of the range's stages on their weights `theta`,
  widened back to all S: the others are all bubbles, which the caller
  masks (their outputs are their inputs, their aux losses and summaries
  zero, their variables kept)."""
  res = spec.runner.CallStages(
      spec, theta,
      StagesAt(spec, stages.Narrow(row), stages.Narrow(args),
               stages.Narrow(var_values), stages.first))
  zeros = lambda x: None if x is None else tf.zeros_like(x[:1])
  return stage_runners.RunnerResult(
      outputs=stages.Widen(res.outputs, args),
      aux=stages.WidenWith(res.aux, zeros(res.aux)),
      summaries=[(name, stages.WidenWith(v, zeros(v)),
                  stages.WidenWith(w, zeros(w)))
                 for name, v, w in res.summaries],
      vars=stages.Widen(res.vars, var_values))


def SelectStages(valid, new, old):
  """Per stage slot: new where the stage was valid, old on bubbles."""
  mask = tf.reshape(valid, [-1] + [1] * (new.shape.rank - 1))
  return tf.where(mask, new, old)


def MaskBubbles(valid, out, stage_in):
  """Bubble slots of the [S] stage outputs pass their input through instead.

  Bubbles never compute on zeros: the loop starts from real data
  (loop_io.BubbleFiller) and a bubble hands its own input on, so every
  bubble runs the body on some real microbatch's values. A body that is
  finite on real data (but, say, divides by its input) thus stays finite on
  bubbles, and the select's zero cotangent times a finite local derivative
  keeps the gradients finite too. The pass-through is cut from the gradient.
  """
  mask = tf.reshape(valid, [-1] + [1] * (out.shape.rank - 1))
  return tf.where(mask, out, tf.stop_gradient(stage_in))


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
  """Rows of the schedule's typed work (a Schedule's Rows, or OneFOneB's
  BackwardRows) as a NestedMap of [T, S] tensors, each field in the dtype
  its metadata names (int32, step seeds int64, flags bool): the one way a
  loop gets the schedule's facts."""
  return NestedMap({
      name: tf.constant(table, dtype)
      for name, (dtype, table) in schedule_lib.FieldTables(rows).items()})


def RowAt(tables, index, place=None):
  """Row `index` (int32 []) of Tables: [S] tensors a field; with a
  placement, replicated (each device takes its own stage's entries). The
  one way to get a row, but a loop's own slicing of its [T, S] inputs."""
  row = tables.Transform(lambda t: tf.gather(t, index))
  return row if place is None else row.Transform(place.ReplicateBookkeeping)


def StagesAt(spec, row, args, var_values, first_stage=0):
  """An iteration's work for the stage runners, from its row.

  Each stage's microbatch (clamped into range on bubbles), repeat and step
  seed; each device takes its own entries of the replicated row.
  """
  per_stage = spec.placement.SplitStages
  seeds = per_stage(spec.base_seed +
                    tf.cast(row.seed_offset, spec.base_seed.dtype))
  return stage_runners.IterationStages(
      args=tuple(args), mb_ids=per_stage(row.microbatch),
      repeat_ids=per_stage(row.repeat), seeds=seeds,
      var_values=list(var_values), first_stage=first_stage)
