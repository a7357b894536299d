"""What to plan: a registered Lingvo model, or a PipelinedLayer on inputs.

A target builds the training step of one candidate (num_microbatches,
circular_repeat, remat_policy) in a scratch graph; varying circular_repeat
keeps the model's depth through the stage body's depth param.
"""

import dataclasses

import tensorflow as tf

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
from gpipe import check_partitioning
from gpipe import layers as gpipe_layers
from gpipe import lingvo_compat
from gpipe.plan import train_step
from lingvo.core import hyperparams


class PlanError(ValueError):
  """A problem with what was asked for, said in one line."""


@dataclasses.dataclass(frozen=True)
class Candidate:
  num_microbatches: int
  circular_repeat: int
  remat_policy: str = 'recompute'

  def Describe(self):
    return (f'M={self.num_microbatches} R={self.circular_repeat} '
            f'{self.remat_policy}')



class ModelTarget:
  """A registered Lingvo model whose task holds one PipelinedLayer.

  With `lingvos_layer`, the stack is built with Lingvo's own
  LayerwiseShardablePipelinedLayer from the same Params (all but the remat
  policy: Lingvo's layer always recomputes), to plan both side by side.
  """

  def __init__(self, name, lingvos_layer=False):
    from gpipe import registered_models  # pylint: disable=g-import-not-at-top
    try:
      self._cfg = registered_models.GetParams(name, 'Train')
    except LookupError as e:
      raise PlanError(f'--model {name}: {e}') from None
    self.name = name
    self.batch_size = self._cfg.input.batch_size
    self._lingvos_layer = lingvos_layer

  @property
  def stack_params(self):
    return _OneStack(self._cfg.task, f'{self.name} task')

  def DescribeError(self, error):
    """None: a model's error is said as it is."""
    del error

  def Build(self, candidate, depth_param):
    cfg = self._cfg.Copy()
    _Reshape(_OneStack(cfg.task, self.name), candidate, depth_param)
    gpipe_layers.ValidateParams(_OneStack(cfg.task, self.name),
                                self.batch_size)
    if self._lingvos_layer:
      _SwapForLingvosLayer(cfg.task, self.name)
    with tf.Graph().as_default():
      task = cfg.task.Instantiate()
    return train_step.TaskStep(task, train_step.InputSpecs(cfg.input))


class LayerTarget:
  """A PipelinedLayer's Params trained on float32 inputs of given shapes.

  `optimizer` (a gpipe.plan.optimizers.Optimizer) updates the weights;
  None: Adam. `lingvos_layer`: as for ModelTarget.
  """

  def __init__(self, layer_params, input_shapes, name='layer',
               optimizer=None, lingvos_layer=False):
    try:
      check_partitioning.CheckPipelineParams(layer_params, name)
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
    return check_partitioning.DescribeInputError(
        self._params, self._input_shapes, error)

  def Build(self, candidate, depth_param):
    p = self._params.Copy()
    _Reshape(p, candidate, depth_param)
    gpipe_layers.ValidateParams(p, self.batch_size)
    if self._lingvos_layer:
      p = lingvo_compat.AsLingvosOwnLayer(p)
    with tf.Graph().as_default():
      layer = p.Instantiate()
    return train_step.LayerStep(layer, self._input_shapes, self._optimizer)


def _OneStack(task_params, where):
  """The Params of the one PipelinedLayer inside `task_params`."""
  found = list(_FindStacks(task_params, ''))
  if len(found) != 1:
    raise PlanError(
        f'{where} has {len(found)} PipelinedLayer params '
        f'({", ".join(path for path, _ in found) or "none"}); the planner '
        'plans a model with exactly one pipelined stack.')
  return found[0][1]


def _SwapForLingvosLayer(task_params, where):
  """Replaces the task's PipelinedLayer Params by Lingvo's layer's."""
  (path, stack), = _FindStacks(task_params, '')
  if path == '.':
    raise PlanError(f'{where}: the task itself is the pipelined layer.')
  *parents, name = path.split('.')
  parent = task_params
  for part in parents:
    parent = parent.Get(part)
  parent.Set(**{name: lingvo_compat.AsLingvosOwnLayer(stack)})


def _FindStacks(p, path):
  if isinstance(getattr(p, 'cls', None), type) and issubclass(
      p.cls, gpipe_layers.PipelinedLayer):
    yield path or '.', p
    return
  for name, value in p.IterParams():
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
      if isinstance(v, hyperparams.Params):
        yield from _FindStacks(v, f'{path}.{name}' if path else name)


def _Reshape(stack, candidate, depth_param):
  """Sets M and R on stack params, keeping depth S x R x blocks per body."""
  r0, r = stack.circular_repeat, candidate.circular_repeat
  if r != r0:
    body = stack.single_stage_body or stack.stage_parallel_body
    if depth_param not in body:
      raise PlanError(
          f'circular_repeat={r} would change the model\'s depth (it has '
          f'{stack.num_stages} x {r0} stage bodies); the stage body '
          f'{body.cls.__name__} has no {depth_param!r} param to keep it. '
          'Pass --depth_param NAME, or plan only circular_repeat='
          f'{r0}.')
    depth = body.Get(depth_param) * r0
    if depth % r:
      raise PlanError(
          f'circular_repeat={r}: {depth} blocks per stage (over all '
          f'repeats) do not split into {r} repeats.')
    body.Set(**{depth_param: depth // r})
  stack.Set(num_microbatches=candidate.num_microbatches, microbatch_size=None,
            circular_repeat=r, remat_policy=candidate.remat_policy,
            store_body_intermediates=False)

