"""The plain stack as a loop over its layers: its FLOPs at one layer's compile.

`unrolled.RunUnrolled` builds every one of the S * R logical layers into
the graph, so the forward pass XLA compiles grows with the layers: for
the largest pod LM on one device (gpipe.plan.model_flops) that compile
outlived the planner (docs/flagships.md has the times). Here the same
layers are one loop of S * R iterations over the layer index, each
iteration taking its layer's weights by that index out of the
stage-stacked [S, (R,) ...] weights:

    x -> [ layer l:  theta[l % S][l // S](x) ]  l = 0 .. S*R-1  -> y

XLA compiles one layer, and its cost analysis, counted per iteration
(gpipe.xla.spmd_worker.LoopAwareCost), gives the unrolled stack's FLOPs
plus a few scalar ones an iteration for the index. Where elementwise work
weighs (a narrow model), the two counts part by how XLA:CPU fuses: its
fusions copy cheap producers into each consumer, more often across an
unrolled stack, which then counts more; on the pod LMs, whose matmuls
dominate, the two agree (docs/flagships.md has both comparisons).

It computes what the unrolled stack computes, with what a count needs
and no more: the layers' aux losses are summed in the loop and added to
the caller's context once, as their sum; TPU summaries are dropped; each
layer draws its random numbers from the caller's step seed. A stack
whose layers carry per-layer states or non-trainable variables, or whose
weights are not indexed by stage (per_stage_vars, stage_parallel_body),
runs unrolled instead (`Runs`).
"""

import tensorflow as tf

from gpipe.loops import while_loops
from gpipe.pipeline import side_outputs
from gpipe.pipeline import stage_call
from lingvo.core import py_utils


def Runs(layout, per_layer_states, carried):
  """Whether a stack's layers can run as the loop: see the module doc."""
  return layout.layers_by_index and not per_layer_states and not carried


def RunLayerLoop(layout, body, fn_name, theta, args, kwargs, kwargs_no_batch):
  """The S * R layers in order, as one loop; returns the outputs tuple.

  Args as for unrolled.RunUnrolled (the layout's weights indexed by stage).
  """
  num_stages = layout.num_stages
  num_layers = num_stages * layout.repeats.count
  step_seed = py_utils.GetStepSeed()
  # The loop carries the inputs' tensors; their Nones stay out of it.
  leaves = tf.nest.flatten(tuple(args))
  carried = [i for i, leaf in enumerate(leaves) if leaf is not None]
  has_aux = []  # whether the body adds aux losses (seen when it is built)

  def Rebuilt(tensors):
    rebuilt = list(leaves)
    for i, t in zip(carried, tensors):
      rebuilt[i] = t
    return tf.nest.pack_sequence_as(tuple(args), rebuilt)

  # Carried: layer [] int32; tensors, the inputs' tensor leaves, each its
  # input's shape [b, ...] (a layer keeps its inputs' shapes); aux_sum [].
  def Layer(layer, tensors, aux_sum):
    stage, repeat = layer % num_stages, layer // num_stages
    res = stage_call.CallStage(
        body, fn_name, layout.LayerTheta(theta, repeat, stage),
        Rebuilt(tensors), dict(kwargs, **kwargs_no_batch),
        where='a layer (as a loop)',
        context=stage_call.StageContext(step_seed, None))
    aux = res.AuxLoss()
    has_aux.append(aux is not None)
    if aux is not None:
      aux_sum += aux
    outputs = tf.nest.flatten(res.outputs)
    return layer + 1, [outputs[i] for i in carried], aux_sum

  _, tensors, aux_sum = while_loops.WhileLoop(
      Layer, [tf.constant(0), [leaves[i] for i in carried],
              tf.zeros([], tf.float32)], num_layers)
  if any(has_aux):
    side_outputs.AddAuxLoss(aux_sum, 1, 'sum')
  return tuple(Rebuilt(tensors))
