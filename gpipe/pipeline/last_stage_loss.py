"""A loss the pipeline takes at its last stage, microbatch by microbatch.

`PipelinedLayer.FPropWithLoss(theta, loss, *args, **kwargs)` returns what
`loss.fn` makes of the layer's outputs, summed over the batch: with the
reverse schedule (and unrolled, in eval) it is exactly

    loss.fn(loss.weights, FProp(theta, *args, **kwargs), loss.inputs)

on the whole batch. With backward_schedule='1f1b' the last stage scores
each microbatch as it finishes, inside the gradient loop, and the loss's
gradient starts back through the stages in the same iteration
(gpipe.pipeline.one_f_one_b): no forward pass runs before the gradient
loop, and the outputs never leave the last stage.

    iteration j      stage S-1: y_m = f(x_m)   sums += fn(weights, y_m, inputs_m)
                                               dy_m = d fn / d y_m  -> backward wave

fn must be a sum over the rows it is given (a cross entropy summed over
tokens, a count of correct ones), so that the sums over microbatches are
the batch's.
"""

import dataclasses
from typing import Any, Callable

import tensorflow as tf

from gpipe.pipeline import nest
from gpipe import sharding
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap

# The loss's inputs travel with the layer's per-example kwargs under this
# key (split and checked as they are), then are split off again.
INPUTS = 'loss.inputs'

# On one device the loss is computed under this name scope.
SCOPE = 'last_stage_loss'


@dataclasses.dataclass(frozen=True, eq=False)
class LastStageLoss:
  """What FPropWithLoss takes at the last stage.

  Attributes:
    fn: (weights, outputs, inputs) -> NestedMap of float32 scalars, each a
      sum over the rows of `outputs` (the layer's outputs, in their
      structure; one microbatch's, or the batch's); `inputs` the rows'
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
            f'the rows), got {value.dtype.name}{value.shape}.')
      checked[key] = tf.cast(value, tf.float32)
    return checked


def StageSums(loss, mb_inputs, outputs, is_last, microbatch_ids, runner,
              placement):
  """Each stage's sums of `loss` on its output, zero but where it ran the
  last layer: NestedMap of float32 [S].

  Args:
    loss: the LastStageLoss.
    mb_inputs: its inputs microbatched, each [M, ...].
    outputs: the stages' outputs in the layer's structure, each [S, ...].
    is_last: bool [S], where a stage ran the last layer on a valid
      microbatch.
    microbatch_ids: int32 [S], the microbatch each stage worked on.
    runner: the stage runner: partitioned, each device scores its own
      stage's output in the manual region (no output leaves its stage);
      on one device only the last stage's slot is scored.
    placement: the layer's sharding placement.
  """
  if runner.manual_mesh is not None:
    return _PerDevice(loss, mb_inputs, outputs, is_last, microbatch_ids,
                      runner.manual_mesh, placement)
  num_stages = is_last.shape.as_list()[0]
  last = lambda x: x[num_stages - 1]
  with tf.name_scope(SCOPE):
    sums = loss.Sums(
        loss.weights, nest.MapTensors(last, outputs),
        tf.nest.map_structure(
            lambda x: tf.gather(x, last(microbatch_ids)), mb_inputs))
    at_last = tf.one_hot(num_stages - 1, num_stages) * tf.cast(
        last(is_last), tf.float32)
    return sums.Transform(lambda s: at_last * s)


def _PerDevice(loss, mb_inputs, outputs, is_last, microbatch_ids, mesh,
               placement):
  """StageSums partitioned: fn in the manual region, each device's own."""
  device_mesh, mesh_dim = mesh
  to_manual = lambda x: sharding.ToManualStage(x, device_mesh, mesh_dim)
  from_manual = lambda x: sharding.FromManualStage(x, device_mesh, mesh_dim)
  mine_inputs = tf.nest.map_structure(
      lambda x: to_manual(placement.SplitStages(tf.gather(x, microbatch_ids))),
      mb_inputs)
  mine_outputs = nest.MapTensors(to_manual, outputs)
  mine_last = to_manual(placement.SplitStages(tf.cast(is_last, tf.float32)))
  weights = nest.MapTensors(to_manual, loss.weights)
  with sharding.ManualStageRegion(mesh_dim):
    sums = loss.Sums(weights, mine_outputs, mine_inputs)
    sums = sums.Transform(lambda s: from_manual(mine_last * s))
  return sums


def ForTheLoop(loss, runner, placement, num_stages):
  """The loss with its weights read as tensors before the loop (a
  variable read inside would escape the loop's gradient), and stacked
  [S, ...] over the stage devices where each device scores its own stage
  (a manual region): each device then holds, and differentiates, its own
  copy, and the gradients leave the loop [S, ...] to be summed outside it
  (weights entering the region whole would sum their gradient in every
  iteration, and XLA's SPMD partitioner cannot place that sum's carry)."""
  if loss is None:
    return loss
  weights = tf.nest.map_structure(tf.convert_to_tensor, loss.weights)
  if runner.manual_mesh is not None:
    weights = nest.MapTensors(
        lambda w: placement.SplitStages(
            tf.broadcast_to(w[None], [num_stages] + w.shape.as_list())),
        weights)
  return dataclasses.replace(loss, weights=weights)


class Unstored:
  """A remat policy that stores nothing of a one-device loss (SCOPE): its
  tensors have no stage dim for a 1f1b ring to split by stage; the
  backward wave computes them again (one microbatch's loss)."""

  def __init__(self, policy):
    self._policy = policy
    self.name = policy.name

  def Stored(self, cell):
    return [n for n in self._policy.Stored(cell)
            if f'/{SCOPE}/' not in f'/{n}']


def WithInputs(kwargs, loss):
  """The layer's per-example kwargs with the loss's inputs (under INPUTS),
  to be microbatched with them."""
  if loss is None:
    return kwargs
  if INPUTS in kwargs:
    raise ValueError(f'FPropWithLoss: a kwarg may not be named {INPUTS!r}.')
  return dict(kwargs, **{INPUTS: loss.inputs})


def SplitOff(mb_kwargs, loss):
  """(the body's kwargs, the loss with its inputs microbatched [M, ...]),
  or (mb_kwargs, None) without a loss."""
  if loss is None:
    return mb_kwargs, None
  mb_kwargs = dict(mb_kwargs)
  mb_inputs = mb_kwargs.pop(INPUTS)
  return mb_kwargs, dataclasses.replace(loss, inputs=mb_inputs)
