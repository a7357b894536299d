"""Moving tensors between batch, microbatch and loop-iteration layouts.

    batch [B, ...]  --ToMicrobatches-->  [M, B/M, ...]
        (in the loop stage 0 reads microbatch m, and the last stage's
        output of each is kept: gpipe.pipeline.loop_io)
    [M, B/M, ...]  --ToBatch-->  [B, ...]

Per-stage states are padded to the loop's [T, S, ...] calls and back; which
call holds which microbatch comes from `gpipe.schedule.Schedule`: this
module only turns its index tables into gathers.
"""

import dataclasses
from typing import Any, Optional, Tuple

import numpy as np
import tensorflow as tf

from gpipe import nest
from gpipe import schedule as schedule_lib

__all__ = [
    'ToMicrobatches',
    'ToBatch',
    'ResolveNumMicrobatches',
]


def BatchSize(x):
  """The static leading dim of `x`, or its dynamic one if unknown."""
  dim = x.shape.as_list()[0] if x.shape.rank else None
  return dim if dim is not None else tf.shape(x)[0]


def ResolveNumMicrobatches(
    batch_size: int, num_microbatches: Optional[int],
    microbatch_size: Optional[int]) -> Tuple[int, bool]:
  """Returns M from the layer's params, checking divisibility.

  Args:
    batch_size: static batch size of the inputs.
    num_microbatches: p.num_microbatches or None.
    microbatch_size: p.microbatch_size or None.

  Returns:
    (M, needs_split): needs_split is False when the inputs are already
    microbatched ([M, ...]) because neither param is set.

  Raises:
    ValueError: naming the parameter and the fix when B is not divisible.
  """
  CheckMicrobatchParams(num_microbatches, microbatch_size)
  if num_microbatches is None and microbatch_size is None:
    return batch_size, False
  if not isinstance(batch_size, int):
    raise ValueError(
        'The pipelined layer needs a static batch size to split it into '
        'microbatches; got a dynamic one. Set the input shapes statically.')
  if num_microbatches is not None:
    if batch_size % num_microbatches:
      raise ValueError(
          f'Batch size {batch_size} is not divisible by num_microbatches='
          f'{num_microbatches}. Use a num_microbatches that divides '
          f'{batch_size} (e.g. {_Divisors(batch_size)}) or change the batch '
          'size.')
    return num_microbatches, True
  if batch_size % microbatch_size:
    raise ValueError(
        f'Batch size {batch_size} is not divisible by microbatch_size='
        f'{microbatch_size}. Use a microbatch_size that divides {batch_size} '
        f'(e.g. {_Divisors(batch_size)}) or change the batch size.')
  return batch_size // microbatch_size, True


def CheckMicrobatchParams(num_microbatches, microbatch_size):
  """Raises ValueError unless at most one is set, as an integer >= 1."""
  if num_microbatches is not None and microbatch_size is not None:
    raise ValueError(
        f'Set only one of num_microbatches ({num_microbatches}) and '
        f'microbatch_size ({microbatch_size}).')
  for name, value in (('num_microbatches', num_microbatches),
                      ('microbatch_size', microbatch_size)):
    if value is not None and (not schedule_lib.IsInteger(value) or
                              value < 1):
      raise ValueError(f'{name} must be None or an integer >= 1, got '
                       f'{value!r} ({type(value).__name__}).')


def _Divisors(n):
  return [d for d in range(1, n + 1) if n % d == 0]


def ToMicrobatches(x: tf.Tensor, num_microbatches: int) -> tf.Tensor:
  """[B, ...] -> [M, B/M, ...]; microbatch m holds examples m, m+M, m+2M, ...

  The batch is reshaped to [B/M, M, ...] and transposed, rather than reshaped
  to [M, B/M, ...], so that a sharding of the batch dim carries over to the
  B/M dim: the M dim is indexed by the loop and must stay unsharded.
  """
  if not nest.IsTensor(x):
    return x
  batch, *rest = _Shape(x)
  reshaped = tf.reshape(x, [batch // num_microbatches, num_microbatches] + rest)
  return tf.transpose(reshaped, [1, 0] + list(range(2, x.shape.rank + 1)))


def ToBatch(x: tf.Tensor) -> tf.Tensor:
  """[M, B/M, ...] -> [B, ...]; the inverse of ToMicrobatches."""
  if not nest.IsTensor(x):
    return x
  rank = x.shape.rank
  transposed = tf.transpose(x, [1, 0] + list(range(2, rank)))
  shape = tf.shape(transposed)
  static = transposed.shape.as_list()
  batch = (static[0] * static[1]
           if static[0] is not None and static[1] is not None else
           shape[0] * shape[1])
  rest = [d if d is not None else shape[i + 2]
          for i, d in enumerate(static[2:])]
  return tf.reshape(transposed, [batch] + rest)


def PadStates(x, schedule: schedule_lib.Schedule):
  """[M, S, ...] per-(microbatch, stage) states -> [T, S, ...] per-call states.

  Entry [i, s] is the state of call (i, s), stage s's at iteration i: that
  of the microbatch it processes then. Every repeat of a circular stage
  starts from the same [m, s] entry. S=2, M=3, R=1 (entries: microbatch)::

      iteration  0  1  2  3
      stage 0    0  1  2  .
      stage 1    .  0  1  2      ('.' = bubble: holds microbatch 0's
                                  state, read but never written)

  S=2, M=2, R=2 (entries: microbatch/repeat; each repeat its own)::

      iteration    0    1    2    3    4
      stage 0    0/0  1/0  0/1  1/1    .
      stage 1      .  0/0  1/0  0/1  1/1
  """
  if not nest.IsTensor(x):
    return x
  index = np.asarray([[(m, s) for s, m in enumerate(per_stage)]
                      for per_stage in schedule.StateMicrobatchPerCall()],
                     np.int32)
  return tf.gather_nd(x, index)


def UnpadStates(padded, schedule: schedule_lib.Schedule):
  """[T, S, ...] per-call states -> [M, L, ...]: each (microbatch, layer)'s.

  L = R * S logical layers, repeat-major; (m, l) is entry
  [LayerIteration(m, l), l % S].
  """
  if not nest.IsTensor(padded):
    return padded
  return tf.gather_nd(padded, _IndexOfEachCall(schedule))


def ReadStatesByLayer(padded, schedule: schedule_lib.Schedule):
  """[T, S, ...] per-call states -> [L, M, ...]: UnpadStates, layer-major."""
  return tf.gather_nd(padded, _IndexOfEachCall(schedule).swapaxes(0, 1))


def WriteStatesByLayer(padded, by_layer, schedule: schedule_lib.Schedule):
  """[T, S, ...] per-call states with each call's entry set to its new one.

  by_layer is [L, M, ...] (ReadStatesByLayer's layout): the new state of
  each (layer, microbatch) call. Bubbles' entries keep what `padded` holds
  there, as the pipeline loop leaves them.
  """
  return tf.tensor_scatter_nd_update(
      padded, _IndexOfEachCall(schedule).swapaxes(0, 1), by_layer)


def _IndexOfEachCall(schedule):
  """[M, L, 2]: the (iteration, stage) index of each (microbatch, layer)
  call; every valid call is exactly one (microbatch, layer)'s."""
  return np.asarray(
      [[(schedule.LayerIteration(m, l), l % schedule.num_stages)
        for l in range(schedule.num_layers)]
       for m in range(schedule.num_microbatches)], np.int32)


def SliceForStages(x, microbatch_ids):
  """[M, ...] -> [S, ...]: each stage's own microbatch of a per-example kwarg.

  Args:
    x: a microbatched tensor [M, ...], or a non-tensor passed through.
    microbatch_ids: int32 [S], already clamped into [0, M).
  """
  if not nest.IsTensor(x):
    return x
  return tf.gather(x, microbatch_ids)


def StatesToMicrobatches(x, num_microbatches):
  """[S, B, ...] per-stage states -> [M, S, B/M, ...], split like the inputs.

  Microbatch m holds the same examples as ToMicrobatches' microbatch m.
  """
  if not nest.IsTensor(x):
    return x
  perm = [1, 0] + list(range(2, x.shape.rank))
  mb = ToMicrobatches(tf.transpose(x, perm), num_microbatches)
  return tf.transpose(mb, [0, 2, 1] + list(range(3, mb.shape.rank)))


def SplitStates(per_stage_states, num_microbatches, microbatch_size):
  """[S, B, ...] states of the whole batch -> [M, S, B/M, ...] (a structure
  of them), split as the layer's params split its inputs."""

  def Split(x):
    if not nest.IsTensor(x):
      return x
    num_mb, split = ResolveNumMicrobatches(
        x.shape.as_list()[1], num_microbatches, microbatch_size)
    if not split:
      raise ValueError(
          'MicrobatchStates needs num_microbatches or microbatch_size to '
          'split the batch; with neither set, states are already '
          '[M, num_stages, ...]: pass them to PadMicrobatches directly.')
    return StatesToMicrobatches(x, num_mb)

  return tf.nest.map_structure(Split, per_stage_states)


@dataclasses.dataclass(frozen=True)
class SplitResult:
  """A pipelined call's inputs as the loop takes them.

  Attributes:
    schedule: the Schedule of this call's M.
    split: whether the batch was split here (else it came [M, ...]).
    args: the nest.TensorLeaves of the [M, ...] args (the buffer carries
      only their tensors; None leaves stay None).
    kwargs: the [M, ...] per-example kwargs.
  """
  schedule: schedule_lib.Schedule
  split: bool
  args: Any
  kwargs: Any


def SplitInputs(args, kwargs, params, replicate_loop_dim):
  """A pipelined layer's inputs, checked and split into microbatches.

  Args:
    args: the positional inputs, [B, ...] (or [M, ...] when neither
      num_microbatches nor microbatch_size is set).
    kwargs: per-example kwargs, likewise.
    params: the layer's params.
    replicate_loop_dim: places a [M, ...] input (sharding.StagePlacement's
      ReplicateLoopDim).

  Returns:
    A SplitResult.
  """
  tensors = [x for x in tf.nest.flatten(args) if nest.IsTensor(x)]
  if not tensors:
    raise ValueError('PipelinedLayer.FProp needs at least one tensor input.')
  batch = BatchSize(tensors[0])
  num_mb, split = ResolveNumMicrobatches(batch, params.num_microbatches,
                                         params.microbatch_size)
  CheckLeadingDims(args, kwargs, batch, num_mb, split)
  if split:
    to_mb = lambda x: ToMicrobatches(x, num_mb)
    args, kwargs = nest.MapTensors(to_mb, args), nest.MapTensors(to_mb,
                                                                 kwargs)
  args = nest.MapTensors(replicate_loop_dim, args)
  return SplitResult(
      schedule=schedule_lib.Schedule.ForLayer(params, num_mb),
      split=split, args=nest.TensorLeaves(args), kwargs=kwargs)


def MicrobatchedNote(inputs):
  """Says how SplitInputs read inputs when no microbatch param is set."""
  first = inputs.args.leaves[0]
  return (f'neither num_microbatches nor microbatch_size is set, so the '
          f'inputs were taken as already microbatched: '
          f'M={inputs.schedule.num_microbatches} microbatches of shape '
          f'{first.shape.as_list()[1:]}. To split a [batch, ...] input, set '
          'num_microbatches or microbatch_size.')


def LayerStatesToBatch(per_layer):
  """[M, L, B/M, ...] per-(microbatch, layer) states -> [L, B, ...].

  A rank-2 [M, L] (a scalar per microbatch and layer) becomes [L, M].
  """
  rank = per_layer.shape.rank
  if rank < 3:
    return tf.transpose(per_layer, [1, 0])
  whole = ToBatch(tf.transpose(per_layer, [0, 2, 1] + list(range(3, rank))))
  return tf.transpose(whole, [1, 0] + list(range(2, rank - 1)))


def CheckLeadingDims(args, kwargs, batch, num_microbatches, split):
  """The args must share the batch dim; per-example kwargs split evenly.

  A per-example kwarg may have a batch of its own (a source of 4 sequences
  for 8 beam hypotheses): it is split into the same M microbatches,
  example r to microbatch r mod M, as Lingvo's layer splits it. Inside
  microbatch m an input example t (position t div M) and a kwarg example
  t mod Bk then keep their relation when M divides Bk: the kwarg's
  examples tile the input's (input example t uses kwarg example t mod Bk,
  Lingvo's FProp order
  [multiplier, source_batch]). Already-microbatched inputs ([M, ...]) need
  every kwarg to be [M, ...] too.
  """
  for x in tf.nest.flatten(args):
    dim0 = _StaticDim0(x)
    if dim0 is not None and isinstance(batch, int) and dim0 != batch:
      raise ValueError(
          f'All args must have the batch size {batch} as leading dim; got a '
          f'tensor of shape {x.shape}. Pass unbatched values via '
          'kwargs_no_batch.')
  for name, value in kwargs.items():
    for x in tf.nest.flatten(value):
      dim0 = _StaticDim0(x)
      if dim0 is None:
        continue
      if split and dim0 % num_microbatches:
        raise ValueError(
            f'Per-example kwarg {name!r} has shape {x.shape}: its leading '
            f'(batch) dim {dim0} must be divisible by num_microbatches='
            f'{num_microbatches} to split it like the inputs. Pass a batch '
            f'that is a multiple of {num_microbatches}, or unbatched values '
            'via kwargs_no_batch.')
      if not split and dim0 != num_microbatches:
        raise ValueError(
            f'Per-example kwarg {name!r} has shape {x.shape}; the inputs are '
            f'already microbatched, [{num_microbatches}, ...], so it must be '
            f'[{num_microbatches}, ...] too.')


def _StaticDim0(x):
  if nest.IsTensor(x) and x.shape.rank:
    return x.shape.as_list()[0]
  return None


def CheckPaddedStates(padded_states, sched):
  """The states' tensor leaves, checked to be [T, S, ...] per-call states."""
  leaves = tf.nest.flatten(padded_states)
  expected = [sched.num_iterations, sched.num_stages]
  for x in leaves:
    if not nest.IsTensor(x):
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


def CheckInputs(args, kwargs):
  """The layer's batched inputs with NumPy arrays made tensors, or an error.

  Every leaf of args and of the per-example kwargs must be a tensor with a
  leading batch dim (or None); NumPy arrays are converted as TensorFlow
  would. Python numbers and scalar tensors have no batch dim: they belong in
  kwargs_no_batch. A kwarg may also be a flag (a bool or a string), which
  every stage gets as it is (as Lingvo's use_short_seq_opt=False).
  """

  def CheckTree(where, tree, flags_ok):
    leaves = [tf.convert_to_tensor(x) if isinstance(x, np.ndarray) else x
              for x in tf.nest.flatten(tree)]
    for i, x in enumerate(leaves):
      if x is None or (nest.IsTensor(x) and x.shape.rank != 0):
        continue
      if flags_ok and isinstance(x, (bool, str)):
        continue
      what = (f'a scalar tensor ({x.dtype.name})' if nest.IsTensor(x) else
              f'a {type(x).__name__} ({x!r:.40})')
      raise ValueError(
          f'PipelinedLayer input {where}{_Paths(tree)[i]} is {what}; inputs '
          'and per-example kwargs must be tensors with the batch as leading '
          'dim (lists are read as structures of inputs). Pass unbatched '
          'values via kwargs_no_batch.')
    return tf.nest.pack_sequence_as(tree, leaves)

  args = tuple(CheckTree(f'args[{i}]', a, False) for i, a in enumerate(args))
  kwargs = {k: CheckTree(f'kwargs[{k!r}]', v, True) for k, v in kwargs.items()}
  return args, kwargs


def _Paths(tree, prefix=''):
  """'[i]' / '.key' paths of tree's leaves, in tf.nest.flatten order."""
  if isinstance(tree, dict):  # NestedMap too; tf.nest sorts the keys
    return [p for k in sorted(tree) for p in _Paths(tree[k], f'{prefix}.{k}')]
  if isinstance(tree, (list, tuple)):
    return [p for i, x in enumerate(tree) for p in _Paths(x, f'{prefix}[{i}]')]
  return [prefix]


def NumPremadeMicrobatches(tree):
  """M of already-microbatched [M, ...] tensors, checked to be shared."""
  leaves = [x for x in tf.nest.flatten(tree) if nest.IsTensor(x)]
  dims = {x.shape.as_list()[0] if x.shape.rank else None for x in leaves}
  if len(dims) != 1 or None in dims:
    shapes = ', '.join(str(x.shape) for x in leaves)
    raise ValueError(
        'With neither num_microbatches nor microbatch_size set, inputs are '
        'taken as already microbatched, [M, ...] with one static M; got '
        f'shapes {shapes}. Set num_microbatches or microbatch_size to pass '
        '[batch, ...] inputs.')
  return dims.pop()


def _Shape(x):
  """The shape of x, static dims as ints, unknown ones as scalar tensors."""
  dynamic = tf.shape(x)
  return [d if d is not None else dynamic[i]
          for i, d in enumerate(x.shape.as_list())]
