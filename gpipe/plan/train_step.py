"""One whole training step as a function of shapes: loss, gradients, update.

A planner needs the program a pod would run, not a toy: the forward pass,
the loss, the backward pass and the optimizer update with its slot
variables. `TrainStep` writes that step as a pure function of tensors

    fn(*weights, *slots, *inputs, global_step, learning_rate)
      -> (loss, *new trainable weights, *new slots)

so that it can be lowered from `tf.TensorSpec`s alone (nothing allocated:
a model larger than host memory lowers on a laptop) and compiled for N
devices. The new weights and slots are the step's outputs, each updating
its input in place (`aliases`), as donated buffers do on a TPU.

Placement: every stage-stacked weight, its gradient's use in the update,
its slots and their new values are annotated by the PipelinedLayer that
owns the weight (`PipelinedLayer.PlaceVariables`), so optimizer state lives
split like the weights rather than wherever propagation happens to put it.
Other variables (embeddings, softmax) are left to XLA's propagation.

The model is built in a throwaway tf.Graph (its variables are never
initialized, so never allocated); the step only uses the layers' code with
weights passed in as theta.
"""

import dataclasses

import tensorflow as tf

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
from gpipe import layers as gpipe_layers
from lingvo.core import base_layer
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap

# The kinds of the step's arguments, in order.
WEIGHT, SLOT, INPUT, SCALAR = 'weight', 'slot', 'input', 'scalar'


class Adam:
  """tf.compat.v1.train.AdamOptimizer's update, as a function of tensors.

  Two slots per trainable weight (m, v); the step count is the global step
  + 1, as the optimizer's beta powers count it.
  """
  slot_names = ('m', 'v')

  def __init__(self, beta1=0.9, beta2=0.999, epsilon=1e-8):
    self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon

  def Update(self, weight, grad, slots, learning_rate, global_step):
    m, v = slots
    t = tf.cast(global_step + 1, weight.dtype)
    lr = tf.cast(learning_rate, weight.dtype)
    lr_t = lr * tf.sqrt(1 - self.beta2**t) / (1 - self.beta1**t)
    m = self.beta1 * m + (1 - self.beta1) * grad
    v = self.beta2 * v + (1 - self.beta2) * tf.square(grad)
    return weight - lr_t * m / (tf.sqrt(v) + self.epsilon), [m, v]


class Sgd:
  """Plain gradient descent: no slots."""
  slot_names = ()

  def Update(self, weight, grad, slots, learning_rate, global_step):
    del slots, global_step
    return weight - tf.cast(learning_rate, weight.dtype) * grad, []


def LearnerOf(task_params):
  """(optimizer update, gradient clip norm) of a Lingvo task's training.

  Reads the task's learner (a built task has its legacy `train.optimizer`
  moved there); Adam and SGD are modelled.
  """
  tp = task_params.train
  learner = tp.learner
  if isinstance(learner, (list, tuple)):
    if len(learner) != 1:
      raise ValueError(
          f'The task has {len(learner)} learners; the planner models one '
          'optimizer over every variable.')
    learner = learner[0]
  source = learner if learner is not None else tp
  opt = source.optimizer
  name = opt.cls.__name__ if opt is not None else None
  if name == 'Adam':
    update = Adam(opt.beta1, opt.beta2, opt.epsilon)
  elif name == 'SGD':
    update = Sgd()
  else:
    raise ValueError(
        f'The optimizer is {name}; the planner models Adam (two slots per '
        'weight) and SGD (none). Plan with one of them: optimizer state is '
        'per weight either way, so memory scales with the slot count.')
  return update, float(source.clip_gradient_norm_to_value or 0.0)


@dataclasses.dataclass(frozen=True)
class Arg:
  """One argument of the step function."""
  name: str
  kind: str  # WEIGHT, SLOT, INPUT or SCALAR
  spec: tf.TensorSpec
  on_stages: bool = False  # a weight (or its slot) of a pipelined stack


class TrainStep:
  """A training step of `root` (a Lingvo task or layer), from shapes.

  Args:
    root: the built layer or task (in a graph of its own).
    input_specs: NestedMap of tf.TensorSpecs, the input batch.
    loss_fn: (theta, input_batch) -> scalar loss, run under the step's
      global step.
    optimizer: Adam or Sgd.
    clip_norm: if > 0, gradients are scaled to at most this global norm.
  """

  def __init__(self, root, input_specs, loss_fn, optimizer, clip_norm=0.0):
    self.root = root
    self.optimizer = optimizer
    self.clip_norm = clip_norm
    self._loss_fn = loss_fn
    self._theta = root.theta
    self._input_specs = input_specs
    variables = dict(root.vars.FlattenItems())
    stage_names = _StageVariableNames(root)
    self.weight_args = [
        Arg(name, WEIGHT, tf.TensorSpec(value.shape, value.dtype),
            name in stage_names) for name, value in self._theta.FlattenItems()
    ]
    self._trainable = [
        i for i, a in enumerate(self.weight_args) if variables[a.name].trainable
    ]
    self.slot_args = [
        Arg(f'{self.weight_args[i].name}/{slot}', SLOT,
            self.weight_args[i].spec, self.weight_args[i].on_stages)
        for slot in optimizer.slot_names for i in self._trainable
    ]
    self.input_args = [
        Arg(name, INPUT, spec) for name, spec in input_specs.FlattenItems()
    ]
    self.scalar_args = [
        Arg('global_step', SCALAR, tf.TensorSpec([], tf.int64)),
        Arg('learning_rate', SCALAR, tf.TensorSpec([], tf.float32)),
    ]

  @property
  def args(self):
    return (self.weight_args + self.slot_args + self.input_args +
            self.scalar_args)

  @property
  def specs(self):
    return [a.spec for a in self.args]

  @property
  def aliases(self):
    """(output index, parameter index): new trainable weights, new slots."""
    num_weights = len(self.weight_args)
    params = self._trainable + list(
        range(num_weights, num_weights + len(self.slot_args)))
    return [(1 + k, param) for k, param in enumerate(params)]

  def __call__(self, *flat):
    """The step: (loss, *new trainable weights, *new slots)."""
    n_w, n_s, n_i = (len(self.weight_args), len(self.slot_args),
                     len(self.input_args))
    weights = list(flat[:n_w])
    slots = list(flat[n_w:n_w + n_s])
    inputs = self._input_specs.Pack(list(flat[n_w + n_s:n_w + n_s + n_i]))
    global_step, learning_rate = flat[n_w + n_s + n_i:]
    weights = self._Place(weights)
    with tf.GradientTape() as tape:
      tape.watch(weights)
      with py_utils.GlobalStepContext(global_step):
        py_utils.ResetStepSeed()
        loss = self._loss_fn(self._theta.Pack(weights), inputs)
    trainable = [weights[i] for i in self._trainable]
    grads = [
        tf.convert_to_tensor(g) if g is not None else tf.zeros_like(w)
        for g, w in zip(tape.gradient(loss, trainable), trainable)
    ]
    if self.clip_norm > 0:
      grads, _ = tf.clip_by_global_norm(grads, self.clip_norm)
    num_slots = len(self.optimizer.slot_names)
    per_weight_slots = [
        [slots[s * len(trainable) + k] for s in range(num_slots)]
        for k in range(len(trainable))
    ]
    new_weights, new_slots = [], [[] for _ in range(num_slots)]
    for w, g, ws in zip(trainable, grads, per_weight_slots):
      new_w, new_ws = self.optimizer.Update(w, g, ws, learning_rate,
                                            global_step)
      new_weights.append(new_w)
      for s, value in enumerate(new_ws):
        new_slots[s].append(value)
    new_weights = self._PlaceTrainable(new_weights)
    new_slots = [self._PlaceSlots(s) for s in new_slots]
    return [loss] + new_weights + [x for s in new_slots for x in s]

  def _PlaceSlots(self, values):
    """Annotates one slot of every trainable weight: split like the weight."""
    return self._PlaceTrainable(values)

  def _Place(self, weights):
    """Annotates a full theta-ordered list as the pipelines place it."""
    placed = _PlaceLike(self.root, self._theta.Pack(weights))
    return placed.Flatten()

  def _PlaceTrainable(self, values):
    """Annotates values of the trainable weights (e.g. one slot of each)."""
    full = [None] * len(self.weight_args)
    for k, i in enumerate(self._trainable):
      full[i] = values[k]
    placed = _PlaceLike(self.root, self._theta.Pack(full)).Flatten()
    return [placed[i] for i in self._trainable]


def _PlaceLike(root, tree):
  """tree (shaped like root.theta) with every pipelined stack's part placed."""
  return _MapStacks(root, tree, lambda stack, t: stack.PlaceVariables(t))


def _StageVariableNames(root):
  """Theta paths of the variables that pipelined stacks hold per stage."""
  marked = _MapStacks(root, root.theta.Transform(lambda _: False),
                      lambda _, t: t.Transform(lambda _: True))
  return {name for name, on_stages in marked.FlattenItems() if on_stages}


def _MapStacks(layer, tree, fn):
  """tree with fn(stack, subtree) applied where a PipelinedLayer's theta is."""
  if isinstance(layer, gpipe_layers.PipelinedLayer):
    return fn(layer, tree)
  mapped = tree.copy()
  for name, child in layer.children.items():
    if name not in tree:
      continue
    if isinstance(child, (list, tuple)):
      mapped[name] = [_MapStacks(c, t, fn) for c, t in zip(child, tree[name])]
    elif isinstance(child, base_layer.BaseLayer):
      mapped[name] = _MapStacks(child, tree[name], fn)
  return mapped


def FindPipelinedLayers(layer, path=''):
  """[(path, PipelinedLayer)] in a built layer tree."""
  if isinstance(layer, gpipe_layers.PipelinedLayer):
    return [(path or '.', layer)]
  found = []
  for name, child in layer.children.items():
    children = child if isinstance(child, (list, tuple)) else [child]
    for i, c in enumerate(children):
      if isinstance(c, base_layer.BaseLayer):
        sub = f'{name}[{i}]' if isinstance(child, (list, tuple)) else name
        found += FindPipelinedLayers(c, f'{path}.{sub}' if path else sub)
  return found


def TaskStep(task, input_specs):
  """The training step of a built Lingvo task with its own optimizer."""

  def Loss(theta, batch):
    with py_utils.TaskCallScope(task):
      metrics, _ = task.FPropTower(theta, batch)
    return metrics['loss'][0]

  optimizer, clip_norm = LearnerOf(task.params)
  return TrainStep(task, input_specs, Loss, optimizer, clip_norm)


def LayerStep(layer, input_shapes, optimizer=None):
  """The training step of a bare pipelined layer on float32 inputs.

  The loss is half the mean square of every output: a loss that needs the
  whole forward and backward pass and nothing else.
  """
  specs = NestedMap(inputs=[tf.TensorSpec(s, tf.float32) for s in input_shapes])

  def Loss(theta, batch):
    out = layer.FProp(theta, *batch.inputs)
    out = out if isinstance(out, (list, tuple)) else [out]
    return tf.add_n([0.5 * tf.reduce_mean(tf.square(o)) for o in out])

  return TrainStep(layer, specs, Loss, optimizer or Adam())


def InputSpecs(input_params):
  """The input batch a Lingvo input generator makes, as TensorSpecs.

  Builds the generator in a scratch graph; every shape must be static.
  """
  with tf.Graph().as_default():
    batch = input_params.Instantiate().GetPreprocessedInputBatch()
    specs = batch.Transform(lambda t: tf.TensorSpec(t.shape, t.dtype))
  for name, spec in specs.FlattenItems():
    if not spec.shape.is_fully_defined():
      raise ValueError(
          f'Input {name!r} has shape {spec.shape}, not fully defined; the '
          'planner compiles for static shapes. Give the input generator a '
          'fixed batch size and sequence length.')
  return specs
