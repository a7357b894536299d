"""Running every stage of one loop iteration: a StageRunner, three kinds.

In each iteration all S stages compute, each on its own slot of the
[S, ...] buffer with its own weights, microbatch, repeat and step seed. A
layer picks its runner on every call (`RunnerFor`, from its layout and
placement: whether graphs are being built for the SPMD partitioner is
known only then); the runner says what the loop may ask of it
(`StageRunner`'s attributes) and runs the stages (`CallStages`):

  * `OneByOne` (one device, no partitioner): the stages one after
    another on their slices, results stacked back to [S, ...]. The manual-
    sharding ops below have no single-device kernel. Where the body allows,
    a layer runs its stages vectorized instead, all in one computation
    (gpipe.pipeline.vectorized_stages.Vectorizing, a runner too).
  * `InManualRegion` (SPMD partitioning): [S, ...] tensors, stage dim
    split, become each device's own [...] slice, the body runs once, and its
    results go back to [S, ...]: each device computes exactly its stage.
  * `Together` (a stage_parallel_body): one call on the [S, ...] tensors.

Each calls the body once per call site through `stage_call.CallStage` and
returns a `RunnerResult`."""

import abc
import dataclasses
from typing import Any, List, Optional, Tuple

import tensorflow as tf

from gpipe import microbatch
from gpipe import nest
from gpipe.pipeline import stage_call
from gpipe.pipeline import non_trainable_vars
from gpipe import sharding


@dataclasses.dataclass(frozen=True, eq=False)
class IterationStages:
  """One iteration's work, every tensor with a leading [S] stage dim.

  Attributes:
    args: the stages' inputs (buffer slots, then state slots), a tuple.
    mb_ids: int32 [S], the microbatch each stage works on (clamped).
    repeat_ids: int32 [S], the repeat each stage runs (clamped).
    seeds: [S], each stage's step seed.
    var_values: the carried non-trainable values, each [S, (R,) ...].
    first_stage: the stage the leading dim starts at: S above may be a
      range of the layer's stages on one device (Schedule.Phases).
  """
  args: Tuple[Any, ...]
  mb_ids: tf.Tensor
  repeat_ids: tf.Tensor
  seeds: tf.Tensor
  var_values: List[tf.Tensor]
  first_stage: int = 0

  @property
  def num_stages(self):
    """The stages this iteration runs: the leading dim."""
    return self.mb_ids.shape.as_list()[0]


@dataclasses.dataclass(frozen=True, eq=False)
class RunnerResult:
  """What a StageRunner's run made: every stage's call, each result with a
  leading [S] dim, bubbles not yet masked (iteration.RunStages masks them).

  Attributes:
    outputs: a tuple with the structure of IterationStages.args.
    aux: float32 [S], each stage's aux losses summed, or None if none added.
    summaries: [(name, value [S], weight [S])] the body added.
    vars: the carried non-trainable values with each stage's assignments.
  """
  outputs: Tuple[Any, ...]
  aux: Optional[tf.Tensor]
  summaries: List[Tuple[str, tf.Tensor, tf.Tensor]]
  vars: List[tf.Tensor]


class StageRunner(abc.ABC):
  """Runs every stage of one iteration, and says what it can do: the
  interface the loops and the layer type against.

  Attributes:
    any_stage_range: it runs whatever range of the stages it is given (one
      device, no partitioner), so the loop may leave out the stages that
      only hold bubbles (skip_bubbles).
    manual_mesh: (device_mesh, mesh_dim) of the manual region the body runs
      in, each device its own stage; None where there is none.
    stage_parallel: one call of the body computes every stage.
    vectorizes: it runs the stages of an iteration as one computation
      vectorized over the stage dim where the body allows (what
      layer_by_layer does over the microbatches).
    stage_dim_inside: every activation of a call has the leading stage dim
      (the stages vectorized, or each device's stage in a manual region),
      so that a 1f1b ring can keep each stage's part of what it stores.
  """
  any_stage_range = False
  manual_mesh = None
  stage_parallel = False
  vectorizes = False
  stage_dim_inside = False

  @abc.abstractmethod
  def CallStages(self, spec, theta,
                 it: 'IterationStages') -> 'RunnerResult':
    """Every stage's body call on `it` (each tensor [S, ...])."""


class OneByOne(StageRunner):
  """One device: the stages one after another (RunOneByOne)."""
  any_stage_range = True

  def CallStages(self, spec, theta, it):
    return RunOneByOne(spec, theta, it)


class InManualRegion(StageRunner):
  """Partitioned: the body once, each device its own stage."""
  stage_dim_inside = True

  def __init__(self, manual_mesh):
    self.manual_mesh = manual_mesh

  def CallStages(self, spec, theta, it):
    return RunInManualRegion(spec, theta, it, self.manual_mesh)


class Together(StageRunner):
  """A stage_parallel_body: one call computes all stages (RunTogether)."""
  stage_parallel = True

  def CallStages(self, spec, theta, it):
    return RunTogether(spec, theta, it)


def RunnerFor(stage_parallel, placement,
              one_device=None) -> StageRunner:
  """The runner for a layout (stage-parallel or not) and a placement.

  A single-stage body whose stages are placed over devices runs in a manual
  region when graphs are built for the SPMD partitioner; otherwise on one
  device, with `one_device` (e.g. gpipe.pipeline.vectorized_stages.
  Vectorizing; OneByOne if None). One stage on a mesh (a stage axis of
  one device: no pipeline) needs no manual region: every device runs the
  one stage, and the body's annotations split it over the other axes as
  anywhere outside a pipeline. (XLA's partitioner also refuses a manual
  region over an axis of one device.)
  """
  if stage_parallel:
    return Together()
  if (placement.mesh is not None and sharding.IsSpmdPartitioning() and
      placement.num_stages > 1):
    return InManualRegion(placement.mesh)
  return one_device or OneByOne()


def _Kwargs(spec, slice_fn):
  """Per-example kwargs sliced by slice_fn, plus the unbatched ones."""
  kw = {k: nest.MapTensors(slice_fn, v) for k, v in spec.mb_kwargs.items()}
  kw.update(spec.kwargs_no_batch)
  return kw


def RunOneByOne(spec, theta, it: IterationStages) -> RunnerResult:
  """The stages one after another, each on its slice; results stacked.

  The stage dim is unstacked once: the gradient of S unstacked pieces is
  one stack, where S separate slices would each back-propagate a full-size
  [S, ...] tensor.
  """
  num_stages = it.num_stages
  theta_parts = nest.Unstack(theta, num_stages)
  args_parts = nest.Unstack(it.args, num_stages)
  results, new_vars = [], []
  for stage in range(num_stages):
    with tf.name_scope(f'stage_{stage:03d}'):
      repeat = it.repeat_ids[stage]
      current = [
          non_trainable_vars.TakeStageSlice(v, stage, repeat, spec.repeats)
          for v in it.var_values
      ]
      res = stage_call.CallStage(
          spec.body, spec.fn_name,
          spec.repeats.TakeByOneHot(theta_parts[stage], repeat),
          args_parts[stage],
          _Kwargs(spec, lambda t, s=stage: tf.gather(t, it.mb_ids[s])),
          where=f'stage {it.first_stage + stage}', var_names=spec.var_names,
          var_values=current,
          context=stage_call.StageContext(it.seeds[stage], spec.global_step))
      new_vars.append([
          spec.repeats.Put(v[stage], repeat, n)
          for v, n in zip(it.var_values, res.new_vars)
      ])
      results.append(res)
  aux = [res.AuxLoss() for res in results]
  if all(a is None for a in aux):
    aux = None
  else:
    zero = tf.constant(0.0, tf.float32)
    aux = tf.stack([zero if a is None else a for a in aux])
  summaries = [
      (entries[0][0], tf.stack([v for _, v, _ in entries]),
       tf.stack([w for _, _, w in entries]))
      for entries in zip(*[res.summaries for res in results])
  ]
  return RunnerResult(
      outputs=nest.Stack([res.outputs for res in results]),
      aux=aux, summaries=summaries,
      vars=[tf.stack(per_stage) for per_stage in zip(*new_vars)])



def RunInManualRegion(spec, theta, it: IterationStages,
                      mesh) -> RunnerResult:
  """The body once, in a manual region: each device its own stage.

  What enters needs no communication: every stage-dim tensor already lives
  on its stage's device, and per-example kwargs are gathered by microbatch
  id first.
  """
  device_mesh, mesh_dim = mesh
  to_manual = lambda x: sharding.ToManualStage(x, device_mesh, mesh_dim)
  from_manual = lambda x: sharding.FromManualStage(x, device_mesh, mesh_dim)
  whole = lambda x: sharding.BroadcastToManualStage(x, device_mesh, mesh_dim)
  repeat = to_manual(it.repeat_ids)
  theta = tf.nest.map_structure(
      lambda t: spec.repeats.Take(to_manual(t), repeat), theta)
  kw = {k: nest.MapTensors(lambda t: to_manual(tf.gather(t, it.mb_ids)), v)
        for k, v in spec.mb_kwargs.items()}
  kw.update({k: nest.MapTensors(whole, v)
             for k, v in spec.kwargs_no_batch.items()})
  global_step = spec.global_step
  if global_step is not None:
    global_step = whole(tf.convert_to_tensor(global_step))
  with sharding.ManualStageRegion(mesh_dim):
    mine = [to_manual(v) for v in it.var_values]  # [(R,) ...] per device
    res = stage_call.CallStage(
        spec.body, spec.fn_name, theta,
        nest.MapTensors(to_manual, it.args), kw,
        where='each device\'s stage (manual region)',
        var_names=spec.var_names,
        var_values=[spec.repeats.Take(v, repeat) for v in mine],
        context=stage_call.StageContext(to_manual(it.seeds), global_step))
    new_values = [spec.repeats.Put(v, repeat, n)
                  for v, n in zip(mine, res.new_vars)]
    aux = res.AuxLoss()
  return RunnerResult(
      outputs=nest.MapTensors(from_manual, res.outputs),
      aux=None if aux is None else from_manual(aux),
      summaries=[(name, from_manual(v), from_manual(w))
                 for name, v, w in res.summaries],
      vars=[from_manual(v) for v in new_values])


def RunTogether(spec, theta, it: IterationStages) -> RunnerResult:
  """A stage_parallel_body: one call computes all stages."""
  num_stages = spec.schedule.num_stages
  theta = tf.nest.map_structure(
      lambda t: spec.repeats.TakeFromRS(t, it.repeat_ids), theta)
  res = stage_call.CallStage(
      spec.body, spec.fn_name, theta, it.args,
      _Kwargs(spec, lambda t: microbatch.SliceForStages(t, it.mb_ids)),
      where='all stages at once',
      context=stage_call.StageContext(it.seeds[0], spec.global_step))
  summaries = [(name, PerStage(v, num_stages), PerStage(w, num_stages))
               for name, v, w in res.summaries]
  return RunnerResult(
      outputs=res.outputs,
      aux=StageParallelAuxLoss(res.aux_losses, num_stages),
      summaries=summaries, vars=it.var_values)


def PerStage(x, num_stages):
  """A stage-parallel body's summary as [num_stages] (a scalar: for all)."""
  if x.shape.rank == 0:
    return tf.broadcast_to(x, [num_stages])
  return tf.reshape(x, [num_stages])


def StageParallelAuxLoss(aux_losses, num_stages):
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
