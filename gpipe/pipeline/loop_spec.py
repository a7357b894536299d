"""What a call's loop is given (LoopSpec) and gives back (LoopResult): data.

The layer (gpipe.layers.PipelinedLayer) fills a LoopSpec once per call,
decides what the params leave to it (gpipe.pipeline.loop_choices) and
hands it, with the tensors, to the path it chose: layer by layer
(gpipe.pipeline.layer_by_layer), the pipeline loop with the reverse backward
(gpipe.pipeline.pipeline_loop) or with 1f1b (gpipe.pipeline.one_f_one_b).
Each gives back a LoopResult.
"""

import dataclasses
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from gpipe import nest
from gpipe.pipeline import repeats as repeats_lib
from gpipe.pipeline import stage_call
from gpipe.pipeline import stage_ends
from gpipe.pipeline import stage_runners
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
      name of a gpipe.loops.remat policy); None: as
      loop_choices.ChosenRematPolicy decides.
    skip_bubbles: on one device, run the fill and drain iterations on the
      stages that hold their useful work only (Schedule.Phases); None:
      where it pays (loop_choices.SkipsBubbles).
    backward_schedule: 'reverse' or '1f1b' (gpipe.pipeline.one_f_one_b).
    stream_io: whether the inputs and outputs are split over the stages
      (gpipe.pipeline.streamed_io).
    ring_split_mesh_dim: the mesh axis the 1f1b rings' entries are split
      over too (gpipe.pipeline.one_f_one_b.rings.SplitRingLayout), or None.
    loss: a gpipe.pipeline.stage_ends.LastStageLoss (its inputs
      microbatched, [M, ...]) the last stage takes, '1f1b' only; None.
    first_stage: a gpipe.pipeline.stage_ends.FirstStageInput (its inputs
      microbatched) stage 0 makes its inputs with, with `loss` only; None.
    io_kind: the class of the loop's io (gpipe.pipeline.loop_io), which
      the loop builds from this spec; None: as loop_choices.IoKind
      decides.
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
  io_kind: Optional[type] = None


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
