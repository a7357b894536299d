"""Where a pipelined layer keeps its body's weights: three layouts.

    StackedLayout       single_stage_body       body/<v>         [S, (R,) ...]
    PerStageLayout      per_stage_vars=True     body_iter_<s>/<v>   [(R,) ...]
    StageParallelLayout stage_parallel_body     body/<v>      [(R,) S, ...]

(R: circular_repeat, present only when > 1; names and shapes as in Lingvo's
LayerwiseShardablePipelinedLayer.) Each answers the same few questions:
which children to create, one logical layer's weights, the stage-stacked
weights the loop carries, how the weights are placed on devices, the body's
non-trainable variables and how their final values are written back, and
how to run one layer on the whole batch (unrolled) or every stage once.
The pipelined layer holds one layout and asks it; it has no branch on
which one it is.
"""

import tensorflow as tf

from gpipe import nest
from gpipe.pipeline import stage_call
from gpipe.pipeline import non_trainable_vars
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap


def _Paths(theta):
  """The set of dotted paths of theta's leaves ('body.w', ...)."""
  if not isinstance(theta, NestedMap):
    raise TypeError(f'theta must be a NestedMap; got {type(theta).__name__}.')
  return frozenset(path for path, _ in theta.FlattenItems())


def LayoutFor(params, repeats):
  """The layout the params ask for."""
  if params.stage_parallel_body is not None:
    return StageParallelLayout(params, repeats)
  if params.per_stage_vars:
    return PerStageLayout(params, repeats)
  return StackedLayout(params, repeats)


class StackedLayout:
  """single_stage_body: one child `body`, every variable stage-stacked."""

  body_param = 'single_stage_body'
  stage_parallel = False
  layers_by_index = True  # LayerTheta takes tensor indices (layer_loop)

  def __init__(self, params, repeats):
    self.num_stages = params.num_stages
    self.repeats = repeats
    self._body_params = params.Get(self.body_param)

  # -- Children and weights. ------------------------------------------------

  def CreateChildren(self, layer):
    with py_utils.VariableShapePrefixContext(self.num_stages):
      with self.repeats.VariablePrefix():
        layer.CreateChild('body', self._body_params)

  def ChildScopeOverrides(self, layer_name):
    del layer_name
    return {}

  def Body(self, layer):
    """The child whose methods compute one stage (or all, stage-parallel)."""
    return layer.body

  def AsLayerTheta(self, theta, layer):
    """The layer's theta from either it or its `body` child's theta.

    Told apart by every weight's path, not by the top-level keys: a body
    whose only child is itself named `body` has the same top-level keys as
    the layer. The layer's paths are the body's with 'body.' in front, so
    the two sets are never equal.
    """
    paths = _Paths(theta)
    if not paths:  # a body without weights
      return theta if 'body' in theta else NestedMap(body=theta)
    if paths == _Paths(layer.vars):
      return theta
    if paths == _Paths(layer.vars.body):
      return NestedMap(body=theta)
    raise ValueError(
        f'PipelinedLayer {layer.params.name!r}: theta must be the layer\'s '
        'theta or its stage-stacked body weights (theta.body); got one with '
        f'weights {sorted(paths)[:3]}, expected '
        f'{sorted(_Paths(layer.vars.body))[:3]}.')

  def LayerTheta(self, theta, repeat, stage):
    """Logical layer repeat * S + stage's weights."""
    return tf.nest.map_structure(
        lambda t: self.repeats.Take(t[stage], repeat), theta.body)

  def Place(self, theta, placement):
    """theta with every weight annotated on its stage dim."""
    placed = theta.copy()
    placed.body = placement.SplitStages(theta.body, 0)
    return placed

  def LoopTheta(self, theta, placement):
    """The stage-stacked weights the loop carries, placed."""
    return self.Place(theta, placement).body

  # -- Non-trainable variables (see gpipe.pipeline.non_trainable_vars). --

  def NonTrainableNames(self, layer):
    """Names (as in the body's theta) of its non-trainable variables."""
    return [name for name, _ in
            non_trainable_vars.NonTrainableItems(self.Body(layer).vars)]

  def NonTrainableValues(self, theta, names):
    """The named variables' values in theta, each [S, (R,) ...]."""
    stacked = dict(theta.body.FlattenItems()) if names else {}
    return [tf.convert_to_tensor(stacked[n]) for n in names]

  def AssignOps(self, layer, names, values):
    """Ops writing the final [S, (R,) ...] values to the variables."""
    variables = dict(layer.vars.body.FlattenItems())
    return [variables[name].assign(value, read_value=False)
            for name, value in zip(names, values)]

  # -- Running the body outside the loop. -----------------------------------

  def AfterAssigning(self, layer, names, values, outputs):
    """Writes the final non-trainable values back (see
    gpipe.pipeline.non_trainable_vars); returns outputs that run after the
    writes."""
    if not names:
      return outputs
    with tf.control_dependencies(self.AssignOps(layer, names, values)):
      return nest.MapTensors(tf.identity, outputs)

  def RunLayerOnBatch(self, body, fn_name, theta, repeat, stage, inputs,
                      kwargs, kwargs_no_batch, var_names, carried):
    """One logical layer on the whole batch; returns (outputs, carried)."""
    take = lambda v: non_trainable_vars.TakeStageSlice(v, stage, repeat,
                                                       self.repeats)
    res = stage_call.CallStage(
        body, fn_name, self.LayerTheta(theta, repeat, stage), inputs,
        dict(kwargs, **kwargs_no_batch),
        where=f'layer {repeat * self.num_stages + stage} (unrolled)',
        var_names=var_names, var_values=[take(v) for v in carried])
    carried = [
        non_trainable_vars.PutStageSlice(v, stage, repeat, n, self.repeats)
        for v, n in zip(carried, res.new_vars)
    ]
    return res.outputs, carried

  def RunEveryStage(self, body, fn_name, theta, args, kwargs):
    """Every stage (repeat 0) once on the same inputs; outputs [S, ...].

    Not a pipeline step (e.g. 'InitStates': its outputs are states, not its
    inputs' structure), so the body is called directly.
    """
    fn = getattr(body.layer, fn_name)
    per_stage = []
    for stage in range(self.num_stages):
      with tf.name_scope(f'stage_{stage:03d}'):
        per_stage.append(
            fn(self.LayerTheta(theta, 0, stage), *args, **kwargs))
    return tf.nest.map_structure(lambda *xs: tf.stack(xs), *per_stage)


class PerStageLayout(StackedLayout):
  """per_stage_vars: a child per stage, body_iter_00000, ...

  Their variables live under <layer>/iter_<s> (Lingvo's names). The loop
  sees the stacked layout: they are stacked outside it, once per step.
  """

  layers_by_index = False  # a child per stage, named by its Python index

  def _ChildName(self, stage):
    return 'body_iter_%05d' % stage

  def _Children(self, tree):
    return [tree[self._ChildName(s)] for s in range(self.num_stages)]

  def CreateChildren(self, layer):
    for stage in range(self.num_stages):
      with self.repeats.VariablePrefix():
        layer.CreateChild(self._ChildName(stage), self._body_params)

  def ChildScopeOverrides(self, layer_name):
    return {self._ChildName(s): [layer_name, 'iter_%05d' % s]
            for s in range(self.num_stages)}

  def Body(self, layer):
    return getattr(layer, self._ChildName(0))

  def AsLayerTheta(self, theta, layer):
    del layer  # Per-stage children: the layer's theta is the only form.
    return theta

  def LayerTheta(self, theta, repeat, stage):
    return tf.nest.map_structure(lambda t: self.repeats.Take(t, repeat),
                                 theta[self._ChildName(stage)])

  def Place(self, theta, placement):
    """Each stage's own weights split on their least-padding dim."""
    placed = theta.copy()
    for s in range(self.num_stages):
      name = self._ChildName(s)
      placed[name] = tf.nest.map_structure(placement.SplitOwnVariable,
                                           theta[name])
    return placed

  def LoopTheta(self, theta, placement):
    """The stages' weights stacked, resharded onto the stage dim once."""
    per_stage = self._Children(self.Place(theta, placement))
    body = tf.nest.map_structure(lambda *xs: tf.stack(xs), *per_stage)
    return placement.SplitStages(body, 0)

  def NonTrainableValues(self, theta, names):
    per_stage = [dict(t.FlattenItems()) for t in self._Children(theta)]
    return [tf.stack([values[n] for values in per_stage]) for n in names]

  def AssignOps(self, layer, names, values):
    per_stage = [dict(v.FlattenItems()) for v in self._Children(layer.vars)]
    return [variables[name].assign(value[s], read_value=False)
            for name, value in zip(names, values)
            for s, variables in enumerate(per_stage)]


class StageParallelLayout(StackedLayout):
  """stage_parallel_body: one child computing all stages on [S, ...] inputs.

  Its variables are [S, ...] ([R, S, ...] when circular: the repeat prefix
  comes first). It manages its own variables, non-trainable ones included:
  the loop carries none for it.
  """

  body_param = 'stage_parallel_body'
  stage_parallel = True
  layers_by_index = False  # the body runs every stage at once

  def CreateChildren(self, layer):
    with self.repeats.VariablePrefix():
      layer.CreateChild('body', self._body_params)

  def _StageDim(self):
    return 0 if self.repeats.count == 1 else 1

  def LayerTheta(self, theta, repeat, stage):
    """The stage's slice of each weight: for inspection, as the body cannot
    consume one stage's weights."""
    return tf.nest.map_structure(
        lambda t: self.repeats.Take(t, repeat)[stage], theta.body)

  def Place(self, theta, placement):
    placed = theta.copy()
    placed.body = placement.SplitStages(theta.body, self._StageDim())
    return placed

  def NonTrainableNames(self, layer):
    del layer
    return []

  def RunLayerOnBatch(self, body, fn_name, theta, repeat, stage, inputs,
                      kwargs, kwargs_no_batch, var_names, carried):
    """Feeds every stage the same inputs and keeps this stage's result."""
    del var_names
    expand = lambda x: nest.MapTensors(  # pylint: disable=g-long-lambda
        lambda t: tf.broadcast_to(t[None], [self.num_stages] +
                                  py_utils.GetShape(t)), x)
    res = stage_call.CallStage(
        body, fn_name,
        tf.nest.map_structure(lambda t: self.repeats.Take(t, repeat),
                              theta.body),
        expand(inputs),
        dict({k: expand(v) for k, v in kwargs.items()}, **kwargs_no_batch),
        where=f'layer {repeat * self.num_stages + stage} (unrolled)')
    return nest.MapTensors(lambda t: t[stage], res.outputs), carried

  def RunEveryStage(self, body, fn_name, theta, args, kwargs):
    fn = getattr(body.layer, fn_name)
    return fn(
        tf.nest.map_structure(lambda t: self.repeats.Take(t, 0), theta.body),
        *args, **kwargs)
