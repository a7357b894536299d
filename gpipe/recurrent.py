"""A while loop over T iterations whose gradient recomputes each iteration.

    state_0 --cell--> state_1 --cell--> ... --cell--> state_T
                |                |                  |
             extras_0         extras_1          extras_{T-1}

`Recurrent` runs `cell_fn(theta, state, inputs[t]) -> (state', extras)` for
t = 0..T-1 and returns the stacked states after each iteration, the final
state and the stacked extras.

Its gradient is a second loop that runs t = T-1..0. Iteration t reads the
state the forward pass kept before it (state_0 or states[t-1]) and what the
remat policy had it store (gpipe.loops.remat), recomputes the rest of the cell
and back-propagates through that one iteration. With the default policy,
'recompute', the forward pass keeps only the carried state per iteration
(which the pipeline needs anyway, as its outputs), never the cell's internal
activations: activation memory is state x iterations, independent of how
much the cell computes inside. 'save_dots' also stores its matmul outputs,
'save_all' every activation the gradient reads; never anything computed
from theta alone. The cell is traced once, with its gradient
(gpipe.loops.cell_graph), and both loops import that graph.

Gradients reach theta, state0, inputs and float tensors the cell captures
from outside (found when the cell is traced). Weights must reach the cell
through theta: a trainable variable read directly inside the cell would get
no gradient, so that is an error. Other variables the cell reads are read
once, before the loops; writing one inside the cell is an error, and so is
differentiating a cell with stateful random ops (the recomputation would
draw other numbers).

Works in TF1 graph mode (tf.compat.v1.Session) and in tf.function, with or
without jit_compile: the loops are while_v2 loops with TensorList stacks,
which XLA compiles to in-place buffers.
"""

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

import tensorflow as tf

from gpipe.loops import cell_graph
from gpipe.loops import compiled_loops
from gpipe.loops import deferred_dots
from gpipe.loops import kept_extras as kept_extras_lib
from gpipe.loops import remat
from gpipe.loops import tensor_lists
from gpipe.loops import while_loops
# pylint: disable=g-direct-tensorflow-import
from tensorflow.python.eager import record
# pylint: enable=g-direct-tensorflow-import

Kept = kept_extras_lib.Kept

__all__ = [
    'Kept',
    'Recurrent',
    'Undo',
]


def Recurrent(theta: Any,
              state0: Any,
              inputs: Any,
              cell_fn: Callable[[Any, Any, Any], Tuple[Any, Any]],
              *,
              remat_policy: Any = 'recompute',
              manual_boundary: Optional[Any] = None,
              kept_extras: Optional[Dict[str, 'Kept']] = None,
              return_states: bool = True,
              activation_state: Optional[Any] = None,
              undo: Optional['Undo'] = None,
              defer_weight_dots: bool = False,
              name: str = 'recurrent') -> Tuple[Any, Any, Any]:
  """Runs `cell_fn` over the leading dim of `inputs`.

  Args:
    theta: a nested structure of tensors the cell reads every iteration
      (weights). Variables are read once, outside the loop.
    state0: a nested structure of tensors, the initial carried state.
    inputs: a nested structure of tensors with the same static leading dim T.
    cell_fn: (theta, state, inputs_t) -> (new_state, extras). new_state has
      state0's structure, dtypes and shapes; extras is any nested structure of
      statically shaped tensors (may be empty). It is traced once.
    remat_policy: what the forward pass stores for the backward pass besides
      the states: a gpipe.loops.remat policy or its name ('recompute',
      'save_dots', 'save_all').
    manual_boundary: a gpipe.sharding.ManualBoundary when the cell computes
      in a manual sharding region: activations stored from inside it leave
      and re-enter it through this.
    kept_extras: {key of the extras (a dict): Kept}: those extras are kept
      in their Kept's entries rather than one entry per iteration.
    return_states: False: the states after each iteration are kept for the
      backward loop only, and not returned (None instead), so that no
      [T, ...] gradient of them is ever made.
    activation_state: bools shaped like state0: which entries carry data whose
      functions are activations the remat policy may store (default all;
      see cell_graph.CellGraph).
    undo: an Undo, or None: state entries the forward loop keeps no
      history of (those that only move data around invertibly, e.g.
      stream_io's streams, whose history would be the whole batch per
      iteration); the backward loop recovers them with undo.fn. Needs
      return_states=False.
    defer_weight_dots: the backward loop keeps the operands of the weight
      gradients' dots where they are small and contracts them once after
      the loop (gpipe.loops.deferred_dots): faster where the dots read few
      examples per iteration, for memory that grows with the iterations.
    name: name scope.

  Returns:
    (states, final_state, extras): states and extras stacked over the T
    iterations ([T, ...]; states[t] is the state after iteration t; an
    extra with a Kept: [num_kept, ...]), and the final state.
  """
  if isinstance(remat_policy, str):
    remat_policy = remat.For(remat_policy)
  if undo is not None and return_states:
    raise ValueError('Recurrent returns no states it does not keep: pass '
                     'return_states=False with undo.')
  with tf.name_scope(name):
    theta = tf.nest.map_structure(tf.convert_to_tensor, theta)
    state0 = tf.nest.map_structure(tf.convert_to_tensor, state0)
    inputs = tf.nest.map_structure(tf.convert_to_tensor, inputs)
    num_iterations = _NumIterations(inputs)
    with record.VariableWatcher() as watcher:
      cell = cell_graph.CellGraph(cell_fn, theta, state0, inputs,
                                  remat_policy, manual_boundary,
                                  activation_state,
                                  defer_weight_dots=defer_weight_dots)
    loops = _Loops(cell, (theta, state0, inputs), num_iterations,
                   kept_extras_lib.FlatKept(cell.extras_spec, kept_extras),
                   watcher.watched_variables(), undo)
    return loops.Forward(return_states)


@dataclasses.dataclass(frozen=True)
class Undo:
  """State entries the forward loop does not keep per iteration.

  Attributes:
    unstored: bools shaped like state0, True for those entries.
    fn: (state after iteration t, inputs[t]) -> the state before it; only
      its unstored entries are read. The backward loop recovers them so,
      from the final state down, instead of reading a history.
  """
  unstored: Any
  fn: Callable

  def Before(self, after, inputs_t):
    """The state before an iteration (structured like state0; only the
    unstored entries mean anything) from the state after it and the
    iteration's inputs: a call back into the loop's owner (`fn`)."""
    return self.fn(after, inputs_t)


class _Loops:
  """The forward loop as a custom gradient whose gradient is the backward
  loop. Its arguments: theta, state0, inputs and the outer float tensors
  the cell captures (their gradients are returned too)."""

  def __init__(self, cell, structure, num_iterations, flat_kept,
               read_variables, undo):
    self._cell = cell
    self._undo = undo
    self._kept_states = ([True] * len(tf.nest.flatten(structure[1]))
                  if undo is None else
                  [not u for u in tf.nest.flatten(undo.unstored)])
    self._structure = structure  # (theta, state0, inputs)
    self._num_iterations = num_iterations
    self._kept_extras = flat_kept
    self._read_variables = read_variables
    self._sizes = [len(tf.nest.flatten(x)) for x in structure]

  def _Unflatten(self, flat):
    """(theta, state0, inputs, captures) from the flat arguments."""
    parts, rest = [], list(flat)
    for like, n in zip(self._structure, self._sizes):
      parts.append(tf.nest.pack_sequence_as(like, rest[:n]))
      rest = rest[n:]
    caps = list(self._cell.captures)
    for i, c in zip(self._cell.differentiable['captures'], rest):
      caps[i] = c
    return parts + [caps]

  def Forward(self, return_states):
    """(states or None, final, extras) of the forward loop."""
    cell = self._cell
    diff_caps = cell.differentiable['captures']
    end = sum(self._sizes)
    compiles = compiled_loops.IsAllowed()  # for the backward loop too

    @tf.custom_gradient
    def _RecurrentWithStoredActivations(*flat):
      th, s0, inp, caps = self._Unflatten(flat)
      # This function's gradient is Grad below. Unrecorded, the while loop
      # does not also build TensorFlow's own gradient of itself for a
      # GradientTape (under tf.function that took most of the tracing).
      with record.stop_recording():
        states, final, extras, stored = _ForwardLoop(
            cell, th, s0, inp, caps, self._num_iterations,
            self._kept_extras, self._kept_states)
      outputs = (states if return_states else (), final, extras)

      def Grad(*dys, variables=None):
        CheckNoTrainableVariables(self._read_variables)
        d_states, d_final, d_extras = _IncomingGradients(
            dys, outputs, s0, cell.extras_spec)
        with compiled_loops.Allowed(compiles):
          grads = _BackwardLoop(
              cell, th, s0, inp, caps, self._num_iterations, states, stored,
              d_states, d_final, d_extras, self._kept_extras, final,
              self._undo)
        grads = grads[:end] + [grads[end + i] for i in diff_caps]
        if variables is None:
          return grads
        return grads, [None] * len(variables)

      return tf.nest.flatten(outputs), Grad

    flat_args = [x for part in self._structure for x in tf.nest.flatten(part)]
    flat_out = _RecurrentWithStoredActivations(
        *flat_args, *[cell.captures[i] for i in diff_caps])
    state0 = self._structure[1]
    n_state = self._sizes[1]
    n_states = n_state if return_states else 0
    states = (tf.nest.pack_sequence_as(state0, flat_out[:n_state])
              if return_states else None)
    final = tf.nest.pack_sequence_as(
        state0, flat_out[n_states:n_states + n_state])
    extras = tf.nest.pack_sequence_as(cell.extras_spec,
                                      flat_out[n_states + n_state:])
    return states, final, extras


def _ForwardLoop(cell, theta, state0, inputs, captures, num_iterations,
                 kept_extras, kept_states):
  """Runs the forward loop.

  Returns:
    (states, final, extras, stored): the states after each iteration and
    the extras, stacked [T, ...] (an extra with a Kept: [num_kept, ...];
    a state entry not in `kept_states`: None); the final state; the stored
    activations, a flat list of [T, ...] stacks (see CellGraph.stored).
  """
  flat_state0 = tf.nest.flatten(state0)
  n_state = len(flat_state0)
  kept_idx = [i for i in range(n_state) if kept_states[i]]
  specs = ([tf.TensorSpec(flat_state0[i].shape, flat_state0[i].dtype)
            for i in kept_idx] +
           tf.nest.flatten(cell.extras_spec) + cell.StoredSpecs())
  n_kept = len(kept_idx)
  n_extras = len(tf.nest.flatten(cell.extras_spec))
  kept = [None] * n_kept + kept_extras + [None] * (len(specs) - n_kept -
                                                    n_extras)
  # A kept-nowhere iteration writes one extra entry, dropped after the loop.
  sizes = [num_iterations if k is None else k.num_kept + 1 for k in kept]

  # Loop variables: t (int32 []); the state, each entry its state0 shape;
  # TensorLists of `sizes` entries, each entry shaped like one kept state
  # entry, one extra or one stored activation (specs).
  def Body(t, *loop_vars):
    state = tf.nest.pack_sequence_as(state0, loop_vars[:n_state])
    lists = loop_vars[n_state:]
    new_state, extras, stored = cell.Forward(theta, state,
                                             _SliceInputs(inputs, t), captures)
    flat_new = tf.nest.flatten(new_state)
    values = ([flat_new[i] for i in kept_idx] + tf.nest.flatten(extras) +
              stored)
    new_lists = [
        tensor_lists.SetEntry(l, t if k is None else k.At(t), v)
        for l, v, k in zip(lists, values, kept)
    ]
    return [t + 1] + flat_new + new_lists

  results = while_loops.WhileLoop(
      Body, [tf.constant(0, tf.int32)] + flat_state0 +
      [tensor_lists.Reserve(s, n) for s, n in zip(specs, sizes)],
      num_iterations)
  final_flat = results[1:1 + n_state]
  stacked = [tensor_lists.Stack(l, s, n) if k is None
             else tensor_lists.Stack(l, s, n)[:k.num_kept]
             for l, s, n, k in zip(results[1 + n_state:], specs, sizes, kept)]
  states = _Scatter(stacked[:n_kept], kept_idx, n_state)
  extras = tf.nest.pack_sequence_as(cell.extras_spec,
                                    stacked[n_kept:n_kept + n_extras])
  final = tf.nest.pack_sequence_as(state0, final_flat)
  return (tf.nest.pack_sequence_as(state0, states), final, extras,
          stacked[n_kept + n_extras:])


def _BackwardLoop(cell, theta, state0, inputs, captures, num_iterations,
                  stacked_states, stored, d_states, d_final, d_extras,
                  kept_extras, final, undo):
  """The reverse loop: iteration t's gradient, from what t stored.

  d_states entries may be None (the caller reads no past state of that
  entry): no [T, ...] gradient of the states is then made at all. A state
  entry the forward loop did not keep (`undo`) is carried from `final`
  down, each iteration undone. Returns gradients for (theta, state0,
  inputs, captures), flat; None for the entries that are not differentiable.
  """
  (flat_theta, flat_state0, flat_inputs, flat_stacked, flat_d_states,
   flat_d_extras) = map(tf.nest.flatten, (theta, state0, inputs, stacked_states,
                                          d_states, d_extras))
  diff = cell.differentiable
  extras_idx = [i for i, s in enumerate(tf.nest.flatten(cell.extras_spec))
                if cell_graph.IsDifferentiable(s)]
  n_th, n_st, n_in, n_cap = (len(diff['theta']), len(diff['state']),
                             len(diff['inputs']), len(diff['captures']))
  unkept = [i for i, h in enumerate(flat_stacked) if h is None]
  theta_diff = [flat_theta[i] for i in diff['theta']]
  sums = deferred_dots.WeightGradientSums(cell.DeferredDots(), theta_diff,
                                          num_iterations)

  # Loop variables, t = T-1..0 (int32 []): d_state, the gradient of the
  # state after iteration t, each like its differentiable state entry;
  # theta_sums, the weights' gradients summed so far (deferred_dots: a
  # weight's own shape, or its deferred dots' operands); acc_caps, the
  # captures' gradients, each its capture's shape; input_lists, TensorLists
  # of T entries shaped like one iteration's differentiable inputs
  # (input_specs); after, the state entries the forward loop did not keep,
  # carried down from `final`, each its state0 shape.
  def Body(t, *loop_vars):
    d_state, theta_sums, acc_caps, input_lists, after = _SplitAt(
        loop_vars, n_st, sums.size, n_cap, len(input_specs))
    inputs_t = _SliceInputs(flat_inputs, t)
    # The state after iteration t: stored, or carried down from the end.
    flat_after = _Scatter(after, unkept, len(flat_stacked))
    flat_after = [a if h is None else tf.gather(h, t)
                  for a, h in zip(flat_after, flat_stacked)]
    before = _Undone(undo, state0, inputs, flat_after, inputs_t)
    # The state before iteration t: state0 when t == 0, else states[t - 1].
    prev = tf.maximum(t - 1, 0)
    state_in = [
        before[i] if h is None else tf.where(t > 0, tf.gather(h, prev), s0)
        for i, (h, s0) in enumerate(zip(flat_stacked, flat_state0))
    ]
    grads = cell.Backward(
        flat_theta, state_in, inputs_t, captures, flat_after, d_state,
        [kept_extras_lib.GradientAt(flat_d_extras[i], kept_extras[i], t)
         for i in extras_idx],
        [tf.gather(s, t) for s in stored])
    g_theta, g_state, g_inputs, g_caps = _SplitAt(grads, n_th, n_st, n_in)

    # d(loss)/d(state before t) also gets the direct gradient of states[t-1].
    new_d_state = [
        g + _PastStateGradient(flat_d_states[i], t - 1, g)
        for i, g in zip(diff['state'], g_state)
    ]
    new_theta_sums = sums.Next(t, theta_sums, g_theta)
    new_acc_caps = [a + g for a, g in zip(acc_caps, g_caps)]
    new_lists = [
        tensor_lists.SetEntry(l, t, g)
        for l, g in zip(input_lists, g_inputs)
    ]
    return ([t - 1] + new_d_state + new_theta_sums + new_acc_caps + new_lists +
            [before[i] for i in unkept])

  input_specs = [tf.TensorSpec(flat_inputs[i].shape[1:], flat_inputs[i].dtype)
                 for i in diff['inputs']]
  results = while_loops.WhileLoop(
      Body, _BackwardStart(diff, num_iterations, d_final, flat_d_states,
                           flat_d_extras, sums, captures, input_specs,
                           [tf.nest.flatten(final)[i] for i in unkept]),
      num_iterations)
  d_state, theta_sums, rest = _SplitAt(
      results[1:len(results) - len(unkept)], n_st, sums.size)
  sizes = [len(x) for x in (flat_theta, flat_state0, flat_inputs, captures)]
  return _BackwardResults(d_state + sums.Final(theta_sums) + rest, diff,
                          sizes, input_specs, num_iterations)


def _BackwardStart(diff, num_iterations, d_final, flat_d_states,
                   flat_d_extras, sums, captures, input_specs, unkept_final):
  """The reverse loop's first loop variables (_BackwardLoop's Body says
  what each is), at t = T - 1."""
  last = num_iterations - 1
  flat_d_final = tf.nest.flatten(d_final)
  return ([tf.constant(last, tf.int32)] + [
      flat_d_final[i] +
      _PastStateGradient(flat_d_states[i], last, flat_d_final[i])
      for i in diff['state']
  ] + sums.Initial(flat_d_final + flat_d_extras) +
          [tf.zeros_like(captures[i]) for i in diff['captures']] +
          [tensor_lists.Reserve(s, num_iterations) for s in input_specs] +
          unkept_final)


def _SliceInputs(inputs, t):
  return tf.nest.map_structure(lambda x: tf.gather(x, t), inputs)


def _BackwardResults(results, diff, sizes, input_specs, num_iterations):
  """The reverse loop's final gradients (state, theta, captures, then the
  inputs' lists), flat in (theta, state, inputs, captures) order, whose
  sizes are `sizes`."""
  sizes = dict(zip(('theta', 'state', 'inputs', 'captures'), sizes))
  parts = {}
  for key in ('state', 'theta', 'captures'):
    n = len(diff[key])
    parts[key], results = results[:n], results[n:]
  parts['inputs'] = [tensor_lists.Stack(l, s, num_iterations)
                     for l, s in zip(results, input_specs)]
  return [g for key in ('theta', 'state', 'inputs', 'captures')
          for g in _Scatter(parts[key], diff[key], sizes[key])]


def _Undone(undo, state0, inputs, flat_after, inputs_t):
  """The flat state before an iteration as `undo` recovers it (its
  unstored entries), from the state after it."""
  if undo is None:
    return [None] * len(flat_after)
  return tf.nest.flatten(undo.Before(
      tf.nest.pack_sequence_as(state0, flat_after),
      tf.nest.pack_sequence_as(inputs, inputs_t)))


def _SplitAt(seq, *sizes):
  """Consecutive lists of the given sizes from seq, then the rest."""
  parts, rest = [], list(seq)
  for n in sizes:
    parts.append(rest[:n])
    rest = rest[n:]
  return parts + [rest]


def _Scatter(values, indices, size):
  """A flat list of `size`: values at indices, None elsewhere."""
  flat = [None] * size
  for i, value in zip(indices, values):
    flat[i] = value
  return flat


def _PastStateGradient(d_states_entry, t, like):
  """The incoming gradient of states[t] (zeros for t < 0 or None)."""
  if d_states_entry is None:
    return tf.zeros_like(like)
  return tf.where(t >= 0, tf.gather(d_states_entry, tf.maximum(t, 0)),
                  tf.zeros_like(like))


def ZeroIfNone(g, like):
  """An incoming gradient as a dense tensor: zeros for None."""
  return tf.zeros_like(like) if g is None else tf.convert_to_tensor(g)


def _IncomingGradients(dys, outputs, state0, extras_spec):
  """(d_states, d_final, d_extras) from the custom gradient's flat dys.

  d_states is None per entry when the states were not returned: the
  backward loop then makes no [T, ...] gradient of them. Missing gradients
  of the final state and the extras are zeros of their (small) shapes.
  """
  states, final, extras = outputs
  flat_dys = list(dys)
  n_states = len(tf.nest.flatten(states))
  if n_states:
    d_states = tf.nest.pack_sequence_as(state0, [
        ZeroIfNone(g, x)
        for g, x in zip(flat_dys[:n_states], tf.nest.flatten(states))])
  else:
    d_states = tf.nest.map_structure(lambda _: None, state0)
  flat_dys = flat_dys[n_states:]
  flat_final = tf.nest.flatten(final)
  d_final = tf.nest.pack_sequence_as(state0, [
      ZeroIfNone(g, x) for g, x in zip(flat_dys, flat_final)])
  d_extras = tf.nest.pack_sequence_as(extras_spec, [
      ZeroIfNone(g, x) for g, x in zip(flat_dys[len(flat_final):],
                                        tf.nest.flatten(extras))])
  return d_states, d_final, d_extras


def CheckNoTrainableVariables(variables):
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
