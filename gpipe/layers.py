"""PipelinedLayer: a GShard-style pipeline over a stack of identical layers.

The layer holds S stages (x R circular repeats) of one body layer and runs
them as a pipeline: the batch is split into M microbatches, and in every loop
iteration each stage works on a different microbatch, passing its result to
the next stage through a buffer of shape [S, microbatch, ...]::

    iteration i:   input[i] --> [stage 0 | stage 1 | ... | stage S-1] --> out
                                  ^   buffer rotates right by one    |
                                  +- (circular: the wrapped slot is -+
                                      read; linear: dropped)

With the stage dim of the weights and of the buffer split over devices, the
XLA SPMD partitioner turns the rotation into one collective-permute per
iteration. On one device the same layer runs unpartitioned and computes
exactly what running the S * R layers one after another computes.

Params and variable names/shapes follow Lingvo's
`gshard_layers.LayerwiseShardablePipelinedLayer`, so its configs and
checkpoints carry over. This module holds the Params and the public API,
and picks the path one FProp call takes, in one place each (modules of
gpipe.pipeline unless named; docs/how-it-works.md walks through it):

    check the Params   param_checks
    unrolled           unrolled: the S * R layers in turn   (FPropFn)
    split inputs       gpipe.microbatch     [B, ...] -> [M, mb, ...]
    run a loop                                               (_RunLoop)
      one device       layer_by_layer: each layer on every microbatch
      the schedule     pipeline_loop: T iterations over the [S, mb, ...]
                       buffer, the gradient in reverse (gpipe.recurrent)
                       one_f_one_b: a forward loop of its own over the
                       same iteration, the gradient in forward order
                       (backward_schedule='1f1b')
      each iteration   iteration.Iterate: read (loop_io), every stage once,
                       bubbles masked, rotate
    reassemble         gpipe.microbatch     [M, mb, ...] -> [B, ...]

What varies is delegated: where the weights live (layouts), which circular
repeat is in use (repeats), where tensors are placed (`gpipe.sharding`), the
schedule's arithmetic (`gpipe.schedule`), what the gradient stores or
recomputes (`gpipe.loops.remat`).
"""

from typing import Optional

from absl import logging
import tensorflow as tf

from gpipe.lingvo_support import flags_and_seeds
from gpipe.lingvo_support import variable_shardings
from gpipe.loops import compiled_loops
from gpipe import microbatch
from gpipe import nest
from gpipe.pipeline import layer_by_layer
from gpipe.pipeline import layer_params
from gpipe.pipeline import layouts
from gpipe.pipeline import loop_choices
from gpipe.pipeline import loop_spec
from gpipe.pipeline import param_checks
from gpipe.pipeline import per_stage_states
from gpipe.pipeline import pipeline_loop
from gpipe.pipeline import repeats
from gpipe.pipeline import one_f_one_b
from gpipe.pipeline import side_outputs
from gpipe.pipeline import stage_call
from gpipe.pipeline import stage_ends
from gpipe.pipeline import stage_runners
from gpipe.pipeline import unrolled
from gpipe.pipeline import vectorized_stages
from gpipe import schedule as schedule_lib
from gpipe import sharding
from lingvo.core import base_layer
from lingvo.core import gshard_utils
from lingvo.core import hyperparams

__all__ = [
    'PipelinedLayer',
    'LayerwiseShardablePipelinedLayer',
    'ValidateParams',
    'CheckedParams',
]

# The layer's methods that run the body: under tf.function, autograph traces
# them (and the body) as written, as a tf.Graph would (see README, TF2).
_NotConvertedByAutograph = tf.autograph.experimental.do_not_convert


# The pipeline's loops by backward_schedule (checked by param_checks).
_LOOPS = {'reverse': pipeline_loop.RunReverse,
          '1f1b': one_f_one_b.RunOneFOneB}


class PipelinedLayer(per_stage_states.PerStageStates, base_layer.BaseLayer):
  """Pipelines S stages (x R circular repeats) of a body layer.

  The body is either `single_stage_body` (one stage; this layer stacks its
  variables with a leading [S] or [S, R] dim) or `stage_parallel_body` (a
  layer that itself computes all S stages on inputs with a leading [S] dim).
  Its FProp(theta, *args, **kwargs) must return the same structure as args.

  Logical layer order is repeat-major: layer `r * S + s` is repeat r of stage
  s; `layer_theta(theta, r, s)` returns its weights.
  """

  @classmethod
  def Params(cls):
    """Lingvo's Params and gpipe's own; gpipe.pipeline.layer_params says what
    each one means."""
    p = super().Params()
    layer_params.DefineLingvos(p)
    layer_params.DefineGpipes(p)
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    param_checks.Check(p)
    param_checks.Normalize(p)
    flags_and_seeds.EnsureFlagsParsed()  # Lingvo bodies read flags.
    self._said_microbatched = False
    self._vectorizing = vectorized_stages.Vectorizing(p.vectorize_stages,
                                                      p.name)
    self._layer_by_layer = layer_by_layer.LayerByLayer(
        layer_by_layer.Resolve(p.layer_by_layer), p.name,
        param_checks.LayerByLayerRematPolicy(p))
    self._layout = layouts.LayoutFor(p, repeats.RepeatsFor(p.circular_repeat))
    self._placement = sharding.StagePlacement(
        p.num_stages, p.shard_stages_1d, p.device_mesh,
        p.pipeline_stage_mesh_dim)
    with gshard_utils.MeshSplitDimPrefixContext(p.pipeline_stage_mesh_dim):
      self._layout.CreateChildren(self)

  def _child_variable_scope_override(self):
    res = super()._child_variable_scope_override()
    res.update(self._layout.ChildScopeOverrides(self.params.name))
    return res

  @property
  def _body(self):
    """The child whose methods compute one stage (or all, stage-parallel)."""
    return stage_call.Body(self._layout.Body(self), self._layout.body_param,
                           self.params.name)

  def Schedule(self, num_microbatches):
    return schedule_lib.Schedule.ForLayer(self.params, num_microbatches)

  def layer_theta(self, theta, repeat_idx, stage_idx):
    """The weights of logical layer repeat_idx * num_stages + stage_idx.

    For a stage_parallel_body this is the stage's slice of each weight, which
    the stage-parallel body itself cannot consume; it is for inspection.
    """
    p = self.params
    param_checks.CheckIndex('repeat_idx', repeat_idx, p.circular_repeat)
    param_checks.CheckIndex('stage_idx', stage_idx, p.num_stages)
    return self._layout.LayerTheta(theta, repeat_idx, stage_idx)

  def PlaceVariables(self, theta):
    """theta with every variable annotated where the pipeline keeps it.

    Stage-stacked variables are split on their stage dim (dim 1 for the
    [R, S, ...] weights of a circular stage-parallel body); a stage's own
    variable (`per_stage_vars`) on its least-padding dim. Without
    `shard_stages_1d` or `pipeline_stage_mesh_dim` nothing is annotated.
    Anything of theta's structure can be placed this way, e.g. optimizer
    slots, so that they live split like their weights. Placed, each also
    keeps its variable's own annotation (the body's split of it, e.g. over
    a model axis, or a data axis too for FSDP), as a TPU keeps the
    variable (gpipe.lingvo_support.variable_shardings).
    """
    if self._placement.mesh is not None:
      theta = variable_shardings.AsTheirVariables(theta, self.vars)
    return self._layout.Place(theta, self._placement)

  # ---------------------------------------------------------------------------
  # Forward.

  def FProp(self, theta, *args, **kwargs):
    """The body's FProp over the pipeline: FPropFn(theta, 'FProp', ...)
    without per-stage states; the outputs in the structure of args."""
    return self.FPropFn(
        theta, 'FProp', *args, padded_per_stage_states=[], **kwargs)

  @_NotConvertedByAutograph
  def FPropWithLoss(self, theta, loss, *args, first_stage=None, **kwargs):
    """`loss` (a gpipe.pipeline.stage_ends.LastStageLoss) of FProp's
    outputs, summed over the batch: NestedMap of float32 scalars. The
    inputs are args, or what `first_stage` (a FirstStageInput) makes.

    Pipelined with backward_schedule='1f1b', the last stage scores each
    microbatch as it finishes and the loss's gradient starts back in the
    same iteration, and stage 0 makes each microbatch's inputs where it
    reads it: one loop computes the loss and its gradient, with no
    forward pass before it. Otherwise (the reverse schedule, unrolled, in
    eval) exactly loss.fn(loss.weights, FProp(theta, *args, **kwargs),
    loss.inputs), args = first_stage.fn(weights, inputs) if given.
    """
    if first_stage is not None and args:
      raise ValueError(
          f'PipelinedLayer {self.params.name!r}: FPropWithLoss takes its '
          'inputs as args or made by first_stage, not both; pass no args '
          'with first_stage.')
    if (self.params.backward_schedule != '1f1b' or self.do_eval or
        self._RunsUnrolled(states=())):
      if first_stage is not None:
        args = first_stage.Args(first_stage.weights, first_stage.inputs)
      return loss.Sums(loss.weights, self.FProp(theta, *args, **kwargs),
                       loss.inputs)
    if first_stage is not None:
      return self._MadeAndScoredInLoop(theta, loss, first_stage, kwargs)
    args, kwargs = microbatch.CheckInputs(args, kwargs)
    return self._PipelinedFProp(theta, 'FProp', args, kwargs, {}, [],
                                loss=loss)

  def _MadeAndScoredInLoop(self, theta, loss, first_stage, kwargs):
    """FPropWithLoss with a FirstStageInput, 1f1b: the gradient loop
    alone, stage 0 making each microbatch's inputs, the last stage scoring
    it (gpipe.pipeline.stage_ends)."""
    p = self.params
    # Any of first_stage's inputs stands for the args in the split: it
    # gives the batch, and the schedule.
    inputs = self._SplitInputs(
        tuple(tf.nest.flatten(first_stage.inputs)[:1]),
        stage_ends.WithInputs(kwargs, loss, first_stage))
    mb_kwargs, mb_loss, mb_first = stage_ends.SplitOff(inputs.kwargs, loss,
                                                       first_stage)
    made = nest.TensorLeaves(first_stage.Args(
        first_stage.weights,
        tf.nest.map_structure(lambda x: x[0], mb_first.inputs)))
    spec = self._LoopSpec(inputs.schedule, 'FProp', made, [], mb_kwargs, {},
                          mb_loss, mb_first)
    with tf.name_scope(p.name), compiled_loops.Allowed(
        p.compile_loops == 'auto'):
      result = self._RunLoop(
          spec, self._LoopTheta(theta), [x[None] for x in made.leaves], [],
          self._layout.NonTrainableValues(theta, spec.var_names))
      side_outputs.AddStageSummaries(result.summaries, p.num_stages)
      return self._layout.AfterAssigning(self, spec.var_names, result.vars,
                                         result.losses)

  @_NotConvertedByAutograph
  def FPropFn(self, theta, fn_name, *args, padded_per_stage_states,
              kwargs_no_batch=None, **kwargs):
    """Runs body method `fn_name` over the pipeline.

    With per-stage states (incremental decoding), the body method is called
    as fn(theta, *args, *states, **kwargs) and returns (*args', *states'):
    every stage keeps its own state for each microbatch it works on. A
    decoding step, with `cache` from PadMicrobatches (see there for the
    layout):

        y, cache = layer.FPropFn(theta, 'ExtendStep', x_t,
                                 padded_per_stage_states=[cache],
                                 kwargs_no_batch={'time_step': t})

    Args:
      theta: this layer's theta.
      fn_name: the body method to run, e.g. 'FProp' or 'ExtendStep'.
      *args: tensors, tuples or NestedMaps (None entries allowed) with the
        batch as leading dim; the body method returns the same structure.
      padded_per_stage_states: a list of states (tensors or NestedMaps) with
        leading dims [num_iterations, num_stages], as PadMicrobatches makes
        them. With unroll, a list of per-layer lists instead: entry k is
        [state of layer 0, ..., state of layer R * S - 1] on the whole
        batch, as the body's own method makes them (see layer_theta).
      kwargs_no_batch: passed to every stage unsliced (e.g. time_step).
      **kwargs: per-example tensors (leading batch dim), microbatched like
        args: each stage sees its own microbatch's slice. Their batch may
        differ from the args' if num_microbatches divides it: example r
        goes to microbatch r mod M, so a source tiled over the args'
        examples (example t uses source example t mod source_batch) stays
        tiled in every
        microbatch (see microbatch.CheckLeadingDims).

    Returns:
      The outputs, in the structure of args (a single arg is not wrapped).
      With states, pipelined: (*outputs, *updated padded states); unrolled:
      (outputs, updated per-layer lists), as Lingvo's layer returns them.
    """
    if not args:
      raise ValueError('PipelinedLayer.FProp needs at least one input.')
    args, kwargs = microbatch.CheckInputs(args, kwargs)
    states = list(padded_per_stage_states or [])
    if self._RunsUnrolled(states):
      return self._UnrolledFProp(theta, fn_name, args, kwargs,
                                 kwargs_no_batch or {}, states)
    return self._PipelinedFProp(theta, fn_name, args, kwargs,
                                kwargs_no_batch or {}, states)

  def _RunsUnrolled(self, states):
    """Whether a call runs the S * R layers one after another."""
    p = self.params
    return (p.unroll == 'always' or (p.unroll == 'eval_only' and self.do_eval)
            or (unrolled.Forced() and not states))

  def _UnrolledFProp(self, theta, fn_name, args, kwargs, kwargs_no_batch,
                     per_layer_states):
    """Runs the S * R layers one after another on the whole batch.

    Inputs already microbatched ([M, ...], neither num_microbatches nor
    microbatch_size set, as the GShard builders feed them) run microbatch by
    microbatch, as the pipeline computes them, and come back [M, ...]; the
    aux losses then combine over microbatches as the pipeline's do.
    """
    p = self.params
    names = self._layout.NonTrainableNames(self)
    carried = self._layout.NonTrainableValues(theta, names)
    run_args = (self._layout, self._body, fn_name, theta, args, kwargs,
                kwargs_no_batch, per_layer_states, names, carried)
    with tf.name_scope(p.name):
      if p.num_microbatches is None and p.microbatch_size is None:
        outputs, per_layer_states, carried = (
            unrolled.RunPremadeMicrobatches(
                p.aux_loss_microbatch_accumulation, *run_args))
      else:
        outputs, per_layer_states, carried = unrolled.RunUnrolled(*run_args)
      outputs, per_layer_states = self._layout.AfterAssigning(
          self, names, carried, (outputs, per_layer_states))
    outputs = outputs[0] if len(outputs) == 1 else tuple(outputs)
    if not per_layer_states:
      return outputs
    return outputs, per_layer_states

  def _PipelinedFProp(self, theta, fn_name, args, kwargs, kwargs_no_batch,
                      padded_states, loss=None):
    """Microbatches, runs the loop over the buffer, reassembles the batch
    (with a LastStageLoss: its sums, scored in the loop where it can)."""
    p = self.params
    if tf.executing_eagerly():
      raise RuntimeError(
          f'PipelinedLayer {p.name!r}: the pipeline is a while loop with a '
          'recomputing gradient and needs a graph; eager execution cannot '
          'run it. Call FProp inside tf.function (e.g. a training step under '
          '@tf.function(jit_compile=True) with tf.GradientTape) or in a '
          "tf.Graph; unroll='always' runs eagerly, unpipelined.")
    inputs = self._SplitInputs(args, stage_ends.WithInputs(kwargs, loss))
    mb_kwargs, mb_loss, _ = stage_ends.SplitOff(inputs.kwargs, loss)
    state_leaves = microbatch.CheckPaddedStates(padded_states,
                                                 inputs.schedule)
    spec = self._LoopSpec(inputs.schedule, fn_name, inputs.args,
                          padded_states, mb_kwargs, kwargs_no_batch, mb_loss)
    var_names = spec.var_names
    var_values = self._layout.NonTrainableValues(theta, var_names)
    loop_theta = self._LoopTheta(theta)
    with tf.name_scope(p.name), compiled_loops.Allowed(
        p.compile_loops == 'auto'):
      try:
        result = self._RunLoop(spec, loop_theta, inputs.args.leaves,
                               state_leaves, var_values)
      except Exception as e:
        if not inputs.split:
          e.add_note(microbatch.MicrobatchedNote(inputs))
        raise
      if result.losses is not None:
        side_outputs.AddStageSummaries(result.summaries, p.num_stages)
        return self._layout.AfterAssigning(self, var_names, result.vars,
                                           result.losses)
      outputs = [self._PlaceOutput(microbatch.ToBatch(x)) if inputs.split
                 else x for x in result.outputs]
      side_outputs.AddAuxLoss(result.aux_loss,
                              inputs.schedule.num_microbatches,
                              p.aux_loss_microbatch_accumulation)
      side_outputs.AddStageSummaries(result.summaries, p.num_stages)
      outputs, new_states = self._layout.AfterAssigning(
          self, var_names, result.vars, (outputs, result.states))
    outputs = inputs.args.Rebuild(outputs)
    if padded_states:
      return outputs + tuple(
          tf.nest.pack_sequence_as(padded_states, new_states))
    outputs = outputs[0] if len(outputs) == 1 else outputs
    if loss is not None:  # a path that does not score in the loop
      return loss.Sums(loss.weights, outputs, loss.inputs)
    return outputs

  def _RunLoop(self, spec, theta, mb_leaves, state_leaves, var_values):
    """The one place a microbatched call's path is chosen, and run.

        layer by layer    one device, where the call allows (every layer
                          on all microbatches: gpipe.pipeline.layer_by_layer)
        the pod's schedule, its backward as backward_schedule says:
          'reverse'       gpipe.pipeline.pipeline_loop
          '1f1b'          gpipe.pipeline.one_f_one_b

    (FPropFn chose unrolled, the S * R layers one after another on the
    whole batch, before anything was microbatched.)

    Args:
      spec: the call's loop_spec.LoopSpec.
      theta: the stage-stacked weights, placed, [S, (R,) ...] each.
      mb_leaves: the [M, mb, ...] tensor leaves of the microbatched inputs.
      state_leaves: the [T, S, ...] padded per-stage state leaves.
      var_values: the carried non-trainable values, [S, (R,) ...] each.

    Returns:
      The loop_spec.LoopResult.
    """
    if self._layer_by_layer.Runs(spec):
      try:
        result = layer_by_layer.RunLayerByLayer(
            spec, theta, mb_leaves, state_leaves,
            self._layer_by_layer.remat_policy)
        self._layer_by_layer.Ran()
        return result
      except vectorized_stages.CannotVectorize as e:
        self._layer_by_layer.CannotVectorize(e)
    spec = loop_choices.Decide(spec, theta, mb_leaves)
    return _LOOPS[spec.backward_schedule](spec, theta, mb_leaves,
                                          state_leaves, var_values)

  def _LoopSpec(self, sched, fn_name, args, states, mb_kwargs,
                kwargs_no_batch, loss=None, first_stage=None):
    """What the loop (or one of its iterations) needs besides tensors."""
    return loop_spec.LoopSpec(
        schedule=sched, body=self._body, fn_name=fn_name,
        runner=stage_runners.RunnerFor(self._layout.stage_parallel,
                                 self._placement, self._vectorizing),
        repeats=self._layout.repeats, placement=self._placement,
        args=args, states=states, mb_kwargs=mb_kwargs,
        kwargs_no_batch=kwargs_no_batch,
        base_seed=flags_and_seeds.NextStepSeed(),
        global_step=flags_and_seeds.CallersGlobalStep(),
        var_names=tuple(self._layout.NonTrainableNames(self)),
        remat_policy=param_checks.LoopRematPolicy(self.params, self.do_eval),
        skip_bubbles=self.params.skip_bubbles,
        backward_schedule=self.params.backward_schedule,
        stream_io=self.params.stream_io,
        ring_split_mesh_dim=self.params.ring_split_mesh_dim, loss=loss,
        first_stage=first_stage)

  @property
  def vectorizing(self):
    """How the stages run on one device (vectorized_stages.Vectorizing):
    its `reason` says why they run one after another, once known."""
    return self._vectorizing

  @property
  def layer_by_layer(self):
    """How calls run with the layer_by_layer param (on one device):
    gpipe.pipeline.layer_by_layer.LayerByLayer; `ran` says whether one ran layer
    by layer, `reason` why the last one ran the pipeline loop instead."""
    return self._layer_by_layer

  def _LoopTheta(self, theta):
    """The stage-stacked weights the loop carries, placed on the devices."""
    return self._layout.LoopTheta(theta, self._placement)

  def _PlaceOutput(self, x):
    """A [B, ...] output: with stream_io split over the stages (as it
    leaves the last stage's stream), else left to the caller."""
    return self._placement.SpreadLoopDim(x) if self.params.stream_io else x

  def _SplitInputs(self, args, kwargs):
    """The inputs checked and split (microbatch.SplitInputs); says once
    how it read inputs that it did not split."""
    place = self._placement
    inputs = microbatch.SplitInputs(
        args, kwargs, self.params,
        place.SpreadLoopDim if self.params.stream_io else
        place.ReplicateLoopDim)
    if not inputs.split and not self._said_microbatched:
      logging.info('PipelinedLayer %r: %s', self.params.name,
                   microbatch.MicrobatchedNote(inputs))
      self._said_microbatched = True
    return inputs


LayerwiseShardablePipelinedLayer = PipelinedLayer


CheckedParams = param_checks.CheckedParams


def ValidateParams(p: hyperparams.Params,
                   batch_size: Optional[int] = None) -> CheckedParams:
  """Checks PipelinedLayer params without building anything.

  Model params call this to fail fast, before a graph exists; the layer
  itself checks the same when it is instantiated (and the batch split when
  it runs).

  Args:
    p: PipelinedLayer params.
    batch_size: if given, also checks that it splits into the configured
      microbatches.

  Returns:
    What was checked, resolved (param_checks.CheckedParams): num_stages,
    circular_repeat, num_microbatches and microbatch_size (from batch_size
    when given), the schedule's num_iterations and bubble_fraction; str()
    says it in one line, e.g. '4 stages x 2 repeats, 16 microbatches of 4:
    35 iterations, bubble 0.086'.

  Raises:
    ValueError: naming the parameter and the fix.
  """
  param_checks.Check(p)
  return param_checks.Checked(p, batch_size)
