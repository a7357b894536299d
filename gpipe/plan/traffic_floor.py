"""The least a step must send over each mesh axis: the floor the planner's
measured collectives are set against.

Derived from the model's shapes (a `ModelShape`, of the numbers the model
gives), the schedule and the mesh, in bytes one chip sends in one step, by the
same ring algorithms the measured figures use (gpipe.plan.collectives;
ring(n) = 2 (n - 1) / n for an all-reduce over n devices). With S stages,
M microbatches, R circular repeats, a mesh of D data and P model devices,
and A = one microbatch's boundary activation on one chip (rows / M / D x
the elements of a row x their bytes):

    stage   2 M R A: every stage call sends its output to the next stage
            once and its input gradient to the previous one once.
    model   (2 k + k') x M R x ring(P) x A': a Megatron-style body
            reduces k activations of a call's size over the model axis in
            its forward pass (k = 2 a Transformer block: after the
            attention and after the feed-forward layer), in the compute
            dtype (A'), and as many input gradients in the backward pass;
            a recomputed forward k' more: k - 1 (the call's last reduction
            feeds only its output, which its backward does not read), the
            model's own count under 'save_checkpoints' (a block recomputed
            from its stored input: 1 each), none where the remat policy
            stores the dots. Plus e x M x
            ring(P) x A' for the pipeline's ends: an embedding lookup in a
            table split by vocab over the model axis reduces its rows, a
            loss scoring with it reduces its input's gradient (e = 2). The
            recomputed forward's k' is a part of its own (RECOMPUTED): the
            floor without it (Floor.without_recompute) is what the model
            needs whatever it stores, and the gap what recomputing costs.
    data    ring(D) x the chip's gradients (in the weights' own dtype):
            one reduction a step.
    tables  a vocab-sized table a chip needs E elements of, kept split
            over the n devices of the axes it is gathered over, gathered
            once in the dtype the model gathers it in (b bytes):
            (n - 1) / n x E x b on those axes; and its gradient, in the
            dtype the model sums it in (g bytes), summed over the r
            devices whose gradients differ (the axes it is summed over, of
            those: the stages, each differentiating its own copy, but not
            a model axis whose devices compute the same copy's gradient)
            into each chip's E / n: (r - 1) x E / n x g on those axes (a
            reduce-scatter where r = n). A weight kept whole over the
            axes instead (a bias) costs as much: its gradient's all-reduce
            is a reduce-scatter and a gather. (Moving the tokens'
            activations to the table's slices instead costs tokens x width
            against vocab x width; the table is the smaller for the LMs
            here.)

The dtypes are the model's: what it casts a table to before gathering it,
what its gradients are summed in (a floor in another dtype than the step's
is no bound: a step sending bfloat16 where the floor counts float32 would
seem to beat it). A step sending less than LEAST_RATIO of a floor is the
planner's error (a floor part the step does not need, or a collective
missed), which the report lists as a problem. A collective the floor has
no part for (e.g. a scalar's all-reduce over an axis with no floor) is
still counted where it runs.
"""

import dataclasses

# Sent / floor under this is the planner's error, not a step that beats
# its floor (the report's problems; a ratio just under 1 is a floor's
# rounding, e.g. a scalar's bytes left out).
LEAST_RATIO = 0.95
# The model floor's part of the recomputed forward (Floor.without_recompute).
RECOMPUTED = 'the recomputed forward\'s reductions'


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """What a model's least traffic depends on.

  Attributes:
    rows: the stack's input rows (sequences) a step.
    row_elements: elements of one row's activation between stages
      (tokens x width).
    activation_bytes: bytes per element between stages (the stack's dtype).
    model_reductions: per stage-repeat call and forward pass, how many
      activations of the call's size the body reduces over the model axis
      (2 per Transformer block); None: not known (no model-axis floor).
    compute_bytes: bytes per element of those reductions (the body's
      compute dtype).
    axis_roles: {'stage' | 'data' | 'model': mesh axis}.
    tables: ((elements a chip gathers, the mesh axes it gathers them
      over, bytes per element gathered, the mesh axes its gradient is
      summed over (of those), bytes per element of its gradient), ...)
      of its vocab-sized tables (embeddings, softmax), in the dtypes the
      model gathers and sums them in.
    end_reductions: per microbatch, activations of its size the
      pipeline's ends reduce over the model axis (see the module).
    checkpoint_reductions: per stage-repeat call, reductions the body's
      backward runs again under remat_policy 'save_checkpoints'; None:
      as under 'recompute'.
  """
  rows: int
  row_elements: int
  activation_bytes: int
  model_reductions: int = None
  compute_bytes: int = 4
  axis_roles: dict = dataclasses.field(default_factory=lambda: {'stage': 0})
  tables: tuple = ()
  end_reductions: int = 0
  checkpoint_reductions: int = None

  def AxisNames(self, rank):
    """A name per mesh axis: its role, or 'axis k'."""
    by_axis = {a: role for role, a in self.axis_roles.items()}
    return tuple(by_axis.get(a, f'axis {a}') for a in range(rank))


def _Ring(n):
  return 2.0 * (n - 1) / n if n > 1 else 0.0


# The layout each floor assumes, named where the report gives the floor.
LAYOUTS = {
    'stage': 'a pipeline: a call\'s output handed on once, its gradient '
             'back once',
    'model': 'Megatron-style tensor parallelism: a block\'s activations '
             'reduced after attention and feed-forward',
    'data': 'data parallelism: the gradients reduced once a step (an FSDP '
            'layout\'s weight gathers are not in it)',
    'tables': 'vocab-sized tables gathered once, their gradients summed '
              'into each share',
}


@dataclasses.dataclass(frozen=True)
class Floor:
  """The floor of one set of mesh axes: its parts, bytes per chip a step,
  and the layouts it assumes (LAYOUTS' keys)."""
  axes: str  # as gpipe.plan.collectives.AxisName names them
  parts: dict  # {what: bytes}
  layouts: tuple = ()

  @property
  def layout(self):
    """What the floor assumes, said: LAYOUTS of its layouts, '; '."""
    return '; '.join(LAYOUTS[k] for k in self.layouts)

  @property
  def bytes(self):
    return sum(self.parts.values())

  @property
  def without_recompute(self):
    """The floor were nothing recomputed: its parts but RECOMPUTED."""
    return sum(b for what, b in self.parts.items() if what != RECOMPUTED)


def Floors(shape, schedule, mesh_shape, remat_policy, gradient_bytes):
  """[Floor] per set of axes the model must use, see the module docstring.

  Args:
    shape: the ModelShape.
    schedule: the gpipe.schedule.Schedule.
    mesh_shape: the device mesh ((N,) for shard_stages_1d).
    remat_policy: the candidate's ('save_dots', 'save_all': no recomputed
      forward on the model axis).
    gradient_bytes: bytes of trainable gradients one chip holds.
  """
  roles = shape.axis_roles
  size = lambda role: mesh_shape[roles[role]] if role in roles else 1
  names = shape.AxisNames(len(mesh_shape))
  m, r = schedule.num_microbatches, schedule.circular_repeat
  elements = shape.rows / m / size('data') * shape.row_elements
  floors = []
  if size('stage') > 1:
    floors.append(Floor(names[roles['stage']], {
        'activations and their gradients, stage to stage':
            2 * m * r * elements * shape.activation_bytes}, ('stage',)))
  if size('model') > 1 and shape.model_reductions is not None:
    one = _Ring(size('model')) * elements * shape.compute_bytes
    floors.append(Floor(names[roles['model']],
                        _ModelParts(shape, remat_policy, m, r, one),
                        ('model',)))
  if size('data') > 1:
    floors.append(Floor(names[roles['data']], {
        'one gradient reduction': _Ring(size('data')) * gradient_bytes},
                        ('data',)))
  for table in shape.tables:
    floors += _TableFloors(table, mesh_shape, names)
  return _Merged(floors)


def _ModelParts(shape, remat_policy, m, r, one):
  """The model axis's floor by part; `one`: a reduction's bytes."""
  k = shape.model_reductions
  again = max(k - 1, 0)
  if remat_policy in ('save_dots', 'save_all'):
    again = 0
  elif (remat_policy == 'save_checkpoints' and
        shape.checkpoint_reductions is not None):
    again = shape.checkpoint_reductions
  parts = {'the body\'s reductions': 2 * k * m * r * one}
  if again:
    parts[RECOMPUTED] = again * m * r * one
  if shape.end_reductions:
    parts['the ends\' reductions'] = shape.end_reductions * m * one
  return parts


def _TableFloors(table, mesh_shape, names):
  """A table's floors: its gather on the axes it is gathered over, its
  gradient's sum on those it is summed over (see the module).

  Raises:
    ValueError: it is summed over an axis it is not gathered over (the
      devices summing would not each end with a share of their own).
  """
  elements, gathered, nbytes, summed, gradient_bytes = table
  if not set(summed) <= set(gathered):
    raise ValueError(
        f'A table of {elements} elements a chip is summed over mesh axes '
        f'{tuple(summed)}, not all among those it is gathered over '
        f'{tuple(gathered)}: a floor knows no such layout.')
  floors = []
  n, axes = _Devices(gathered, mesh_shape, names)
  if n > 1:
    floors.append(Floor(axes, {
        'tables gathered': (n - 1) / n * elements * nbytes}, ('tables',)))
  sums, axes = _Devices(summed, mesh_shape, names)
  if sums > 1:
    floors.append(Floor(axes, {
        'tables\' gradients summed':
            (sums - 1) * elements / n * gradient_bytes}, ('tables',)))
  return floors


def _Devices(axes, mesh_shape, names):
  """(devices, name) of the mesh axes `axes` (those of one device left
  out): how many devices they span, and the floor's name for them."""
  axes = sorted(a for a in set(axes) if mesh_shape[a] > 1)
  n = 1
  for a in axes:
    n *= mesh_shape[a]
  return n, '+'.join(names[a] for a in axes)


def _Merged(floors):
  """Floors of the same axes as one (parts of the same name added)."""
  merged, layouts = {}, {}
  for f in floors:
    parts = merged.setdefault(f.axes, {})
    for what, nbytes in f.parts.items():
      parts[what] = parts.get(what, 0.0) + nbytes
    layouts[f.axes] = tuple(dict.fromkeys(layouts.get(f.axes, ()) +
                                          f.layouts))
  return [Floor(axes, parts, layouts[axes]) for axes, parts in merged.items()]


def Ratios(per_axis, floors):
  """{axes: (sent, its Floor or None)} over every axes name either has."""
  sent = {axes: sum(kinds.values()) for axes, kinds in per_axis.items()}
  floor = {f.axes: f for f in floors}
  return {axes: (sent.get(axes, 0.0), floor.get(axes))
          for axes in sorted(set(sent) | set(floor))}


def UnderFloor(per_axis, floors):
  """[(axes, sent, floor bytes)] where the step sends less than
  LEAST_RATIO of the floor: the planner's error (see the module)."""
  return [(axes, sent, f.bytes)
          for axes, (sent, f) in Ratios(per_axis, floors).items()
          if f and f.bytes and sent < LEAST_RATIO * f.bytes]


def ShapeOf(step, stage_axis):
  """The ModelShape of a planned step (a gpipe.model_step.train_step.TrainStep):
  from its task's own numbers (a `TrafficShape(input_specs)` method giving
  {ModelShape field: value}: the model says, the planner builds), or for a
  bare pipelined layer its inputs' rows and elements (no model axis known);
  None for a task that does not say."""
  from gpipe import layers  # pylint: disable=g-import-not-at-top
  root = step.root
  if hasattr(root, 'TrafficShape'):
    return ModelShape(**root.TrafficShape(step.input_specs))
  if not isinstance(root, layers.PipelinedLayer):
    return None
  specs = [a.spec for a in step.input_args]
  return ModelShape(
      rows=specs[0].shape[0],
      row_elements=sum(s.shape[1:].num_elements() for s in specs),
      activation_bytes=specs[0].dtype.size,
      axis_roles={'stage': stage_axis})
