"""How much of the step's collectives the compute beside them can hide.

The roofline's step (gpipe.plan.roofline) adds every collective to the
compute: none overlaps. A TPU runs a collective on its ICI links while its
matrix units go on with work that neither feeds the collective nor waits
for it. Read off the partitioned module's dependency graph
(gpipe.xla.dependencies), per computation (one run of a loop body, of a
called computation, or the step outside the loops):

    a collective's time   its bytes sent (gpipe.plan.collectives) / link
                          bandwidth, as the roofline counts it
    the work beside it    the matrix FLOPs of each instruction that neither
                          feeds it nor waits for it / the chip's peak
    hidden                the most collective time that work can cover, each
                          second of work covering at most one second of
                          collective: two collectives beside the same dot
                          share its time (a max flow from the collectives,
                          capped by their times, to the work, capped by its
                          time, along "runs beside")

times how often the computation runs in the step (its loop's trip count,
and the trips of the loops it is nested in). The overlapped step is the
no-overlap step less what is hidden: never below max(compute, memory
traffic). An optimistic bound of what a scheduler could reach (XLA must
also order the work so; the links are assumed free), where the no-overlap
step is a pessimistic one: the planner's targets and its pick keep the
no-overlap figure.
"""

import collections
import math

from gpipe.plan import collectives
from gpipe.xla import dependencies


def HiddenSeconds(compiled, trips, chip):
  """Seconds of the step's collectives the compute beside them hides.

  Args:
    compiled: a gpipe.xla.partitioning.CompiledModule.
    trips: {loop body: iterations} (hlo_text.LoopTripCounts).
    chip: a gpipe.plan.roofline.Chip.
  """
  module = dependencies.Module(compiled.hlo)
  by_computation = collections.defaultdict(list)
  for c in compiled.collectives:
    by_computation[c.computation].append(c)
  total = 0.0
  for computation, some in by_computation.items():
    first = some[0]  # one computation: one loop, as often as each other
    runs = collectives.Runs(first) * (
        1 if first.loop < 0 else trips.get(compiled.loops[first.loop], 1))
    seconds = {c.name: collectives.SentBytes(c, compiled.num_devices) /
                       chip.link_bandwidth for c in some}
    beside = {c.name: module.Beside(computation, c.name) for c in some}
    work = {name: flops / chip.peak_flops
            for name, flops in module.Work(computation).items()}
    total += runs * Hidden(seconds, beside, work)
  return total


def Hidden(seconds, beside, work):
  """The most collective seconds `work` can hide in one computation.

  Args:
    seconds: {collective: seconds it takes}.
    beside: {collective: the instructions that may run beside it}.
    work: {instruction: seconds of work}.

  Each second of an instruction's work hides at most one second of one
  collective, and only of a collective it runs beside: the value of a
  max flow, collectives to work. Instructions beside the same collectives
  are one node (their times summed), which keeps the graph small.
  """
  groups = collections.defaultdict(float)
  for name, t in work.items():
    key = frozenset(c for c, names in beside.items() if name in names)
    if key:
      groups[key] += t
  capacity = collections.defaultdict(dict)

  def Edge(a, b, c):
    capacity[a][b] = capacity[a].get(b, 0.0) + c
    capacity[b].setdefault(a, 0.0)

  for c, t in seconds.items():
    Edge('source', ('collective', c), t)
  for key, t in groups.items():
    Edge(('work', key), 'sink', t)
    for c in key:
      Edge(('collective', c), ('work', key), math.inf)
  return _MaxFlow(capacity, 'source', 'sink')


def _MaxFlow(capacity, source, sink):
  """Edmonds-Karp on the residual `capacity` ({a: {b: capacity}}, changed
  in place): the flow's value."""
  flow = 0.0
  while True:
    parent, todo = {source: None}, collections.deque([source])
    while todo and sink not in parent:
      a = todo.popleft()
      for b, c in capacity[a].items():
        if c > 0 and b not in parent:
          parent[b] = a
          todo.append(b)
    if sink not in parent:
      return flow
    path, b = [], sink
    while parent[b] is not None:
      path.append((parent[b], b))
      b = parent[b]
    pushed = min(capacity[a][b] for a, b in path)
    for a, b in path:
      capacity[a][b] -= pushed
      capacity[b][a] += pushed
    flow += pushed
