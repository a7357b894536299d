"""The 1f1b gradient loop: a forward and a backward wave per iteration.

gpipe.pipeline.one_f_one_b says what the waves do; gpipe.schedule.OneFOneB
has the picture and the arithmetic (which call each stage's backward wave
differentiates, and where its input waits in the ring). Per iteration j:

    forward wave    iteration.Iterate on the cell's forward (cell.BoundCell):
                    the forward loop's iteration j again; each stage's
                    input (and what the remat policy keeps) pushed into its
                    ring at the row's ring_index (OneFOneB.ForwardWaveRows)
    backward wave   each stage's output gradient: the layer's (the io
                    reads it) where its call is the last layer's, else the
                    one the next stage handed back (rotation.RotateStages
                    by -1); the cell's gradient at the ring entry; the
                    input gradient handed back (d_buffer) or, for the first
                    layer, written by the io

What the loop carries, with shapes: GradientCarry.

Non-trainable values take no gradient: a body's updates of them go
through `assign`, which cuts the gradient (gpipe.pipeline.non_trainable_vars).

With a LastStageLoss (gpipe.pipeline.stage_ends) the loop is the
whole pass (`RunWithLoss`): no output gradient comes in, the last stage's
call scores its microbatch inside the cell and is differentiated from
that, and the forward wave also sums what the forward loop would have
returned: the loss's sums and the body's summaries over the iterations
(GradientCarry.loss, .summaries).
"""

import dataclasses
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from gpipe.loops import cell_graph
from gpipe.loops import made_after
from gpipe.loops import while_loops
from gpipe.pipeline.one_f_one_b import cell as cell_lib
from gpipe.pipeline.one_f_one_b import per_stage_entries
from gpipe.pipeline.one_f_one_b import rings
from gpipe.pipeline import iteration
from gpipe.pipeline import rotation
from gpipe import schedule as schedule_lib
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap


class GradientLoop:
  """The gradient of one forward loop (forward_loop.ForwardLoop), or with
  a LastStageLoss the whole pass."""

  def __init__(self, cell, io, theta, held, state_leaves, var_values,
               captures, loss=None):
    self._loss = loss
    self._cell = cell
    self._graph = cell.graph
    self._io = io
    self._place = cell.spec.placement
    self._waves = schedule_lib.OneFOneB(cell.spec.schedule)
    # The forward wave's hand-off, and the backward wave's: each stage's
    # input gradient to the stage before it, with the same hop.
    self._handoff = rotation.HandoffFor(cell.spec.schedule, self._place)
    self._handoff_back = rotation.HandoffFor(cell.spec.schedule, self._place,
                                             shift=-1)
    self._forward_tables = iteration.Tables(self._waves.ForwardWaveRows())
    self._backward_tables = iteration.Tables(self._waves.BackwardRows())
    self._theta = theta
    self._held = held
    self._states = [self._place.SplitStages(x, 1) for x in state_leaves]
    self._num_vars = len(tf.nest.flatten(var_values))
    self._var_values = [self._place.SplitStages(v) for v in var_values]
    self._captures = captures
    place = self._place
    entry = lambda x: tf.TensorSpec(x.shape, x.dtype)
    size = self._waves.ring_size
    self._per_stage = per_stage_entries.EntriesFor(
        place, cell.spec.runner.manual_mesh)
    ring = lambda spec: rings.Ring(spec, size, place,
                                         cell.spec.ring_split_mesh_dim)
    self._rings = NestedMap(
        buffer=[ring(entry(x)) for x in cell.state0.buffer],
        vars=[ring(entry(x)) for x in self._var_values],
        stored=[ring(s) for s in self._graph.StoredSpecs()])

  def Gradients(self, d):
    """Gradients of the forward loop's arguments, flat: theta, held
    inputs, state leaves, non-trainable values (None), captures."""
    carry = self._Start(d)
    consts = NestedMap(
        d_aux=d.aux,
        d_summaries=tf.nest.map_structure(
            lambda x: _ByStage(x, self._place), d.summaries),
        d_states=[_ByStage(x, self._place) for x in d.states],
        states=[_ByStage(x, self._place) for x in self._states])
    for phase in self._waves.Phases():
      carry = self._WavesLoop(phase, carry, consts)
    return self._Finish(carry)

  def RunWithLoss(self):
    """The whole pass with a LastStageLoss: (NestedMap(loss: its sums,
    summaries: {name: (value x weight [S], weight [S])} summed over the
    iterations, vars), the gradients of its differentiated sum, flat as
    Gradients'."""
    extras = self._graph.extras_spec
    zeros = lambda spec: tf.zeros(spec.shape, spec.dtype)
    carry = self._Start(NestedMap(outputs=None, aux=None)).With(
        # Per stage [S], summed after the loop: a loop-carried scalar is
        # what the partitioner tends to give the cell's manual sharding.
        loss=extras.loss.Transform(
            lambda s: self._place.SplitStages(zeros(s))),
        summaries=tf.nest.map_structure(zeros, extras.summaries))
    t = self._waves.schedule.num_iterations
    num_stages = self._waves.schedule.num_stages
    consts = NestedMap(
        d_aux=tf.zeros([], tf.float32),
        d_summaries=tf.nest.map_structure(
            lambda _: self._place.SplitStages(
                tf.zeros([num_stages, t], tf.float32), 0),
            extras.summaries),
        d_states=[], states=[],
        d_loss=NestedMap({k: self._place.SplitStages(tf.fill(
            [num_stages], float(k == self._loss.differentiated)))
                          for k in extras.loss}))
    for phase in self._waves.Phases():
      carry = self._WavesLoop(phase, carry, consts)
    return (NestedMap(loss=carry.loss.Transform(tf.reduce_sum),
                      summaries=carry.summaries, vars=carry.vars),
            self._Finish(carry))

  def _Start(self, d):
    diff = self._graph.differentiable
    flat_theta = tf.nest.flatten(self._theta)
    filler = self._cell.state0.buffer
    after = [] if d.aux is None else [d.aux]
    return GradientCarry(
        buffer=self._handoff.Start(filler), vars=self._var_values,
        reading=self._io.StartReading(self._held),
        rings=tf.nest.map_structure(lambda r: r.Empty(), self._rings),
        d_buffer=self._handoff_back.Start(
            [tf.zeros_like(x) for x in filler]),
        d_reading=([] if d.outputs is None else
                   self._io.StartReadingGradients(d.outputs)),
        d_writing=self._io.StartWritingGradients(filler),
        d_theta=[made_after.ZerosAfter(flat_theta[i], after)
                 for i in diff['theta']],
        d_captures=[tf.zeros(self._captures[i].shape,
                             _Accumulated(self._captures[i].dtype))
                    for i in diff['captures']],
        d_states=[tf.zeros_like(_ByStage(self._states[i], self._place))
                  for i in self._DiffStateInputs()])

  def _DiffStateInputs(self):
    """Indices of the per-stage state leaves that take gradients (the
    cell's differentiable inputs are its row's fields, then the states)."""
    num_fields = len(tf.nest.flatten(cell_lib.CellFields(self._cell.tables)))
    return [i - num_fields for i in self._graph.differentiable['inputs']]

  def _WavesLoop(self, phase, carry, consts):
    """The phase's iterations as one loop: the carry after them.

    The loop carries only what its waves change; what it only reads (the
    rings in the backward phase) it captures. (A constant carried
    unchanged through three consecutive loops makes TensorFlow 2.21's
    tf2xla abort: 'Cannot find body function ..._const_0'.)
    """
    keys = ((FORWARD_WAVE if 'forward' in phase.waves else ()) +
            (FORWARD_SUMS if 'forward' in phase.waves and self._loss else ()) +
            (BACKWARD_WAVE if 'backward' in phase.waves else ()))

    def Body(j, changing):
      full = carry.With(**changing)
      if 'forward' in phase.waves:
        full = self._ForwardWave(j, full)
      if 'backward' in phase.waves:
        full = self._BackwardWave(j, full, consts)
      return j + 1, full.Fields(keys)

    _, changed = while_loops.WhileLoop(
        Body, [tf.constant(phase.begin), carry.Fields(keys)],
        phase.end - phase.begin)
    return carry.With(**changed)

  def _ForwardWave(self, j, carry):
    """Iteration j of the forward loop again, its stage inputs (and what
    the policy keeps) pushed into the rings at the row's ring_index."""
    row = iteration.RowAt(self._forward_tables, j, self._place)  # [S] a field
    iterated = iteration.Iterate(
        self._cell.Bind(self._theta, self._captures,
                        with_extras=self._loss is not None, with_stored=True),
        self._io, self._handoff, row, self._held,
        carry.buffer, carry.vars, carry.reading,
        stage_states=[x[j] for x in self._states])
    done = iterated.done
    index = row.ring_index[0]  # the same entry for every stage
    # Each ring entry [S, ...]: stage s's input (and what the policy keeps).
    entries = NestedMap(buffer=iterated.stage_in, vars=carry.vars,
                        stored=done.stored)
    changed = dict(
        rings=tf.nest.map_structure(
            lambda r, ring, e: r.Write(ring, index, e),
            self._rings, carry.rings, entries),
        buffer=iterated.buffer,  # the hand-off's carry
        vars=done.vars,  # [S, (R,) ...] per variable
        reading=iterated.reading)
    if self._loss is not None:
      changed.update(
          loss=tf.nest.map_structure(
              lambda total, s: self._place.SplitStages(total + s),
              carry.loss, done.losses),
          summaries=tf.nest.map_structure(
              lambda total, s: total + s, carry.summaries, done.summaries))
    return carry.With(**changed)

  def _BackwardWave(self, j, carry, consts):
    """Each stage differentiates the call schedule.OneFOneB gives it."""
    place = self._place
    per_stage = place.SplitStages
    row = iteration.RowAt(self._backward_tables, j - self._waves.delay,
                          place)  # [S] per field
    indices = per_stage(row.ring_index)  # [S]: each stage's own
    # Each entry [S, ...]: the input (and what the policy kept) of the call
    # each stage differentiates.
    entries = tf.nest.map_structure(lambda r, ring: r.Read(ring, indices),
                                    self._rings, carry.rings)
    if self._loss is None:  # d_out: [S or 1, mb, ...] per leaf
      d_out, d_reading = self._io.ReadGradient(carry.d_reading, row)
    else:  # the last layer's output gradient is the loss's, in the cell
      d_out, d_reading = [tf.zeros_like(b) for b in carry.d_buffer], []
    last = per_stage(row.last_layer)  # [S] bools
    # dy [S, mb, ...] per leaf: the layer's output gradient where a stage's
    # call is the last layer's, else the one the next stage handed back.
    dy = [per_stage(tf.where(_Mask(last, o), o, b)) for o, b in
          zip(d_out, self._handoff_back.Ready(carry.d_buffer))]
    at = per_stage(row.iteration)  # [S]: the forward iteration of the call
    grads = self._Differentiate(row, at, entries, dy, consts)
    first = per_stage(row.first_layer)  # [S] bools
    return carry.With(
        d_reading=d_reading,
        d_writing=self._io.WriteGradient(carry.d_writing, row, grads.d_x),
        # [S, mb, ...] per leaf, handed one stage back.
        d_buffer=self._handoff_back.Next(carry.d_buffer, [
            per_stage(tf.where(_Mask(first, x), tf.zeros_like(x), x))
            for x in grads.d_x]),
        d_theta=[a + g for a, g in zip(carry.d_theta, grads.theta)],
        d_captures=[a + tf.cast(g, a.dtype)
                    for a, g in zip(carry.d_captures, grads.captures)],
        d_states=[self._per_stage.Add(a, at, g)
                  for a, g in zip(carry.d_states, grads.states)])

  def _Differentiate(self, row, at, entries, dy, consts):
    """The cell's gradient for each stage's call: NestedMap(d_x per buffer
    leaf, theta, states, captures) of the differentiable entries."""
    graph = self._graph
    diff = graph.differentiable
    read = lambda x: self._per_stage.Read(x, at)
    state = NestedMap(buffer=entries.buffer, vars=entries.vars)
    flat_state = tf.nest.flatten(state)
    num_buffer = len(entries.buffer)
    d_state = [dy[i] if i < num_buffer else tf.zeros_like(flat_state[i])
               for i in diff['state']]
    num_stages = at.shape.as_list()[0]
    d_extras = NestedMap(
        aux=tf.fill([num_stages], consts.d_aux),
        summaries=tf.nest.map_structure(read, consts.d_summaries),
        states=[read(x) for x in consts.d_states],
        loss=consts.get('d_loss', NestedMap()))
    flat_d_extras = [
        g for g, s in zip(tf.nest.flatten(d_extras),
                          tf.nest.flatten(graph.extras_spec))
        if cell_graph.IsDifferentiable(s)]
    inputs = NestedMap(row=cell_lib.CellFields(row),
                       states=[read(x) for x in consts.states])
    grads = graph.Backward(
        tf.nest.flatten(self._theta), flat_state, tf.nest.flatten(inputs),
        self._captures, None, d_state, flat_d_extras, entries.stored)
    sizes = [len(diff[k]) for k in ('theta', 'state', 'inputs')]
    g_theta, rest = grads[:sizes[0]], grads[sizes[0]:]
    g_state, rest = rest[:sizes[1]], rest[sizes[1]:]
    g_inputs, g_captures = rest[:sizes[2]], rest[sizes[2]:]
    d_x = [tf.zeros_like(x) for x in entries.buffer]
    for i, g in zip(diff['state'], g_state):
      if i < num_buffer:
        d_x[i] = g
    return NestedMap(d_x=d_x, theta=g_theta, states=g_inputs,
                     captures=g_captures)

  def _Finish(self, carry):
    graph, place = self._graph, self._place
    diff = graph.differentiable
    flat_theta = tf.nest.flatten(self._theta)
    d_theta = [None] * len(flat_theta)
    for i, g in zip(diff['theta'], carry.d_theta):
      d_theta[i] = g
    d_held = [
        g if cell_graph.IsDifferentiable(x) else None for g, x in zip(
            self._io.FinishWritingGradients(carry.d_writing,
                                            self._cell.state0.buffer),
            self._held)]
    d_states = [None] * len(self._states)
    for i, g in zip(self._DiffStateInputs(), carry.d_states):
      d_states[i] = _ByIteration(g, place)
    return (d_theta + d_held + d_states + [None] * self._num_vars +
            list(carry.d_captures))


@dataclasses.dataclass(frozen=True)
class GradientCarry:
  """What the gradient loop carries. A phase's loop carries the fields its
  waves change (FORWARD_WAVE, BACKWARD_WAVE, FORWARD_SUMS) and reads the
  others. Lists hold a tensor per leaf.

  Attributes:
    buffer: the forward wave's buffer, the hand-off's carry: [S, mb, ...]
      per buffer leaf (delayed sends: twice).
    vars: [S, (R,) ...] per non-trainable variable: the forward wave's.
    reading: the io's input state: [] (whole), [K, S, mb, ...] (streamed).
    rings: NestedMap(buffer, vars, stored) of [S, ring_size, ...] rings
      (gpipe.pipeline.one_f_one_b.rings; split further over
      ring_split_mesh_dim where asked).
    d_buffer: the backward hand-off's carry, [S, mb, ...] per buffer leaf:
      each stage's input gradient of the iteration before, handed one
      stage back (delayed sends: of the one before that, and those in
      flight).
    d_reading: the output gradients the io reads: [M, S or 1, mb, ...]
      (whole), [K, S, mb, ...] (streamed); [] with a LastStageLoss.
    d_writing: the input gradients the io writes: TensorLists of M + 1
      entries [S or 1, mb, ...] (whole), [K, S, mb, ...] (streamed), []
      (made at stage 0).
    d_theta: the differentiable weights' gradients, [S, (R,) ...] each.
    d_captures: the differentiable captures' gradients, each its capture's
      shape (16-bit floats summed in float32: _Accumulated).
    d_states: [S, T, ...] per differentiable per-stage state leaf.
    loss: with a LastStageLoss, its sums per stage, [S] per name.
    summaries: with a LastStageLoss, {name: (value x weight [S], weight
      [S])} summed over the iterations.
  """
  buffer: List[tf.Tensor]
  vars: List[tf.Tensor]
  reading: List[tf.Tensor]
  rings: NestedMap
  d_buffer: List[tf.Tensor]
  d_reading: List[tf.Tensor]
  d_writing: List[tf.Tensor]
  d_theta: List[tf.Tensor]
  d_captures: List[tf.Tensor]
  d_states: List[tf.Tensor]
  loss: Optional[NestedMap] = None
  summaries: Optional[Dict[str, Tuple[tf.Tensor, tf.Tensor]]] = None

  def Fields(self, names) -> NestedMap:
    """The named fields, as a loop's carry."""
    return NestedMap({n: getattr(self, n) for n in names})

  def With(self, **changed) -> 'GradientCarry':
    return dataclasses.replace(self, **changed)


# What each wave changes of the carry (with a LastStageLoss: and what the
# forward wave sums; no output gradient is read).
FORWARD_WAVE = ('buffer', 'vars', 'reading', 'rings')
BACKWARD_WAVE = ('d_buffer', 'd_reading', 'd_writing', 'd_theta',
                 'd_captures', 'd_states')
FORWARD_SUMS = ('loss', 'summaries')


def _Mask(flags, like):
  """[S] bools -> [S, 1, ...] against `like`."""
  return tf.reshape(flags, [-1] + [1] * (like.shape.rank - 1))


def _Accumulated(dtype):
  """The dtype a captured tensor's gradient is summed in over the
  iterations: float32 for a 16-bit float (a weight cast to bfloat16
  before the loop, say: each iteration's gradient is bfloat16, their sum
  is kept, and leaves the loop, in float32)."""
  return tf.float32 if dtype in (tf.bfloat16, tf.float16) else dtype


def _ByStage(x, place):
  """[T, S, ...] -> [S, T, ...], stage dim split: entries a stage reads."""
  perm = [1, 0] + list(range(2, x.shape.rank))
  return place.SplitStages(tf.transpose(x, perm), 0)


def _ByIteration(x, place):
  """[S, T, ...] -> [T, S, ...], stage dim split."""
  perm = [1, 0] + list(range(2, x.shape.rank))
  return place.SplitStages(tf.transpose(x, perm), 1)
