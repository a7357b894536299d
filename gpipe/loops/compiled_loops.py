"""Loops a Session runs as one XLA computation (graph mode, one device).

A Session runs a while_v2 loop lowered to Switch/Merge/NextIteration ops,
op by op: each iteration costs microseconds per loop variable and per op of
the body, which is most of a small body's time. Kept functional, a loop
runs its body through the function runtime instead, without oneDNN's graph
rewrites, which slows vectorized stages' batched matmuls. Compiled by XLA,
the loop costs neither (the figures:
docs/benchmarks.md#measured-behind-the-codes-choices).

`Compiled(build, loop_vars)` builds a loop as one call of a
tf.function(jit_compile=True) when

  - the graph is a Session's, outside an XLA context (a tf.function's
    loops are compiled or not with it; a TPU's are XLA's anyway),
  - the loops are allowed to be (`Allowed`; a layer's `compile_loops`),
  - every op of the loop has an XLA kernel for its dtypes and no v1
    control flow, none is pinned to a device of its own, none draws random
    numbers (XLA's generators, stateless ones too, draw other numbers than
    TensorFlow's kernels), none computes in a 16-bit float (XLA rounds
    those once per fused computation, TensorFlow's kernels once per op),
    every float tensor has a static shape and no resource or TensorList
    handle comes in from outside: the loop then gives what the same body
    gives op by op, up to float32 rounding,

and returns None otherwise: the caller builds the loop as it is. The
TensorLists the loop fills cannot cross XLA's boundary: an empty list made
outside (TensorListReserve) is made again inside, and a list the loop
returns leaves it stacked, wrapped in a TensorList that
gpipe.loops.tensor_lists.Stack unwraps without a copy.
"""

import contextlib
import functools
import threading

import tensorflow as tf

from gpipe.loops import cell_graph

# pylint: disable=g-direct-tensorflow-import
from tensorflow.python.framework import func_graph as func_graph_lib
from tensorflow.python.framework import kernels
from tensorflow.python.ops import control_flow_ops
from tensorflow.python.ops import control_flow_util
from tensorflow.python.ops import list_ops
# pylint: enable=g-direct-tensorflow-import

_state = threading.local()

_SIXTEEN_BIT = frozenset([tf.bfloat16.as_datatype_enum,
                          tf.float16.as_datatype_enum])


@contextlib.contextmanager
def Allowed(allowed):
  """Loops built inside may (True) or may not be compiled."""
  previous = IsAllowed()
  _state.allowed = bool(allowed)
  try:
    yield
  finally:
    _state.allowed = previous


def IsAllowed():
  """Whether loops built now may be compiled (off unless a layer allows
  it: loops built outside a pipelined layer run as they always have)."""
  return getattr(_state, 'allowed', False)


def UnderXla():
  """Whether the graph being built is compiled by XLA: inside
  tf.function(jit_compile=True), a TPU computation or a loop Compiled
  builds (the one place gpipe asks TensorFlow's private context test)."""
  return control_flow_util.GraphOrParentsInXlaContext(
      tf.compat.v1.get_default_graph())


def Compiled(build, loop_vars):
  """build(loop_vars) as one XLA computation, or None (see module doc)."""
  graph = tf.compat.v1.get_default_graph()
  if (not IsAllowed() or isinstance(graph, func_graph_lib.FuncGraph) or
      UnderXla()):
    return None
  structure = list(loop_vars)
  flat = tf.nest.flatten(structure)
  lists = {i: _EmptyList.Of(t) for i, t in enumerate(flat)
           if t.dtype == tf.variant}
  if None in lists.values():
    return None
  passed = [t for i, t in enumerate(flat) if i not in lists]

  def Loop(*args):
    args = iter(args)
    inside = [lists[i].Make() if i in lists else next(args)
              for i in range(len(flat))]
    with _XlaContext():
      results = tf.nest.flatten(
          build(tf.nest.pack_sequence_as(structure, inside)))
    return [lists[i].Stack(r) if i in lists else r
            for i, r in enumerate(results)]

  function = tf.function(Loop, jit_compile=True, autograph=False)
  concrete = function.get_concrete_function(
      *[tf.TensorSpec(t.shape, t.dtype) for t in passed])
  captured = [outer for outer, _ in concrete.graph.captures]
  if (any(t.dtype in (tf.variant, tf.resource) for t in captured) or
      not _StaticShapes(concrete.graph) or
      not _Compilable(concrete.graph.as_graph_def())):
    return None
  results = concrete(*passed)
  return tf.nest.pack_sequence_as(
      structure, [lists[i].Wrap(r) if i in lists else r
                  for i, r in enumerate(results)])


@contextlib.contextmanager
def _XlaContext():
  """Conds and loops built inside are not marked for lowering to Switch
  and Merge ops (which XLA does not compile in a function body)."""
  context = control_flow_ops.XLAControlFlowContext()
  context.Enter()
  try:
    yield
  finally:
    context.Exit()


class _EmptyList:
  """An empty TensorList of static shape, made again inside the loop."""

  def __init__(self, element_shape, num_elements, dtype):
    self._shape = element_shape
    self._num = num_elements
    self._dtype = dtype

  @classmethod
  def Of(cls, t):
    """The list `t` is, or None if it is not an empty one of static shape."""
    if t.op.type != 'TensorListReserve':
      return None
    shape = tf.get_static_value(t.op.inputs[0])
    num = tf.get_static_value(t.op.inputs[1])
    if shape is None or num is None or (shape < 0).any():
      return None
    return cls(shape.tolist(), int(num), t.op.get_attr('element_dtype'))

  def Make(self):
    return list_ops.tensor_list_reserve(self._shape, self._num, self._dtype)

  def Stack(self, tensor_list):
    return list_ops.tensor_list_stack(tensor_list, self._dtype,
                                      num_elements=self._num,
                                      element_shape=self._shape)

  def Wrap(self, stacked):
    return list_ops.tensor_list_from_tensor(stacked, self._shape)


_SUBGRAPHS = ('_body_graph', '_cond_graph', '_true_graph', '_false_graph')


def _StaticShapes(graph):
  """Whether every float tensor used in `graph` and in its loops' and
  conds' bodies has a static shape. XLA would take a dynamic one (a
  decoding step's cache cut at the time step, say) for a constant per run,
  or fail. (Integer vectors computed from static shapes, such as a
  gradient's broadcast axes, XLA computes while compiling.)"""
  for op in graph.get_operations():
    if not all(t.shape.is_fully_defined() or not t.consumers() or
               not t.dtype.is_floating for t in op.outputs):
      return False
    for name in _SUBGRAPHS:
      inner = getattr(op, name, None)
      if inner is not None and not _StaticShapes(inner):
        return False
  return True


def _Compilable(graph_def):
  """Whether every node of graph_def (and of its functions) may be compiled
  and compiles to what TensorFlow's kernels compute."""
  nodes = [n for n in graph_def.node if n.op != 'Placeholder']
  for function in graph_def.library.function:
    nodes.extend(function.node_def)
  return all(not node.device and _HasXlaKernel(node) and
             not _NotCompiled(node) and not _SixteenBit(node)
             for node in nodes)


# TensorFlow 1's control flow (a tf.Assert's guard, say) is not compiled in
# a function body.
_V1_CONTROL_FLOW = frozenset(
    ['Switch', 'Merge', 'Enter', 'Exit', 'NextIteration', 'LoopCond'])

# XLA draws other numbers than TensorFlow's kernels, stateless ones too: a
# body's dropout in a compiled loop would not drop what it drops outside.
_RANDOM_WORDS = ('Random', 'Multinomial', 'TruncatedNormal', 'Rng')


def _NotCompiled(node):
  op_type = node.op
  lowered = node.attr.get('_lower_using_switch_merge')
  return (op_type in _V1_CONTROL_FLOW or (lowered is not None and lowered.b) or
          op_type in cell_graph.STATEFUL_RANDOM_OPS or
          op_type.startswith('XlaSpmd') or
          any(word in op_type for word in _RANDOM_WORDS))


def _SixteenBit(node):
  for value in node.attr.values():
    if value.type in _SIXTEEN_BIT or _SIXTEEN_BIT.intersection(
        value.list.type):
      return True
  return False


_FUNCTION_NODES = frozenset(['_Arg', '_Retval', 'NoOp'])


def _HasXlaKernel(node):
  """Whether XLA compiles `node` for the CPU (its dtypes included)."""
  if node.op in _FUNCTION_NODES:
    return True
  return any(_Satisfies(node, k) for k in _XlaKernels(node.op))


def _Satisfies(node, kernel_def):
  for constraint in kernel_def.constraint:
    allowed = set(constraint.allowed_values.list.type)
    value = node.attr.get(constraint.name)
    if value is None:
      continue  # a default the kernel registration covers
    types = list(value.list.type) if value.HasField('list') else [value.type]
    if not allowed.issuperset(types):
      return False
  return True


@functools.lru_cache(maxsize=None)
def _XlaKernels(op_type):
  _RegisterXlaKernels()
  return tuple(k for k in kernels.get_registered_kernels_for_op(op_type).kernel
               if k.device_type == 'XLA_CPU_JIT')


@functools.lru_cache(maxsize=None)
def _RegisterXlaKernels():
  """XLA registers its kernels on its first compilation: compile once."""
  with tf.Graph().as_default():
    one = tf.function(lambda x: x + 1.0, jit_compile=True,
                      autograph=False)(tf.constant(0.0))
    with tf.compat.v1.Session() as session:
      session.run(one)
