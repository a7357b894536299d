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

import numpy as np
import tensorflow as tf

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
from gpipe import microbatch
from gpipe import recurrent
from gpipe import schedule as schedule_lib
from gpipe import sharding
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
      return _NullContext()
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
  # Forward.

  def FProp(self, theta, *args, **kwargs):
    return self.FPropFn(
        theta, 'FProp', *args, padded_per_stage_states=[], **kwargs)

  def FPropFn(self, theta, fn_name, *args, padded_per_stage_states,
              kwargs_no_batch=None, **kwargs):
    """Runs body method `fn_name` over the pipeline.

    Args:
      theta: this layer's theta.
      fn_name: the body method to run, e.g. 'FProp'.
      *args: tensors, tuples or NestedMaps (None entries allowed) with the
        batch as leading dim; the body method returns the same structure.
      padded_per_stage_states: must be [] for now.
      kwargs_no_batch: passed to every stage unsliced.
      **kwargs: per-example tensors (leading batch dim), microbatched like
        args: each stage sees its own microbatch's slice.

    Returns:
      The outputs, in the structure of args (a single arg is not wrapped).
    """
    p = self.params
    if padded_per_stage_states:
      raise NotImplementedError(
          'padded_per_stage_states (per-stage decoding states) are not '
          'supported yet; pass padded_per_stage_states=[].')
    if not args:
      raise ValueError('PipelinedLayer.FProp needs at least one input.')
    if p.unroll == 'always' or (p.unroll == 'eval_only' and self.do_eval):
      return self._UnrolledFProp(theta, fn_name, args, kwargs,
                                 kwargs_no_batch or {})
    return self._PipelinedFProp(theta, fn_name, args, kwargs,
                                kwargs_no_batch or {})

  def _UnrolledFProp(self, theta, fn_name, args, kwargs, kwargs_no_batch):
    """Runs the S * R layers one after another on the whole batch."""
    p = self.params
    outputs = tuple(args)
    with tf.name_scope(p.name):
      for repeat in range(p.circular_repeat):
        for stage in range(p.num_stages):
          with tf.name_scope(f'layer_{repeat * p.num_stages + stage:03d}'):
            outputs = self._UnrolledLayer(theta, fn_name, repeat, stage,
                                          outputs, kwargs, kwargs_no_batch)
    return outputs[0] if len(outputs) == 1 else tuple(outputs)

  def _UnrolledLayer(self, theta, fn_name, repeat, stage, inputs, kwargs,
                     kwargs_no_batch):
    p = self.params
    fn = getattr(self._body, fn_name)
    if p.stage_parallel_body is None:
      out = fn(self.layer_theta(theta, repeat, stage), *inputs, **kwargs,
               **kwargs_no_batch)
      return self._CheckBodyOutputs(inputs, out)
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
    return _MapTensor(lambda t: t[stage], out)

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

  def _StackedTheta(self, theta):
    """Loop theta: the stage-stacked weights, annotated on the stage dim."""
    p = self.params
    if p.per_stage_vars:
      return NestedMap(
          stages=[theta[_PerStageChildName(s)] for s in range(p.num_stages)])
    # Stage-parallel circular weights are [R, S, ...]; all others [S, ...].
    stage_dim = 1 if (p.stage_parallel_body is not None and
                      p.circular_repeat > 1) else 0
    return NestedMap(body=tf.nest.map_structure(
        lambda t: self._SplitStages(t, stage_dim), theta.body))

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

  def _PipelinedFProp(self, theta, fn_name, args, kwargs, kwargs_no_batch):
    """Microbatches, runs the loop over the buffer, reassembles the batch."""
    p = self.params
    loop = self._LoopSetup(args, kwargs)
    loop.fn_name = fn_name
    loop.kwargs_no_batch = kwargs_no_batch
    state0 = NestedMap(
        buffer=[
            self._SplitStages(
                tf.zeros([p.num_stages] + _Shape(x)[1:], x.dtype), 0)
            for x in loop.mb_leaves
        ],
        iteration=tf.constant(0, tf.int32),
        aux_loss=tf.constant(0.0, tf.float32))
    inputs = NestedMap(stage0=[
        microbatch.PadForIterations(x, loop.schedule) for x in loop.mb_leaves
    ])
    with tf.name_scope(p.name):
      states, final, _ = recurrent.Recurrent(
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
      self._AddAuxLoss(final.aux_loss, loop.schedule.num_microbatches)
    result = tuple(loop.Rebuild(outputs))
    return result[0] if len(result) == 1 else result

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
    it = state.iteration
    stage_ids = tf.range(p.num_stages, dtype=tf.int32)
    stage_in = [
        self._SplitStages(self._ShiftIn(sched, it, buf, x), 0)
        for buf, x in zip(state.buffer, inp.stage0)
    ]
    mb_ids = tf.clip_by_value(
        sched.MicrobatchId(it, stage_ids), 0, sched.num_microbatches - 1)
    repeat_ids = tf.clip_by_value(
        sched.RepeatId(it, stage_ids), 0, p.circular_repeat - 1)
    outs, stage_aux = self._RunStages(loop_theta, loop.fn_name,
                                      loop.Rebuild(stage_in), loop.mb_kwargs,
                                      loop.kwargs_no_batch, mb_ids, repeat_ids)
    valid = sched.IsValid(it, stage_ids)
    new_buffer = [
        self._SplitStages(_MaskBubbles(valid, o), 0) for o in loop.Leaves(outs)
    ]
    aux = state.aux_loss
    if stage_aux is not None:
      aux += tf.reduce_sum(tf.where(valid, stage_aux, tf.zeros_like(stage_aux)))
    return NestedMap(buffer=new_buffer, iteration=it + 1, aux_loss=aux), {}

  def _ShiftIn(self, sched, iteration, buf, stage0_input):
    """The stages' inputs this iteration: stage 0 new input, others buffer.

    Linear: buffer shifted right by one stage (stage 0's slot gets the
    input). Circular: rotated, so the last stage feeds stage 0 whenever stage
    0 does not read a fresh microbatch.
    """
    p = self.params
    if p.circular_repeat == 1:
      shifted = tf.concat([tf.zeros_like(buf[:1]), buf[:-1]], axis=0)
    else:
      shifted = tf.concat([buf[-1:], buf[:-1]], axis=0)
    reads = tf.logical_and(
        tf.equal(tf.range(p.num_stages), 0),
        sched.StageZeroReadsInput(iteration))
    reads = tf.reshape(reads, [p.num_stages] + [1] * (buf.shape.rank - 1))
    fresh = tf.broadcast_to(stage0_input[None], _Shape(buf))
    return tf.where(reads, fresh, shifted)

  def _RunStages(self, loop_theta, fn_name, stage_args, mb_kwargs,
                 kwargs_no_batch, mb_ids, repeat_ids):
    """Runs every stage on its own slot of `stage_args` ([S, ...] leaves)."""
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
      with py_utils.AuxLossContext(reentrant=True) as aux_ctx:
        out = fn(theta_now, *stage_args, **kw)
      return (self._CheckBodyOutputs(stage_args, out),
              _StageParallelAuxLoss(aux_ctx.aux_losses, p.num_stages))

    per_stage, per_stage_aux = [], []
    for stage in range(p.num_stages):
      with tf.name_scope(f'stage_{stage:03d}'):
        theta_s = self._OneStageTheta(loop_theta, stage, repeat_ids[stage])
        args_s = _MapTensor(lambda t, s=stage: t[s], stage_args)
        kw = {
            k: _MapTensor(lambda t, s=stage: tf.gather(t, mb_ids[s]), v)
            for k, v in mb_kwargs.items()
        }
        kw.update(kwargs_no_batch)
        with py_utils.AuxLossContext(reentrant=True) as aux_ctx:
          out = fn(theta_s, *args_s, **kw)
        per_stage.append(self._CheckBodyOutputs(args_s, out))
        per_stage_aux.append(_SumAuxLosses(aux_ctx.aux_losses))
    outs = tf.nest.map_structure(
        lambda *xs: None if xs[0] is None else tf.stack(xs), *per_stage)
    if all(a is None for a in per_stage_aux):
      return outs, None
    zero = tf.constant(0.0, tf.float32)
    return outs, tf.stack([zero if a is None else a for a in per_stage_aux])

  def _OneStageTheta(self, loop_theta, stage, repeat_id):
    p = self.params
    if p.per_stage_vars:
      theta_s = loop_theta.stages[stage]
    else:
      theta_s = tf.nest.map_structure(lambda t: t[stage], loop_theta.body)
    if p.circular_repeat > 1:
      theta_s = tf.nest.map_structure(lambda t: tf.gather(t, repeat_id),
                                      theta_s)
    return theta_s

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
        f'{_AUX_LOSS_ACCUMULATIONS}, got {p.aux_loss_microbatch_accumulation!r}.')
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


class _NullContext:

  def __enter__(self):
    return None

  def __exit__(self, *unused):
    return False


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


def _Shape(t):
  return py_utils.GetShape(t)


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


def _MaskBubbles(valid, x):
  """Zeros the [S] stage slots of x that ran a bubble this iteration."""
  mask = tf.reshape(valid, [-1] + [1] * (x.shape.rank - 1))
  return tf.where(mask, x, tf.zeros_like(x))


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
