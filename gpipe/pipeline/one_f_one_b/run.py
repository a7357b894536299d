"""The 1f1b pipeline's entry: the forward loop (keeping nothing per
iteration) as one tf.custom_gradient whose gradient is the gradient loop
(gradient_loop.GradientLoop); with a LastStageLoss, the gradient loop
alone. Each iteration's stage work is the _StageCell: stage_step.Step
traced once with its gradient (gpipe.loops.cell_graph).
"""

import dataclasses

from absl import logging
import tensorflow as tf
# pylint: disable=g-direct-tensorflow-import
from tensorflow.python.eager import record
# pylint: enable=g-direct-tensorflow-import

from gpipe.loops import cell_graph
from gpipe.loops import compiled_loops
from gpipe.loops import remat
from gpipe.loops import tensor_lists
from gpipe.loops import while_loops
from gpipe.pipeline.one_f_one_b import gradient_loop
from gpipe.pipeline import stage_ends
from gpipe.pipeline import loop_spec
from gpipe.pipeline import rotating_buffer
from gpipe.pipeline import stage_step
from gpipe import recurrent
from gpipe import sharding
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap

# The name scope of the forward loop (the planner tells it from the
# gradient loops by it).
FORWARD_LOOP = 'one_f_one_b_forward'

# What the stage cell reads of a table row (the backward tables say more).
_CELL_ROWS = ('microbatch', 'repeat', 'seed_offset', 'valid', 'reads')


def Run(spec, theta, mb_leaves, state_leaves,
        var_values) -> loop_spec.LoopResult:
  """The 1f1b pipeline (with spec.loss: `losses`, its sums, and no
  outputs).

  Args: as gpipe.pipeline.pipeline_loop.Run's.
  """
  loss, first_stage = stage_ends.ForTheLoop(
      (spec.loss, spec.first_stage), spec.runner, spec.placement,
      spec.schedule.num_stages)
  spec = dataclasses.replace(spec, loss=loss, first_stage=first_stage)
  io = loop_spec.Io(spec)
  native = io.ToNative(mb_leaves)
  cell = _StageCell(spec, theta, io.Filler(native), state_leaves, var_values)
  if spec.loss is not None:
    return _WithLoss(cell, io, theta, native, var_values)
  result = _Pipelined(cell, io, theta, native, state_leaves, var_values)
  return loop_spec.LoopResult(
      outputs=io.Outputs(result.outputs),
      states=[spec.placement.SplitStages(x, 1) for x in result.states],
      aux_loss=result.aux, summaries=result.summaries, vars=result.vars)


class _StageCell:
  """stage_step.Step traced once with its gradient (gpipe.loops.cell_graph): the
  forward loop and the forward wave import its forward, the backward wave
  its gradient.

  Attributes:
    graph: the CellGraph.
    spec: the loop_spec.LoopSpec.
    state0: NestedMap(buffer=[S, ...] leaves, vars=[S, (R,) ...]).
    read_variables: the variables the cell reads (checked in the gradient).
    aux_added: whether the body adds aux losses.
  """

  def __init__(self, spec, theta, filler, state_leaves, var_values):
    self.spec = spec
    self.aux_added = False
    place = spec.placement
    self.tables = stage_step.StageTables(spec.schedule)
    self.state0 = NestedMap(
        buffer=filler,
        vars=[place.SplitStages(tf.stop_gradient(v)) for v in var_values])
    self._inputs = NestedMap(
        rows=self.CellRows(self.tables),
        states=[place.SplitStages(x, 1) for x in state_leaves])
    policy = remat.For(spec.remat_policy)
    if spec.loss is not None and spec.runner.manual_mesh is None:
      policy = stage_ends.Unstored(policy)
    self.graph, self.read_variables = self._Build(theta, policy)
    if self.graph.stored and not self._StageMajor():
      logging.info(
          "PipelinedLayer %r: backward_schedule='1f1b' with remat_policy=%r "
          'keeps the stage inputs only (and recomputes the rest, with the '
          'same results): its stages run one after another, or in one '
          'stage-parallel call, whose activations have no stage dim to '
          'split a ring of them by.', spec.body.owner, spec.remat_policy)
      self.graph, self.read_variables = self._Build(theta, remat.Recompute())

  @staticmethod
  def CellRows(rows):
    """What the cell reads of a table row (backward rows say more)."""
    return NestedMap({n: rows[n] for n in _CELL_ROWS})

  def _Build(self, theta, policy):
    with record.VariableWatcher() as watcher:
      graph = cell_graph.CellGraph(
          self._Fn, theta, self.state0, self._inputs, policy,
          sharding.ManualBoundary.For(self.spec.runner.manual_mesh),
          data_state=NestedMap(buffer=[True] * len(self.state0.buffer),
                               vars=[False] * len(self.state0.vars)),
          keeps_new_state=False)
    return graph, watcher.watched_variables()

  def _Fn(self, theta, state, inp):
    spec = self.spec
    rows = inp.rows.Transform(spec.placement.ReplicateBookkeeping)
    step = stage_step.Step(
        spec, stage_step.StageRange.All(spec.schedule.num_stages), theta,
        rows, state.buffer, inp.states, state.vars)
    self.aux_added = step.aux_added
    return (NestedMap(buffer=step.outputs, vars=step.vars),
            NestedMap(aux=step.aux, summaries=step.summaries,
                      states=step.states, loss=step.losses))

  def _StageMajor(self):
    """Whether every activation of the cell has a leading stage dim (the
    stages vectorized, or each device's stage in a manual region), so that
    a ring can keep each stage's part of what the policy stores."""
    return self.spec.runner.stage_dim_inside

  def Forward(self, theta, buffer, var_values, rows, state_slots, captures,
              with_extras=True, with_stored=False):
    """(NestedMap(buffer, vars), extras, stored) of one iteration."""
    return self.graph.Forward(
        theta, NestedMap(buffer=buffer, vars=var_values),
        NestedMap(rows=self.CellRows(rows), states=state_slots), captures,
        with_stored=with_stored, with_extras=with_extras)


def _Pipelined(cell, io, theta, native, state_leaves, var_values):
  """The forward loop as a custom gradient whose gradient is the 1f1b
  loop: a NestedMap(outputs, aux, summaries, states, vars)."""
  graph = cell.graph
  diff_caps = graph.differentiable['captures']
  structure = (theta, native, state_leaves, var_values)
  Unflatten = _Unflattener(graph, structure)
  result_structure = []

  compiles = compiled_loops.IsAllowed()  # for the gradient's loops too

  @tf.custom_gradient
  def Pipelined(*flat):
    th, nat, states, var_vals, caps = Unflatten(flat)
    # Unrecorded: the while loop does not also build TensorFlow's own
    # gradient of itself for a GradientTape.
    with record.stop_recording():
      result = _ForwardLoop(cell, io, th, nat, states, var_vals, caps)
    result_structure.append(result)

    def Grad(*dys, variables=None):
      recurrent.CheckNoTrainableVariables(cell.read_variables)
      d = tf.nest.pack_sequence_as(result, [
          recurrent.ZeroIfNone(g, x) if g is None else tf.convert_to_tensor(g)
          for g, x in zip(dys, tf.nest.flatten(result))])
      with compiled_loops.Allowed(compiles):
        grads = gradient_loop.GradientLoop(
            cell, io, th, nat, states, var_vals, caps).Run(d)
      if variables is None:
        return grads
      return grads, [None] * len(variables)

    return tf.nest.flatten(result), Grad

  flat_args = [x for part in structure for x in tf.nest.flatten(part)]
  flat_out = Pipelined(*flat_args, *[graph.captures[i] for i in diff_caps])
  return tf.nest.pack_sequence_as(result_structure[0], flat_out)


def _Unflattener(graph, structure):
  """flat -> the parts of `structure` (theta, native inputs, states, the
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


def _WithLoss(cell, io, theta, native, var_values):
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
  diff_caps = graph.differentiable['captures']
  structure = (theta, native, [], var_values)
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
      if variables is None:
        return scaled
      return scaled, [None] * len(variables)

    return tf.nest.flatten(values), Grad

  flat_args = [x for part in structure for x in tf.nest.flatten(part)]
  flat_out = Scored(*flat_args, *[graph.captures[i] for i in diff_caps])
  values = tf.nest.pack_sequence_as(values_structure[0], flat_out)
  place = cell.spec.placement
  return loop_spec.LoopResult(
      outputs=[], states=[], losses=values.loss,
      aux_loss=tf.zeros([], tf.float32),
      summaries={name: (place.SplitStages(vw[None], 1),
                        place.SplitStages(w[None], 1))
                 for name, (vw, w) in values.summaries.items()},
      vars=values.vars)


def _ForwardLoop(cell, io, theta, native, state_leaves, var_values, caps):
  """The T forward iterations, keeping the outputs, the aux loss, the
  summaries and states per iteration, and no activation."""
  spec, place = cell.spec, cell.spec.placement
  t = spec.schedule.num_iterations
  states = [place.SplitStages(x, 1) for x in state_leaves]
  filler = cell.state0.buffer
  extras_spec = cell.graph.extras_spec
  carry = NestedMap(
      buffer=filler,  # [S, mb, ...] per leaf
      vars=[place.SplitStages(v) for v in var_values],  # [S, (R,) ...]
      reading=io.StartReading(native), writing=io.StartWriting(filler),
      # Per iteration, summed after the loop: a loop-carried scalar is what
      # the partitioner tends to give the body's manual sharding.
      aux=tensor_lists.Reserve(tf.TensorSpec([], tf.float32), t),
      summaries=tf.nest.map_structure(lambda s: tensor_lists.Reserve(s, t),
                                      extras_spec.summaries),
      states=[tensor_lists.Reserve(s, t) for s in extras_spec.states])

  def Body(i, carry):
    rows = gradient_loop.Row(cell.tables, i, place)  # [S] each

    def RunStages(stage_in):  # [S, mb, ...] per leaf
      new, extras, _ = cell.Forward(theta, stage_in, carry.vars, rows,
                                    [x[i] for x in states], caps)
      return new.buffer, (new, extras)

    stepped = rotating_buffer.Step(io, i, rows, native, carry.reading,
                                   carry.buffer, RunStages,
                                   writing=carry.writing)
    new, extras = stepped.ran
    return i + 1, NestedMap(
        buffer=stepped.buffer,  # [S, mb, ...] per leaf
        vars=new.vars,  # [S, (R,) ...] per variable
        reading=stepped.reading, writing=stepped.writing,
        aux=tensor_lists.SetEntry(carry.aux, i, place.ReplicateBookkeeping(
            tf.reduce_sum(extras.aux))),
        summaries=tf.nest.map_structure(
            lambda l, v: tensor_lists.SetEntry(l, i, v),
            carry.summaries, extras.summaries),
        states=[tensor_lists.SetEntry(l, i, v) for l, v in zip(carry.states,
                                                  extras.states)])

  with tf.name_scope(FORWARD_LOOP):
    _, final = while_loops.WhileLoop(Body, [tf.constant(0), carry], t)
  return NestedMap(
      outputs=io.FinishWriting(final.writing, filler),
      aux=place.ReplicateBookkeeping(tf.reduce_sum(
          tensor_lists.Stack(final.aux, tf.TensorSpec([], tf.float32), t))),
      summaries=tf.nest.map_structure(
          lambda l, s: place.SplitStages(tensor_lists.Stack(l, s, t), 1),
          final.summaries, extras_spec.summaries),
      states=[place.SplitStages(tensor_lists.Stack(l, s, t), 1)
              for l, s in zip(final.states, extras_spec.states)],
      vars=final.vars)


