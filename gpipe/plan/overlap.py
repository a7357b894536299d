"""How much of the step's collectives the compute beside them hides.

The roofline's step (gpipe.plan.roofline) adds every collective to the
compute: none overlaps. A TPU runs a collective on its ICI links while its
matrix units go on with work that neither feeds it nor waits for it. What
a step gets of that is what a schedule reaches, not what a bound credits,
so each computation of the partitioned module (a loop body, once; the step
outside the loops; a called computation that runs collectives) is list
scheduled on its dependency graph (gpipe.xla.dependencies: operands and
control predecessors), and what the schedule saves over running its
instructions one after another is the time hidden.

Resources: one compute unit, and one link per mesh axis. Each instruction
is one task, never split:

    matrix work    a dot, a convolution, a fusion or call of them: its
                   FLOPs / (peak x matmul_efficiency), on the compute unit
    a collective   on the link of every mesh axis its groups span (one over
                   stage and model holds both), for latency + bytes sent
                   (gpipe.plan.collectives) / link bandwidth + its own HBM
                   traffic, its result read and written (2 x wire bytes /
                   HBM bandwidth); the latency is its ring steps (all-reduce
                   2 (n-1); all-gather, reduce-scatter, all-to-all n-1; a
                   permute 1) x one ICI hop (ICI_HOP_SECONDS). An async
                   pair is one task at its -start; its -done takes no time
    a nested loop  (or a call, a conditional, that runs collectives) on the
                   compute unit and every link, for its body's schedule
                   length x its trip count (a conditional: its longest
                   branch): nothing runs beside it
    anything else  no time: elementwise work and HBM traffic are in the
                   roofline's compute and memory figures, not in the schedule

so collectives on one axis run in turn, on different axes at once, and
beside the compute. A 2 s dot D beside a chain A -> X -> B (1 s
all-reduces on one axis around a 1 s dot X):

    compute  |====== D ======|== X ==|
    link 0   |== A ==|               |== B ==|
             0       1       2       3       4 s

The schedule: event-driven list scheduling; whenever a task ends, of the
ready tasks whose resources are free the one with the longest path (by
duration) to the computation's end starts first (ties: the earlier
instruction). Per computation, with L its schedule's length, C its
collectives' durations and W its compute's (nested loops counted as
compute), hidden = W + C - L: above, 3 + 2 - 4 = 1 s (a max flow from the
collectives to the work beside them credits 2, D covering both). The
step's hidden seconds are each computation's times how often it runs in
the step: the entry once, a loop body its trips x the trips of every loop
it is nested in.

Nothing crosses an iteration: a body's schedule ends when all of its
instructions have, so a collective is hidden only beside work of its own
iteration (XLA:TPU's collective pipeliner can move some across; the
planner does not credit it). A collective's duration is the one the
roofline charges (gpipe.plan.collectives.Seconds); the overlapped step is
the no-overlap step less what is hidden, never below max(compute, memory
traffic). The calibrated step (what the planner's pick and targets use)
is scheduled the same way, its matrix work at the fitted efficiency.
"""

import collections
import dataclasses
import heapq

from gpipe.plan import collectives
from gpipe.xla import dependencies
from gpipe.xla import hlo_text
from gpipe.xla import spmd_worker

ICI_HOP_SECONDS = collectives.ICI_HOP_SECONDS
_COMPUTE = -1  # the compute unit; a link is its mesh axis' index
_COMPUTE_ONLY = frozenset([_COMPUTE])
_NOTHING = frozenset()


@dataclasses.dataclass(frozen=True)
class Schedule:
  """One computation's schedule, seconds per run of it."""
  computation: str
  length: float  # L: when its last instruction ends
  compute: float  # W: its matrix work's durations, nested loops included
  collective: float  # C: its collectives' durations
  runs: int  # how often it runs in the step

  @property
  def hidden(self):
    """What running at once saved over one after another: W + C - L."""
    return max(0.0, self.compute + self.collective - self.length)


def HiddenSeconds(compiled, trips, chip, mesh_shape=None,
                  matmul_efficiency=1.0, hop_seconds=ICI_HOP_SECONDS):
  """Seconds of the step's collectives the compute beside them hides.

  Args:
    compiled: a gpipe.xla.partitioning.CompiledModule.
    trips: {loop body: iterations} (hlo_text.LoopTripCounts).
    chip: a gpipe.plan.roofline.Chip.
    mesh_shape: the device mesh, for each collective's axes (default: a
      1-D mesh of the module's devices).
    matmul_efficiency: the share of the chip's peak matrix work runs at.
    hop_seconds: one ICI hop, what each ring step of a collective pays.
  """
  return sum(s.hidden * s.runs for s in Schedules(
      compiled, trips, chip, mesh_shape=mesh_shape,
      matmul_efficiency=matmul_efficiency, hop_seconds=hop_seconds))


def Schedules(compiled, trips, chip, mesh_shape=None, matmul_efficiency=1.0,
              hop_seconds=ICI_HOP_SECONDS):
  """[Schedule] of the entry and of each computation a nested task runs
  (callers first), as HiddenSeconds (same arguments) sums them."""
  scheduler = _Scheduler(compiled, trips, chip,
                         tuple(mesh_shape or (compiled.num_devices,)),
                         matmul_efficiency, hop_seconds)
  return scheduler.All()


class _Scheduler:
  """Tasks, durations and schedules of one module's computations."""

  def __init__(self, compiled, trips, chip, mesh_shape, efficiency, hop):
    self._module = dependencies.Module(compiled.hlo)
    # An instruction's collectives: one, or the parts a TPU runs of it
    # (gpipe.xla.reduce_scatters.AsTpuRuns: a reduce-scatter and the rest).
    self._collectives = collections.defaultdict(list)
    for c in compiled.collectives:
      self._collectives[(c.computation, c.name)].append(c)
    self._num_devices = compiled.num_devices
    self._trips, self._chip, self._mesh = trips, chip, mesh_shape
    self._flops_per_second = chip.peak_flops * efficiency
    self._hop = hop
    self._every = frozenset([_COMPUTE, *range(len(mesh_shape))])
    self._timed = {}  # computation: (L, W, C)

  def All(self):
    """[Schedule] from the entry down, with how often each runs."""
    entry = self._module.entry
    if entry is None:
      return []
    order, calls = [], {}
    self._Visit(entry, order, calls)
    order.reverse()  # callers first
    runs = collections.Counter({entry: 1})
    for computation in order:
      for callee, factor in calls[computation]:
        runs[callee] += runs[computation] * factor
    return [Schedule(c, *self._Timed(c), runs=runs[c]) for c in order]

  def _Visit(self, computation, order, calls):
    """Post-order over nested tasks: `calls` {computation: [(callee,
    runs per run)]}."""
    calls[computation] = [
        call for i in self._module.Graph(computation).values()
        for call in self._Nested(i)]
    for callee, _ in calls[computation]:
      if callee not in calls:
        self._Visit(callee, order, calls)
    order.append(computation)

  def _Nested(self, instruction):
    """[(computation, runs per run of `instruction`)]: what it calls that
    runs collectives (a loop's body its trips, its condition once more)."""
    if dependencies.Kind(instruction.op) in hlo_text.COLLECTIVE_KINDS:
      return []
    callees = [c for c in hlo_text.Callees(instruction.line)
               if self._module.HoldsCollective(c)]
    if instruction.op != 'while' or not callees:
      return [(c, 1) for c in callees]
    body = hlo_text.WHILE_BODY_RE.search(instruction.line).group(1)
    trips = self._trips.get(body, hlo_text.KnownTripCount(instruction.line))
    if trips is None:
      raise spmd_worker.UnknownTripCount(
          f'XLA did not find the trip count of the while loop of {body!r}, '
          'which runs collectives: its overlap cannot be counted.')
    return [(c, trips if c == body else trips + 1) for c in callees]

  def _Timed(self, computation):
    """(L, W, C) of `computation`'s schedule (see the module's docstring)."""
    if computation not in self._timed:
      seconds, needs = {}, {}
      compute = collective = 0.0
      for name, instruction in self._module.Graph(computation).items():
        t, need, what = self._Task(computation, instruction)
        seconds[name], needs[name] = (t, need) if t > 0 else (0.0, _NOTHING)
        compute += t if what == 'compute' else 0.0
        collective += t if what == 'collective' else 0.0
      follows, users = self._module.Edges(computation)
      self._timed[computation] = (_Length(seconds, needs, follows, users),
                                  compute, collective)
    return self._timed[computation]

  def _Task(self, computation, instruction):
    """(seconds, resources, 'compute' | 'collective' | '') of one
    instruction's task."""
    kind = dependencies.Kind(instruction.op)
    if kind in hlo_text.COLLECTIVE_KINDS:
      if instruction.op.endswith('-done'):
        return 0.0, _NOTHING, ''
      parts = self._collectives.get((computation, instruction.name)) or [
          hlo_text.Collective(  # not among the module's: read off its line
              kind=kind, shape=instruction.type, computation=computation,
              loop=-1, groups=hlo_text.DeviceGroups(instruction.line),
              name=instruction.name)]
      return (sum(self._CollectiveSeconds(c) for c in parts),
              frozenset(a for c in parts for a in c.MeshAxes(self._mesh)),
              'collective')
    nested = self._Nested(instruction)
    if nested:
      lengths = [self._Timed(c)[0] * factor for c, factor in nested]
      seconds = max(lengths) if instruction.op == 'conditional' else sum(
          lengths)
      return seconds, self._every, 'compute'
    flops = float(self._module.Flops(computation, instruction))
    return flops / self._flops_per_second, _COMPUTE_ONLY, 'compute'

  def _CollectiveSeconds(self, c):
    """Latency + bytes sent over the link + its result's HBM traffic."""
    return collectives.Seconds(c, self._num_devices, self._chip, self._hop,
                               self._mesh)


def _Priorities(seconds, follows, users):
  """{task: the longest path, by duration, from its start to the end}."""
  waiting = {n: len(users[n]) for n in seconds}
  todo = [n for n, count in waiting.items() if not count]
  priority = {}
  while todo:
    n = todo.pop()
    priority[n] = seconds[n] + max((priority[u] for u in users[n]),
                                   default=0.0)
    for operand in follows[n]:
      waiting[operand] -= 1
      if not waiting[operand]:
        todo.append(operand)
  if len(priority) < len(seconds):
    raise ValueError('A computation whose dependencies form a cycle.')
  return priority


def _Length(seconds, needs, follows, users):
  """When the last task ends, list scheduled: each time tasks end, the
  ready ones whose resources (`needs`) are free start, highest priority
  first. Ready tasks are kept in a heap per set of resources they need:
  if one set's best cannot start, none of that set can."""
  priority = _Priorities(seconds, follows, users)
  order = {n: i for i, n in enumerate(seconds)}
  waiting = {n: len(before) for n, before in follows.items()}
  ready = collections.defaultdict(list)  # needs: [(-priority, order, task)]
  free = set(_COMPUTE_ONLY).union(*needs.values())
  running, now = [], 0.0  # running: [(end, order, task)]
  finished = []  # tasks ended at `now`, their users not yet released

  def Arrive(n):  # its operands have ended
    if seconds[n]:
      heapq.heappush(ready[needs[n]], (-priority[n], order[n], n))
    else:
      finished.append(n)  # taking no time, it ends as it arrives

  for n, before in follows.items():
    if not before:
      Arrive(n)
  while True:
    while finished:
      for u in users[finished.pop()]:
        waiting[u] -= 1
        if not waiting[u]:
          Arrive(u)
    startable = [(heap[0], need) for need, heap in ready.items()
                 if heap and need <= free]
    if startable:
      (_, _, n), need = min(startable)
      heapq.heappop(ready[need])
      free -= need
      heapq.heappush(running, (now + seconds[n], order[n], n))
      continue
    if not running:
      return now
    now = running[0][0]
    while running and running[0][0] <= now:
      n = heapq.heappop(running)[2]
      free |= needs[n]
      finished.append(n)
