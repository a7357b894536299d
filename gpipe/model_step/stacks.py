"""Where a model keeps its pipelined stack, and how a candidate reshapes it.

A task's pipelined stack is one of:

  GpipeStack     gpipe's PipelinedLayer Params, somewhere in the task's
                 Params tree (params/lm.py's models): M, R and the remat
                 policy are that layer's own Params.
  LingvoClient   a Lingvo layer that builds the pipelined layer itself, in
                 its __init__, from Params of its own: Lingvo's
                 `batch_major_attention.PipelinedTransformerLayers`. With
                 `UseGpipeInLingvo()` it builds gpipe's layer; its
                 pipelined layer exists only in the built task, so the
                 stack's Params are read off a built copy.
  GshardClient   a task built by Lingvo's GShard builder with
                 `num_spmd_pipeline_stages` > 1 (`gshard_builder.
                 UniTransformer`): the builder makes the pipelined layer
                 in the task's __init__, its stage dim placed nowhere, so
                 it is built with its stages over num_stages devices
                 (lingvo_compat.StagesOverDevicesLayer).

    FindStack(task_params) -> stack
    stack.Reshape(task_params, candidate, depth_param)   # a copy's, in place
    stack.StackParams(task_params)  # the PipelinedLayer Params it amounts to
    with stack.Switch(): task = task_params.Instantiate()  # on gpipe

`FindStack` refuses a task with no pipelined stack or with several, in
one line.
"""

import numpy as np
import tensorflow as tf

from gpipe import layers as gpipe_layers
from gpipe import lingvo_compat
from gpipe.pipeline import param_checks
from lingvo.core import batch_major_attention
from lingvo.core import hyperparams


class StackError(ValueError):
  """The task's stack cannot be planned as asked; said in one line."""


class GpipeStack:
  """gpipe PipelinedLayer Params at `path` in the task's Params."""

  def __init__(self, path):
    self.path = path

  def StackParams(self, task_params):
    return _Get(task_params, self.path)

  def Reshape(self, task_params, candidate, depth_param):
    """Sets M, R, the remat policy and the mesh, keeping S x R x depth per
    body."""
    stack = _Get(task_params, self.path)
    body = stack.single_stage_body or stack.stage_parallel_body
    num_stages = (candidate.mesh[stack.pipeline_stage_mesh_dim]
                  if candidate.mesh else stack.num_stages)
    _KeepDepth(body, depth_param, (stack.num_stages, stack.circular_repeat),
               (num_stages, candidate.circular_repeat), '--depth_param NAME')
    SetSchedule(stack, candidate)

  def Validate(self, task_params, batch_size):
    gpipe_layers.ValidateParams(_Get(task_params, self.path), batch_size)

  @staticmethod
  def Switch():
    return lingvo_compat.UseGpipeInLingvo()


class LingvoClient:
  """Lingvo's PipelinedTransformerLayers at `path`, built on gpipe's layer.

  It names M `num_pipeline_microbatches` and R `circular_repeat`, and its
  stage (StackedTransformerLayers) holds `num_layers`, scaled to keep the
  depth when R varies. It passes no remat policy, so the built layer has
  gpipe's default and only that one can be planned.
  """

  DEPTH_PARAM = 'num_layers'

  def __init__(self, path):
    self.path = path

  @staticmethod
  def Matches(p):
    return issubclass(p.cls, batch_major_attention.PipelinedTransformerLayers)

  def StackParams(self, task_params):
    """The Params of the pipelined layer the client builds (in a scratch
    graph, with gpipe's layer switched in)."""
    return _BuiltStackParams(task_params.Copy(), self.Switch())

  @staticmethod
  def Switch():
    return lingvo_compat.UseGpipeInLingvo()

  def Reshape(self, task_params, candidate, depth_param):
    del depth_param  # the client's stage keeps its depth in num_layers
    client = _Get(task_params, self.path)
    _OnlyTheDefaultPolicy(candidate, client.cls.__name__)
    _KeepDepth(client.pipeline_stage, self.DEPTH_PARAM,
               (client.num_pipeline_stages, client.circular_repeat),
               (client.num_pipeline_stages, candidate.circular_repeat), None)
    client.Set(num_pipeline_microbatches=candidate.num_microbatches,
               pipeline_microbatch_size=None,
               circular_repeat=candidate.circular_repeat)

  def Validate(self, task_params, batch_size):
    del task_params, batch_size  # the built layer checks its own


class GshardClient(LingvoClient):
  """A task Lingvo's GShard builder pipelines (gshard_builder.UniTransformer
  and its kin: `num_spmd_pipeline_stages` > 1), built on gpipe's layer.

  M is the task's `num_spmd_pipeline_microbatches` (the builder splits the
  batch into microbatches before the pipeline); the builder makes no
  circular repeat and passes no remat policy, so only R = 1 and gpipe's
  default policy can be planned. Its stage dim, which the builder places
  nowhere, is split over num_stages devices.
  """

  @staticmethod
  def Matches(p):
    return ('builder' in p and 'num_spmd_pipeline_stages' in p and
            (p.num_spmd_pipeline_stages or 1) > 1)

  @staticmethod
  def Switch():
    return lingvo_compat.UseGpipeInLingvo(split_unplaced_stages=True)

  def Reshape(self, task_params, candidate, depth_param):
    del depth_param  # the builder keeps the depth in num_transformer_layers
    task = _Get(task_params, self.path)
    _OnlyTheDefaultPolicy(candidate, task.cls.__name__)
    if candidate.circular_repeat != 1:
      raise StackError(
          f'circular_repeat={candidate.circular_repeat}: '
          f'{task.cls.__name__}\'s GShard builder pipelines without '
          'circular repeats; plan only circular_repeat=1.')
    task.Set(num_spmd_pipeline_microbatches=candidate.num_microbatches)


def SetSchedule(stack_params, candidate):
  """Sets a candidate's M, R, remat policy, backward schedule, stream_io
  and mesh on PipelinedLayer Params (the depth is the caller's: see
  _KeepDepth; a backward schedule or stream_io of None keeps the stack's
  own). skip_bubbles and layer_by_layer go off: the one-device reference
  step must run the pipeline loop and compute every slot, as each
  partitioned device does."""
  stack_params.Set(num_microbatches=candidate.num_microbatches,
                   microbatch_size=None,
                   circular_repeat=candidate.circular_repeat,
                   remat_policy=candidate.remat_policy,
                   store_body_intermediates=False, skip_bubbles=False,
                   layer_by_layer=False)
  if candidate.backward_schedule is not None:
    stack_params.Set(backward_schedule=candidate.backward_schedule)
  if candidate.stream_io is not None:
    stack_params.Set(stream_io=candidate.stream_io)
  if candidate.mesh:
    stack_params.Set(
        num_stages=candidate.mesh[stack_params.pipeline_stage_mesh_dim],
        device_mesh=np.arange(np.prod(candidate.mesh)).reshape(
            candidate.mesh))
  if getattr(candidate, 'fsdp_mesh_dim', None) is not None:
    _SetFsdp(stack_params, candidate.fsdp_mesh_dim)


def _SetFsdp(stack_params, axis):
  """The stage body's fsdp_mesh_dim (a negative axis: none), for a body
  that stores its weights split over a mesh axis and gathers them where
  it uses them (params.pod_blocks.BatchMajorStage)."""
  body = stack_params.single_stage_body
  if body is None or 'fsdp_mesh_dim' not in body:
    name = body.cls.__name__ if body is not None else 'stage_parallel_body'
    raise StackError(
        f'fsdp_mesh_dim={axis}: the stage body {name} has no fsdp_mesh_dim '
        'param; FSDP needs a body that gathers its weights where it uses '
        'them (e.g. params.pod_blocks.BatchMajorStage).')
  body.fsdp_mesh_dim = None if axis < 0 else axis


def _OnlyTheDefaultPolicy(candidate, client_name):
  """Raises StackError unless the candidate's policy is gpipe's default
  and its mesh the client's own: a Lingvo client builds its pipelined
  layer without a remat policy, on a mesh of its own making."""
  if candidate.mesh:
    raise StackError(f'mesh {candidate.mesh}: {client_name} builds its '
                     'pipelined layer on a mesh of its own; plan it without '
                     '--mesh.')
  if candidate.backward_schedule not in (None, 'reverse') or candidate.stream_io:
    raise StackError(
        f'{candidate.Describe()}: {client_name} builds its pipelined layer '
        "without backward_schedule or stream_io, so it runs gpipe's "
        "defaults ('reverse', no stream_io); plan only those.")
  default = param_checks.RematPolicy(gpipe_layers.PipelinedLayer.Params())
  if candidate.remat_policy != default:
    raise StackError(
        f'remat_policy={candidate.remat_policy!r}: {client_name} builds '
        'its pipelined layer without a remat policy, so it runs gpipe\'s '
        f'default {default!r}; plan only that one.')


def FindStack(task_params, where):
  """The one pipelined stack of a task's Params (GpipeStack, LingvoClient).

  Raises:
    StackError: none, or more than one.
  """
  found = list(_FindStacks(task_params, ''))
  if len(found) != 1:
    raise StackError(
        f'{where} has {len(found)} pipelined stacks '
        f'({", ".join(s.path for s in found) or "none"}); the planner '
        'plans a model with exactly one: gpipe\'s PipelinedLayer, '
        'Lingvo\'s PipelinedTransformerLayers, or a GShard builder\'s '
        'task with num_spmd_pipeline_stages > 1.')
  return found[0]


def _FindStacks(p, path):
  cls = getattr(p, 'cls', None)
  if isinstance(cls, type) and issubclass(cls, gpipe_layers.PipelinedLayer):
    yield GpipeStack(path or '.')
    return
  if isinstance(cls, type) and LingvoClient.Matches(p):
    yield LingvoClient(path or '.')
    return
  if isinstance(cls, type) and GshardClient.Matches(p):
    yield GshardClient(path or '.')
    return
  for name, value in p.IterParams():
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
      if isinstance(v, hyperparams.Params):
        yield from _FindStacks(v, f'{path}.{name}' if path else name)


def _Get(task_params, path):
  p = task_params
  if path != '.':
    for part in path.split('.'):
      p = p.Get(part)
  return p


def _KeepDepth(body, depth_param, shape0, shape, hint):
  """Scales body.<depth_param> by S0 R0 / (S R), so that the stack keeps its
  depth; shape0 = (S0, R0) is the stack's own, shape = (S, R) the
  candidate's."""
  (s0, r0), (s, r) = shape0, shape
  if s * r == s0 * r0:
    return
  what = (f'circular_repeat={r}' if s == s0 else
          f'{s} stages x circular_repeat={r}')
  if depth_param not in body:
    fix = f'Pass {hint}, or plan' if hint else 'Plan'
    raise StackError(
        f'{what} would change the model\'s depth (it has {s0} x {r0} '
        f'stage bodies); the stage body {body.cls.__name__} has no '
        f'{depth_param!r} param to keep it. {fix} only {s0 * r0} stage '
        'bodies in all.')
  depth = body.Get(depth_param) * s0 * r0
  if depth % (s * r):
    raise StackError(
        f'{what}: {depth} blocks in all do not split into {s} x {r} stage '
        'bodies.')
  body.Set(**{depth_param: depth // (s * r)})


def _BuiltStackParams(task_params, switch):
  """The Params of the one pipelined layer in the task built from them
  (with `switch`, a lingvo_compat.UseGpipeInLingvo)."""
  from gpipe.model_step import train_step  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default(), switch:
    task = task_params.Instantiate()
  found = train_step.FindPipelinedLayers(task)
  if len(found) != 1:
    raise StackError(f'The built task has {len(found)} pipelined layers; '
                     'the planner plans a model with exactly one.')
  return found[0][1].params.Copy()
