"""The pipeline loop: a while loop whose gradient recomputes each iteration.

    state_0 --cell--> state_1 --cell--> ... --cell--> state_T
                |                |                  |
             extras_0         extras_1          extras_{T-1}

`Recurrent` runs `cell_fn(theta, state, inputs[t]) -> (state', extras)` for
t = 0..T-1 and returns the stacked states after each iteration, the final
state and the stacked extras.

Its gradient is a second loop that runs t = T-1..0. Iteration t reads the
state the forward pass saved before it (state_0 or states[t-1]), re-runs the
cell on it and back-propagates through that one iteration. So the forward pass
keeps only the carried state per iteration (which the pipeline needs anyway,
as its outputs), never the cell's internal activations: activation memory is
state x iterations, independent of how much the cell computes inside.

With `store_intermediates=True` the loop is differentiated by TensorFlow's own
while-loop gradient instead, which stores every intermediate the cell's
gradient needs: faster (no recompute), more memory.

Gradients reach theta, state0, inputs and float tensors the cell captures
from outside (found by tracing the cell once into a scratch graph). Weights
must reach the cell through theta: a trainable variable read directly inside
the cell would get no gradient, so that is an error.

Works in TF1 graph mode (tf.compat.v1.Session) and in tf.function, with or
without jit_compile: the loops are while_v2 loops with TensorList stacks,
which XLA compiles to in-place buffers.
"""

import contextlib

import tensorflow as tf

# pylint: disable=g-direct-tensorflow-import
from tensorflow.python.framework import func_graph as func_graph_lib
from tensorflow.python.ops import control_flow_util_v2
from tensorflow.python.ops import list_ops
from tensorflow.python.ops import while_v2
# pylint: enable=g-direct-tensorflow-import


def _IsDifferentiable(t):
  return t.dtype.is_floating or t.dtype.is_complex


@contextlib.contextmanager
def _WithoutConstantPropagation(graph):
  """While loops built in `graph` don't make XLA turn inputs into literals.

  TF marks every while loop built for XLA with
  `_xla_propagate_compile_time_consts`; XLA then tries to evaluate *each*
  loop input on the host, before checking whether it is loop-invariant. The
  backward loop's gradient accumulators start as zeros of the stacked
  weights' shapes: a model whose weights exceed host memory would fail to
  lower (RESOURCE_EXHAUSTED allocating the literal), though nothing of the
  kind is ever needed. Our loops use no compile-time constants from outside
  (their lists are reserved outside, their bodies index with the loop
  counter), so only they are exempted: loops the cell builds live in the
  loop body's graph and keep the attribute.
  """
  original = control_flow_util_v2.maybe_propagate_compile_time_consts_in_xla

  def MaybePropagate(op):
    if op.graph is not graph:
      original(op)

  control_flow_util_v2.maybe_propagate_compile_time_consts_in_xla = (
      MaybePropagate)
  try:
    yield
  finally:
    control_flow_util_v2.maybe_propagate_compile_time_consts_in_xla = original


def _WhileLoop(body, loop_vars, num_iterations):
  """Runs `body` exactly num_iterations times (a while_v2 loop).

  The loop's only condition is while_v2's own iteration counter against
  `maximum_iterations`: XLA then finds the trip count (cost analysis counts
  the body that often), which it cannot once a second counter is tested.
  The counter also sizes TensorLists built inside the body under XLA.
  """
  with _WithoutConstantPropagation(tf.compat.v1.get_default_graph()):
    return while_v2.while_loop(
        lambda *unused: tf.constant(True), body, loop_vars,
        maximum_iterations=num_iterations, return_same_structure=True)


class _Structures:
  """Flattening bookkeeping for theta, state, inputs and extras."""

  def __init__(self, theta, state0, inputs, extras_spec):
    self.theta = theta
    self.state = state0
    self.inputs = inputs
    self.extras = extras_spec
    self.n_theta = len(tf.nest.flatten(theta))
    self.n_state = len(tf.nest.flatten(state0))
    self.n_inputs = len(tf.nest.flatten(inputs))
    self.n_extras = len(tf.nest.flatten(extras_spec))

  def Split(self, flat):
    """Splits [theta, state, inputs, captures] flat args into structures."""
    a = self.n_theta
    b = a + self.n_state
    c = b + self.n_inputs
    return (tf.nest.pack_sequence_as(self.theta, flat[:a]),
            tf.nest.pack_sequence_as(self.state, flat[a:b]),
            tf.nest.pack_sequence_as(self.inputs, flat[b:c]), list(flat[c:]))


def _CheckCellOutputs(state0, new_state):
  """Raises a clear error when the cell's new state differs from state0."""
  try:
    tf.nest.assert_same_structure(state0, new_state)
  except (ValueError, TypeError) as e:
    raise ValueError(
        'Recurrent cell_fn must return a state with the same structure as '
        f'state0. state0: {tf.nest.map_structure(lambda _: "*", state0)}; '
        f'returned: {tf.nest.map_structure(lambda _: "*", new_state)}. '
        f'({e})') from None
  for path_value in zip(tf.nest.flatten(state0), tf.nest.flatten(new_state)):
    old, new = path_value
    if old.dtype != new.dtype or not old.shape.is_compatible_with(new.shape):
      raise ValueError(
          'Recurrent cell_fn must keep each state tensor\'s dtype and shape: '
          f'state0 has {old.dtype.name}{old.shape}, the cell returned '
          f'{new.dtype.name}{new.shape}.')


def _SliceInputs(inputs, t):
  return tf.nest.map_structure(lambda x: tf.gather(x, t), inputs)


def _ProbeCell(theta, state0, inputs, cell_fn):
  """Traces the cell once in a scratch graph.

  Returns:
    (extras_spec, captures): the TensorSpec structure of the extras, and the
    outer float tensors the cell captures (the implicit inputs whose
    gradients we must return).
  """
  graph = func_graph_lib.FuncGraph('recurrent_probe')
  with graph.as_default():
    ph = lambda x: tf.compat.v1.placeholder(x.dtype, x.shape)
    theta_ph = tf.nest.map_structure(ph, theta)
    state_ph = tf.nest.map_structure(ph, state0)
    inputs_ph = tf.nest.map_structure(
        lambda x: tf.compat.v1.placeholder(x.dtype, x.shape[1:]), inputs)
    new_state, extras = cell_fn(theta_ph, state_ph, inputs_ph)
    _CheckCellOutputs(state0, new_state)
    extras_spec = tf.nest.map_structure(
        lambda x: tf.TensorSpec(x.shape, x.dtype), extras)
  captures = [t for t in graph.external_captures if _IsDifferentiable(t)]
  for spec in tf.nest.flatten(extras_spec):
    if not spec.shape.is_fully_defined():
      raise ValueError(
          f'Recurrent cell_fn extras must have static shapes; got {spec}.')
  return extras_spec, captures


def _ForwardLoop(structs, theta, state0, inputs, cell_fn, num_iterations):
  """Runs the forward loop; returns (stacked states, final state, extras)."""
  flat_state0 = tf.nest.flatten(state0)
  flat_extras_spec = tf.nest.flatten(structs.extras)
  n_state = len(flat_state0)

  def Reserve(shape, dtype):
    return list_ops.tensor_list_reserve(
        element_shape=shape, num_elements=num_iterations, element_dtype=dtype)

  state_lists = [Reserve(s.shape, s.dtype) for s in flat_state0]
  extras_lists = [Reserve(s.shape, s.dtype) for s in flat_extras_spec]

  def Body(t, *loop_vars):
    state = tf.nest.pack_sequence_as(state0, loop_vars[:n_state])
    lists = loop_vars[n_state:]
    new_state, extras = cell_fn(theta, state, _SliceInputs(inputs, t))
    _CheckCellOutputs(state0, new_state)
    flat_new = [
        tf.ensure_shape(v, s.shape)
        for v, s in zip(tf.nest.flatten(new_state), flat_state0)
    ]
    flat_values = flat_new + tf.nest.flatten(extras)
    new_lists = [
        list_ops.tensor_list_set_item(l, t, v)
        for l, v in zip(lists, flat_values)
    ]
    return [t + 1] + flat_new + new_lists

  results = _WhileLoop(
      Body,
      [tf.constant(0, tf.int32)] + flat_state0 + state_lists + extras_lists,
      num_iterations)
  final_flat = results[1:1 + n_state]
  lists = results[1 + n_state:]
  specs = flat_state0 + flat_extras_spec
  stacked = [
      list_ops.tensor_list_stack(
          l, s.dtype, num_elements=num_iterations, element_shape=s.shape)
      for l, s in zip(lists, specs)
  ]
  states = tf.nest.pack_sequence_as(state0, stacked[:n_state])
  extras = tf.nest.pack_sequence_as(structs.extras, stacked[n_state:])
  final = tf.nest.pack_sequence_as(state0, final_flat)
  return states, final, extras


def _Accumulate(total, grad):
  if grad is None:
    return total
  if isinstance(grad, tf.IndexedSlices):
    grad = tf.convert_to_tensor(grad)
  return total + grad


def _BackwardLoop(structs, theta, state0, inputs, captures, cell_fn,
                  num_iterations, stacked_states, d_states, d_final, d_extras):
  """The reverse loop: recomputes iteration t, back-propagates through it.

  Returns gradients for (theta, state0, inputs, captures), flat.
  """
  flat_theta = tf.nest.flatten(theta)
  flat_state0 = tf.nest.flatten(state0)
  flat_inputs = tf.nest.flatten(inputs)
  flat_stacked = tf.nest.flatten(stacked_states)
  flat_d_states = tf.nest.flatten(d_states)
  flat_d_extras = tf.nest.flatten(d_extras)

  theta_idx = [i for i, x in enumerate(flat_theta) if _IsDifferentiable(x)]
  state_idx = [i for i, x in enumerate(flat_state0) if _IsDifferentiable(x)]
  input_idx = [i for i, x in enumerate(flat_inputs) if _IsDifferentiable(x)]
  n_th, n_st, n_in, n_cap = (len(theta_idx), len(state_idx), len(input_idx),
                             len(captures))

  def Body(t, *loop_vars):
    d_state = list(loop_vars[:n_st])
    acc_theta = list(loop_vars[n_st:n_st + n_th])
    acc_caps = list(loop_vars[n_st + n_th:n_st + n_th + n_cap])
    input_lists = list(loop_vars[n_st + n_th + n_cap:])

    # The state before iteration t: state0 when t == 0, else states[t - 1].
    prev = tf.maximum(t - 1, 0)
    state_in = [
        tf.where(t > 0, tf.gather(h, prev), s0)
        for h, s0 in zip(flat_stacked, flat_state0)
    ]
    # Fresh tensors to differentiate w.r.t. The stop_gradient keeps their
    # gradients apart from the captures': a cell may also capture the very
    # tensor it gets as theta, state0 or inputs, and that path is counted
    # once, as a capture.
    fresh = lambda x: tf.identity(tf.stop_gradient(x))
    state_in = [fresh(x) for x in state_in]
    theta_in = [fresh(x) for x in flat_theta]
    inputs_in = [fresh(tf.gather(x, t)) for x in flat_inputs]
    # Captured tensors appear in this graph as placeholders; differentiate
    # w.r.t. those.
    graph = tf.compat.v1.get_default_graph()
    caps_in = [graph.capture(c) for c in captures]

    new_state, extras = cell_fn(
        tf.nest.pack_sequence_as(theta, theta_in),
        tf.nest.pack_sequence_as(state0, state_in),
        tf.nest.pack_sequence_as(
            structs.inputs,
            inputs_in))
    flat_new = tf.nest.flatten(new_state)
    flat_ex = tf.nest.flatten(extras)

    ys, grad_ys = [], []
    for j, i in enumerate(state_idx):
      ys.append(flat_new[i])
      grad_ys.append(d_state[j])
    for i, e in enumerate(flat_ex):
      if _IsDifferentiable(e):
        ys.append(e)
        grad_ys.append(tf.gather(flat_d_extras[i], t))
    xs = ([theta_in[i] for i in theta_idx] + [state_in[i] for i in state_idx] +
          [inputs_in[i] for i in input_idx] + caps_in)
    grads = tf.gradients(ys, xs, grad_ys=grad_ys,
                         unconnected_gradients=tf.UnconnectedGradients.ZERO)
    g_theta = grads[:n_th]
    g_state = grads[n_th:n_th + n_st]
    g_inputs = grads[n_th + n_st:n_th + n_st + n_in]
    g_caps = grads[n_th + n_st + n_in:]

    # d(loss)/d(state before t) also gets the direct gradient of states[t-1].
    new_d_state = []
    for j, i in enumerate(state_idx):
      direct = tf.where(t > 0, tf.gather(flat_d_states[i], prev),
                        tf.zeros_like(g_state[j]))
      new_d_state.append(_Accumulate(direct, g_state[j]))
    new_acc_theta = [_Accumulate(a, g) for a, g in zip(acc_theta, g_theta)]
    new_acc_caps = [_Accumulate(a, g) for a, g in zip(acc_caps, g_caps)]
    new_lists = [
        list_ops.tensor_list_set_item(l, t, tf.convert_to_tensor(g))
        for l, g in zip(input_lists, g_inputs)
    ]
    return [t - 1] + new_d_state + new_acc_theta + new_acc_caps + new_lists

  last = num_iterations - 1
  init_d_state = [
      tf.gather(flat_d_states[i], last) + tf.nest.flatten(d_final)[i]
      for i in state_idx
  ]
  init_theta = [tf.zeros_like(flat_theta[i]) for i in theta_idx]
  init_caps = [tf.zeros_like(c) for c in captures]
  init_lists = [
      list_ops.tensor_list_reserve(
          element_shape=flat_inputs[i].shape[1:],
          num_elements=num_iterations,
          element_dtype=flat_inputs[i].dtype) for i in input_idx
  ]
  results = _WhileLoop(
      Body,
      [tf.constant(last, tf.int32)] + init_d_state + init_theta + init_caps +
      init_lists, num_iterations)
  results = results[1:]
  d_state0_part = results[:n_st]
  d_theta_part = results[n_st:n_st + n_th]
  d_caps = results[n_st + n_th:n_st + n_th + n_cap]
  d_input_lists = results[n_st + n_th + n_cap:]

  d_theta = [None] * len(flat_theta)
  for j, i in enumerate(theta_idx):
    d_theta[i] = d_theta_part[j]
  d_state0 = [None] * len(flat_state0)
  for j, i in enumerate(state_idx):
    d_state0[i] = d_state0_part[j]
  d_inputs = [None] * len(flat_inputs)
  for j, i in enumerate(input_idx):
    d_inputs[i] = list_ops.tensor_list_stack(
        d_input_lists[j],
        flat_inputs[i].dtype,
        num_elements=num_iterations,
        element_shape=flat_inputs[i].shape[1:])
  return d_theta + d_state0 + d_inputs + list(d_caps)


def _ZeroIfNone(g, like):
  return tf.zeros_like(like) if g is None else g


def Recurrent(theta,
              state0,
              inputs,
              cell_fn,
              *,
              store_intermediates=False,
              name='recurrent'):
  """Runs `cell_fn` over the leading dim of `inputs`.

  Args:
    theta: a nested structure of tensors the cell reads every iteration
      (weights). Variables are read once, outside the loop.
    state0: a nested structure of tensors, the initial carried state.
    inputs: a nested structure of tensors with the same static leading dim T.
    cell_fn: (theta, state, inputs_t) -> (new_state, extras). new_state has
      state0's structure, dtypes and shapes; extras is any nested structure of
      statically shaped tensors (may be empty).
    store_intermediates: if True, differentiate with TensorFlow's while-loop
      gradient, which stores the cell's intermediates, instead of recomputing.
    name: name scope.

  Returns:
    (states, final_state, extras): states and extras stacked over the T
    iterations ([T, ...]; states[t] is the state after iteration t), and the
    final state.
  """
  with tf.name_scope(name):
    theta = tf.nest.map_structure(tf.convert_to_tensor, theta)
    state0 = tf.nest.map_structure(tf.convert_to_tensor, state0)
    inputs = tf.nest.map_structure(tf.convert_to_tensor, inputs)
    num_iterations = _NumIterations(inputs)
    extras_spec, captures = _ProbeCell(theta, state0, inputs, cell_fn)
    structs = _Structures(theta, state0, inputs, extras_spec)

    if store_intermediates:
      return _ForwardLoop(structs, theta, state0, inputs, cell_fn,
                          num_iterations)

    flat_args = (
        tf.nest.flatten(theta) + tf.nest.flatten(state0) +
        tf.nest.flatten(inputs) + captures)

    @tf.custom_gradient
    def _RecurrentWithRecompute(*flat):
      th, s0, inp, _ = structs.Split(flat)
      states, final, extras = _ForwardLoop(structs, th, s0, inp, cell_fn,
                                           num_iterations)
      outputs = (states, final, extras)

      def Grad(*dys, variables=None):
        flat_dys = list(dys)
        n_s = structs.n_state
        d_states = tf.nest.pack_sequence_as(
            state0, [
                _ZeroIfNone(g, x) for g, x in zip(flat_dys[:n_s],
                                                  tf.nest.flatten(states))
            ])
        d_final = tf.nest.pack_sequence_as(
            state0, [
                _ZeroIfNone(g, x) for g, x in zip(flat_dys[n_s:2 * n_s],
                                                  tf.nest.flatten(final))
            ])
        d_extras = tf.nest.pack_sequence_as(
            extras_spec, [
                _ZeroIfNone(g, x)
                for g, x in zip(flat_dys[2 * n_s:], tf.nest.flatten(extras))
            ])
        grads = _BackwardLoop(structs, th, s0, inp, captures, cell_fn,
                              num_iterations, states, d_states, d_final,
                              d_extras)
        if variables is None:
          return grads
        _CheckNoTrainableVariables(variables)
        return grads, [None] * len(variables)

      return tf.nest.flatten(outputs), Grad

    flat_out = _RecurrentWithRecompute(*flat_args)
    n_s = structs.n_state
    states = tf.nest.pack_sequence_as(state0, flat_out[:n_s])
    final = tf.nest.pack_sequence_as(state0, flat_out[n_s:2 * n_s])
    extras = tf.nest.pack_sequence_as(extras_spec, flat_out[2 * n_s:])
    return states, final, extras


def _CheckNoTrainableVariables(variables):
  trainable = [v.name for v in variables if v.trainable]
  if trainable:
    raise ValueError(
        'Recurrent cell_fn reads trainable variables directly: '
        f'{trainable}. Pass them through theta so that their gradients are '
        'computed by the recomputing backward loop.')


def _NumIterations(inputs):
  flat = tf.nest.flatten(inputs)
  if not flat:
    raise ValueError('Recurrent needs at least one input tensor with a '
                     'leading iterations dim.')
  dims = {x.shape.as_list()[0] if x.shape.rank else None for x in flat}
  if len(dims) != 1 or None in dims:
    raise ValueError(
        'All Recurrent inputs must share one static leading dim (the number '
        f'of iterations); got {sorted(dims, key=str)}.')
  return dims.pop()
