"""Weight gradients contracted once after the backward loop.

Each iteration of the backward loop computes the gradient of a weight that
a matmul reads as a contraction over that iteration's n examples (times
their positions, for a sequence), and adds it to an accumulator the loop
carries: with few of them (a small microbatch) writing and re-reading the
whole [d, h] gradient every iteration costs more than the dot itself.
Deferred, the loop keeps the dot's two operands per iteration instead, and
one contraction over iterations and examples makes the sum after the
loop::

    per iteration:  acc += einsum('nd,nh->dh', x_t, dy_t)     T dots, T adds
    deferred:       einsum('tnd,tnh->dh', x[T], dy[T])        one dot

The numbers are the same sum in another order. The price is memory: the
operands of every iteration until the loop ends, which `Find` allows only
where they are at most a quarter of the gradient (n <= d h / (4 (d + h))).
A loop that keeps one iteration's operands a while and contracts them on
their own (zero bubble's deferred weight gradient, DeferredDot.ContractOne)
asks for them whatever their size (max_operands_per_gradient=None).
A pipeline defers on one device only (gpipe.sharding's placement
splits_stage_dim False): partitioned, memory is what the pipeline saves.
"""

import dataclasses
import string
from typing import AbstractSet, Optional, Tuple

import tensorflow as tf

from gpipe.loops import made_after
from gpipe.loops import tensor_lists

# How large one iteration's two operands may be, as a fraction of the
# gradient they make.
MAX_OPERANDS_PER_GRADIENT = 0.25


@dataclasses.dataclass(frozen=True)
class DeferredDot:
  """A gradient einsum(equation of one iteration) of two per-iteration
  operands, as the contraction of their [T, ...] stacks."""
  equation: str  # the stacked operands' equation: iteration label first
  operands: Tuple[str, str]  # tensor names in the cell's graph
  specs: Tuple[tf.TensorSpec, tf.TensorSpec]
  one_equation: str = ''  # one iteration's: the gradient's own dot

  def Contract(self, stacked_a, stacked_b):
    return tf.einsum(self.equation, stacked_a, stacked_b)

  def ContractOne(self, a, b):
    """The gradient of one iteration from its two operands (what a
    deferred weight gradient computes where it runs: zero bubble's W)."""
    return tf.einsum(self.one_equation, a, b)


def Find(grad, per_iteration: AbstractSet[str],
         max_operands_per_gradient: Optional[float] = (
             MAX_OPERANDS_PER_GRADIENT)) -> Optional[DeferredDot]:
  """The deferred form of `grad`, or None.

  Args:
    grad: a weight's gradient for one iteration, in the cell's graph.
    per_iteration: names of the tensors that differ from iteration to
      iteration (those depending on the carried state, the iteration's
      inputs or the incoming gradients).
    max_operands_per_gradient: how large the two operands may be, as a
      fraction of the gradient; None: any size (a caller that keeps one
      iteration's operands, not all of them).
  """
  while grad.op.type == 'Identity':
    grad = grad.op.inputs[0]
  op = grad.op
  equation = _Equation(op)
  if equation is None:
    return None
  a, b = op.inputs[0], op.inputs[1]
  if not (a.name in per_iteration and b.name in per_iteration):
    return None
  if not (a.shape.is_fully_defined() and b.shape.is_fully_defined() and
          grad.shape.is_fully_defined()) or a.dtype != b.dtype:
    return None
  sizes = [t.shape.num_elements() for t in (a, b, grad)]
  if (max_operands_per_gradient is not None and
      sizes[0] + sizes[1] > max_operands_per_gradient * sizes[2]):
    return None
  label = next(c for c in string.ascii_letters if c not in equation)
  lhs, out = equation.split('->')
  in_a, in_b = lhs.split(',')
  return DeferredDot(f'{label}{in_a},{label}{in_b}->{out}', (a.name, b.name),
                     (tf.TensorSpec(a.shape, a.dtype),
                      tf.TensorSpec(b.shape, b.dtype)),
                     one_equation=equation)


class WeightGradientSums:
  """How a backward loop sums the weights' gradients over the iterations:
  accumulated as it goes, or, for those the cell defers (a
  cell_graph.CellGraph's DeferredDots), their dots' operands written entry
  by entry (one per iteration) and contracted once after the loop. Its
  loop variables: the accumulators (each its weight's shape), then the
  operands' TensorLists (T entries, each one iteration's operand)."""

  def __init__(self, deferred, theta, num_iterations):
    """deferred: the cell's DeferredDots ({index into theta: DeferredDot});
    theta: the differentiable weights, flat, in the cell's order."""
    self._deferred = deferred
    self._theta = list(theta)
    self._summed = [j for j in range(len(self._theta))
                    if j not in self._deferred]
    self._kept = sorted(self._deferred)  # the operand lists' order
    self._specs = [x for j in self._kept for x in self._deferred[j].specs]
    self._num_iterations = num_iterations
    self.size = len(self._summed) + len(self._specs)

  def Initial(self, incoming):
    """The loop variables' initial values: each accumulator zeros of its
    weight's shape, made once a tensor of `incoming` (the loop's incoming
    gradients) exists (made_after.ZerosAfter)."""
    return ([made_after.ZerosAfter(self._theta[j], incoming)
             for j in self._summed] +
            [tensor_lists.Reserve(s, self._num_iterations)
             for s in self._specs])

  def Next(self, t, carried, g_theta):
    """Adds iteration t's gradients (g_theta: Backward's theta part)."""
    sums, lists = carried[:len(self._summed)], carried[len(self._summed):]
    operands = [x for j in self._kept for x in g_theta[j]]
    return ([a + g_theta[j] for a, j in zip(sums, self._summed)] +
            [tensor_lists.SetEntry(l, t, x) for l, x in zip(lists, operands)])

  def Final(self, carried):
    """The differentiable theta entries' gradients, in order."""
    sums, lists = carried[:len(self._summed)], carried[len(self._summed):]
    grads = dict(zip(self._summed, sums))
    operands = [tensor_lists.Stack(l, s, self._num_iterations)
                for l, s in zip(lists, self._specs)]
    for k, j in enumerate(self._kept):
      grads[j] = self._deferred[j].Contract(*operands[2 * k:2 * k + 2])
    return [grads[j] for j in range(len(self._theta))]


def _Equation(op) -> Optional[str]:
  """The einsum equation `op` computes, if it is a two-operand matmul or
  einsum without broadcasting."""
  if op.type == 'Einsum':
    equation = op.get_attr('equation').decode()
    if (len(op.inputs) != 2 or '...' in equation or '->' not in equation or
        equation.count(',') != 1):
      return None
    return equation.replace(' ', '')
  if op.type == 'MatMul':
    a = 'ji' if op.get_attr('transpose_a') else 'ij'
    b = 'kj' if op.get_attr('transpose_b') else 'jk'
    return f'{a},{b}->ik'
  if op.type in ('BatchMatMul', 'BatchMatMulV2', 'BatchMatMulV3'):
    x, y = op.inputs[0].shape, op.inputs[1].shape
    if (x.rank is None or x.rank != y.rank or x.rank < 2 or
        x[:-2] != y[:-2] or not x[:-2].is_fully_defined()):
      return None
    batch = 'abcdefgh'[:x.rank - 2]
    a = 'ji' if op.get_attr('adj_x') else 'ij'
    b = 'kj' if op.get_attr('adj_y') else 'jk'
    return f'{batch}{a},{batch}{b}->{batch}ik'
  return None
