"""What a call's loop is given and gives back, and the remat policy it runs.

The layer (gpipe.layers.PipelinedLayer) fills a LoopSpec once per call and
hands it, with the tensors, to the path it chose: layer by layer
(gpipe.pipeline.layer_by_layer), the pipeline loop with the reverse backward
(gpipe.pipeline.pipeline_loop) or with 1f1b (gpipe.pipeline.one_f_one_b).
Each gives back a LoopResult.
"""

import dataclasses
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from gpipe import nest
from gpipe.pipeline import loop_io
from gpipe.pipeline import repeats as repeats_lib
from gpipe.pipeline import stage_call
from gpipe.pipeline import stage_ends
from gpipe.pipeline import stage_runners
from gpipe.pipeline import streamed_io
from gpipe import schedule as schedule_lib
from gpipe import sharding
from lingvo.core import py_utils


@dataclasses.dataclass(frozen=True, eq=False)
class LoopSpec:
  """Everything the loop needs besides the tensors it carries.

  Attributes:
    schedule: which stage works on what, per iteration.
    body: the body layer.
    fn_name: the body method each stage runs.
    runner: runs every stage of an iteration (a
      gpipe.pipeline.stage_runners.StageRunner, which says what it can do).
    repeats: the circular-repeat selector (gpipe.pipeline.repeats: a
      Linear, or a Circular one).
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
      over too (gpipe.pipeline.one_f_one_b.rings.SplitRingLayout), or None.
    loss: a gpipe.pipeline.stage_ends.LastStageLoss (its inputs
      microbatched, [M, ...]) the last stage takes, '1f1b' only; None.
    first_stage: a gpipe.pipeline.stage_ends.FirstStageInput (its inputs
      microbatched) stage 0 makes its inputs with, with `loss` only; None.
  """
  schedule: schedule_lib.Schedule
  body: stage_call.Body
  fn_name: str
  runner: stage_runners.StageRunner
  repeats: repeats_lib.Linear
  placement: sharding.StagePlacement
  args: nest.TensorLeaves
  states: List[nest.Structure]
  mb_kwargs: Dict[str, nest.Structure]
  kwargs_no_batch: Dict[str, nest.Structure]
  base_seed: tf.Tensor
  global_step: Optional[tf.Tensor]
  var_names: Tuple[str, ...]
  remat_policy: Optional[str]
  skip_bubbles: Optional[bool] = False
  backward_schedule: str = 'reverse'
  stream_io: bool = False
  ring_split_mesh_dim: Optional[int] = None
  loss: Optional[stage_ends.LastStageLoss] = None
  first_stage: Optional[stage_ends.FirstStageInput] = None


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
  losses: Optional[py_utils.NestedMap] = None


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


def Io(spec) -> loop_io.LoopInputs:
  """The loop io the call asks for: a loop_io.LoopIo (whole, or streamed
  with stream_io), or with a FirstStageInput (1f1b with a LastStageLoss:
  no outputs) loop_io.MadeAtStageZero."""
  if spec.first_stage is not None:
    return loop_io.MadeAtStageZero(spec)
  if spec.stream_io:
    return streamed_io.StreamedIo(spec)
  return loop_io.WholeIo(spec)


def WithRematPolicy(spec, theta, mb_leaves) -> LoopSpec:
  """spec with its remat_policy decided (RematPolicy)."""
  return dataclasses.replace(
      spec, remat_policy=RematPolicy(spec, theta, mb_leaves))
