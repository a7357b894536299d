"""One loop iteration and its gradient, traced once, imported into the loops.

gpipe.recurrent's loop runs the same cell in two while loops:
forward, and backward in reverse order. Both use one graph, traced once:

    placeholders: theta, state, inputs[t], d_state, d_extras
        |
      cell_fn ------------------> new_state, extras        (forward part)
        |      (activations A, B, ...)
      tf.gradients --------------> d_theta, d_state, d_inputs, d_captures

The forward loop imports the forward part and also returns the activations
the remat policy stores (gpipe.loops.remat), per iteration. The backward loop
imports the gradient part with those stored activations *substituted* for
the tensors of the same names: the ops that computed them are cut off, so
only what was not stored is recomputed, and the numbers are the forward
pass's own. With nothing stored, the backward loop recomputes the whole
forward of the iteration from the carried state.

Imports are pruned to what their outputs need before they are built, so
neither loop holds ops it does not run.
"""

import tensorflow as tf

from gpipe.loops import deferred_dots
from gpipe.loops import graph_import
from gpipe.loops import remat

# pylint: disable=g-direct-tensorflow-import
from tensorflow.python.framework import func_graph as func_graph_lib
# pylint: enable=g-direct-tensorflow-import


def IsDifferentiable(t):
  return t.dtype.is_floating or t.dtype.is_complex


def CheckCellOutputs(state0, new_state):
  """Raises a clear error when the cell's new state differs from state0."""
  try:
    tf.nest.assert_same_structure(state0, new_state)
  except (ValueError, TypeError) as e:
    raise ValueError(
        'Recurrent cell_fn must return a state with the same structure as '
        f'state0. state0: {tf.nest.map_structure(lambda _: "*", state0)}; '
        f'returned: {tf.nest.map_structure(lambda _: "*", new_state)}. '
        f'({e})') from None
  for old, new in zip(tf.nest.flatten(state0), tf.nest.flatten(new_state)):
    if old.dtype != new.dtype or not old.shape.is_compatible_with(new.shape):
      raise ValueError(
          'Recurrent cell_fn must keep each state tensor\'s dtype and shape: '
          f'state0 has {old.dtype.name}{old.shape}, the cell returned '
          f'{new.dtype.name}{new.shape}.')


class CellGraph:
  """The cell and its one-iteration gradient in one graph.

  Attributes:
    extras_spec: the TensorSpec structure of the cell's extras.
    captures: the outer tensors the cell reads (other than its arguments).
    differentiable: per group ('theta', 'state', 'inputs', 'captures'), the
      flat indices whose gradients Backward returns.
    forward_ops, gradient_ops: the ops of the two parts that their results
      need (for policies; the gradient part is built when first needed).
    stored: names of the activations the forward loop stores.

  Activations are the tensors that depend on the float state and inputs;
  `activation_state` (bools shaped like state0) may leave out state entries that
  carry no data (e.g. the pipeline's non-trainable values): what depends
  only on them and on theta is weight-like, recomputed rather than stored.

  defer_weight_dots: Backward returns a weight gradient that is one dot of
  per-iteration operands as those operands, where they are small enough to
  keep for every iteration (gpipe.loops.deferred_dots); split_weight_dots:
  every such gradient, whatever their size (a loop that contracts each
  iteration's own, later: zero bubble's deferred W).
  """

  def __init__(self, cell_fn, theta, state0, inputs, policy,
               manual_boundary=None, activation_state=None,
               keeps_new_state=True, defer_weight_dots=False,
               split_weight_dots=False):
    self._structure = (theta, state0, inputs)
    self._operand_limit = _OperandLimit(defer_weight_dots, split_weight_dots)
    graph = func_graph_lib.FuncGraph('recurrent_cell')
    with graph.as_default():
      ph = lambda x, shape: tf.compat.v1.placeholder(x.dtype, shape)
      flat_theta = [ph(x, x.shape) for x in tf.nest.flatten(theta)]
      flat_state = [ph(x, x.shape) for x in tf.nest.flatten(state0)]
      flat_inputs = [ph(x, x.shape[1:]) for x in tf.nest.flatten(inputs)]
      new_state, extras = cell_fn(
          tf.nest.pack_sequence_as(theta, flat_theta),
          tf.nest.pack_sequence_as(state0, flat_state),
          tf.nest.pack_sequence_as(inputs, flat_inputs))
      CheckCellOutputs(state0, new_state)
      flat_new = [
          tf.ensure_shape(v, s.shape)
          for v, s in zip(tf.nest.flatten(new_state), flat_state)
      ]
      flat_extras = [tf.convert_to_tensor(e) for e in tf.nest.flatten(extras)]
      self.extras_spec = tf.nest.pack_sequence_as(
          extras, [tf.TensorSpec(e.shape, e.dtype) for e in flat_extras])
      _CheckStaticShapes(flat_extras)
      every_op = list(graph.get_operations())
      _CheckNoVariableWrites(every_op)
      # What the outputs need (not a vectorized body's one-stage trace).
      self.forward_ops = _OpsNeededBy(flat_new + flat_extras, every_op)

    captured = _WithVariablesReadOutside(graph.captures)
    self.captures = [ext for ext, _ in captured]
    flat_caps = [internal for _, internal in captured]
    self._read_outside = _ReadOutsideIndex(flat_caps)
    groups = dict(theta=flat_theta, state=flat_state, inputs=flat_inputs,
                  captures=flat_caps)
    self.differentiable = {
        k: [i for i, x in enumerate(v) if IsDifferentiable(x)]
        for k, v in groups.items()
    }
    self._graph, self._groups = graph, groups
    self._flat_new = flat_new
    self._flat_extras = flat_extras
    self._grads = None
    self._graph_def, self._graph_def_ops = None, None
    is_data = ([True] * len(flat_state) if activation_state is None else
               tf.nest.flatten(activation_state))
    self._activations = _ActivationsOf(
        [flat_state[i] for i in self.differentiable['state'] if is_data[i]] +
        [flat_inputs[i] for i in self.differentiable['inputs']],
        self.forward_ops)
    # The new state is kept per iteration anyway (the loop's states): it,
    # and what it is an identity of, are fed from there, never stored twice.
    # A loop that keeps no states (keeps_new_state=False) stores or
    # recomputes them like any activation.
    self._new_state_views = {}
    for i, t in enumerate(flat_new if keeps_new_state else []):
      while True:
        self._new_state_views.setdefault(t.name, i)
        if t.op.type not in remat.SAME_VALUE_OPS or not t.op.inputs:
          break
        t = t.op.inputs[0]
    try:
      stored = policy.Stored(self)
    except LookupError:
      # An op without a gradient: the cell is for forward use only (e.g.
      # decoding). Nothing to store; Backward, if ever built, says why.
      stored = []
    self.stored = [n for n in stored if n not in self._new_state_views]
    # Activations computed in a manual sharding region (one stage's, per
    # device) are stored outside it, [S, ...] split over the stages.
    manual = _ManualTensors(self.forward_ops)
    self._stored_manual = [n in manual for n in self.stored]
    if any(self._stored_manual) and manual_boundary is None:
      raise ValueError(
          'Recurrent: the cell computes in a manual sharding region and the '
          f'remat policy {policy.name!r} stores activations from inside it; '
          'pass manual_boundary (gpipe.sharding.ManualBoundary) to store '
          'them, or use remat_policy=\'recompute\'.')
    self._boundary = manual_boundary

  @property
  def gradient_ops(self):
    """The ops of the gradient part (built on first use)."""
    self._BuildGradient()
    return self._gradient_ops

  def _BuildGradient(self):
    """d(state', extras) -> d(theta, state, inputs, captures).

    Built only when needed: a cell used forward only (decoding) may hold
    ops without gradients. Placeholders carry the incoming gradients.
    """
    if self._grads is not None:
      return
    groups, flat_new = self._groups, self._flat_new
    num_ops = len(self._graph.get_operations())
    with self._graph.as_default():
      ph = lambda x: tf.compat.v1.placeholder(x.dtype, x.shape)
      ys, self._d_state, self._d_extras = [], [], []
      for i in self.differentiable['state']:
        ys.append(flat_new[i])
        self._d_state.append(ph(flat_new[i]))
      for e in self._flat_extras:
        if IsDifferentiable(e):
          ys.append(e)
          self._d_extras.append(ph(e))
      xs = [groups[k][i] for k in groups for i in self.differentiable[k]]
      grads = tf.gradients(ys, xs, grad_ys=self._d_state + self._d_extras,
                           unconnected_gradients=tf.UnconnectedGradients.ZERO)
      self._grads = [tf.convert_to_tensor(g) for g in grads]
    self._gradient_ops = _OpsNeededBy(
        self._grads, self._graph.get_operations()[num_ops:])
    self._deferred = {}
    if self._operand_limit is not False:
      per_iteration = _ActivationsOf(
          [groups['state'][i] for i in self.differentiable['state']] +
          [groups['inputs'][i] for i in self.differentiable['inputs']] +
          self._d_state + self._d_extras, self._graph.get_operations())
      for j in range(len(self.differentiable['theta'])):
        found = deferred_dots.Find(self._grads[j], per_iteration,
                                   self._operand_limit)
        if found is not None:
          self._deferred[j] = found

  def DeferredDots(self):
    """{position among the differentiable theta entries: DeferredDot}: the
    weight gradients Backward returns as their dot's two operands (only
    with defer_weight_dots or split_weight_dots;
    gpipe.loops.deferred_dots)."""
    self._BuildGradient()
    return self._deferred

  def _GraphDef(self):
    """The graph as it is now (the gradient part may come later)."""
    num_ops = len(self._graph.get_operations())
    if self._graph_def_ops != num_ops:
      self._graph_def = self._graph.as_graph_def()
      self._graph_def_ops = num_ops
    return self._graph_def

  def IsActivation(self, t):
    """Whether `t` depends on the carried state or the iteration's inputs."""
    return t.name in self._activations

  def Storable(self, t):
    """Whether `t` can be stored per iteration (static shape, numeric)."""
    return (t.op.type != 'Placeholder' and t.shape.is_fully_defined() and
            t.dtype not in (tf.resource, tf.variant, tf.string))

  def StoredSpecs(self):
    """TensorSpecs of the stored activations as stored, `stored` order."""
    specs = []
    for name, manual in zip(self.stored, self._stored_manual):
      t = self._graph.get_tensor_by_name(name)
      shape = t.shape
      if manual:  # [S, ...]: see ManualBoundary.
        shape = tf.TensorShape([self._boundary.num_stages]).concatenate(shape)
      specs.append(tf.TensorSpec(shape, t.dtype))
    return specs

  def _InputMap(self, theta, state, inputs_t, captures):
    values = {}
    for key, flat in (('theta', tf.nest.flatten(theta)),
                      ('state', tf.nest.flatten(state)),
                      ('inputs', tf.nest.flatten(inputs_t)),
                      ('captures', captures)):
      for ph, value in zip(self._groups[key], flat):
        values[ph.name] = value
    return values

  def Forward(self, theta, state, inputs_t, captures, with_stored=True,
              with_extras=True):
    """One iteration: (new_state, extras, [stored activations]).

    `captures` are the values for `self.captures` (the same tensors, or
    stand-ins for them). with_stored=False: no stored activations (an
    empty list), for a loop that keeps none; with_extras=False: no extras
    (None), for a loop that only carries the state on.
    """
    extras_wanted = self._flat_extras if with_extras else []
    names = ([t.name for t in self._flat_new + extras_wanted] +
             (list(self.stored) if with_stored else []))
    input_map = self._InputMap(theta, state, inputs_t, captures)
    values = graph_import.Import(self._GraphDef(), input_map, names, 'cell',
                                 self._graph)
    n_state, n_extras = len(self._flat_new), len(extras_wanted)
    new_state = tf.nest.pack_sequence_as(self._structure[1],
                                         values[:n_state])
    extras = (tf.nest.pack_sequence_as(self.extras_spec,
                                       values[n_state:n_state + n_extras])
              if with_extras else None)
    stored = [self._boundary.Out(v) if manual else v
              for v, manual in zip(values[n_state + n_extras:],
                                   self._stored_manual)] if with_stored else []
    return new_state, extras, stored

  def Backward(self, theta, state, inputs_t, captures, new_state, d_state,
               d_extras, stored):
    """One iteration's gradients, with the stored activations substituted.

    Args:
      theta, state, inputs_t, captures: as for Forward.
      new_state: the state after the iteration (flat), as the forward
        pass computed it (None when built with keeps_new_state=False).
      d_state: the gradients of the differentiable new-state entries.
      d_extras: the gradients of the differentiable extras.
      stored: the forward pass's stored activations, in `stored` order.

    Returns:
      The gradients of the differentiable theta, state, inputs and captures
      entries (see `differentiable`), flat, in that order; a deferred
      weight gradient (DeferredDots) as the pair of its dot's operands.
    """
    _CheckNoStatefulRandomOps(self.forward_ops)
    self._BuildGradient()
    input_map = self._InputMap(theta, state, inputs_t, captures)
    for name, value in self._GradientReads(captures).items():
      input_map.setdefault(name, value)
    input_map.update(
        (ph.name, g) for ph, g in zip(self._d_state + self._d_extras,
                                      list(d_state) + list(d_extras)))
    input_map.update(
        (name, self._boundary.In(v) if manual else v)
        for name, v, manual in zip(self.stored, stored, self._stored_manual))
    input_map.update((name, new_state[i])
                     for name, i in self._new_state_views.items()
                     if name not in input_map)
    names = []
    for j, g in enumerate(self._grads):
      names.extend(self._deferred[j].operands if j in self._deferred else
                   [g.name])
    values = graph_import.Import(self._GraphDef(), input_map, names,
                                 'cell_grad', self._graph)
    grads = []
    for j in range(len(self._grads)):
      n = 2 if j in self._deferred else 1
      grads.append(tuple(values[:n]) if n == 2 else values[0])
      values = values[n:]
    return grads

  def _GradientReads(self, captures):
    """Values for the reads of a variable read outside that only the
    gradient part makes (a recomputing gradient reads the global step
    again, say): the value the forward's reads are fed. Unfed, they would
    read the handle's stand-in."""
    fed = {}
    for handle, i in self._read_outside.items():
      for op in self._graph.get_tensor_by_name(handle).consumers():
        if op.type == 'ReadVariableOp':
          fed.setdefault(op.outputs[0].name, captures[i])
    return fed


# Stateful random ops draw anew each time they run. (Their stateless
# counterparts, tf.random.stateless_*, compute from a seed tensor.)
STATEFUL_RANDOM_OPS = frozenset([
    'RandomUniform', 'RandomUniformInt', 'RandomStandardNormal',
    'TruncatedNormal', 'ParameterizedTruncatedNormal', 'Multinomial',
    'RandomGamma', 'RandomPoisson', 'RandomPoissonV2', 'RandomShuffle',
    'StatefulUniform', 'StatefulUniformInt', 'StatefulUniformFullInt',
    'StatefulStandardNormal', 'StatefulStandardNormalV2',
    'StatefulTruncatedNormal', 'StatefulRandomBinomial', 'RngSkip',
    'RngReadAndSkip'
])

# Ops that read a variable without changing it.
_VARIABLE_READS = frozenset([
    'ReadVariableOp', 'ResourceGather', 'ResourceGatherNd', 'VariableShape',
    'VarIsInitializedOp'
])


def _OperandLimit(defer_weight_dots, split_weight_dots):
  """deferred_dots.Find's max_operands_per_gradient for the cell's weight
  gradients (None: any size), or False: none returned as operands."""
  if split_weight_dots:
    return None
  return deferred_dots.MAX_OPERANDS_PER_GRADIENT if defer_weight_dots else False


def _CheckNoStatefulRandomOps(ops):
  """The backward pass recomputes the cell: it must draw what the forward
  pass drew, which a stateful random op does not."""
  found = sorted({op.type for op in ops if op.type in STATEFUL_RANDOM_OPS})
  if found:
    raise ValueError(
        'Recurrent cell_fn (for a PipelinedLayer: its body) draws random '
        f'numbers with stateful ops ({", ".join(found)}: e.g. '
        'tf.random.uniform, or dropout without a stateless seed). The '
        'backward pass recomputes each iteration and would draw other '
        'numbers than the forward pass did, so the gradients would be '
        'wrong. Use stateless random ops seeded per step (in Lingvo: '
        'layers.DeterministicDropoutLayer, attention\'s '
        'atten_dropout_deterministic=True; the pipeline gives every stage '
        'and microbatch its own step seed, see py_utils.GenerateStepSeedPair).')


def _CheckNoVariableWrites(ops):
  """Variables must not change inside the loops: the backward pass re-runs
  the cell (writing again), and ops whose results nothing reads are pruned
  (writing never)."""
  writes = sorted({op.type for op in ops if _WritesAVariable(op)})
  if writes:
    raise ValueError(
        'Recurrent cell_fn changes variables inside the loop '
        f'({", ".join(writes)}). Carry the value in the state instead and '
        'assign it after the loop (a PipelinedLayer does this for its '
        'body\'s non-trainable variables).')


def _WritesAVariable(op):
  if op.type in _VARIABLE_READS:
    return False
  return (any(t.dtype == tf.resource for t in op.inputs) and
          any(word in op.type for word in ('Assign', 'Scatter', 'Apply')))


def _WithVariablesReadOutside(captures):
  """(outer tensor, cell tensor) pairs the cell is fed with.

  A captured variable that the cell only reads is read once, outside the
  loops, and each read in the cell is fed that value: every iteration, and
  the backward pass, see the value the forward pass started with (a later
  assignment cannot reach the recomputation), and no resource handle needs
  to enter the loop bodies (where XLA could not compile the stand-in an
  imported handle needs).
  """
  pairs = []
  for outer, inner in captures:
    readers = inner.consumers()
    if (inner.dtype == tf.resource and readers and
        all(op.type == 'ReadVariableOp' for op in readers)):
      pairs.extend(
          (tf.raw_ops.ReadVariableOp(resource=outer, dtype=op.outputs[0].dtype),
           op.outputs[0]) for op in readers)
    else:
      pairs.append((outer, inner))
  return pairs


def _ReadOutsideIndex(flat_caps):
  """{variable handle in the cell: index of the capture its value is}."""
  index = {}
  for i, t in enumerate(flat_caps):
    if t.op.type == 'ReadVariableOp':
      index.setdefault(t.op.inputs[0].name, i)
  return index


def _CheckStaticShapes(flat_extras):
  for e in flat_extras:
    if not e.shape.is_fully_defined():
      raise ValueError(
          'Recurrent cell_fn extras must have static shapes; got '
          f'{tf.TensorSpec(e.shape, e.dtype)}.')


def _OpsNeededBy(tensors, ops):
  """Those of `ops` that computing `tensors` runs (tf.gradients also
  builds ops whose results it then drops, e.g. towards a stop_gradient)."""
  among = set(ops)
  needed, work = set(), [t.op for t in tensors]
  while work:
    op = work.pop()
    if op in needed or op not in among:
      continue
    needed.add(op)
    work.extend(t.op for t in op.inputs)
    work.extend(op.control_inputs)
  return [op for op in ops if op in needed]


def _ManualTensors(ops):
  """Names of `ops`' outputs inside a manual sharding region."""
  manual = set()
  for op in ops:  # Creation order is a topological order.
    if op.type == 'XlaSpmdFullToShardShape' or (
        op.type != 'XlaSpmdShardToFullShape' and
        any(t.name in manual for t in op.inputs)):
      manual.update(t.name for t in op.outputs)
  return manual


def _ActivationsOf(sources, ops):
  """Names of the tensors among `ops`' outputs that depend on `sources`."""
  reached = {t.name for t in sources}
  for op in ops:  # Creation order is a topological order.
    if any(t.name in reached for t in op.inputs):
      reached.update(t.name for t in op.outputs)
  return reached
