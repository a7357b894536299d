"""One training step, partitioned and on one device, and what that shows.

    PipelineStep (a step as a function of arrays: weights, then inputs)
      --RunUnpartitioned--> results on one device
      --RunStepPartitioned(N)--> PartitionedRun on N virtual devices
    Report(run, step, expected): the largest difference, each weight's
      per-device shape, the collectives per loop and mesh axis, and the
      problems (weights gathered, not split, split less than annotated)

A bare layer's step comes from BuildPipelineStep (gpipe.check_partitioning
--params); a registered model's from gpipe.xla.check_model (--model).
"""

import collections
import contextlib
import dataclasses
import re

import numpy as np
import tensorflow as tf

from gpipe.pipeline import one_f_one_b
from gpipe import sharding
from gpipe.xla import hlo_text as hlo
from gpipe.xla import partitioning
from gpipe.xla import spmd_worker
from lingvo.core import py_utils


@dataclasses.dataclass
class PipelineStep:
  """One training step of a pipelined layer as a function of arrays.

  fn(*weights, *inputs) returns [*outputs, loss, *d loss/d trainable
  weights, *d loss/d inputs]. Weights (every theta leaf, non-trainable ones
  included) are arguments, not captured variables, so each is one entry
  parameter of the compiled module.
  """
  fn: object
  args: list  # NumPy: the weights' values, then the inputs
  weight_names: list
  grad_names: list  # the trainable weights, in order
  num_inputs: int
  variables: list  # the layer's variables (the step assigns non-trainable)
  # Per weight, whether a pipelined stack holds it per stage, and the
  # per-device shape its own sharding annotation asks for (None: none);
  # None for the whole list: not known (a bare layer's stage-stacked
  # weights are told by their stage dim).
  on_stages: list = None
  annotated_shards: list = None
  # fn's results, if not a bare layer's (outputs, loss, gradients).
  result_names: list = None

  @property
  def num_weights(self):
    return len(self.weight_names)

  def ResultNames(self):
    """A name for each of fn's results."""
    if self.result_names is not None:
      return self.result_names
    return ([f'output {i}' for i in range(self.num_inputs)] + ['loss'] +
            [f'd loss/d {n}' for n in self.grad_names] +
            [f'd loss/d input {i}' for i in range(self.num_inputs)])

def BuildPipelineStep(layer, input_shapes, seed=0):
  """A PipelineStep for `layer` on float32 inputs of `input_shapes`."""
  theta = layer.theta
  names = [name for name, _ in theta.FlattenItems()]
  weights = [tf.convert_to_tensor(v).numpy() for _, v in theta.FlattenItems()]
  variables = dict(layer.vars.FlattenItems())
  trainable = [i for i, n in enumerate(names) if variables[n].trainable]
  rng = np.random.RandomState(seed)
  inputs = [rng.uniform(-1, 1, s).astype(np.float32) for s in input_shapes]
  # The body returns its inputs' structure, so the outputs have the inputs'
  # shapes; a fixed random projection of them is the loss.
  cotangents = [rng.uniform(-1, 1, s).astype(np.float32) for s in input_shapes]

  def Step(*flat):
    w = [tf.convert_to_tensor(t) for t in flat[:len(names)]]
    x = list(flat[len(names):])
    with tf.GradientTape() as tape:
      tape.watch(w + x)
      step_theta = theta.Pack(w)
      # A training step at global step 0 (bodies with dropout read it).
      with py_utils.GlobalStepContext(tf.constant(0, tf.int64)):
        out = layer.FProp(step_theta, *x)
      out = list(out) if isinstance(out, tuple) else [out]
      loss = tf.add_n(
          [tf.reduce_sum(o * c) for o, c in zip(out, cotangents)])
    grads = tape.gradient(loss, [w[i] for i in trainable] + x)
    grads = [tf.convert_to_tensor(g) for g in grads]
    return out + [loss] + grads

  return PipelineStep(
      fn=Step, args=weights + inputs, weight_names=names,
      grad_names=[names[i] for i in trainable], num_inputs=len(inputs),
      variables=layer.vars.Flatten())

@dataclasses.dataclass
class Report:
  """What partitioning a pipelined step gave."""
  run: partitioning.PartitionedRun
  step: PipelineStep
  expected: list  # the step's results run unpartitioned on one device
  num_stages: int
  # The stack's device mesh (its shape; (N,) for shard_stages_1d) and the
  # axis of its stages: collectives are listed by the axes they run on.
  mesh_shape: tuple = ()
  stage_axis: int = 0
  # Mesh axes the stack's weights are stored split over and gathered from
  # where they are used (its body's FSDP axis): those gathers are asked for.
  gathered_over: tuple = ()

  @property
  def max_abs_diff(self):
    """Largest |partitioned - unpartitioned| over every result."""
    return max(
        float(np.max(np.abs(a - e))) if np.size(e) else 0.0
        for a, e in zip(self.run.outputs, self.expected))

  def WeightShapes(self):
    """[(name, full shape, per-device shape)] for every weight."""
    return [(name, tuple(np.shape(value)), shard)
            for name, value, shard in zip(self.step.weight_names,
                                          self.step.args,
                                          self.run.param_shard_shapes)]

  def WeightBytes(self):
    """(bytes one device holds, total bytes) of the weights."""
    per_device = total = 0
    weights = self.step.args[:self.step.num_weights]
    for value, shard in zip(weights, self.run.param_shard_shapes):
      itemsize = np.asarray(value).dtype.itemsize
      per_device += int(np.prod(shard, dtype=np.int64)) * itemsize
      total += np.asarray(value).nbytes
    return per_device, total

  def _OnStages(self):
    """Per weight: whether a stack holds it per stage (when not told: a
    weight with a dim of num_stages)."""
    if self.step.on_stages is not None:
      return self.step.on_stages
    return [self.num_stages in full for _, full, _ in self.WeightShapes()]

  def GatheredWeights(self):
    """All-gathers and all-to-alls that move a whole weight (or a stage's):
    of a bare layer, any weight; of a model, a stack's."""
    staged = self.step.on_stages or [True] * self.step.num_weights
    return hlo.GatheredTensors(
        self.run.collectives,
        [full for (_, full, _), keep in zip(self.WeightShapes(), staged)
         if keep], self.mesh_shape, self.gathered_over)

  def UnsplitWeights(self):
    """Stage-stacked weights every device holds whole: the stage
    annotations were lost (or never asked for)."""
    if self.num_stages == 1:
      return []
    return [name for (name, full, shard), staged in zip(self.WeightShapes(),
                                                        self._OnStages())
            if staged and tuple(full) == tuple(shard)]

  def UnderSplitWeights(self):
    """[(name, per-device shape, annotated shape)] of stage-stacked weights
    held on more devices than their own annotation splits them over (e.g.
    whole on a model axis that should split their heads)."""
    annotated = self.step.annotated_shards or [None] * self.step.num_weights
    unsplit = set(self.UnsplitWeights())
    return [(name, shard, want) for (name, _, shard), staged, want in zip(
        self.WeightShapes(), self._OnStages(), annotated)
            if staged and want and name not in unsplit and
            np.prod(shard) > np.prod(want)]

  def Problems(self, tolerance):
    """One line per failed check (none: the layer partitions as intended)."""
    problems = []
    if self.max_abs_diff > tolerance:
      problems.append(f'MISMATCH: partitioned and unpartitioned results '
                      f'differ by {self.max_abs_diff:.3g} > {tolerance}.')
    if self.GatheredWeights():
      problems.append('WEIGHTS GATHERED: a stage-stacked weight is moved '
                      'whole between devices; an annotation is wrong.')
    unsplit = self.UnsplitWeights()
    if unsplit:
      problems.append(
          f'WEIGHTS NOT SPLIT: {", ".join(unsplit)} live whole on every '
          'device; the stage dim lost its annotation (shard_stages_1d or '
          'pipeline_stage_mesh_dim).')
    under = self.UnderSplitWeights()
    if under:
      listed = '; '.join(f'{name} {list(shard)} (annotated {list(want)})'
                         for name, shard, want in under)
      problems.append(
          f'WEIGHTS SPLIT LESS THAN ANNOTATED: {listed} per device; the '
          'partitioned step replicates them over a mesh axis their own '
          'annotation splits them on.')
    return problems

  def CountsByAxes(self, loop):
    """{'kind over axes': count} in loop `loop` (-1: outside the loops)."""
    mesh = self.mesh_shape or (self.run.num_devices,)
    return dict(collections.Counter(
        hlo.KindOverAxes(c, mesh, self.stage_axis)
        for c in self.run.collectives if c.loop == loop))

  def LoopLabels(self, verbose=False):
    """Per loop: 'forward' or 'backward' (ForwardLoop), its iterations
    when XLA knows them, with verbose its body computation's name."""
    forward = ForwardLoop(self.run.hlo, self.run.loops)
    try:
      trips = hlo.LoopTripCounts(self.run.hlo)
    except spmd_worker.UnknownTripCount:
      trips = {}
    labels = []
    for i, body in enumerate(self.run.loops):
      said = [f'{trips[body]} iterations'] if body in trips else []
      said += [f'XLA body {body}'] if verbose else []
      labels.append(('forward' if i == forward else 'backward') +
                    (f' ({"; ".join(said)})' if said else ''))
    return labels

  def Summary(self, verbose=False):
    """The report as text; verbose names each loop's XLA computation."""
    lines = [f'Partitioned for {self.run.num_devices} virtual devices' + (
        f', a {list(self.mesh_shape)} mesh with the stages on axis '
        f'{self.stage_axis}.' if len(self.mesh_shape) > 1 else '.')]
    for i, label in enumerate(self.LoopLabels(verbose)):
      lines.append(f'  loop {i}, {label}, per iteration: '
                   f'{_Counts(self.CountsByAxes(i))}')
    lines.append(f'  outside the loops: {_Counts(self.CountsByAxes(-1))}')
    lines.append('Weights (full shape -> per-device shape):')
    for name, full, shard in self.WeightShapes():
      lines.append(f'  {name}: {list(full)} -> {list(shard)}')
    per_device, total = self.WeightBytes()
    lines.append(f'Weight bytes per device: {per_device} of {total} '
                 f'({per_device / max(total, 1):.3f} of the total).')
    gathered = self.GatheredWeights()
    lines.append('Weights gathered or transposed: ' + (
        'none' if not gathered else '; '.join(
            f'{c.kind} {c.shape} from {c.op_name or "?"}' for c in gathered)))
    lines.append(f'Largest |partitioned - unpartitioned|: '
                 f'{self.max_abs_diff:.3g}')
    return '\n'.join(lines)


def ForwardLoop(hlo_text, bodies):
  """Index of the forward loop among a partitioned step's outermost while
  loops (`bodies`, their body computations): with backward_schedule='1f1b'
  the one in its forward name scope (XLA may order the gradient's loops
  before it), otherwise the first. The others are the backward pass."""
  for i, name in enumerate(hlo.OpNames(hlo_text, bodies)):
    if one_f_one_b.FORWARD_LOOP in name:
      return i
  return 0


def _Counts(counts):
  if not counts:
    return 'no collectives'
  return ', '.join(f'{n} {kind}' for kind, n in sorted(counts.items()))


def RunUnpartitioned(step):
  """The step on one device, as NumPy arrays.

  Run by TensorFlow's own kernels, as traced (no Grappler): the
  partitioned XLA module is checked against another compiler's numbers,
  and the graph runs long before XLA:CPU has compiled the whole step
  (docs/testing.md). A step whose numbers only XLA gives
  (`_NumbersOnlyXlaGives`) is compiled by XLA, as the partitioned one is.
  """
  tensors = [tf.constant(a) for a in step.args]
  traced = tf.function(step.fn, autograph=False).get_concrete_function(
      *tensors)
  if _NumbersOnlyXlaGives(traced.graph):
    traced = tf.function(traced, jit_compile=True, autograph=False)
  with _GrapplerOff():
    return [t.numpy() for t in traced(*tensors)]


@contextlib.contextmanager
def _GrapplerOff():
  """Functions first called in the block run as traced: Grappler's passes
  change how fast a graph runs, not what it computes."""
  before = tf.config.optimizer.get_experimental_options().get(
      'disable_meta_optimizer', False)
  tf.config.optimizer.set_experimental_options({'disable_meta_optimizer': True})
  try:
    yield
  finally:
    tf.config.optimizer.set_experimental_options(
        {'disable_meta_optimizer': before})


_RANDOM_OP = re.compile(r'Random|Rng|Multinomial')
_LOW_PRECISION = frozenset([tf.bfloat16.as_datatype_enum,
                            tf.float16.as_datatype_enum])


def _NumbersOnlyXlaGives(graph):
  """True if TensorFlow's kernels would compute other numbers than XLA for
  the graph (or a function it calls, a loop's body): it draws random
  numbers (dropout: XLA's generators are others), or it computes in
  bfloat16 or float16 (XLA's fusions keep float32 inside where the kernels
  round every op's result)."""
  graph_def = graph.as_graph_def()
  nodes = list(graph_def.node) + [
      node for fn in graph_def.library.function for node in fn.node_def]
  return any(_RANDOM_OP.search(node.op) or _InLowPrecision(node)
             for node in nodes)


def _InLowPrecision(node):
  return any(attr.type in _LOW_PRECISION or
             _LOW_PRECISION.intersection(attr.list.type)
             for attr in node.attr.values())


def RunStepPartitioned(step, num_devices):
  """The step partitioned for `num_devices`, its stages in a manual region."""

  def Partitioned(*args):
    with sharding.SpmdPartitioning():
      return step.fn(*args)

  return partitioning.RunPartitioned(
      Partitioned, step.args, num_devices, variables=step.variables)

def StackMesh(params, num_devices):
  """Report's mesh_shape, stage_axis and gathered_over for a
  PipelinedLayer's Params. A body that stores its weights split over a
  mesh axis beyond their use (FSDP) names it in its `fsdp_mesh_dim`
  param (params/pod_blocks.py's stage does)."""
  placed = sharding.StagePlacement(
      params.num_stages, params.shard_stages_1d, params.device_mesh,
      params.pipeline_stage_mesh_dim).mesh
  mesh, axis = placed or (np.arange(num_devices), 0)
  body = params.single_stage_body or params.stage_parallel_body
  fsdp = body.Get('fsdp_mesh_dim') if 'fsdp_mesh_dim' in body else None
  return {'mesh_shape': tuple(np.shape(mesh)), 'stage_axis': axis,
          'gathered_over': () if fsdp is None else (fsdp,)}
