"""Reading a compiled, partitioned module's HLO text.

What XLA's SPMD partitioner made of a step is read off the per-device
module's text (`gpipe.xla.partitioning` gets it from jaxlib): its computations,
its while loops (which body each runs, the trip count XLA knows, the op
name the loop came from), its collectives (kind, result type, the loop they
run in, the device groups taking part and the mesh axes those span), the
largest buffers it makes, and the TensorFlow op names its instructions'
metadata gives. Plain text parsing: needs neither TensorFlow nor jax.
"""

import dataclasses
import re

import numpy as np

from gpipe.xla import spmd_worker
from gpipe.xla import widening

COLLECTIVE_KINDS = ('collective-permute', 'all-gather', 'all-reduce',
                    'all-to-all', 'reduce-scatter', 'collective-broadcast')


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of the partitioned per-device module."""
  kind: str
  shape: str  # its result type, e.g. 'f32[1,2,8]{2,1,0}'
  computation: str
  loop: int  # index into PartitionedRun.loops, or -1 outside every loop
  op_name: str = ''  # the TensorFlow op it was partitioned from
  # The devices that take part together: replica groups (all-reduce,
  # all-gather, ...) or (source, target) pairs (collective-permute).
  groups: tuple = ()
  # Per element of the result: widened by XLA:CPU from bfloat16 (see
  # `wire_bytes`); () for none.
  widened: tuple = ()
  # How often it runs per iteration of its loop (outside the loops: per
  # step): the product of the trip counts of the loops nested in that loop
  # that it runs in (1 in none); None where XLA knows no trip count of one.
  runs: int = 1
  name: str = ''  # its instruction's name in `computation`

  @property
  def bytes(self):
    """Bytes of its result (a tuple result: all elements), on one device."""
    return TypeBytes(self.shape)

  @property
  def wire_bytes(self):
    """Bytes of its result in the dtype XLA's SPMD partitioner gave it.

    XLA:CPU moves no bfloat16: after partitioning, its passes widen
    bfloat16 collectives to float32, converting on the way in and
    narrowing back on the way out, which doubles the bytes a TPU, moving
    bfloat16 natively, would send. A widened element
    (gpipe.xla.widening) counts at 16 bits here; a float32 the program
    itself sends, at 32.
    """
    return sum(size // 2 if widened else size for (_, size), widened in zip(
        _ElementBytes(self.shape),
        self.widened or [False] * len(_ElementBytes(self.shape))))

  @property
  def group_size(self):
    """Devices that take part together (a permute: 2, a sender and a
    receiver); 0 when the line names no groups."""
    if not self.groups:
      return 0
    return len(self.groups[0])

  def MeshAxes(self, mesh_shape):
    """The device-mesh axes it runs along: those on which the devices of
    a group (or a permute's source and target) differ, e.g. (0,) for the
    rotation over a [stages, model] mesh's stage axis. Naming no groups,
    it runs over every device: every axis of more than one."""
    if not self.groups:
      return tuple(a for a, n in enumerate(mesh_shape)
                   if n > 1 or len(mesh_shape) == 1)
    axes = set()
    for group in self.groups:
      coords = [np.unravel_index(d, mesh_shape) for d in group]
      for axis in range(len(mesh_shape)):
        if len({c[axis] for c in coords}) > 1:
          axes.add(axis)
    return tuple(sorted(axes))


def AxesName(axes, stage_axis=0):
  """'stage', 'axis 2', 'stage+axis 1', ...: mesh axes a collective runs
  along, the pipeline's stage axis by that name."""
  return '+'.join('stage' if a == stage_axis else f'axis {a}'
                  for a in axes) or 'all devices'


def KindOverAxes(collective, mesh_shape, stage_axis=0):
  """'collective-permute over stage', 'all-reduce over axis 2', ..."""
  axes = collective.MeshAxes(mesh_shape)
  return f'{collective.kind} over {AxesName(axes, stage_axis)}'


_COMPUTATION_RE = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$')
_INSTRUCTION_RE = re.compile(
    r'^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.*?)\s(?P<op>[a-z][a-z0-9\-]*)\(')
_CALLEE_RE = re.compile(
    r'\b(?:body|condition|to_apply|calls|true_computation|false_computation)'
    r'=%?([\w.\-]+)')
_BRANCHES_RE = re.compile(r'branch_computations=\{([^}]*)\}')
_GROUPS_RE = re.compile(
    r'(?:replica_groups|source_target_pairs)=(\{(?:\{[\d,]*\},?)*\}|'
    r'\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|'
    r"mesh\[[^\]]*\] \{[^}]*\})")
# A while instruction: its name and its operand (the initial tuple).
WHILE_RE = re.compile(r'^\s*%?([\w.\-]+)\s*=.*\swhile\(%?([\w.\-]+)\)')
# The body computation a while instruction names.
WHILE_BODY_RE = re.compile(r'\bbody=%?([\w.\-]+)')
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')


def DeviceGroups(line):
  """The device groups of a collective's HLO line, as tuples of ids.

  Reads both spellings: explicit `{{0,1},{2,3}}` (and a permute's
  `source_target_pairs`) and XLA's iota form `[2,2]<=[4]` or
  `[2,4]<=[4,2]T(1,0)` (iota over the bracketed dims, transposed, reshaped
  to [groups, size]) and the mesh-axes form
  `mesh['axis_0'=4,'axis_1'=2] {'axis_1'}` (_MeshAxesGroups).
  """
  match = _GROUPS_RE.search(line)
  if not match:
    return ()
  text = match.group(1)
  if text.startswith('mesh'):
    return _MeshAxesGroups(text)
  if text.startswith('{'):
    return tuple(tuple(int(d) for d in g.split(',') if d)
                 for g in re.findall(r'\{([\d,]*)\}', text[1:-1]))
  shape, dims, perm = re.match(
      r'\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', text).groups()
  ints = lambda t: [int(d) for d in t.split(',')]  # pylint: disable=g-long-lambda
  ids = np.arange(int(np.prod(ints(dims)))).reshape(ints(dims))
  if perm:
    ids = ids.transpose(ints(perm))
  return tuple(tuple(int(d) for d in g) for g in ids.reshape(ints(shape)))


def _MeshAxesGroups(text):
  """`mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_2'}` -> device groups:
  the devices (ids row-major over the named axes) that differ only along
  the axes in braces."""
  mesh, grouped = re.match(r"mesh\[([^\]]*)\] \{([^}]*)\}", text).groups()
  axes = re.findall(r"'([^']+)'=(\d+)", mesh)
  names = re.findall(r"'([^']+)'(:?)", grouped)
  if any(sub for _, sub in names) or len(axes) != mesh.count('='):
    raise ValueError(f'Replica groups {text!r}: sub-axes and device lists '
                     'are not read here; only whole axes of an iota mesh.')
  order = [n for n, _ in axes]
  inner = [order.index(n) for n, _ in names]
  outer = [a for a in range(len(axes)) if a not in inner]
  ids = np.arange(int(np.prod([int(s) for _, s in axes]))).reshape(
      [int(s) for _, s in axes]).transpose(outer + inner)
  size = int(np.prod([int(axes[a][1]) for a in inner]))
  return tuple(tuple(int(d) for d in g) for g in ids.reshape(-1, size))


def ParseComputations(hlo_text):
  """{computation name: [instruction lines]}, and the entry's name."""
  computations, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    if not line.startswith((' ', '\t')):
      match = _COMPUTATION_RE.match(line)
      if match:
        current = match.group(1)
        computations[current] = []
        if line.startswith('ENTRY'):
          entry = current
        continue
      if line.startswith('}'):
        current = None
      continue
    if current is not None:
      computations[current].append(line)
  return computations, entry


def ShapesOf(hlo_type):
  """'f32[1,8,8]{2,1,0}' -> [(1, 8, 8)]; a tuple type gives each element's."""
  return [
      tuple(int(d) for d in dims.split(',') if d)
      for dims in re.findall(r'[a-z]\w*\[([\d,]*)\]', hlo_type)
  ]


_DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2,
                'bf16': 2, 's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8,
                'f64': 8, 'c64': 8, 'c128': 16}


def _ElementBytes(hlo_type):
  """'(f32[2]{0}, bf16[3]{0})' -> [('f32', 8), ('bf16', 6)]."""
  elements = []
  for dtype, dims in re.findall(r'([a-z]\w*)\[([\d,]*)\]', hlo_type):
    count = 1
    for d in dims.split(','):
      if d:
        count *= int(d)
    elements.append((dtype, count * _DTYPE_BYTES.get(dtype, 4)))
  return elements


def TypeBytes(hlo_type):
  """'f32[1,8,8]{2,1,0}' -> 256; a tuple type: the sum of its elements."""
  return sum(size for _, size in _ElementBytes(hlo_type))


def Callees(line):
  """The computations an instruction's HLO line calls: a loop's body and
  condition, a fusion's, a reduction's, a conditional's branches."""
  names = _CALLEE_RE.findall(line)
  for group in _BRANCHES_RE.findall(line):
    names += [n.strip().lstrip('%') for n in group.split(',') if n.strip()]
  return names


def _Walk(computations, root, into_loops):
  """Computations reachable from `root`, and the while bodies on the way.

  With into_loops=False a while instruction is not entered: its body is
  listed, but neither it nor what it calls counts as reached.
  """
  reached, loops, todo = set(), [], [root]
  while todo:
    name = todo.pop()
    if name in reached or name not in computations:
      continue
    reached.add(name)
    for line in computations[name]:
      body = WHILE_BODY_RE.search(line)
      if body and ' while(' in line:
        loops.append(body.group(1))
        if not into_loops:
          continue
      todo.extend(Callees(line))
  return reached, loops


def GatheredTensors(collectives, shapes, mesh_shape=(), gathered_over=()):
  """All-gathers and all-to-alls that move a whole tensor of `shapes`.

  Judged by shape: the collective's result has one of the full shapes, or
  one without its leading stage (and repeat) dims, i.e. some device received
  data that another device owns. Activation shapes that happen to equal a
  weight's shape would be reported too. An all-gather over `gathered_over`
  alone (mesh axes of `mesh_shape` the weights are stored split over and
  gathered from for use: FSDP) is what that layout asks for, not reported.
  """
  suspects = set()
  for shape in shapes:
    shape = tuple(shape)
    suspects.update(shape[k:] for k in range(min(len(shape), 3)))
  return [
      c for c in collectives
      if c.kind in ('all-gather', 'all-to-all') and
      any(s in suspects for s in ShapesOf(c.shape)) and not (
          c.kind == 'all-gather' and gathered_over and
          set(c.MeshAxes(mesh_shape)) <= set(gathered_over))
  ]


def OpNameOf(line):
  """The TF op name an HLO instruction's metadata gives, or ''."""
  match = _OP_NAME_RE.search(line)
  return match.group(1) if match else ''


def LoopTripCounts(hlo_text):
  """{while body computation: iterations} (XLA's known_trip_count)."""
  trips = {}
  for line in hlo_text.splitlines():
    body = WHILE_BODY_RE.search(line)
    if body and ' while(' in line:
      trips[body.group(1)] = spmd_worker.TripCount(line)
  return trips


def OpNames(hlo_text, bodies):
  """The TensorFlow op name of each while loop (by body computation), as
  the HLO's metadata has it ('' where it has none)."""
  names = {}
  for line in hlo_text.splitlines():
    loop = WHILE_RE.match(line)
    if loop and ' while(' in line:
      op_name = OpNameOf(line)
      names[WHILE_BODY_RE.search(line).group(1)] = op_name
  return [names.get(body, '') for body in bodies]


_NOT_BUFFERS = ('parameter', 'get-tuple-element', 'tuple', 'bitcast', 'while',
                'call', 'conditional', 'constant')


# Instructions that update an operand in place (a loop's stacks and rings,
# written row by row): the buffer is their operand's, already counted.
_IN_PLACE = ('dynamic-update-slice', 'scatter')
_INSTRUCTION_NAME_RE = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=')


def _UpdatesInPlace(line, op):
  if op in _IN_PLACE:
    return True
  name = _INSTRUCTION_NAME_RE.match(line).group(1)
  return op == 'fusion' and any(f'{kind}_fusion' in name or
                                f'_{kind}' in name for kind in _IN_PLACE)


def LargestBuffers(hlo_text, count=5):
  """[(bytes, HLO type, TF op name)]: the largest arrays the module makes.

  One row per TF op (its largest result), biggest first; what fusions keep
  internal is not counted (it is never materialized), nor an in-place
  update of a buffer (a row written into a loop's stack: the stack is
  listed once, where it is made). A hint where the memory goes, not the
  live set at the peak.
  """
  computations, _ = ParseComputations(hlo_text)
  largest = {}
  for name, lines in computations.items():
    if name.startswith(('fused_', 'wrapped_')):
      continue
    for line in lines:
      match = _INSTRUCTION_RE.match(line)
      if (not match or match.group('op') in _NOT_BUFFERS or
          _UpdatesInPlace(line, match.group('op'))):
        continue
      op_name = _OP_NAME_RE.search(line)
      key = op_name.group(1) if op_name else match.group('type')
      nbytes = TypeBytes(match.group('type'))
      if nbytes > largest.get(key, (0,))[0]:
        largest[key] = (nbytes, match.group('type').split('{')[0], key)
  return sorted(largest.values(), reverse=True)[:count]


def AnalyzeHlo(hlo_text):
  """Finds the collectives of an HLO module and the loops they run in.

  Returns:
    (collectives, loops): a list of Collective, and the body computation
    names of the module's outermost while loops; Collective.loop indexes
    that list (-1: outside every loop). A nested loop is part of the loop
    that contains it: its collectives' `runs` count its trips.
  """
  computations, entry = ParseComputations(hlo_text)
  module = widening.Module(computations)
  reached, loops = _Walk(computations, entry, into_loops=False)
  owner, runs = {}, _Runs(computations, entry, reached)
  for index, body in enumerate(loops):
    reached, _ = _Walk(computations, body, into_loops=True)
    for name, count in _Runs(computations, body, reached).items():
      if name not in owner:
        owner[name], runs[name] = index, count

  collectives = []
  for name, lines in computations.items():
    for line in lines:
      match = _INSTRUCTION_RE.match(line)
      if not match:
        continue
      op = match.group('op')
      if op.endswith('-done'):
        continue
      kind = op[:-len('-start')] if op.endswith('-start') else op
      if kind in COLLECTIVE_KINDS:
        op_name = _OP_NAME_RE.search(line)
        collectives.append(
            Collective(kind=kind, shape=match.group('type'), computation=name,
                       loop=owner.get(name, -1),
                       op_name=op_name.group(1) if op_name else '',
                       groups=DeviceGroups(line),
                       widened=module.WidenedElements(name, line),
                       runs=runs.get(name, 1),
                       name=_INSTRUCTION_NAME_RE.match(line).group(1)))
  return collectives, loops


def _Runs(computations, root, reached):
  """{computation: how often it runs per run of `root`}, over `reached`
  (what a walk from root reaches): a while loop's body its trip count
  times per run of the computation holding the loop, any other callee
  once per call; None where a loop on the way has no known trip count."""
  callers = {}
  for name in reached:
    for line in computations[name]:
      body = WHILE_BODY_RE.search(line)
      body = body.group(1) if body and ' while(' in line else None
      for callee in Callees(line):
        if callee in reached and callee != root:
          factor = KnownTripCount(line) if callee == body else 1
          callers.setdefault(callee, []).append((name, factor))
  runs = {root: 1}

  def Runs(name):
    if name not in runs:
      runs[name] = 0  # while it is being counted (HLO calls no cycles)
      counts = [(Runs(caller), factor)
                for caller, factor in callers.get(name, [])]
      runs[name] = (None if any(r is None or f is None for r, f in counts)
                    else sum(r * f for r, f in counts))
    return runs[name]

  return {name: Runs(name) for name in reached}


def KnownTripCount(while_line):
  """The while loop's trip count, or None where XLA does not know it."""
  try:
    return spmd_worker.TripCount(while_line)
  except spmd_worker.UnknownTripCount:
    return None
