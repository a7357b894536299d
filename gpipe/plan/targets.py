"""What to plan: a registered Lingvo model, or a PipelinedLayer on inputs.

A target builds the training step of one candidate (num_microbatches,
circular_repeat, remat_policy) in a scratch graph; varying circular_repeat
keeps the model's depth through the stage body's depth param.
"""

import contextlib
import dataclasses
import functools

import tensorflow as tf

from gpipe import layers as gpipe_layers
from gpipe import lingvo_compat
from gpipe.model_step import stacks
from gpipe.model_step import train_step
from gpipe.xla import user_layer


class PlanError(ValueError):
  """A problem with what was asked for, said in one line."""


@dataclasses.dataclass(frozen=True)
class Candidate:
  num_microbatches: int
  circular_repeat: int
  remat_policy: str = 'recompute'
  # The device mesh's shape, its stage axis giving num_stages (a model on
  # a mesh only); None: the model's own.
  mesh: tuple = None
  # 'reverse' or '1f1b', and stream_io; None: the stack's own.
  backward_schedule: str = None
  stream_io: bool = None
  # The mesh axis the stage body stores its weights split over too (FSDP;
  # NO_FSDP: none); None: the body's own.
  fsdp_mesh_dim: int = None

  def Describe(self):
    mesh = f' mesh {MeshName(self.mesh)}' if self.mesh else ''
    schedule = f' {self.backward_schedule}' if self.backward_schedule else ''
    io = {None: '', True: ' stream_io', False: ' no stream_io'}[self.stream_io]
    fsdp = {None: '', NO_FSDP: ' no fsdp'}.get(
        self.fsdp_mesh_dim, f' fsdp over axis {self.fsdp_mesh_dim}')
    return (f'M={self.num_microbatches} R={self.circular_repeat} '
            f'{self.remat_policy}{schedule}{io}{mesh}{fsdp}')


# Candidate.fsdp_mesh_dim of a candidate without FSDP.
NO_FSDP = -1


def MeshName(shape):
  """'8x1x4' for (8, 1, 4)."""
  return 'x'.join(str(n) for n in shape)



class ModelTarget:
  """A registered Lingvo model whose task holds one pipelined stack.

  The stack is gpipe's PipelinedLayer in the task's Params, or a Lingvo
  client that builds one (PipelinedTransformerLayers, a GShard builder's
  task; see gpipe.model_step.stacks): the task is built with gpipe's layer
  switched in (`stack.Switch()`), so either way the step runs gpipe's
  layer. With `lingvos_layer`, it runs Lingvo's own
  LayerwiseShardablePipelinedLayer from the same Params instead (all but
  the remat policy: Lingvo's layer always recomputes), to plan both side
  by side.
  """

  def __init__(self, name, lingvos_layer=False):
    from gpipe.lingvo_support import registered_models  # pylint: disable=g-import-not-at-top
    try:
      self._cfg = registered_models.GetParams(name, 'Train')
      self._stack = stacks.FindStack(self._cfg.task, f'{name} task')
    except (LookupError, stacks.StackError) as e:
      raise PlanError(f'--model {name}: {e}') from None
    self.name = name
    self.batch_size = self._cfg.input.batch_size
    self._lingvos_layer = lingvos_layer

  @functools.cached_property
  def stack_params(self):
    return self._stack.StackParams(self._cfg.task)

  def DescribeError(self, error):
    """None: a model's error is said as it is."""
    del error

  def Build(self, candidate, depth_param):
    cfg = self._cfg.Copy()
    try:
      self._stack.Reshape(cfg.task, candidate, depth_param)
      self._stack.Validate(cfg.task, self.batch_size)
    except stacks.StackError as e:
      raise PlanError(str(e)) from None
    if self._lingvos_layer:
      _SwapForLingvosLayer(cfg.task, self.name)
    with tf.Graph().as_default(), contextlib.ExitStack() as switch:
      if not self._lingvos_layer:
        switch.enter_context(self._stack.Switch())
      task = cfg.task.Instantiate()
    return train_step.TaskStep(task, train_step.InputSpecs(cfg.input))


class LayerTarget:
  """A PipelinedLayer's Params trained on float32 inputs of given shapes.

  `optimizer` (a gpipe.model_step.optimizers.Optimizer) updates the weights;
  None: Adam. `lingvos_layer`: as for ModelTarget.
  """

  def __init__(self, layer_params, input_shapes, name='layer',
               optimizer=None, lingvos_layer=False):
    try:
      user_layer.CheckPipelineParams(layer_params, name)
    except ValueError as e:
      raise PlanError(str(e)) from None
    self._params = layer_params
    self._input_shapes = input_shapes
    self.name = name
    self.batch_size = input_shapes[0][0]
    self._optimizer = optimizer
    self._lingvos_layer = lingvos_layer

  @property
  def stack_params(self):
    return self._params

  def DescribeError(self, error):
    """One line naming the input and sizes when the layer cannot take the
    input shapes (as check_partitioning says it), else None."""
    if not isinstance(error, (ValueError, TypeError, tf.errors.OpError)):
      return None
    return user_layer.DescribeInputError(
        self._params, self._input_shapes, error)

  def Build(self, candidate, depth_param):
    p = self._params.Copy()
    stack = stacks.GpipeStack('.')
    try:
      stack.Reshape(p, candidate, depth_param)
    except stacks.StackError as e:
      raise PlanError(str(e)) from None
    gpipe_layers.ValidateParams(p, self.batch_size)
    if self._lingvos_layer:
      p = lingvo_compat.AsLingvosOwnLayer(p)
    with tf.Graph().as_default():
      layer = p.Instantiate()
    return train_step.LayerStep(layer, self._input_shapes, self._optimizer)


def _SwapForLingvosLayer(task_params, where):
  """Replaces the task's PipelinedLayer Params by Lingvo's layer's."""
  stack = stacks.FindStack(task_params, where)
  if not isinstance(stack, stacks.GpipeStack):
    return  # a Lingvo client builds Lingvo's layer unless switched
  if stack.path == '.':
    raise PlanError(f'{where}: the task itself is the pipelined layer.')
  *parents, name = stack.path.split('.')
  parent = task_params
  for part in parents:
    parent = parent.Get(part)
  parent.Set(**{name: lingvo_compat.AsLingvosOwnLayer(parent.Get(name))})
