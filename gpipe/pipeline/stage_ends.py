"""What the pipeline computes at its ends: the first stage's inputs, the
last stage's loss, microbatch by microbatch.

`PipelinedLayer.FPropWithLoss(theta, loss, *args, first_stage=None,
**kwargs)` returns what `loss.fn` makes of the layer's outputs, summed
over the batch: with the reverse schedule (and unrolled, in eval) it is
exactly

    args = first_stage.fn(first_stage.weights, first_stage.inputs)  # if given
    loss.fn(loss.weights, FProp(theta, *args, **kwargs), loss.inputs)

on the whole batch. With backward_schedule='1f1b' both run inside the
one gradient loop (gpipe.pipeline.one_f_one_b): stage 0 makes each
microbatch's inputs where it reads it, the last stage scores each
microbatch as it finishes, and the loss's gradient starts back through the
stages in the same iteration. No forward pass runs before the gradient
loop; the inputs are never made for the whole batch and the outputs never
leave the last stage:

    iteration j   stage 0:   x_m = first.fn(weights, inputs_m)
                  stage S-1: y_m = f(x_m)  sums += loss.fn(weights, y_m, ..)
                                           dy_m = d loss.fn / d y_m -> back

loss.fn must be a sum over the examples it is given (a cross entropy summed
over tokens, a count of correct ones), so that the sums over microbatches
are the batch's; first_stage.fn must treat examples independently (an
embedding lookup), so that a microbatch's inputs are the batch's examples.

Partitioned, each device computes both for its own stage in the manual
region (the others' results are masked off), on its own copy of their
weights: the weights are stacked [S, ...] over the stage devices before
the loop and their gradients summed after it (`ForTheLoop`). On one
device only the first (last) stage's slot is computed.
"""

import dataclasses
from typing import Any, Callable

import tensorflow as tf

from gpipe import nest
from gpipe import sharding
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap

# Their per-example inputs travel with the layer's per-example kwargs under
# these keys (split and checked as they are), then are split off again.
LOSS_INPUTS = 'loss.inputs'
FIRST_STAGE_INPUTS = 'first_stage.inputs'

# On one device they are computed under these name scopes.
_SCOPES = ('first_stage_input', 'last_stage_loss')


@dataclasses.dataclass(frozen=True, eq=False)
class FirstStageInput:
  """What FPropWithLoss makes the layer's inputs from at stage 0.

  Attributes:
    fn: (weights, inputs) -> the layer's positional inputs (a tuple, or
      one structure for one input) for the examples of `inputs` (one
      microbatch's slices, or the batch), examples treated independently.
    weights: NestedMap of the tensors fn reads (e.g. an embedding table),
      not stage-stacked: the pipeline differentiates them too.
    inputs: NestedMap of per-example tensors [B, ...] (token ids).
  """
  fn: Callable[[Any, Any], Any]
  weights: NestedMap = dataclasses.field(default_factory=NestedMap)
  inputs: NestedMap = dataclasses.field(default_factory=NestedMap)

  def Args(self, weights, inputs):
    """fn's result as a tuple of the layer's positional inputs."""
    args = self.fn(weights, inputs)
    return tuple(args) if isinstance(args, (list, tuple)) else (args,)


@dataclasses.dataclass(frozen=True, eq=False)
class LastStageLoss:
  """What FPropWithLoss takes at the last stage.

  Attributes:
    fn: (weights, outputs, inputs) -> NestedMap of float32 scalars, each a
      sum over the examples of `outputs` (the layer's outputs, in their
      structure; one microbatch's, or the batch's); `inputs` the examples'
      slices of `inputs` below.
    weights: NestedMap of the tensors fn reads besides (e.g. a softmax),
      not stage-stacked: the pipeline differentiates them too.
    inputs: NestedMap of per-example tensors [B, ...] (labels, their
      weights), microbatched as the layer's inputs are.
    differentiated: the key of fn's result that is the loss; the others
      are metrics, summed but not differentiated.
  """
  fn: Callable[[Any, Any, Any], NestedMap]
  weights: NestedMap = dataclasses.field(default_factory=NestedMap)
  inputs: NestedMap = dataclasses.field(default_factory=NestedMap)
  differentiated: str = 'loss'

  def Sums(self, weights, outputs, inputs):
    """fn's result, checked: float32 scalars, the differentiated key in
    it."""
    sums = self.fn(weights, outputs, inputs)
    if not isinstance(sums, dict) or self.differentiated not in sums:
      raise ValueError(
          f'LastStageLoss.fn must return a NestedMap (a dict) of scalars '
          f'holding its differentiated key {self.differentiated!r}; got '
          f'{sums!r}.')
    checked = NestedMap()
    for key, value in sums.items():
      value = tf.convert_to_tensor(value)
      if value.shape.rank != 0 or not value.dtype.is_floating:
        raise ValueError(
            f'LastStageLoss.fn\'s {key!r} must be a float scalar (a sum over '
            f'the examples), got {value.dtype.name}{value.shape}.')
      checked[key] = tf.cast(value, tf.float32)
    return checked


def StageSums(loss, outputs, is_last, microbatch_ids, runner, placement):
  """Each stage's sums of `loss` on its output, zero but where it ran the
  last layer: NestedMap of float32 [S].

  Args:
    loss: the LastStageLoss, its inputs microbatched [M, ...].
    outputs: the stages' outputs in the layer's structure, each [S, ...].
    is_last: bool [S], where a stage ran the last layer on a valid
      microbatch.
    microbatch_ids: int32 [S], the microbatch each stage worked on.
    runner: the stage runner (its manual_mesh: partitioned).
    placement: the layer's sharding placement.
  """
  fn = lambda w, mine, inputs: loss.Sums(w, mine, inputs)
  return _AtOneStage(
      fn, loss.weights, loss.inputs, outputs, is_last, microbatch_ids,
      runner, placement, stage=-1, scope=_SCOPES[1],
      out=lambda sums, at: sums.Transform(lambda s: at * s))


def FirstStageInputs(first, stage_in, reads, microbatch_ids, runner,
                     placement):
  """The stages' inputs with stage 0's replaced, where it reads a fresh
  microbatch, by the inputs first.fn makes of that microbatch.

  Args:
    first: the FirstStageInput, its inputs microbatched [M, ...].
    stage_in: the stages' input leaves, each [S, ...].
    reads: bool [S], where a stage reads a fresh microbatch (stage 0).
    microbatch_ids, runner, placement: as for StageSums.
  """
  fresh = _AtOneStage(
      lambda w, _, inputs: nest.TensorLeaves(first.Args(w, inputs)).leaves,
      first.weights, first.inputs, None, reads, microbatch_ids, runner,
      placement, stage=0, scope=_SCOPES[0], out=lambda leaves, at: leaves)
  mask = lambda like: tf.reshape(reads, [-1] + [1] * (like.shape.rank - 1))
  return [placement.SplitStages(tf.where(mask(x), f, x))
          for f, x in zip(fresh, stage_in)]


def _AtOneStage(fn, weights, mb_inputs, stage_values, flags, microbatch_ids,
                runner, placement, stage, scope, out):
  """fn(weights, the stage's values, its microbatch's inputs), as `stage`
  computes it where `flags` says: [S, ...] results, out(result, at) with
  `at` the float flag ([S] on one device, each device's own partitioned).

  One device: computed for slot `stage` alone, placed into [S, ...] (the
  other slots zero). Partitioned: each device computes its own stage's in
  the manual region."""
  if runner.manual_mesh is not None:
    return _PerDevice(fn, weights, mb_inputs, stage_values, flags,
                      microbatch_ids, runner.manual_mesh, placement, out)
  num_stages = flags.shape.as_list()[0]
  pick = lambda x: x[stage]
  with tf.name_scope(scope):
    result = fn(weights, nest.MapTensors(pick, stage_values),
                tf.nest.map_structure(
                    lambda x: tf.gather(x, pick(microbatch_ids)), mb_inputs))
    place = lambda r: tf.concat(
        [tf.zeros_like(r[None])] * (stage % num_stages) + [r[None]] +
        [tf.zeros_like(r[None])] * (num_stages - 1 - stage % num_stages), 0)
    at = tf.cast(flags, tf.float32)
    return out(tf.nest.map_structure(place, result), at)


def _PerDevice(fn, weights, mb_inputs, stage_values, flags, microbatch_ids,
               mesh, placement, out):
  """_AtOneStage partitioned: fn in the manual region, each device's own.

  Each device takes its own microbatch's examples of the inputs (whole on
  every device) inside the region: gathered outside, by every stage's id
  at once, they would be resharded by a collective."""
  device_mesh, mesh_dim = mesh
  to_manual = lambda x: sharding.ToManualStage(x, device_mesh, mesh_dim)
  from_manual = lambda x: sharding.FromManualStage(x, device_mesh, mesh_dim)
  whole = lambda x: sharding.BroadcastToManualStage(x, device_mesh, mesh_dim)
  mine_id = to_manual(placement.SplitStages(microbatch_ids))
  mine_values = nest.MapTensors(to_manual, stage_values)
  mine_at = to_manual(placement.SplitStages(tf.cast(flags, tf.float32)))
  every_input = nest.MapTensors(whole, mb_inputs)
  with sharding.ManualStageRegion(mesh_dim):
    mine_inputs = nest.MapTensors(lambda x: tf.gather(x, mine_id),
                                  every_input)
    result = fn(nest.MapTensors(to_manual, weights), mine_values, mine_inputs)
    return tf.nest.map_structure(from_manual, out(result, mine_at))


def ForTheLoop(ends, runner, placement, num_stages):
  """The ends (FirstStageInput / LastStageLoss, or None) with their weights
  read as tensors before the loop (a variable read inside would escape the
  loop's gradient) and, where each device computes its own stage (a
  manual region), stacked [S, ...] over the stage devices: each device
  holds and differentiates its own copy, and the gradients leave the loop
  [S, ...] to be summed outside it (weights entering the region whole
  would sum their gradient in every iteration, and XLA's SPMD partitioner
  cannot place that sum's carry). A weight both ends read is stacked once."""
  stacked = {}

  def ForLoop(w):
    if id(w) not in stacked:
      value = tf.convert_to_tensor(w)
      if runner.manual_mesh is not None:
        value = _StackedOverStages(value, placement, num_stages)
      stacked[id(w)] = value
    return stacked[id(w)]

  # Their per-example inputs (ids, labels: small) whole on every device:
  # each stage's read of its microbatch then needs no collective.
  return [None if end is None else dataclasses.replace(
      end, weights=tf.nest.map_structure(ForLoop, end.weights),
      inputs=nest.MapTensors(placement.ReplicateLoopDim, end.inputs))
          for end in ends]


def _StackedOverStages(value, placement, num_stages):
  """[S, ...] copies of `value` split over the stage devices, whose
  gradient (each stage's, summed) is reduce-scattered over them along the
  last dim of a matrix (or more) where S divides it (a vector's is summed
  whole: small, and kept whole, as a norm's scale is): written as the
  exchange of each device's
  parts of its own stage's gradient (an all-to-all) and a sum on every
  device, so that no compiler has to find the reduce-scatter in an
  all-reduce of the whole (XLA's SPMD partitioner writes one so). A value
  kept split so over the stages (its last dim) is gathered by the copy,
  once, and gets its gradient back split the same way."""
  shape = value.shape.as_list()
  last = shape[-1] if len(shape) >= 2 else None

  @tf.custom_gradient
  def Stacked(v):

    def Grad(dy):
      # Each stage's gradient where the loop left it (pinned: else the
      # partitioner would lay the loop's sum out for the exchange below
      # and exchange in every iteration).
      dy = placement.SplitStages(dy)
      if not last or last % num_stages:
        return tf.reduce_sum(dy, 0)
      parts = tf.reshape(dy, [num_stages] + shape[:-1] +
                         [num_stages, last // num_stages])
      parts = placement.SplitStages(parts, len(shape))  # the all-to-all
      summed = tf.reduce_sum(parts, 0)
      return placement.SplitStages(tf.reshape(summed, shape), len(shape) - 1)

    return placement.SplitStages(
        tf.broadcast_to(v[None], [num_stages] + shape)), Grad

  return Stacked(value)


def FirstStageFiller(first, made, runner, placement, num_stages):
  """The buffer's first value: [S, ...] leaves, every slot microbatch 0's
  inputs as `first` makes them (real data for the bubbles to compute on),
  no gradient. `made`: those inputs [1, ...], made before the loop.
  Partitioned, each device makes its own slot's from its own copy of the
  weights: no collective moves them."""
  if runner.manual_mesh is None:
    return [placement.SplitStages(tf.broadcast_to(
        x, [num_stages] + x.shape.as_list()[1:])) for x in made]
  made = _PerDevice(
      lambda w, _, inputs: nest.TensorLeaves(first.Args(w, inputs)).leaves,
      first.weights, first.inputs, None, tf.ones([num_stages], tf.bool),
      tf.zeros([num_stages], tf.int32), runner.manual_mesh, placement,
      out=lambda leaves, at: leaves)
  return [placement.SplitStages(tf.stop_gradient(x)) for x in made]


class Unstored:
  """A remat policy that stores nothing of what one device computes at
  the ends (their name scopes): those tensors have no stage dim for a
  1f1b ring to split by stage; the backward wave computes them again (one
  microbatch's)."""

  def __init__(self, policy):
    self._policy = policy
    self.name = policy.name

  def Stored(self, cell):
    return [n for n in self._policy.Stored(cell)
            if not any(f'/{s}/' in f'/{n}' for s in _SCOPES)]


def WithInputs(kwargs, loss, first_stage=None):
  """The layer's per-example kwargs with the ends' inputs (under
  LOSS_INPUTS, FIRST_STAGE_INPUTS), to be microbatched with them."""
  ends = {LOSS_INPUTS: loss, FIRST_STAGE_INPUTS: first_stage}
  taken = [key for key in ends if key in kwargs]
  if taken:
    raise ValueError(f'FPropWithLoss: a kwarg may not be named {taken[0]!r}.')
  return dict(kwargs, **{key: end.inputs for key, end in ends.items()
                         if end is not None})


def SplitOff(mb_kwargs, loss, first_stage=None):
  """(the body's kwargs, the loss and the first stage with their inputs
  microbatched [M, ...]); an end that is None stays None."""
  mb_kwargs = dict(mb_kwargs)
  ends = []
  for key, end in ((LOSS_INPUTS, loss), (FIRST_STAGE_INPUTS, first_stage)):
    ends.append(None if end is None else
                dataclasses.replace(end, inputs=mb_kwargs.pop(key)))
  return (mb_kwargs, *ends)
