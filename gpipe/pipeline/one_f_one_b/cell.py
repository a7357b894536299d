"""The 1f1b loops' cell: one iteration's stage work, traced once with its
gradient, which the forward loop and both waves of the gradient loop share.

    StageCell     gpipe.pipeline.iteration.RunStages traced once as a graph
                  (gpipe.loops.cell_graph): every stage's call, bubbles
                  masked, on [S, mb, ...] stage inputs
    .Bind(...)    -> BoundCell, the cell an iteration.Iterate runs: its
                  forward imported (the forward loop, the forward wave)
    .Backward     its gradient, the backward wave's (gradient_loop)
    Row           row i of the schedule's [T, S] tables, [S] per field

Neither loop calls into the other: each builds on this cell.
"""

import dataclasses
from typing import Any, List

from absl import logging
import tensorflow as tf
# pylint: disable=g-direct-tensorflow-import
from tensorflow.python.eager import record
# pylint: enable=g-direct-tensorflow-import

from gpipe.loops import cell_graph
from gpipe.loops import remat
from gpipe.pipeline import iteration
from gpipe.pipeline import stage_ends
from gpipe import sharding
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap

# What the cell reads of a row (the backward wave's rows say more).
_CELL_FIELDS = ('microbatch', 'repeat', 'seed_offset', 'valid', 'reads')


class StageCell:
  """iteration.RunStages on all S stages, traced once with its gradient.

  Attributes:
    spec: the loop_spec.LoopSpec.
    tables: the schedule's rows as [T, S] tensors per field
      (iteration.Tables).
    state0: NestedMap(buffer=[S, mb, ...] per leaf, vars=[S, (R,) ...] per
      variable): the first iteration's.
    graph: the CellGraph.
    read_variables: the variables the cell reads (checked in the gradient).
    aux_added: whether the body adds aux losses.
  """

  def __init__(self, spec, theta, filler, state_leaves, var_values):
    self.spec = spec
    self.aux_added = False
    place = spec.placement
    self.tables = iteration.Tables(spec.schedule.Rows())
    self.state0 = NestedMap(
        buffer=filler,
        vars=[place.SplitStages(tf.stop_gradient(v)) for v in var_values])
    self._inputs = NestedMap(
        row=CellFields(self.tables),  # [T, S] per field
        states=[place.SplitStages(x, 1) for x in state_leaves])  # [T, S, ...]
    self.graph, self.read_variables = self._Build(
        theta, self._Policy(remat.For(spec.remat_policy)))
    if self.graph.stored and not spec.runner.stage_dim_inside:
      # Without a stage dim on every activation (the stages run one after
      # another, or in one stage-parallel call), a ring cannot keep each
      # stage's part of what the policy stores.
      logging.info(
          "PipelinedLayer %r: backward_schedule='1f1b' with remat_policy=%r "
          'keeps the stage inputs only (and recomputes the rest, with the '
          'same results): its stages run one after another, or in one '
          'stage-parallel call, whose activations have no stage dim to '
          'split a ring of them by.', spec.body.owner, spec.remat_policy)
      self.graph, self.read_variables = self._Build(theta, remat.Recompute())

  def _Build(self, theta, policy):
    with record.VariableWatcher() as watcher:
      graph = cell_graph.CellGraph(
          self._Fn, theta, self.state0, self._inputs, policy,
          sharding.ManualBoundary.For(self.spec.runner.manual_mesh),
          activation_state=NestedMap(buffer=[True] * len(self.state0.buffer),
                               vars=[False] * len(self.state0.vars)),
          keeps_new_state=False)
    return graph, watcher.watched_variables()

  def _Policy(self, policy):
    """What the cell stores for the backward wave: the remat policy's."""
    return policy

  def _Fn(self, theta, state, inp):
    done = self._Work(
        theta, inp.row.Transform(self.spec.placement.ReplicateBookkeeping),
        state.buffer, inp.states, state.vars)
    self.aux_added = done.aux_added
    return (NestedMap(buffer=done.outputs, vars=done.vars),
            NestedMap(aux=done.aux, summaries=done.summaries,
                      states=done.states, loss=done.losses))

  def _Work(self, theta, row, stage_in, stage_states, var_values):
    """Every stage's call, bubbles masked (iteration.MaskedStages)."""
    return iteration.RunStages(
        self.spec, iteration.StageRange.All(self.spec.schedule.num_stages),
        theta, row, stage_in, stage_states, var_values)

  def Bind(self, theta, captures, with_extras=True, with_stored=False):
    """The cell an iteration.Iterate runs, on these weights and captures."""
    return BoundCell(self, theta, captures, with_extras, with_stored)


class ScoringCell(StageCell):
  """A StageCell with FPropWithLoss's ends (gpipe.pipeline.stage_ends):
  stage 0 makes its fresh inputs where there is a FirstStageInput, and the
  last stage scores what it finishes with the LastStageLoss."""

  def _Policy(self, policy):
    # On one device what the ends compute has no stage dim for a ring to
    # split by: the backward wave computes it again.
    if self.spec.runner.manual_mesh is None:
      return stage_ends.Unstored(policy)
    return policy

  def _Work(self, theta, row, stage_in, stage_states, var_values):
    spec = self.spec
    if spec.first_stage is not None:  # stage 0 makes its fresh inputs
      stage_in = stage_ends.FirstStageInputs(
          spec.first_stage, stage_in, row.reads, row.microbatch, spec.runner,
          spec.placement)
    done = super()._Work(theta, row, stage_in, stage_states, var_values)
    return dataclasses.replace(done, losses=self._LastStageSums(row, done))

  def _LastStageSums(self, row, done):
    """The LastStageLoss's sums per stage, [S] each: scored where a stage
    ran the last layer on a valid microbatch."""
    spec = self.spec
    sched = spec.schedule
    is_last = (row.valid &
               tf.equal(row.repeat, sched.circular_repeat - 1) &
               tf.equal(tf.range(sched.num_stages), sched.num_stages - 1))
    built = spec.args.Rebuild(done.outputs)
    return stage_ends.StageSums(
        spec.loss, built[0] if len(built) == 1 else built, is_last,
        row.microbatch, spec.runner, spec.placement)


@dataclasses.dataclass(frozen=True)
class BoundCell:
  """A StageCell's forward on given weights: what iteration.Iterate runs.

  Attributes:
    cell: the StageCell.
    theta: the stage-stacked weights, [S, (R,) ...].
    captures: the cell's captured tensors (their loop values).
    with_extras: whether to return the aux losses, summaries, states and
      loss sums (the forward loop; with a LastStageLoss, the forward wave).
    with_stored: whether to return what the remat policy keeps (the
      forward wave, for its rings).
  """
  cell: StageCell
  theta: Any
  captures: List[tf.Tensor]
  with_extras: bool
  with_stored: bool

  def Apply(self, stage_in, var_values, row,
            stage_states) -> iteration.MaskedStages:
    new, extras, stored = self.cell.graph.Forward(
        self.theta, NestedMap(buffer=stage_in, vars=var_values),
        NestedMap(row=CellFields(row), states=stage_states), self.captures,
        with_stored=self.with_stored, with_extras=self.with_extras)
    extras = extras or NestedMap(aux=None, summaries={}, states=[],
                                 loss=NestedMap())
    return iteration.MaskedStages(
        outputs=new.buffer, vars=new.vars, aux=extras.aux,
        summaries=extras.summaries, states=extras.states, losses=extras.loss,
        aux_added=self.cell.aux_added, stored=stored)


def CellFields(row):
  """What the cell reads of a row or table (backward rows say more)."""
  return NestedMap({n: row[n] for n in _CELL_FIELDS})
