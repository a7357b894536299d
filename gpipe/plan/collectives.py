"""What a chip sends over each mesh axis in one step, by collective kind.

Read off the partitioned per-device module (gpipe.xla.hlo_text): each
collective's result in the dtype XLA's SPMD partitioner gave it
(`Collective.wire_bytes`: XLA:CPU's widening of bfloat16 reductions to
float32 undone), and the bytes one chip sends for it over the links of
its group, by the ring algorithms a TPU's collectives run (n devices in
the group, X the result's bytes on one device):

    collective-permute   X              one send to the neighbour
    all-reduce           2 (n-1)/n X    a reduce-scatter, then an all-gather
    all-gather           (n-1)/n X      X is the gathered result
    reduce-scatter       (n-1) X        X is one device's share
    all-to-all           (n-1)/n X

A step's total is each loop's collectives times its trip count (one in a
loop nested in it times that loop's too: `Collective.runs`), plus those
outside the loops; the collective's mesh axes are those its groups span
(`Collective.MeshAxes`), named `AxisName`. How long a collective takes
(`Seconds`: a latency per ring step, its bytes over the links its axes
drive at once, its own HBM traffic) is what the roofline charges and the
overlap schedules.
"""

from gpipe.xla import spmd_worker


def SentBytes(collective, num_devices):
  """Bytes one chip sends over the links for one run of `collective`."""
  n = collective.group_size or num_devices
  x = collective.wire_bytes
  kind = collective.kind
  if kind == 'collective-permute':
    return float(x)
  if n <= 1:
    return 0.0
  if kind == 'all-reduce':
    return 2.0 * (n - 1) / n * x
  if kind == 'reduce-scatter':
    return float((n - 1) * x)
  return (n - 1) / n * x  # all-gather, all-to-all, collective-broadcast


# One ICI hop, seconds: a microsecond, the TPU figure of the jax-ml book
# "How to Scale Your Model". Each ring step of a collective pays one.
ICI_HOP_SECONDS = 1e-6


def Seconds(collective, num_devices, chip, hop_seconds=ICI_HOP_SECONDS,
            mesh_shape=None):
  """How long one run of `collective` holds its links: a latency of one
  hop per ring step (all-reduce 2 (n-1); all-gather, reduce-scatter,
  all-to-all n-1; a permute 1), its bytes sent over the links its mesh axes
  give it at once (`chip.Links`: one in one direction unless the chip says
  more for an axis of `mesh_shape`; a permute's one neighbour, one), and
  its result read and written in HBM (2 x wire bytes). The roofline's
  collective time and the overlap's schedule both use it."""
  n = collective.group_size or num_devices
  kind = collective.kind
  steps = (1 if kind == 'collective-permute' else
           (2 if kind == 'all-reduce' else 1) * max(n - 1, 0))
  # A permute sends to one neighbour: over one link, however many its
  # axes have.
  links = 1 if kind == 'collective-permute' else chip.Links(
      collective.MeshAxes(mesh_shape or (num_devices,)))
  wire = SentBytes(collective, num_devices) / (links * chip.link_bandwidth)
  hbm = 2 * collective.wire_bytes / chip.hbm_bandwidth
  return steps * hop_seconds + wire + hbm


def StepSeconds(compiled, trips, chip, hop_seconds=ICI_HOP_SECONDS,
                mesh_shape=None):
  """Seconds of every collective of the step, one after another (each run
  counted: a loop's trips, and a nested loop's)."""
  return sum(
      Runs(c) * (1 if c.loop < 0 else trips.get(compiled.loops[c.loop], 1)) *
      Seconds(c, compiled.num_devices, chip, hop_seconds, mesh_shape)
      for c in compiled.collectives)


def AxisName(axes, names):
  """The name of a set of mesh axes: `names[a]` joined by '+', e.g.
  'stage', 'model', 'stage+model'; 'all devices' for none."""
  return '+'.join(names[a] for a in axes) or 'all devices'


def MeshAxisNames(rank, stage_axis, names=None):
  """A name per mesh axis: `names` where given, else 'stage' for the
  stage axis and 'axis k' for the others."""
  if names:
    return tuple(names)
  return tuple('stage' if a == stage_axis else f'axis {a}'
               for a in range(rank))


def PerAxis(compiled, trips, mesh_shape, axis_names):
  """{axes name: {kind: bytes one chip sends in the step}}.

  Args:
    compiled: a gpipe.xla.partitioning.CompiledModule.
    trips: {loop body: iterations} (hlo_text.LoopTripCounts).
    mesh_shape: the device mesh ((N,) for a 1-D one).
    axis_names: a name per mesh axis (MeshAxisNames).
  """
  totals = {}
  for c in compiled.collectives:
    runs = Runs(c) * (1 if c.loop < 0 else
                      trips.get(compiled.loops[c.loop], 1))
    axes = AxisName(c.MeshAxes(mesh_shape), axis_names)
    kinds = totals.setdefault(axes, {})
    kinds[c.kind] = (kinds.get(c.kind, 0.0) +
                     runs * SentBytes(c, compiled.num_devices))
  return {axes: dict(sorted(kinds.items()))
          for axes, kinds in sorted(totals.items())}


def Total(per_axis):
  """Bytes sent in all, over every axis and kind."""
  return sum(b for kinds in per_axis.values() for b in kinds.values())


def Runs(collective):
  """How often `collective` runs per iteration of its loop (per step
  outside the loops): Collective.runs.

  Raises:
    spmd_worker.UnknownTripCount: a loop nested in its loop that it runs
      in has no trip count XLA knows.
  """
  if collective.runs is None:
    raise spmd_worker.UnknownTripCount(
        f'XLA did not find the trip count of a loop the {collective.kind} '
        f'{collective.op_name or collective.shape!r} runs in, nested in '
        'another: its bytes per step cannot be counted.')
  return collective.runs


def CountAndWireBytes(collectives, key):
  """{key(c): {'count', 'bytes'}} over collectives (wire bytes, each run
  counted: one in a nested loop as often as it runs), sorted by key: what
  a loop's iteration runs, as the report lists it."""
  totals = {}
  for c in collectives:
    count, nbytes = totals.get(key(c), (0, 0))
    totals[key(c)] = (count + Runs(c), nbytes + Runs(c) * c.wire_bytes)
  return {k: {'count': n, 'bytes': b} for k, (n, b) in sorted(totals.items())}


def KindOverAxes(collective, mesh_shape, axis_names):
  """'collective-permute over stage', 'all-reduce over model', ..."""
  return (f'{collective.kind} over '
          f'{AxisName(collective.MeshAxes(mesh_shape), axis_names)}')
