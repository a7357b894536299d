"""What the pipeline loop's backward pass saves, and what it recomputes.

The loop's gradient runs the iterations backwards; for each it needs the
tensors the body's gradient reads. A policy says which of them the forward
pass stores per iteration; everything else the backward pass recomputes
from what was stored, the carried buffer and the weights:

    policy            stored per iteration        recomputed per iteration
    recompute         the buffer (always stored)  the whole forward of the
                                                  body
    save_checkpoints  + what the body marks       what its gradient needs
                        with Checkpoint (e.g.     from them (e.g. each block
                        each block's input)       again, one at a time)
    save_dots         + matmul / einsum outputs   the elementwise rest
    save_all          + every activation the      nothing of the activations
                        gradient reads              (but control flow: below)

A tf.cond or tf.while_loop inside the body is re-run by the backward pass
under every policy: its gradient reads intermediate values of its own that
exist only once the gradient is built.

Weights are never stored per iteration: a tensor that depends only on the
weights and on integer bookkeeping (a stage's slice of the stacked weights,
a circular repeat's selection) is recomputed from the stacked weights,
which the backward pass holds anyway. Only *activations* -- tensors that
depend on the data the loop carries or reads per iteration -- are stored.

A policy is a predicate over the one-iteration graph (gpipe.loops.cell_graph):
it names the activations to store; the same numbers come out under every
policy, since the stored values are the ones the recomputation would make.
"""

from typing import Iterable, List

# Ops whose output is a (batched) matrix product of their inputs; their
# gradients read the inputs only, so a stored output is never recomputed.
DOT_OPS = frozenset([
    'MatMul', 'BatchMatMul', 'BatchMatMulV2', 'BatchMatMulV3', 'Einsum',
    'Conv2D', 'Conv3D', 'DepthwiseConv2dNative', 'XlaDot', 'XlaDotV2',
    'XlaEinsum', 'SparseMatMul'
])

# Ops whose output is their first input, unchanged (up to annotations).
SAME_VALUE_OPS = frozenset([
    'Identity', 'Snapshot', 'StopGradient', 'PreventGradient', 'XlaSharding',
    'EnsureShape'
])

# Ops that pass their first input on unchanged up to shape or annotation:
# storing their output as well as their input would store the data twice.
VIEW_OPS = SAME_VALUE_OPS | frozenset(['Reshape', 'ExpandDims', 'Squeeze'])

# Ops that only move or pick data (the pipeline's stage inputs are such
# picks of the carried buffer): cheap to redo from their inputs, which are
# stored instead, or are the loop's own state and inputs.
_MOVE_OPS = frozenset([
    'Unpack', 'Pack', 'ConcatV2', 'Slice', 'StridedSlice', 'GatherV2',
    'GatherNd', 'SelectV2', 'Select', 'BroadcastTo', 'Tile', 'Transpose'
])

# Gradient ops that read only a tensor's shape, not its values.
_SHAPE_READERS = frozenset(
    ['ZerosLike', 'OnesLike', 'Shape', 'ShapeN', 'Size', 'Rank'])


class Recompute:
  """Store nothing but the buffer: recompute each iteration's forward."""

  name = 'recompute'

  def Stored(self, cell) -> List[str]:
    del cell
    return []


# The name of the op that marks a tensor for 'save_checkpoints'.
CHECKPOINT_NAME = 'remat_checkpoint'


def Checkpoint(x):
  """x, marked to be stored per iteration under remat_policy
  'save_checkpoints' (an identity; under the other policies nothing
  changes).

  A body made of blocks that each recompute themselves in the backward
  pass (e.g. params.pod_blocks.RecomputedInBackward) marks each block's
  input: its backward pass then runs each block again from its stored
  input, instead of running the body's whole forward first to make them.
  """
  # Imported here: command lines read POLICIES before TensorFlow loads.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.identity(x, name=CHECKPOINT_NAME)


class SaveCheckpoints(Recompute):
  """Store what the body marks with Checkpoint; recompute the rest."""

  name = 'save_checkpoints'

  def Stored(self, cell) -> List[str]:
    return _Roots(cell, [
        t for op in cell.forward_ops
        if op.type == 'Identity' and
        op.name.split('/')[-1].startswith(CHECKPOINT_NAME)
        for t in op.outputs if cell.IsActivation(t)
    ])


class SaveDots(Recompute):
  """Store matmul and einsum outputs; recompute the elementwise rest.

  The expensive part of a body (its matrix products) runs once; norms,
  activation functions and residual adds run again in the backward pass.
  """

  name = 'save_dots'

  def Stored(self, cell) -> List[str]:
    return _Roots(cell, [
        t for op in cell.forward_ops if op.type in DOT_OPS
        for t in op.outputs if cell.IsActivation(t)
    ])


class SaveAll(Recompute):
  """Store every activation the body's gradient reads: no recomputation."""

  name = 'save_all'

  def Stored(self, cell) -> List[str]:
    forward = set(cell.forward_ops)
    read = []
    for op in cell.gradient_ops:
      if op.type in _SHAPE_READERS:
        continue
      for t in op.inputs:
        if t.op in forward and cell.IsActivation(t):
          read.append(t)
    return _Roots(cell, read)


POLICIES = {p.name: p for p in (Recompute, SaveCheckpoints, SaveDots,
                                 SaveAll)}


def For(name):
  """The policy called `name` (one of POLICIES)."""
  if name not in POLICIES:
    raise ValueError(f'remat_policy must be one of {tuple(POLICIES)}, got '
                     f'{name!r}.')
  return POLICIES[name]()


def _Roots(cell, tensors: Iterable) -> List[str]:
  """Names of the tensors to store for `tensors`: each followed back
  through views and data moves to what they were made of.

  A reshape, identity, slice or select of activations is cheap to redo
  from its inputs; storing those instead keeps one copy of the data, and
  none when they are the loop's own state or inputs (which the loop keeps
  anyway). A move whose activation inputs are larger than its output (a
  slice, a gather of some entries) is stored itself: its source would cost
  more per iteration than what the gradient reads. Tensors of unknown
  shape or of non-numeric dtypes cannot be stored per iteration and are
  left to the recomputation.
  """
  names, seen = [], set()
  work = list(tensors)
  while work:
    t = work.pop(0)
    if t.name in seen:
      continue
    seen.add(t.name)
    op = t.op
    if op.type in VIEW_OPS and op.inputs and cell.IsActivation(op.inputs[0]):
      work.append(op.inputs[0])
    elif op.type == 'IdentityN':
      if cell.IsActivation(op.inputs[t.value_index]):
        work.append(op.inputs[t.value_index])
    elif op.type in _MOVE_OPS and not _Shrinks(cell, op):
      work.extend(x for x in op.inputs if cell.IsActivation(x))
    elif cell.Storable(t):
      names.append(t.name)
  return names


def _Shrinks(cell, op):
  """Whether the activations `op` reads hold more elements than all its
  outputs (a slice or gather does; an unstack into pieces does not)."""
  sources = [x for x in op.inputs if cell.IsActivation(x)]
  tensors = sources + list(op.outputs)
  if not sources or not all(x.shape.is_fully_defined() for x in tensors):
    return False
  return (sum(x.shape.num_elements() for x in sources) >
          sum(x.shape.num_elements() for x in op.outputs))
