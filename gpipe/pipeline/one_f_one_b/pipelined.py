"""The 1f1b pipeline's entry, RunOneFOneB: the forward loop (forward_loop,
keeping nothing per iteration) as one tf.custom_gradient whose gradient is the
gradient loop (gradient_loop); with a LastStageLoss, the gradient loop
alone. The two loops share the cell (cell.StageCell) and nothing else.
"""

import dataclasses

import tensorflow as tf
# pylint: disable=g-direct-tensorflow-import
from tensorflow.python.eager import record
# pylint: enable=g-direct-tensorflow-import

from gpipe.loops import compiled_loops
from gpipe.pipeline.one_f_one_b import cell as cell_lib
from gpipe.pipeline.one_f_one_b import forward_loop
from gpipe.pipeline.one_f_one_b import gradient_loop
from gpipe.pipeline import stage_ends
from gpipe.pipeline import loop_spec
from gpipe import recurrent
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap


def RunOneFOneB(spec, theta, mb_leaves, state_leaves,
                var_values) -> loop_spec.LoopResult:
  """The 1f1b pipeline (with spec.loss: `losses`, its sums, and no
  outputs).

  Args: as gpipe.pipeline.pipeline_loop.RunReverse's.
  """
  if spec.loss is not None:
    return _Scored(spec, theta, mb_leaves, state_leaves, var_values)
  io = spec.io_kind(spec)
  held = io.Hold(mb_leaves)  # [M, mb, ...] or [K, S, mb, ...] a leaf
  cell = cell_lib.StageCell(spec, theta, io.Filler(held), state_leaves,
                            var_values)
  result = _Pipelined(cell, io, theta, held, state_leaves, var_values)
  return loop_spec.LoopResult(
      outputs=io.Outputs(result.outputs),
      states=[spec.placement.SplitStages(x, 1) for x in result.states],
      aux_loss=result.aux, summaries=result.summaries, vars=result.vars)


def _Scored(spec, theta, mb_leaves, state_leaves, var_values):
  """With a LastStageLoss: the ends' weights read for the loop
  (stage_ends.ForTheLoop), the ScoringCell, the gradient loop alone."""
  loss, first_stage = stage_ends.ForTheLoop(
      (spec.loss, spec.first_stage), spec.runner, spec.placement,
      spec.schedule.num_stages)
  spec = dataclasses.replace(spec, loss=loss, first_stage=first_stage)
  io = spec.io_kind(spec)
  held = io.Hold(mb_leaves)  # as for RunOneFOneB; made: [1, ...]
  cell = cell_lib.ScoringCell(spec, theta, io.Filler(held), state_leaves,
                              var_values)
  return _WithLoss(cell, io, theta, held, var_values)


def _Pipelined(cell, io, theta, held, state_leaves, var_values):
  """The forward loop as a custom gradient whose gradient is the 1f1b
  loop: a NestedMap(outputs, aux, summaries, states, vars)."""
  graph = cell.graph
  structure = (theta, held, state_leaves, var_values)
  Unflatten = _Unflattener(graph, structure)
  result_structure = []

  compiles = compiled_loops.IsAllowed()  # for the gradient's loops too

  @tf.custom_gradient
  def Pipelined(*flat):
    th, nat, states, var_vals, caps = Unflatten(flat)
    # Unrecorded: the while loop does not also build TensorFlow's own
    # gradient of itself for a GradientTape.
    with record.stop_recording():
      result = forward_loop.ForwardLoop(cell, io, th, nat, states, var_vals,
                                        caps)
    result_structure.append(result)

    def Grad(*dys, variables=None):
      recurrent.CheckNoTrainableVariables(cell.read_variables)
      d = tf.nest.pack_sequence_as(result, [
          recurrent.ZeroIfNone(g, x) if g is None else tf.convert_to_tensor(g)
          for g, x in zip(dys, tf.nest.flatten(result))])
      with compiled_loops.Allowed(compiles):
        grads = gradient_loop.GradientLoop(
            cell, io, th, nat, states, var_vals, caps).Gradients(d)
      return _NoVariableGradients(grads, variables)

    return tf.nest.flatten(result), Grad

  flat_out = Pipelined(*_FlatArguments(graph, structure))
  return tf.nest.pack_sequence_as(result_structure[0], flat_out)


def _FlatArguments(graph, structure):
  """A custom gradient's flat arguments: the parts of `structure`, then the
  cell's differentiable captures (what _Unflattener takes apart)."""
  return ([x for part in structure for x in tf.nest.flatten(part)] +
          [graph.captures[i] for i in graph.differentiable['captures']])


def _NoVariableGradients(grads, variables):
  """A custom gradient's answer: the loops' gradients, and None for every
  variable it read (the cell reads none that trains:
  recurrent.CheckNoTrainableVariables)."""
  if variables is None:
    return grads
  return grads, [None] * len(variables)


def _Unflattener(graph, structure):
  """flat -> the parts of `structure` (theta, held inputs, states, the
  vars' values) and the cell's captures with the differentiable ones
  replaced by the rest of flat: how a custom gradient's flat arguments
  come back apart."""
  diff_caps = graph.differentiable['captures']
  sizes = [len(tf.nest.flatten(x)) for x in structure]

  def Unflatten(flat):
    parts, rest = [], list(flat)
    for like, n in zip(structure, sizes):
      parts.append(tf.nest.pack_sequence_as(like, rest[:n]))
      rest = rest[n:]
    caps = list(graph.captures)
    for i, c in zip(diff_caps, rest):
      caps[i] = c
    return parts + [caps]

  return Unflatten


def _WithLoss(cell, io, theta, held, var_values):
  """The gradient loop alone, scoring each microbatch at the last stage
  (gradient_loop.GradientLoop.RunWithLoss), as a custom gradient: its
  value the loss's sums, its gradient the loop's gradients of the
  differentiated sum, scaled by that sum's incoming gradient."""
  graph = cell.graph
  loss = cell.spec.loss
  if cell.aux_added:
    raise ValueError(
        f'PipelinedLayer {cell.spec.body.owner!r}: FPropWithLoss with '
        "backward_schedule='1f1b' differentiates the loss alone, and the "
        'body adds aux losses; use the reverse backward_schedule (or FProp '
        'and a loss of your own) for a body with aux losses.')
  structure = (theta, held, [], var_values)
  Unflatten = _Unflattener(graph, structure)
  values_structure = []

  compiles = compiled_loops.IsAllowed()

  @tf.custom_gradient
  def Scored(*flat):
    th, nat, states, var_vals, caps = Unflatten(flat)
    with record.stop_recording(), compiled_loops.Allowed(compiles):
      values, grads = gradient_loop.GradientLoop(
          cell, io, th, nat, states, var_vals, caps, loss=loss).RunWithLoss()
    values_structure.append(values)
    position = sorted(values.loss).index(loss.differentiated)

    def Grad(*dys, variables=None):
      recurrent.CheckNoTrainableVariables(cell.read_variables)
      d_loss = dys[position]
      scaled = [None if g is None else g * tf.cast(d_loss, g.dtype)
                for g in grads]
      return _NoVariableGradients(scaled, variables)

    return tf.nest.flatten(values), Grad

  flat_out = Scored(*_FlatArguments(graph, structure))
  values = tf.nest.pack_sequence_as(values_structure[0], flat_out)
  place = cell.spec.placement
  return loop_spec.LoopResult(
      outputs=[], states=[], losses=values.loss,
      aux_loss=tf.zeros([], tf.float32),
      summaries={name: (place.SplitStages(vw[None], 1),
                        place.SplitStages(w[None], 1))
                 for name, (vw, w) in values.summaries.items()},
      vars=values.vars)
