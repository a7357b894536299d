"""PipelinedLayer: a GShard-style pipeline over a stack of identical layers.

The layer holds S stages (x R circular repeats) of one body layer and runs
them as a pipeline: the batch is split into M microbatches, and in every loop
iteration each stage works on a different microbatch, passing its result to
the next stage through a buffer of shape [S, microbatch, ...]::

    iteration i:   input[i] --> [stage 0 | stage 1 | ... | stage S-1] --> out
                                  ^    buffer shifts right by one    |
                                  +------- (circular: rotates) ------+

With the stage dim of the weights and of the buffer split over devices, the
XLA SPMD partitioner turns the shift into one collective-permute per
iteration. On one device the same layer runs unpartitioned and computes
exactly what running the S * R layers one after another computes.

Params and variable names/shapes follow Lingvo's
`gshard_layers.LayerwiseShardablePipelinedLayer`, so its configs and
checkpoints carry over. The schedule arithmetic lives in `gpipe.schedule`,
the layout changes in `gpipe.microbatch`, the loop and its recomputing
gradient in `gpipe.recurrent`, and annotations in `gpipe.sharding`.
"""

import contextlib

from absl import flags
import numpy as np
import tensorflow as tf

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
from gpipe import microbatch
from gpipe import recurrent
from gpipe import schedule as schedule_lib
from gpipe import sharding
from gpipe import stage_vars
from lingvo.core import base_layer
from lingvo.core import gshard_utils
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap

_UNROLL_VALUES = ('never', 'eval_only', 'always')
_AUX_LOSS_ACCUMULATIONS = ('mean', 'sum')


def _PerStageChildName(stage):
  return 'body_iter_%05d' % stage


class PipelinedLayer(base_layer.BaseLayer):
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
    p = super().Params()
    p.Define('num_stages', 1, 'Number of pipeline stages S.')
    p.Define(
        'single_stage_body', None,
        'Params of one stage. Its variables get a leading [num_stages] dim '
        '([num_stages, circular_repeat] when circular).')
    p.Define(
        'stage_parallel_body', None,
        'Params of a layer that computes all stages at once: its inputs and '
        'weights have a leading num_stages dim. Excludes single_stage_body.')
    p.Define(
        'num_microbatches', None,
        'Split the batch into this many microbatches. If neither this nor '
        'microbatch_size is set, the inputs are already [M, ...].')
    p.Define('microbatch_size', None,
             'Split the batch into microbatches of this size.')
    p.Define(
        'shard_stages_1d', False,
        'Split the stage dim of weights and buffer over num_stages devices.')
    p.Define(
        'pipeline_stage_mesh_dim', None,
        'Split the stage dim over this axis of device_mesh (instead of '
        'shard_stages_1d); the body annotates its tensors without the stage '
        'dim.')
    p.Define('per_stage_vars', False,
             'Separate variables per stage (children body_iter_00000, ...). '
             'With single_stage_body only.')
    p.Define('circular_repeat', 1,
             'R > 1 makes the pipeline circular: each microbatch passes '
             'through the S stages R times (S * R layers in all).')
    p.Define('unroll', 'eval_only',
             'never | eval_only | always: run the layers one after another '
             'instead of pipelining (always, or in eval only).')
    p.Define('aux_loss_microbatch_accumulation', 'mean',
             'mean | sum: how aux losses added by the body combine over '
             'microbatches.')
    p.Define(
        'store_body_intermediates', False,
        'If True, the backward pass uses the body activations stored by the '
        'forward pass (faster, more memory). If False, it recomputes each '
        'iteration from the saved buffer (activation memory = buffer x '
        'iterations).')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _ValidateParams(p)
    with gshard_utils.MeshSplitDimPrefixContext(p.pipeline_stage_mesh_dim):
      if p.stage_parallel_body is not None:
        with self._CircularPrefix():
          self.CreateChild('body', p.stage_parallel_body)
      elif p.per_stage_vars:
        for stage in range(p.num_stages):
          with self._CircularPrefix():
            self.CreateChild(_PerStageChildName(stage), p.single_stage_body)
      else:
        with py_utils.VariableShapePrefixContext(p.num_stages):
          with self._CircularPrefix():
            self.CreateChild('body', p.single_stage_body)

  def _CircularPrefix(self):
    """Adds the [circular_repeat] variable dim (unsharded) when circular."""
    p = self.params
    if p.circular_repeat == 1:
      return contextlib.nullcontext()
    return _Chain(
        gshard_utils.MeshSplitDimPrefixContext(-1),
        py_utils.VariableShapePrefixContext(p.circular_repeat))

  def _child_variable_scope_override(self):
    p = self.params
    res = super()._child_variable_scope_override()
    if p.per_stage_vars:
      for stage in range(p.num_stages):
        res[_PerStageChildName(stage)] = [p.name, 'iter_%05d' % stage]
    return res

  @property
  def _body(self):
    """The child whose FProp computes one stage (or all, stage-parallel)."""
    if self.params.per_stage_vars:
      return getattr(self, _PerStageChildName(0))
    return self.body

  def Schedule(self, num_microbatches):
    p = self.params
    return schedule_lib.Schedule(p.num_stages, num_microbatches,
                                 p.circular_repeat)

  # ---------------------------------------------------------------------------
  # Per-layer weights.

  def layer_theta(self, theta, repeat_idx, stage_idx):
    """The weights of logical layer repeat_idx * num_stages + stage_idx.

    For a stage_parallel_body this is the stage's slice of each weight, which
    the stage-parallel body itself cannot consume; it is for inspection.
    """
    p = self.params
    _CheckIndex('repeat_idx', repeat_idx, p.circular_repeat)
    _CheckIndex('stage_idx', stage_idx, p.num_stages)
    if p.per_stage_vars:
      stage_theta = theta[_PerStageChildName(stage_idx)]
      if p.circular_repeat == 1:
        return stage_theta
      return tf.nest.map_structure(lambda t: t[repeat_idx], stage_theta)
    if p.stage_parallel_body is not None:
      if p.circular_repeat == 1:
        return tf.nest.map_structure(lambda t: t[stage_idx], theta.body)
      return tf.nest.map_structure(lambda t: t[repeat_idx][stage_idx],
                                   theta.body)

    def _Slice(t):
      t = t[stage_idx]
      return t[repeat_idx] if p.circular_repeat > 1 else t

    return tf.nest.map_structure(_Slice, theta.body)

  # ---------------------------------------------------------------------------
  # Per-stage states (incremental decoding).

  def BodyFPropNoMicrobatching(self, theta, fn_name, *args, **kwargs):
    """Runs body method `fn_name` for every stage on the whole batch.

    For methods such as 'InitStates' that make per-stage states: stage s
    runs with its own weights (repeat 0 when circular), and every output
    gets a leading [num_stages] dim.

    Args:
      theta: the stage-stacked body weights, `theta.body` (as in Lingvo's
        layer), or this layer's theta.
      fn_name: the body method.
      *args: passed to every stage as they are.
      **kwargs: passed to every stage as they are.

    Returns:
      (outputs with a leading [num_stages] dim, a no-op), the pair Lingvo's
      layer returns.
    """
    p = self.params
    fn = getattr(self._body, fn_name)
    layer_theta = self._AsLayerTheta(theta)
    if p.stage_parallel_body is not None:
      stacked = layer_theta.body
      if p.circular_repeat > 1:
        stacked = tf.nest.map_structure(lambda t: t[0], stacked)
      out = fn(stacked, *args, **kwargs)
    else:
      per_stage = []
      for stage in range(p.num_stages):
        with tf.name_scope(f'stage_{stage:03d}'):
          per_stage.append(
              fn(self.layer_theta(layer_theta, 0, stage), *args, **kwargs))
      out = tf.nest.map_structure(lambda *xs: tf.stack(xs), *per_stage)
    out = _MapTensor(lambda t: self._SplitStages(t, 0), out)
    return out, tf.no_op()

  def _AsLayerTheta(self, theta):
    """This layer's theta from either it or its `body` child's theta."""
    if self.params.per_stage_vars:
      return theta
    if isinstance(theta, NestedMap) and set(theta.keys()) == {'body'}:
      return theta
    return NestedMap(body=theta)

  def MicrobatchStates(self, per_stage_states):
    """[S, B, ...] states of the whole batch -> [M, S, B/M, ...].

    Microbatch m holds the same examples as the layer's inputs' microbatch m.
    """
    p = self.params

    def Split(x):
      if not microbatch.IsTensor(x):
        return x
      batch = x.shape.as_list()[1]
      num_mb, split = microbatch.ResolveNumMicrobatches(
          batch, p.num_microbatches, p.microbatch_size)
      if not split:
        raise ValueError(
            'MicrobatchStates needs num_microbatches or microbatch_size to '
            'split the batch; with neither set, states are already '
            '[M, num_stages, ...]: pass them to PadMicrobatches directly.')
      perm = [1, 0] + list(range(2, x.shape.rank))
      mb = microbatch.ToMicrobatches(tf.transpose(x, perm), num_mb)
      return tf.transpose(mb, [0, 2, 1] + list(range(3, mb.shape.rank)))

    return tf.nest.map_structure(Split, per_stage_states)

  def PadMicrobatches(self, x):
    """[M, S, ...] per-(microbatch, stage) states -> [T, S, ...] state slots.

    Slot [i, s] is the state stage s reads and writes at iteration i: that
    of the microbatch it works on then (and, when circular, every repeat of
    stage s starts from the same [m, s] state). S=3, M=4, R=1, cells are
    the microbatch whose state the slot holds::

        iteration  0  1  2  3  4  5
        stage 0    0  1  2  3  .  .
        stage 1    .  0  1  2  3  .
        stage 2    .  .  0  1  2  3      ('.' = bubble: never written)

    S=2, M=2, R=2 (cells: microbatch/repeat; repeats keep separate slots)::

        iteration    0    1    2    3    4
        stage 0    0/0  1/0  0/1  1/1    .
        stage 1      .  0/0  1/0  0/1  1/1

    The padded states are opaque to the caller: pass them to FPropFn call
    after call; UnpadStates gives each layer's state back.
    """
    if not microbatch.IsTensor(x):
      return tf.nest.map_structure(self.PadMicrobatches, x)
    sched = self.Schedule(x.shape.as_list()[0])
    return self._SplitStages(microbatch.PadStates(x, sched), 1)

  def UnpadStates(self, padded, num_microbatches=None):
    """[T, S, ...] state slots -> [R * S, B, ...]: each layer's state.

    The inverse of PadMicrobatches(MicrobatchStates(.)), per logical layer
    (repeat-major) and on the whole batch again.

    Args:
      padded: states as FPropFn returns them (a tensor or a structure).
      num_microbatches: M; defaults to p.num_microbatches.
    """
    p = self.params
    num_mb = num_microbatches or p.num_microbatches
    if num_mb is None:
      raise ValueError('UnpadStates needs num_microbatches when the layer\'s '
                       'num_microbatches param is not set.')
    sched = self.Schedule(num_mb)

    def Unpad(x):
      if not microbatch.IsTensor(x):
        return x
      per_layer = microbatch.UnpadStates(x, sched)  # [M, L, B/M, ...]
      rank = per_layer.shape.rank
      if rank < 3:
        return tf.transpose(per_layer, [1, 0])
      whole = microbatch.ToBatch(
          tf.transpose(per_layer, [0, 2, 1] + list(range(3, rank))))
      return tf.transpose(whole, [1, 0] + list(range(2, rank - 1)))

    return tf.nest.map_structure(Unpad, padded)

  # ---------------------------------------------------------------------------
  # Forward.

  def FProp(self, theta, *args, **kwargs):
    return self.FPropFn(
        theta, 'FProp', *args, padded_per_stage_states=[], **kwargs)

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
        args: each stage sees its own microbatch's slice.

    Returns:
      The outputs, in the structure of args (a single arg is not wrapped).
      With states, pipelined: (*outputs, *updated padded states); unrolled:
      (outputs, updated per-layer lists), as Lingvo's layer returns them.
    """
    p = self.params
    if not args:
      raise ValueError('PipelinedLayer.FProp needs at least one input.')
    states = list(padded_per_stage_states or [])
    if p.unroll == 'always' or (p.unroll == 'eval_only' and self.do_eval):
      return self._UnrolledFProp(theta, fn_name, args, kwargs,
                                 kwargs_no_batch or {}, states)
    return self._PipelinedFProp(theta, fn_name, args, kwargs,
                                kwargs_no_batch or {}, states)

  def _UnrolledFProp(self, theta, fn_name, args, kwargs, kwargs_no_batch,
                     per_layer_states):
    """Runs the S * R layers one after another on the whole batch."""
    p = self.params
    outputs = tuple(args)
    names = self._NonTrainableNames()
    carried = self._NonTrainableValues(theta, names)
    per_layer_states = self._CheckPerLayerStates(per_layer_states)
    with tf.name_scope(p.name):
      for repeat in range(p.circular_repeat):
        for stage in range(p.num_stages):
          layer = repeat * p.num_stages + stage
          with tf.name_scope(f'layer_{layer:03d}'):
            states = tuple(s[layer] for s in per_layer_states)
            outputs, carried = self._UnrolledLayer(theta, fn_name, repeat,
                                                   stage, outputs + states,
                                                   kwargs, kwargs_no_batch,
                                                   names, carried)
            outputs, states = (outputs[:len(args)], outputs[len(args):])
            for per_layer, state in zip(per_layer_states, states):
              per_layer[layer] = state
      outputs = self._AfterAssigning(names, carried,
                                     (outputs, per_layer_states))
      outputs, per_layer_states = outputs
    outputs = outputs[0] if len(outputs) == 1 else tuple(outputs)
    if not per_layer_states:
      return outputs
    return outputs, per_layer_states

  def _CheckPerLayerStates(self, per_layer_states):
    """Copies of the per-layer state lists, checked to have R * S entries."""
    num_layers = self.params.num_stages * self.params.circular_repeat
    checked = []
    for k, states in enumerate(per_layer_states):
      if not isinstance(states, (list, tuple)) or len(states) != num_layers:
        got = type(states).__name__
        if isinstance(states, (list, tuple)):
          got += f' of {len(states)}'
        raise ValueError(
            f'With unroll, padded_per_stage_states[{k}] must be a list of '
            f'{num_layers} per-layer states (num_stages * circular_repeat), '
            f'one per logical layer; got a {got}. Make them with the body '
            'method for each layer_theta.')
      checked.append(list(states))
    return checked

  def _UnrolledLayer(self, theta, fn_name, repeat, stage, inputs, kwargs,
                     kwargs_no_batch, names, carried):
    """One logical layer on the whole batch; returns (outputs, carried)."""
    p = self.params
    fn = getattr(self._body, fn_name)
    if p.stage_parallel_body is None:
      current = [_TakeStageSlice(v, stage, repeat, p.circular_repeat)
                 for v in carried]
      out, new = self._CallWithStageVars(
          fn, self.layer_theta(theta, repeat, stage), names, current, inputs,
          dict(kwargs, **kwargs_no_batch))
      carried = [
          _PutStageSlice(v, stage, repeat, n, p.circular_repeat)
          for v, n in zip(carried, new)
      ]
      return self._CheckBodyOutputs(inputs, out), carried
    # A stage-parallel body computes every stage: feed all stages the same
    # input and keep this stage's result.
    stacked_theta = theta.body
    if p.circular_repeat > 1:
      stacked_theta = tf.nest.map_structure(lambda t: t[repeat], stacked_theta)
    expand = lambda x: _MapTensor(  # pylint: disable=g-long-lambda
        lambda t: tf.broadcast_to(t[None], [p.num_stages] + _Shape(t)), x)
    expanded = expand(inputs)
    out = fn(stacked_theta, *expanded,
             **{k: expand(v) for k, v in kwargs.items()}, **kwargs_no_batch)
    out = self._CheckBodyOutputs(expanded, out)
    return _MapTensor(lambda t: t[stage], out), carried

  def _CheckBodyOutputs(self, inputs, out):
    """Returns the body's outputs as a tuple like inputs, or a clear error."""
    p = self.params
    body_param = ('stage_parallel_body'
                  if p.stage_parallel_body is not None else 'single_stage_body')
    out = _ToTuple(out, len(inputs))
    problem = _StructureMismatch(inputs, out)
    if problem:
      raise ValueError(
          f'The {body_param} ({self._body.__class__.__name__}) must return '
          'the same structure as its inputs (one output per input, same '
          f'nesting, None where the input is None, same dtype): {problem}.')
    return out

  def PlaceVariables(self, theta):
    """theta with every variable annotated where the pipeline keeps it.

    Stage-stacked variables are split on their stage dim (dim 1 for the
    [R, S, ...] weights of a circular stage-parallel body); a stage's own
    variable (`per_stage_vars`) on its least-padding dim. Without
    `shard_stages_1d` or `pipeline_stage_mesh_dim` nothing is annotated.
    Anything of theta's structure can be placed this way, e.g. optimizer
    slots, so that they live split like their weights.
    """
    p = self.params
    placed = theta.copy()
    if p.per_stage_vars:
      for s in range(p.num_stages):
        name = _PerStageChildName(s)
        placed[name] = tf.nest.map_structure(self._SplitPerStageVar,
                                             theta[name])
    else:
      stage_dim = 1 if (p.stage_parallel_body is not None and
                        p.circular_repeat > 1) else 0
      placed.body = tf.nest.map_structure(
          lambda t: self._SplitStages(t, stage_dim), theta.body)
    return placed

  def _StackedTheta(self, theta):
    """Loop theta: the stage-stacked weights, annotated on the stage dim.

    Per-stage variables are stacked here, outside the loop, so the loop sees
    one layout; with sharding each is first split on its least-padding dim,
    and the stack is resharded onto the stage dim once per step.
    """
    p = self.params
    placed = self.PlaceVariables(theta)
    if not p.per_stage_vars:
      return NestedMap(body=placed.body)
    per_stage = [placed[_PerStageChildName(s)] for s in range(p.num_stages)]
    body = tf.nest.map_structure(lambda *xs: tf.stack(xs), *per_stage)
    return NestedMap(body=tf.nest.map_structure(
        lambda t: self._SplitStages(t, 0), body))

  def _SplitPerStageVar(self, x):
    """Splits one stage's own variable over the pipeline's devices."""
    p = self.params
    if not tf.is_tensor(x):
      return x
    dim = sharding.LeastPaddingDim(x.shape.as_list(), p.num_stages)
    if dim is None:
      return x
    return self._SplitStages(x, dim)

  def _SplitStages(self, x, stage_dim):
    """Annotates the stage dim of x as split over the pipeline's devices."""
    p = self.params
    if p.shard_stages_1d:
      return sharding.Split(x, stage_dim, p.num_stages)
    if p.pipeline_stage_mesh_dim is not None:
      return sharding.SplitStageDim(x, stage_dim, p.num_stages, p.device_mesh,
                                    p.pipeline_stage_mesh_dim)
    return x

  def _ReplicateLoopDim(self, x):
    """Annotates x ([M, ...] or [T, ...]) as replicated: the loop indexes it.

    Only with shard_stages_1d; on a device mesh the other axes may shard the
    batch, which a full replicate would undo.
    """
    if self.params.shard_stages_1d:
      return sharding.Replicate(x)
    return x

  def _ReplicateBookkeeping(self, x):
    """Annotates a loop counter, index vector or scalar as replicated."""
    if self._StageMesh() is None:
      return x
    return sharding.Replicate(x)

  def _PipelinedFProp(self, theta, fn_name, args, kwargs, kwargs_no_batch,
                      padded_states):
    """Microbatches, runs the loop over the buffer, reassembles the batch."""
    p = self.params
    loop = self._LoopSetup(args, kwargs)
    state_leaves = self._CheckPaddedStates(padded_states, loop.schedule)
    loop.RebuildStates = lambda leaves: tf.nest.pack_sequence_as(
        padded_states, leaves)
    loop.fn_name = fn_name
    loop.kwargs_no_batch = kwargs_no_batch
    # Every (layer, microbatch) draws its random numbers from its own stream
    # base_seed + StepSeedOffset(layer, microbatch); see _Iteration.
    loop.base_seed = _IncStepSeed()
    # Read now: the backward pass recomputes the body outside the caller's
    # GlobalStepContext.
    loop.global_step = _CallerGlobalStep()
    loop.summary_names = []
    loop.var_names = self._NonTrainableNames()
    # Carried: the buffer, and the body's non-trainable variables (see
    # gpipe.stage_vars). The iteration index comes in as an input and each
    # iteration's aux loss goes out as an extra, summed afterwards:
    # loop-carried scalars are what the partitioner tends to mis-shard.
    state0 = NestedMap(
        buffer=[
            self._SplitStages(_BubbleFiller(x, p.num_stages), 0)
            for x in loop.mb_leaves
        ],
        vars=[
            self._SplitStages(tf.stop_gradient(v), 0)
            for v in self._NonTrainableValues(theta, loop.var_names)
        ])
    inputs = NestedMap(
        stage0=[
            microbatch.PadForIterations(x, loop.schedule)
            for x in loop.mb_leaves
        ],
        iteration=tf.range(loop.schedule.num_iterations, dtype=tf.int32),
        states=[self._SplitStages(x, 1) for x in state_leaves])
    with tf.name_scope(p.name):
      states, final, extras = recurrent.Recurrent(
          self._StackedTheta(theta),
          state0,
          inputs,
          lambda th, st, inp: self._Iteration(loop, th, st, inp),
          store_intermediates=p.store_body_intermediates)
      outputs = []
      for history in states.buffer:
        history = self._SplitStages(history, 1)
        out = microbatch.LastStageOutputs(history, loop.schedule)
        out = self._ReplicateLoopDim(out)
        outputs.append(microbatch.ToBatch(out) if loop.split else out)
      self._AddAuxLoss(
          tf.reduce_sum(extras.aux_loss), loop.schedule.num_microbatches)
      self._AddSummaries(loop.summary_names, extras.summaries)
      new_states = [self._SplitStages(x, 1) for x in extras.states]
      outputs, new_states = self._AfterAssigning(loop.var_names, final.vars,
                                                 (outputs, new_states))
    result = tuple(loop.Rebuild(outputs))
    if padded_states:
      return result + tuple(loop.RebuildStates(new_states))
    return result[0] if len(result) == 1 else result

  def _CheckPaddedStates(self, padded_states, sched):
    """The states' tensor leaves, checked to be [T, S, ...] state slots."""
    leaves = tf.nest.flatten(padded_states)
    expected = [sched.num_iterations, self.params.num_stages]
    for x in leaves:
      if not microbatch.IsTensor(x):
        raise ValueError(
            'padded_per_stage_states must hold tensors (in lists, tuples or '
            f'NestedMaps); got {type(x).__name__}.')
      if x.shape.rank is None or x.shape.rank < 2 or x.shape.as_list(
      )[:2] != expected:
        raise ValueError(
            f'A per-stage state has shape {x.shape}; its leading dims must '
            f'be [num_iterations, num_stages] = {expected} for '
            f'{sched.num_microbatches} microbatches. Make it with '
            'PadMicrobatches([M, num_stages, ...] states), e.g. '
            'PadMicrobatches(MicrobatchStates(per_stage_states)).')
    return leaves

  def _LoopSetup(self, args, kwargs):
    """Checks the inputs and splits them into microbatches.

    Returns:
      A NestedMap: schedule; split (whether the batch was split here);
      mb_leaves, the [M, ...] tensor leaves of args (the buffer carries only
      these; None leaves stay None); Rebuild(leaves) to put such leaves back
      into the structure of args; mb_kwargs, the [M, ...] kwargs.
    """
    p = self.params
    tensor_leaves = [x for x in tf.nest.flatten(args) if microbatch.IsTensor(x)]
    if not tensor_leaves:
      raise ValueError('PipelinedLayer.FProp needs at least one tensor input.')
    batch = microbatch.BatchSize(tensor_leaves[0])
    num_mb, split = microbatch.ResolveNumMicrobatches(batch, p.num_microbatches,
                                                      p.microbatch_size)
    _CheckLeadingDims(args, kwargs, batch)
    if split:
      to_mb = lambda x: microbatch.ToMicrobatches(x, num_mb)
      args, kwargs = _MapTensor(to_mb, args), _MapTensor(to_mb, kwargs)
    args = _MapTensor(self._ReplicateLoopDim, args)
    flat = tf.nest.flatten(args)
    slots = [i for i, x in enumerate(flat) if microbatch.IsTensor(x)]

    def Rebuild(leaves):
      full = list(flat)
      for i, leaf in zip(slots, leaves):
        full[i] = leaf
      return tuple(tf.nest.pack_sequence_as(args, full))

    def Leaves(tree):
      flat_tree = tf.nest.flatten(tree)
      return [flat_tree[i] for i in slots]

    return NestedMap(
        schedule=self.Schedule(num_mb),
        split=split,
        mb_leaves=[flat[i] for i in slots],
        mb_kwargs=kwargs,
        Rebuild=Rebuild,
        Leaves=Leaves)

  def _Iteration(self, loop, loop_theta, state, inp):
    """One loop iteration: every stage runs on its slot of the buffer."""
    p = self.params
    sched = loop.schedule
    # Loop bookkeeping is replicated explicitly: left unannotated, the
    # partitioner may propagate the body's manual sharding into it.
    pin = self._ReplicateBookkeeping
    it = pin(inp.iteration)
    stage_ids = tf.range(p.num_stages, dtype=tf.int32)
    stage_in = [
        self._SplitStages(
            self._StageInputs(sched, it, self._SplitStages(buf, 0),
                              self._ReplicateLoopDim(x)),
            0) for buf, x in zip(state.buffer, inp.stage0)
    ]
    stage_in_tree = loop.Rebuild(stage_in)
    num_args = len(stage_in_tree)
    stage_in_tree += tuple(loop.RebuildStates(inp.states))
    # Per-stage [S] vectors live with their stages; each device computes its
    # own entry from the replicated iteration index.
    per_stage = lambda v: self._SplitStages(v, 0)
    mb_ids = per_stage(tf.clip_by_value(
        sched.MicrobatchId(it, stage_ids), 0, sched.num_microbatches - 1))
    repeat_ids = per_stage(tf.clip_by_value(
        sched.RepeatId(it, stage_ids), 0, p.circular_repeat - 1))
    layer_ids = repeat_ids * p.num_stages + stage_ids
    rng = NestedMap(
        seeds=per_stage(loop.base_seed + tf.cast(
            sched.StepSeedOffset(layer_ids, mb_ids), loop.base_seed.dtype)),
        global_step=loop.global_step)
    outs, stats = self._RunStages(loop_theta, loop.fn_name, stage_in_tree,
                                  loop.mb_kwargs, loop.kwargs_no_batch,
                                  mb_ids, repeat_ids, rng,
                                  (loop.var_names, state.vars))
    valid = per_stage(sched.IsValid(it, stage_ids))
    outs, state_outs = outs[:num_args], outs[num_args:]
    new_buffer = [
        self._SplitStages(
            RotateStages(self._SplitStages(_MaskBubbles(valid, o, x), 0)), 0)
        for o, x in zip(loop.Leaves(outs), stage_in)
    ]
    # A bubble leaves its state slot as it found it.
    new_states = [
        per_stage(_SelectStages(valid, new, old))
        for new, old in zip(tf.nest.flatten(state_outs), inp.states)
    ]
    # Bubbles' aux losses and summaries are dropped by the same select.
    keep = lambda v: tf.where(valid, v, tf.zeros_like(v))
    aux = tf.constant(0.0, tf.float32)
    if stats.aux is not None:
      aux = tf.reduce_sum(keep(stats.aux))
    loop.summary_names = [name for name, _, _ in stats.summaries]
    summaries = [
        (per_stage(keep(value * weight)), per_stage(keep(weight)))
        for _, value, weight in stats.summaries
    ]
    # Bubbles keep the non-trainable state they found.
    new_vars = [
        per_stage(_SelectStages(valid, new, old))
        for new, old in zip(stats.vars, state.vars)
    ]
    return NestedMap(buffer=new_buffer, vars=new_vars), NestedMap(
        aux_loss=pin(aux), summaries=summaries, states=new_states)

  def _StageInputs(self, sched, iteration, rotated, stage0_input):
    """The stages' inputs: the rotated buffer, stage 0 maybe a fresh input.

    The carried buffer is last iteration's outputs already rotated by one
    stage (see RotateStages): slot s holds what stage s - 1 produced, and
    slot 0 what the last stage produced. Stage 0 takes the fresh microbatch
    whenever the schedule says it reads one: always when linear (the wrapped
    slot is dropped), in the first S iterations of each R * S block when
    circular (otherwise it keeps the wrapped slot: the microbatch's next
    repeat).
    """
    p = self.params
    reads = tf.logical_and(
        tf.equal(tf.range(p.num_stages), 0),
        sched.StageZeroReadsInput(iteration))
    reads = tf.reshape(reads, [p.num_stages] + [1] * (rotated.shape.rank - 1))
    fresh = tf.broadcast_to(stage0_input[None], _Shape(rotated))
    return tf.where(reads, fresh, rotated)

  def _RunStages(self, loop_theta, fn_name, stage_args, mb_kwargs,
                 kwargs_no_batch, mb_ids, repeat_ids, rng, carried):
    """Runs every stage on its own slot of `stage_args` ([S, ...] leaves).

    rng.seeds [S] are the stages' step seeds; rng.global_step the step the
    body sees (the caller's, also when the backward pass recomputes).
    carried = (names, values): the body's non-trainable variables, values
    [S, (R,) ...] as the loop carries them.

    Returns:
      (outputs, stats): outputs with [S, ...] leaves; stats.aux, the [S] aux
      losses the body added (or None); stats.summaries, [(name, value [S],
      weight [S])] of the TPU summaries it added; stats.vars, the carried
      values with each stage's assignments applied.
    """
    names, values = carried
    p = self.params
    fn = getattr(self._body, fn_name)
    stage_args = tuple(stage_args)
    if p.stage_parallel_body is not None:
      theta_now = loop_theta.body
      if p.circular_repeat > 1:
        index = tf.stack([repeat_ids, tf.range(p.num_stages)], axis=-1)
        theta_now = tf.nest.map_structure(lambda t: tf.gather_nd(t, index),
                                          theta_now)
      kw = {k: microbatch.SliceForStages(v, mb_ids)
            for k, v in mb_kwargs.items()}
      kw.update(kwargs_no_batch)
      with _StageContext(rng.seeds[0], rng.global_step) as ctx:
        out = fn(theta_now, *stage_args, **kw)
      summaries = [
          (name, _PerStage(v, p.num_stages), _PerStage(w, p.num_stages))
          for name, v, w in ctx.Summaries()
      ]
      return (self._CheckBodyOutputs(stage_args, out),
              NestedMap(
                  aux=_StageParallelAuxLoss(ctx.aux_losses, p.num_stages),
                  summaries=summaries,
                  vars=values))

    stage_mesh = self._StageMesh()
    if stage_mesh is not None and sharding.IsSpmdPartitioning():
      return self._RunStagesManual(stage_mesh, loop_theta, fn_name, stage_args,
                                   mb_kwargs, kwargs_no_batch, mb_ids,
                                   repeat_ids, rng, carried)
    # One device: run the stages one after another on their slices. The
    # stage dim is unstacked once: the gradient of S unstacked pieces is one
    # stack, where S separate slices would each back-propagate a full-size
    # [S, ...] tensor.
    per_stage, per_stage_aux, per_stage_summaries = [], [], []
    per_stage_vars = []
    theta_parts = _Unstack(loop_theta.body, p.num_stages)
    args_parts = _Unstack(stage_args, p.num_stages)
    for stage in range(p.num_stages):
      with tf.name_scope(f'stage_{stage:03d}'):
        theta_s = self._OneStageTheta(theta_parts[stage], repeat_ids[stage])
        args_s = args_parts[stage]
        kw = {
            k: _MapTensor(lambda t, s=stage: tf.gather(t, mb_ids[s]), v)
            for k, v in mb_kwargs.items()
        }
        kw.update(kwargs_no_batch)
        current = [
            _TakeStageSlice(v, stage, repeat_ids[stage], p.circular_repeat)
            for v in values
        ]
        with _StageContext(rng.seeds[stage], rng.global_step) as ctx:
          out, new = self._CallWithStageVars(fn, theta_s, names, current,
                                             args_s, kw)
        per_stage_vars.append([
            _PutRepeat(v[stage], repeat_ids[stage], n, p.circular_repeat)
            for v, n in zip(values, new)
        ])
        per_stage.append(self._CheckBodyOutputs(args_s, out))
        per_stage_aux.append(_SumAuxLosses(ctx.aux_losses))
        per_stage_summaries.append(ctx.Summaries())
    outs = tf.nest.map_structure(
        lambda *xs: None if xs[0] is None else tf.stack(xs), *per_stage)
    aux = None
    if any(a is not None for a in per_stage_aux):
      zero = tf.constant(0.0, tf.float32)
      aux = tf.stack([zero if a is None else a for a in per_stage_aux])
    summaries = [
        (entries[0][0], tf.stack([v for _, v, _ in entries]),
         tf.stack([w for _, _, w in entries]))
        for entries in zip(*per_stage_summaries)
    ]
    new_values = [tf.stack(rows) for rows in zip(*per_stage_vars)]
    return outs, NestedMap(aux=aux, summaries=summaries, vars=new_values)

  def _OneStageTheta(self, stage_theta, repeat_id):
    """One stage's weights ([R, ...] when circular) for repeat `repeat_id`."""
    r_count = self.params.circular_repeat
    if r_count == 1:
      return stage_theta
    # A one-hot sum over the R repeats rather than a gather: its gradient is
    # R scaled copies, not a scatter into zeros.
    hot = tf.one_hot(repeat_id, r_count)

    def Select(t):
      parts = tf.unstack(t, num=r_count)
      return tf.add_n([tf.cast(hot[r], t.dtype) * parts[r]
                       for r in range(r_count)])

    return tf.nest.map_structure(Select, stage_theta)

  def _StageMesh(self):
    """(device_mesh, stage axis) of the manual region, or None if unsharded."""
    p = self.params
    if p.shard_stages_1d:
      return sharding.StageMesh(p.num_stages)
    if p.pipeline_stage_mesh_dim is not None:
      return sharding.StageMesh(p.num_stages, p.device_mesh,
                                p.pipeline_stage_mesh_dim)
    return None

  def _RunStagesManual(self, stage_mesh, loop_theta, fn_name, stage_args,
                       mb_kwargs, kwargs_no_batch, mb_ids, repeat_ids, rng,
                       carried):
    """Runs the body once, in a manual region: each device its own stage.

    [S, ...] tensors (stage dim split) become each device's [...] slice; the
    body's outputs and aux loss go back to [S, ...]. What enters needs no
    communication: every stage-dim tensor already lives on its stage's
    device, and per-example kwargs are gathered by microbatch id first.
    """
    p = self.params
    mesh, mesh_dim = stage_mesh
    to_manual = lambda x: sharding.ToManualStage(x, mesh, mesh_dim)
    from_manual = lambda x: sharding.FromManualStage(x, mesh, mesh_dim)
    theta = tf.nest.map_structure(to_manual, loop_theta.body)
    if p.circular_repeat > 1:
      theta = tf.nest.map_structure(
          lambda t: tf.gather(t, to_manual(repeat_ids)), theta)
    args = _MapTensor(to_manual, stage_args)
    kw = {
        k: _MapTensor(lambda t: to_manual(tf.gather(t, mb_ids)), v)
        for k, v in mb_kwargs.items()
    }
    kw.update({
        k: _MapTensor(
            lambda t: sharding.BroadcastToManualStage(t, mesh, mesh_dim), v)
        for k, v in kwargs_no_batch.items()
    })
    fn = getattr(self._body, fn_name)
    global_step = rng.global_step
    if global_step is not None:
      global_step = sharding.BroadcastToManualStage(
          tf.convert_to_tensor(global_step), mesh, mesh_dim)
    names, values = carried
    repeat_id = to_manual(repeat_ids)
    with sharding.ManualStageRegion(mesh_dim), \
        _StageContext(to_manual(rng.seeds), global_step) as ctx:
      mine = [to_manual(v) for v in values]  # [(R,) ...] on each device
      current = [_TakeRepeat(v, repeat_id, p.circular_repeat) for v in mine]
      out, new = self._CallWithStageVars(fn, theta, names, current, args, kw)
      new_values = [
          _PutRepeat(v, repeat_id, n, p.circular_repeat)
          for v, n in zip(mine, new)
      ]
      out = self._CheckBodyOutputs(args, out)
      aux = _SumAuxLosses(ctx.aux_losses)
      summaries = [(name, tf.cast(v, tf.float32), tf.cast(w, tf.float32))
                   for name, v, w in ctx.Summaries()]
    outs = _MapTensor(from_manual, out)
    summaries = [(name, from_manual(v), from_manual(w))
                 for name, v, w in summaries]
    return outs, NestedMap(
        aux=None if aux is None else from_manual(aux), summaries=summaries,
        vars=[from_manual(v) for v in new_values])

  # ---------------------------------------------------------------------------
  # Non-trainable variables (see gpipe.stage_vars).

  def _NonTrainableNames(self):
    """Names (as in the body's theta) of its non-trainable variables.

    A stage_parallel_body manages its own stacked variables: none.
    """
    if self.params.stage_parallel_body is not None:
      return []
    return [name for name, _ in stage_vars.NonTrainableItems(self._body.vars)]

  def _StageVariables(self, name):
    """The variable(s) behind `name`: [stacked], or one per stage."""
    p = self.params
    if p.per_stage_vars:
      return [
          dict(self.vars[_PerStageChildName(s)].FlattenItems())[name]
          for s in range(p.num_stages)
      ]
    return [dict(self.vars.body.FlattenItems())[name]]

  def _NonTrainableValues(self, theta, names):
    """The named variables' values in theta, each [S, (R,) ...]."""
    p = self.params
    if p.per_stage_vars:
      per_stage = [
          dict(theta[_PerStageChildName(s)].FlattenItems())
          for s in range(p.num_stages)
      ]
      return [tf.stack([values[n] for values in per_stage]) for n in names]
    stacked = dict(theta.body.FlattenItems()) if names else {}
    return [tf.convert_to_tensor(stacked[n]) for n in names]

  def _AfterAssigning(self, names, values, outputs):
    """Writes the final values back; outputs that run after the writes."""
    if not names:
      return outputs
    assigns = []
    for name, value in zip(names, values):
      variables = self._StageVariables(name)
      if self.params.per_stage_vars:
        assigns += [v.assign(value[s], read_value=False)
                    for s, v in enumerate(variables)]
      else:
        assigns.append(variables[0].assign(value, read_value=False))
    with tf.control_dependencies(assigns):
      return _MapTensor(tf.identity, outputs)

  def _CallWithStageVars(self, fn, theta, names, current, args, kwargs):
    """Calls the body with its non-trainable variables standing for `current`.

    The body's theta entries and `self.vars` reads give the carried values;
    its assignments are collected instead of written.

    Returns:
      (outputs, new values of the named variables).
    """
    if not names:
      return fn(theta, *args, **kwargs), []
    stand_ins = {
        name: stage_vars.StageVar(value, name)
        for name, value in zip(names, current)
    }
    by_id = {
        id(v): stand_ins[name]
        for name, v in self._body.vars.FlattenItems()
        if name in stand_ins
    }
    theta = theta.Pack([
        stand_ins[name].value() if name in stand_ins else t
        for name, t in theta.FlattenItems()
    ])
    with self._body.TransformVarsTempContext(lambda v: by_id.get(id(v), v)):
      out = fn(theta, *args, **kwargs)
    return out, [stand_ins[name].value() for name in names]

  def _AddSummaries(self, names, accumulated):
    """Adds `<name>/stage_<i>`: the body's summary averaged over stage i.

    Each is the weighted mean over the valid iterations of stage i (every
    microbatch, and with circular_repeat > 1 every repeat of the stage), with
    the summed weight as its weight.
    """
    for name, (weighted, weight) in zip(names, accumulated):
      weighted = tf.reduce_sum(weighted, axis=0)
      weight = tf.reduce_sum(weight, axis=0)
      mean = tf.math.divide_no_nan(weighted, weight)
      for stage in range(self.params.num_stages):
        py_utils.AddTpuSummaryTensor(f'{name}/stage_{stage}', mean[stage],
                                     weight[stage])

  def _AddAuxLoss(self, total, num_microbatches):
    """Adds the pipeline's aux loss to the caller's AuxLossContext."""
    p = self.params
    ctx = py_utils.AuxLossContext.Current()
    if ctx is None:
      return
    if p.aux_loss_microbatch_accumulation == 'mean':
      total = total / num_microbatches
    ctx.AddLoss(total)


# -----------------------------------------------------------------------------
# Helpers.


LayerwiseShardablePipelinedLayer = PipelinedLayer


def ValidateParams(p, batch_size=None):
  """Checks PipelinedLayer params without building anything.

  Model params call this to fail fast, before a graph exists; the layer
  itself checks the same when it is instantiated (and the batch split when
  it runs).

  Args:
    p: PipelinedLayer params.
    batch_size: if given, also checks that it splits into the configured
      microbatches.

  Raises:
    ValueError: naming the parameter and the fix.
  """
  _ValidateParams(p)
  if batch_size is not None:
    microbatch.ResolveNumMicrobatches(batch_size, p.num_microbatches,
                                      p.microbatch_size)


def _ValidateParams(p):
  """Raises ValueError naming the parameter for every bad combination."""
  if not isinstance(p.num_stages, int) or p.num_stages < 1:
    raise ValueError(f'num_stages must be an integer >= 1, got '
                     f'{p.num_stages!r}.')
  if not isinstance(p.circular_repeat, int) or p.circular_repeat < 1:
    raise ValueError(f'circular_repeat must be an integer >= 1, got '
                     f'{p.circular_repeat!r}.')
  if p.unroll not in _UNROLL_VALUES:
    raise ValueError(f'unroll must be one of {_UNROLL_VALUES}, got '
                     f'{p.unroll!r}.')
  if p.aux_loss_microbatch_accumulation not in _AUX_LOSS_ACCUMULATIONS:
    raise ValueError(
        'aux_loss_microbatch_accumulation must be one of '
        f'{_AUX_LOSS_ACCUMULATIONS}, got '
        f'{p.aux_loss_microbatch_accumulation!r}.')
  if (p.single_stage_body is None) == (p.stage_parallel_body is None):
    raise ValueError(
        'Set exactly one of single_stage_body and stage_parallel_body; got '
        f'single_stage_body={"set" if p.single_stage_body else None}, '
        f'stage_parallel_body={"set" if p.stage_parallel_body else None}.')
  if p.per_stage_vars and p.stage_parallel_body is not None:
    raise ValueError(
        'per_stage_vars=True needs single_stage_body; a stage_parallel_body '
        'defines its own stacked variables. Unset per_stage_vars or use '
        'single_stage_body.')
  if p.num_microbatches is not None and p.microbatch_size is not None:
    raise ValueError(
        f'Set only one of num_microbatches ({p.num_microbatches}) and '
        f'microbatch_size ({p.microbatch_size}).')
  for name in ('num_microbatches', 'microbatch_size'):
    value = p.Get(name)
    if value is not None and (not isinstance(value, int) or value < 1):
      raise ValueError(f'{name} must be None or an integer >= 1, got '
                       f'{value!r}.')
  if p.shard_stages_1d and p.pipeline_stage_mesh_dim is not None:
    raise ValueError(
        'Set at most one of shard_stages_1d and pipeline_stage_mesh_dim; got '
        f'shard_stages_1d=True and pipeline_stage_mesh_dim='
        f'{p.pipeline_stage_mesh_dim}.')
  if p.pipeline_stage_mesh_dim is not None:
    if p.device_mesh is None:
      raise ValueError(
          f'pipeline_stage_mesh_dim={p.pipeline_stage_mesh_dim} needs '
          'device_mesh to be set.')
    mesh = np.asarray(p.device_mesh)
    if not 0 <= p.pipeline_stage_mesh_dim < mesh.ndim:
      raise ValueError(
          f'pipeline_stage_mesh_dim={p.pipeline_stage_mesh_dim} is not an '
          f'axis of device_mesh with shape {mesh.shape}.')
    if mesh.shape[p.pipeline_stage_mesh_dim] != p.num_stages:
      raise ValueError(
          f'device_mesh axis {p.pipeline_stage_mesh_dim} has '
          f'{mesh.shape[p.pipeline_stage_mesh_dim]} devices but num_stages='
          f'{p.num_stages}; they must be equal.')


def _CheckIndex(name, value, bound):
  if isinstance(value, (int, np.integer)) and not 0 <= value < bound:
    raise ValueError(f'{name}={value} is out of range [0, {bound}).')


def _CheckLeadingDims(args, kwargs, batch):
  """Every tensor input and per-example kwarg must share the batch dim."""
  for where, tree in (('args', args), ('kwargs', kwargs)):
    for x in tf.nest.flatten(tree):
      dim0 = x.shape.as_list()[0] if (microbatch.IsTensor(x) and
                                       x.shape.rank) else None
      if dim0 is not None:
        if isinstance(batch, int) and dim0 != batch:
          raise ValueError(
              f'All {where} must have the batch size {batch} as leading dim; '
              f'got a tensor of shape {x.shape}. Pass unbatched values via '
              'kwargs_no_batch.')


class _Chain:
  """Enters several context managers in order."""

  def __init__(self, *managers):
    self._managers = managers

  def __enter__(self):
    for m in self._managers:
      m.__enter__()

  def __exit__(self, *exc):
    for m in reversed(self._managers):
      m.__exit__(*exc)
    return False


def _IncStepSeed():
  """py_utils.GetIncStepSeed(), safe against a stale seed of a dead graph.

  Lingvo keys the step seed by id() of the default graph; a new graph can
  reuse the id of one that was garbage collected, and would then be handed
  a tensor of that dead graph. Such a seed is reset first, as for a new
  graph.
  """
  seed = py_utils.GetStepSeed()
  if (not tf.executing_eagerly() and hasattr(seed, 'graph') and
      seed.graph is not tf.compat.v1.get_default_graph()):
    py_utils.ResetStepSeed()
  return py_utils.GetIncStepSeed()


def _CallerGlobalStep():
  """The global step the caller's FProp sees, or None where there is none.

  Lingvo reads its --xla_device flag to find a global step when no
  GlobalStepContext is active; without parsed flags (a plain script or a
  test) there is none to find.
  """
  try:
    return py_utils.GetGlobalStep()
  except flags.UnparsedFlagAccessError:
    return None


def _Shape(t):
  return py_utils.GetShape(t)


def _Unstack(tree, num):
  """[num, ...] tensor leaves -> num trees of [...] leaves (None kept)."""
  leaves = tf.nest.flatten(tree)
  parts = [
      tf.unstack(x, num=num) if microbatch.IsTensor(x) else [x] * num
      for x in leaves
  ]
  return [tf.nest.pack_sequence_as(tree, [p[i] for p in parts])
          for i in range(num)]


def _MapTensor(fn, tree):
  return tf.nest.map_structure(
      lambda x: fn(x) if microbatch.IsTensor(x) else x, tree)


def _ToTuple(out, num_inputs):
  """Body outputs as a tuple: one arg's output is not wrapped by the body."""
  if num_inputs == 1:
    return (out,)
  if isinstance(out, list):
    return tuple(out)
  return out


def _StructureMismatch(inputs, outputs):
  """Returns a description of how outputs differ from inputs, or ''."""
  if not isinstance(outputs, tuple) or len(outputs) != len(inputs):
    return (f'expected {len(inputs)} outputs, got '
            f'{type(outputs).__name__}'
            f'{f" of {len(outputs)}" if isinstance(outputs, tuple) else ""}')
  try:
    tf.nest.assert_same_structure(inputs, outputs, check_types=False)
  except (ValueError, TypeError):
    return (f'nesting differs: inputs {_Outline(inputs)}, outputs '
            f'{_Outline(outputs)}')
  for x, y in zip(tf.nest.flatten(inputs), tf.nest.flatten(outputs)):
    if (x is None) != (y is None):
      return f'input {x} but output {y}'
    if x is None:
      continue
    if not microbatch.IsTensor(y):
      return f'output {y!r} is not a tensor'
    if x.dtype != y.dtype:
      return f'input dtype {x.dtype.name}, output dtype {y.dtype.name}'
    if not x.shape.is_compatible_with(y.shape):
      return f'input shape {x.shape}, output shape {y.shape}'
  return ''


def _Outline(tree):
  """A structure with leaves drawn as T (tensor), None, or their type."""

  def Leaf(x):
    if x is None:
      return 'None'
    return 'T' if microbatch.IsTensor(x) else type(x).__name__

  return str(tf.nest.map_structure(Leaf, tree)).replace("'", '')


@tf.custom_gradient
def RotateStages(x):
  """[S, ...] -> slot s gets slot s - 1, slot 0 gets slot S - 1.

  Along a split stage dim this is exactly one collective-permute once
  partitioned, and so is its gradient, the opposite rotation (written out:
  TensorFlow's gradient of the concat of two slices is two permutes). A
  shift that pads a zero in instead becomes an all-to-all.
  """
  rotated = tf.concat([x[-1:], x[:-1]], axis=0)

  def Grad(dy):
    return tf.concat([dy[1:], dy[:1]], axis=0)

  return rotated, Grad


def _TakeRepeat(value, repeat, circular_repeat):
  """value[repeat] of a [R, ...] value when circular; value itself if not."""
  if circular_repeat == 1:
    return value
  return tf.gather(value, repeat)


def _PutRepeat(value, repeat, new, circular_repeat):
  """value with [repeat] replaced by new (circular), or new (linear)."""
  if circular_repeat == 1:
    return new
  hit = tf.equal(tf.range(circular_repeat), repeat)
  hit = tf.reshape(hit, [circular_repeat] + [1] * new.shape.rank)
  return tf.where(hit, new[None], value)


def _TakeStageSlice(value, stage, repeat, circular_repeat):
  """A stage's (and repeat's) slice of a [S, (R,) ...] value."""
  return _TakeRepeat(value[stage], repeat, circular_repeat)


def _PutStageSlice(value, stage, repeat, new, circular_repeat):
  """The [S, (R,) ...] value with that stage's (repeat's) slice replaced."""
  row = _PutRepeat(value[stage], repeat, new, circular_repeat)
  rows = [row if s == stage else value[s] for s in range(value.shape[0])]
  return tf.stack(rows)


def _SelectStages(valid, new, old):
  """Per stage slot: new where the stage was valid, old on bubbles."""
  mask = tf.reshape(valid, [-1] + [1] * (new.shape.rank - 1))
  return tf.where(mask, new, old)


def _MaskBubbles(valid, out, stage_in):
  """Bubble slots of the [S] stage outputs pass their input through instead.

  Bubbles never compute on zeros: the loop starts from real data
  (_BubbleFiller) and a bubble hands its own input on, so every bubble runs
  the body on some real microbatch's values. A body that is finite on real
  data (but, say, divides by its input) thus stays finite on bubbles, and
  the select's zero cotangent times a finite local derivative keeps the
  gradients finite too. The pass-through is cut from the gradient.
  """
  mask = tf.reshape(valid, [-1] + [1] * (out.shape.rank - 1))
  return tf.where(mask, out, tf.stop_gradient(stage_in))


def _BubbleFiller(x, num_stages):
  """The initial buffer: microbatch 0 of x ([M, ...]) in every stage slot.

  What the stages work on before the first microbatch reaches them; their
  results are discarded (see _MaskBubbles), so any real data will do.
  """
  return tf.stop_gradient(
      tf.broadcast_to(x[:1], [num_stages] + _Shape(x)[1:]))


class _StageContext(contextlib.ExitStack):
  """What the body sees while computing one stage (or all, in one call).

  Its own step seed (the (layer, microbatch) stream), the caller's global
  step, and its own AuxLossContext and TPU summary context, so that the aux
  losses and summaries it adds can be masked on bubbles and combined by the
  pipeline instead of reaching the caller once per iteration.
  """

  def __init__(self, step_seed, global_step):
    super().__init__()
    self._step_seed = step_seed
    self._global_step = global_step

  def __enter__(self):
    super().__enter__()
    py_utils.ResetStepSeed(self._step_seed)
    if self._global_step is not None:
      self.enter_context(py_utils.GlobalStepContext(self._global_step))
    self._aux_ctx = self.enter_context(
        py_utils.AuxLossContext(reentrant=True))
    self.enter_context(py_utils.TpuSummaryTensorContext())
    # Lingvo keeps the innermost context's entries on this stack; its public
    # getter folds the (in-loop, meaningless) name scope into each key.
    self._entries = py_utils._TPU_SUMMARY_CONTEXTS.stack[-1]  # pylint: disable=protected-access
    return self

  @property
  def aux_losses(self):
    return self._aux_ctx.aux_losses

  def Summaries(self):
    """[(name, value, weight)] the body added, float32, in order."""
    out, seen = [], {}
    for entry in self._entries:
      value, weight = entry.value
      name = entry.name
      if name in seen:
        seen[name] += 1
        name = f'{name}_{seen[name]}'
      else:
        seen[name] = 0
      out.append((name, tf.cast(value, tf.float32),
                  tf.cast(weight, tf.float32)))
    return out


def _PerStage(x, num_stages):
  """A stage-parallel body's summary as [num_stages] (a scalar: for all)."""
  if x.shape.rank == 0:
    return tf.broadcast_to(x, [num_stages])
  return tf.reshape(x, [num_stages])


def _SumAuxLosses(aux_losses):
  """One stage's aux losses summed to a float32 scalar, or None."""
  if not aux_losses:
    return None
  return tf.add_n([tf.reduce_sum(tf.cast(l, tf.float32)) for l in aux_losses])


def _StageParallelAuxLoss(aux_losses, num_stages):
  """A stage-parallel body's aux losses as one [num_stages] vector, or None."""
  if not aux_losses:
    return None
  total = tf.zeros([num_stages], tf.float32)
  for loss in aux_losses:
    if loss.shape.as_list() != [num_stages]:
      raise ValueError(
          'A stage_parallel_body must add aux losses of shape [num_stages]='
          f'[{num_stages}] (one per stage); got shape {loss.shape}.')
    total += tf.cast(loss, tf.float32)
  return total
