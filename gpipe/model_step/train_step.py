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

The optimizer (gpipe.model_step.optimizers) is the task's own, and says each
weight's slots; a slot may have another shape than its weight (Adafactor's
factored moments drop one of the weight's dims).

Placement: every stage-stacked weight, its new value, and its slots as
they are read and written are annotated by the PipelinedLayer that owns
the weight (`PipelinedLayer.PlaceVariables`), so optimizer state lives
split like the weights rather than wherever propagation happens to put
it; a slot of another shape that keeps its weight's stage dim (a factored
[S, d] of an [S, d, f] weight) is split on it the same way.
Other variables (embeddings, softmax) are left to XLA's propagation.

The model is built in a throwaway tf.Graph (its variables are never
initialized, so never allocated); the step only uses the layers' code with
weights passed in as theta.
"""

import dataclasses
import inspect

import tensorflow as tf

from gpipe import layers as gpipe_layers
from gpipe import lingvo_compat
from gpipe.lingvo_support import variable_shardings
from gpipe.loops import made_after
from gpipe.model_step import optimizers
from lingvo.core import base_layer
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap

# The kinds of the step's arguments, in order.
WEIGHT, SLOT, INPUT, SCALAR = 'weight', 'slot', 'input', 'scalar'


def LearnerOf(task_params):
  """(optimizer update, gradient clip norm) of a Lingvo task's training.

  Reads the task's learner (a built task has its legacy `train.optimizer`
  moved there); the optimizers gpipe.model_step.optimizers models are accepted,
  any other is refused with one line naming it.
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
  update = optimizers.FromLingvoParams(source.optimizer)
  return update, float(source.clip_gradient_norm_to_value or 0.0)


@dataclasses.dataclass(frozen=True)
class Arg:
  """One argument of the step function."""
  name: str
  kind: str  # WEIGHT, SLOT, INPUT or SCALAR
  spec: tf.TensorSpec
  on_stages: bool = False  # a weight (or its slot) of a pipelined stack
  # The per-device shape the variable's own sharding annotation asks for
  # (e.g. a mesh body's weight split over a model axis too); None if the
  # variable has none.
  annotated_shard: tuple = None


class TrainStep:
  """A training step of `root` (a Lingvo task or layer), from shapes.

  Args:
    root: the built layer or task (in a graph of its own).
    input_specs: NestedMap of tf.TensorSpecs, the input batch.
    loss_fn: (theta, input_batch) -> scalar loss, run under the step's
      global step.
    optimizer: a gpipe.model_step.optimizers.Optimizer (its slots may have other
      shapes than their weights, e.g. Adafactor's factored moments).
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
    self._num_stages = _StageVariables(root)
    self.weight_args = [
        Arg(name, WEIGHT, tf.TensorSpec(value.shape, value.dtype),
            name in self._num_stages, AnnotatedShard(variables.get(name)))
        for name, value in self._theta.FlattenItems()
    ]
    self._trainable = [
        i for i, a in enumerate(self.weight_args) if variables[a.name].trainable
    ]
    self._MakeSlotArgs()
    self.input_args = [
        Arg(name, INPUT, spec) for name, spec in input_specs.FlattenItems()
    ]
    self.scalar_args = [
        Arg('global_step', SCALAR, tf.TensorSpec([], tf.int64)),
        Arg('learning_rate', SCALAR, tf.TensorSpec([], tf.float32)),
    ]

  def _MakeSlotArgs(self):
    """Slot args, each trainable weight's slots together, in weight order.

    Also records, per slot, its weight (theta index), its position among
    that weight's slots, and whether it is placed like its weight
    (`_FollowsWeight`): only such a slot of a stage-stacked weight counts
    as stage-stacked itself (`on_stages`).
    """
    self.slot_args, self._slot_owners, self._slot_follows = [], [], []
    for i in self._trainable:
      weight = self.weight_args[i]
      for k, slot in enumerate(self.optimizer.Slots(weight.spec)):
        follows = _FollowsWeight(slot, weight.spec.shape.as_list(),
                                 self._num_stages.get(weight.name))
        same_shape = slot.spec.shape == weight.spec.shape
        self.slot_args.append(
            Arg(f'{weight.name}/{slot.name}', SLOT, slot.spec,
                weight.on_stages and follows,
                weight.annotated_shard if same_shape else None))
        self._slot_owners.append((i, k))
        self._slot_follows.append(follows)

  @property
  def input_specs(self):
    """NestedMap of TensorSpecs: the input batch."""
    return self._input_specs

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
    # Read and written where they live: an aliased slot's input and output
    # must agree, which propagation alone need not make them.
    slots = self._PlaceSlots(slots)
    loss, trainable, grads = self._LossAndGradients(weights, inputs,
                                                    global_step)
    scale = _ClipScale(grads, self.clip_norm) if self.clip_norm > 0 else None
    slots_of = {i: [] for i in self._trainable}
    for (i, _), value in zip(self._slot_owners, slots):
      slots_of[i].append(value)
    new_weights, new_slots = [], []
    after_previous = None
    for i, w, g in zip(self._trainable, trainable, grads):
      new_w, new_ws = self.optimizer.Update(
          w, g, slots_of[i], learning_rate, global_step,
          grad_scale=_ScaleAfter(scale, after_previous))
      after_previous = new_w
      new_weights.append(new_w)
      new_slots += new_ws
    new_weights = self._PlaceTrainable(new_weights)
    return [loss] + new_weights + self._PlaceSlots(new_slots)

  def Gradients(self, *flat):
    """(loss, *gradients of the trainable weights) of flat = (*weights,
    *inputs) at global step 0: the step up to its update, unclipped, to
    check a partitioned run of it against one device."""
    n_w = len(self.weight_args)
    inputs = self._input_specs.Pack(list(flat[n_w:]))
    loss, _, grads = self._LossAndGradients(
        list(flat[:n_w]), inputs, tf.constant(0, tf.int64))
    return [loss] + grads

  def Loss(self, *flat):
    """The loss alone of flat = (*weights, *inputs) at global step 0: the
    step's forward pass (e.g. to count the model's FLOPs)."""
    n_w = len(self.weight_args)
    weights = self._Place(list(flat[:n_w]))
    inputs = self._input_specs.Pack(list(flat[n_w:]))
    with py_utils.GlobalStepContext(tf.constant(0, tf.int64)):
      py_utils.ResetStepSeed()
      return self._loss_fn(self._theta.Pack(weights), inputs)

  def _LossAndGradients(self, weights, inputs, global_step):
    """(loss, placed trainable weights, their gradients)."""
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
    return loss, trainable, grads

  @property
  def trainable_args(self):
    return [self.weight_args[i] for i in self._trainable]

  def _PlaceSlots(self, values):
    """Annotates slot values (slot_args order) that follow their weight.

    A pipelined stack places a weight-structured tree (PlaceVariables), so
    the slots go through it in rounds: the k-th slot of every weight in
    the k-th round, each at its weight's place; a slot of any shape can
    take its weight's place as long as it keeps the weight's stage dim at
    the same index (`_FollowsWeight`). The other slots are left to XLA's
    propagation.
    """
    rounds = {}
    for j, ((i, k), follows) in enumerate(
        zip(self._slot_owners, self._slot_follows)):
      if follows:
        rounds.setdefault(k, {})[i] = j
    placed = list(values)
    for members in rounds.values():
      full = [None] * len(self.weight_args)
      for i, j in members.items():
        full[i] = values[j]
      tree = _PlaceLike(self.root, self._theta.Pack(full)).Flatten()
      for i, j in members.items():
        placed[j] = tree[i]
    return placed

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


def _ClipScale(grads, clip_norm):
  """The factor tf.clip_by_global_norm scales every gradient by:
  clip_norm / max(global norm, clip_norm); NaN if the norm is not finite.
  The optimizers apply it where they use the gradient."""
  norm = tf.linalg.global_norm(grads)
  scale = clip_norm * tf.minimum(1.0 / norm, 1.0 / clip_norm)
  return scale + tf.where(tf.math.is_finite(norm), 0.0, float('nan'))


def _ScaleAfter(scale, previous):
  """The gradient scale of an update that waits for the `previous` one.

  The weights are updated one after another: each update's gradient scale
  is made once the previous new weight exists (+ 0 computed from it:
  gpipe.loops.made_after). A step's optimizer temporaries (Adafactor's
  squared gradient, an update) are then one weight's at a time. Free to
  start every update at once, XLA:CPU's scheduler holds a weight-sized
  temporary of every weight together, as much again as the gradients (an
  optimization barrier does not stop it: XLA:CPU removes barriers before
  scheduling). The cost: one scalar all-reduce per weight.
  """
  if previous is None:
    return scale
  return (1.0 if scale is None else scale) + made_after.ZeroAfter(previous)


def AnnotatedShard(variable):
  """The per-device shape `variable`'s own XLA sharding attribute asks for.

  Lingvo's layers annotate a variable where they create it (a mesh body's
  tensor_split_dims_mapping, with the pipeline's stage dim in front); the
  planner passes weights in as arguments, so it reads the annotation here
  to check the compiled split against it. None without one.
  """
  return variable_shardings.ShardShape(variable)


def _FollowsWeight(slot, weight_shape, num_stages):
  """Whether `slot` is split on its stage dim when placed as its weight is.

  PlaceVariables splits a stage-stacked weight on its stage dim by index:
  dim 0 ([S, (R,) ...]), or dim 1 for the [R, S, ...] weights of a
  circular stage-parallel body; and a stage's own variable
  (per_stage_vars) on the least-padding dim of whatever it is given. A
  slot that keeps the weight's dims in order and drops none before the
  stage dim has the stage dim at the same index, so the weight's placement
  splits it there: weight-shaped slots, and factored moments of the later
  dims ([S, R, d] and [S, R, f] of [S, R, d, f]; [S, b] and [S, a] of
  [S, a, b]). A slot without dim 0, or without a dim 1 of num_stages
  elements (which may be the stage dim), is left to XLA's propagation.

  Args:
    slot: a gpipe.model_step.optimizers.Slot.
    weight_shape: the weight's shape, a list.
    num_stages: S of the weight's pipelined stack, None for another weight.
  """
  dims = list(slot.dims)
  if dims != sorted(dims):
    return False
  dropped = [d for d in range(len(weight_shape)) if d not in dims]
  if not dropped or dropped[0] >= 2:
    return True
  return dropped[0] == 1 and weight_shape[1] != num_stages


def _PlaceLike(root, tree):
  """tree (shaped like root.theta) with every pipelined stack's part placed.

  Lingvo's own layer (planned side by side) places its variables itself,
  where it reads them, and so is left as it is.
  """

  def Place(stack, t):
    place = getattr(stack, 'PlaceVariables', None)
    return place(t) if place else t

  return _MapStacks(root, tree, Place)


def _IsPipelined(layer):
  """gpipe's PipelinedLayer, or Lingvo's own pipelined layer."""
  return isinstance(layer, (gpipe_layers.PipelinedLayer,
                            lingvo_compat.LingvosOwnLayer()))


def _StageVariables(root):
  """{theta path: S} of the variables that pipelined stacks hold per stage."""
  marked = _MapStacks(
      root, root.theta.Transform(lambda _: 0),
      lambda stack, t: t.Transform(lambda _: stack.params.num_stages))
  return {name: s for name, s in marked.FlattenItems() if s}


def _MapStacks(layer, tree, fn):
  """tree with fn(stack, subtree) applied where a PipelinedLayer's theta is."""
  if _IsPipelined(layer):
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
  """[(path, pipelined layer)] in a built layer tree (gpipe's or Lingvo's)."""
  if _IsPipelined(layer):
    return [(path or '.', layer)]
  found = []
  for name, child in layer.children.items():
    children = child if isinstance(child, (list, tuple)) else [child]
    for i, c in enumerate(children):
      if isinstance(c, base_layer.BaseLayer):
        sub = f'{name}[{i}]' if isinstance(child, (list, tuple)) else name
        found += FindPipelinedLayers(c, f'{path}.{sub}' if path else sub)
  return found


def TaskStep(task, input_specs, own_optimizer=True):
  """The training step of a built Lingvo task with its own optimizer (or,
  for a step only its Gradients are taken of, plain SGD)."""

  def Loss(theta, batch):
    with py_utils.TaskCallScope(task):
      predictions = _PredictionsFromTheta(task, theta, batch)
      metrics, _ = task.ComputeLoss(theta, predictions, batch)
    return metrics['loss'][0]

  if not own_optimizer:
    return TrainStep(task, input_specs, Loss, optimizers.Sgd())
  optimizer, clip_norm = LearnerOf(task.params)
  return TrainStep(task, input_specs, Loss, optimizer, clip_norm)


def _PredictionsFromTheta(task, theta, batch):
  """task.ComputePredictions (as FPropTower calls it), every weight read
  from theta: the step's weights are its arguments. A task that reads
  some variables itself unless told (GShard's UniTransformer: the softmax
  weights) is told, by its `read_vars_from_theta`."""
  parameters = inspect.signature(task.ComputePredictions).parameters
  if 'read_vars_from_theta' in parameters:
    return task.ComputePredictions(theta, batch, read_vars_from_theta=True)
  return task.ComputePredictions(theta, batch)


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

  return TrainStep(layer, specs, Loss, optimizer or optimizers.Adam())


def InputSpecs(input_params):
  """The input batch a Lingvo input generator makes, as TensorSpecs.

  Builds the generator in a scratch graph that has a global step, as
  Lingvo's programs do (a generator may read it: data as a function of the
  step); every shape must be static.
  """
  with tf.Graph().as_default():
    py_utils.GetOrCreateGlobalStepVar()
    return SpecsOf(input_params.Instantiate().GetPreprocessedInputBatch())


def SpecsOf(batch):
  """TensorSpecs of an input batch (a NestedMap of tensors), each shape
  checked static."""
  specs = batch.Transform(lambda t: tf.TensorSpec(t.shape, t.dtype))
  for name, spec in specs.FlattenItems():
    if not spec.shape.is_fully_defined():
      raise ValueError(
          f'Input {name!r} has shape {spec.shape}, not fully defined; the '
          'planner compiles for static shapes. Give the input generator a '
          'fixed batch size and sequence length.')
  return specs
