"""What the compiled module's while loops compute and hold.

The partitioned per-device module (HLO text) has the pipeline's forward
loop and its backward loop (with backward_schedule='1f1b', up to three
gradient loops); the planner reads off it each loop's FLOPs (LoopFlops)
and what the forward pass stores for the backward pass: the forward loop's
per-iteration stacks (StoredActivations), or the 1f1b gradient loop's
rings of stage inputs (Rings).
"""

import functools
import re

from gpipe.xla import hlo_text as hlo
from gpipe.xla import spmd_worker


@functools.lru_cache(maxsize=1)
def _CostClient():
  """jaxlib's CPU client: cost analysis of HLO text needs one device."""
  import jax  # pylint: disable=g-import-not-at-top
  return jax.devices('cpu')[0].client


def LoopFlops(hlo_text, bodies):
  """FLOPs of each while loop (by body computation), all iterations.

  XLA's cost analysis of the loop's body as the module's entry (nested
  loops counted per iteration, as for the whole module), times the loop's
  trip count: the per-loop split of the module's FLOPs, which tells the
  work the bubbles waste from the work outside the loops.
  """
  trips = hlo.LoopTripCounts(hlo_text)
  return [
      trips[body] * spmd_worker.LoopAwareCost(
          _CostClient(), _WithEntry(hlo_text, body))['flops']
      for body in bodies
  ]


def _WithEntry(hlo_text, computation):
  """The HLO module's text with `computation` as its entry."""
  lines = []
  for line in hlo_text.splitlines():
    if line.startswith('ENTRY '):
      line = line[len('ENTRY '):]
    elif line.startswith((f'%{computation} ', f'{computation} ')):
      line = 'ENTRY ' + line
    lines.append(line)
  return '\n'.join(lines)


_NAME = r'%?([\w.\-]+)'
_TUPLE_RE = re.compile(rf'^\s*{_NAME}\s*=.*\stuple\(([^)]*)\)')
_GTE_RE = re.compile(
    rf'^\s*{_NAME}\s*=\s*(\S+)\s+get-tuple-element\({_NAME}\),'
    r'\s*index=(\d+)')
# An instruction of one operand (a convert, copy, bitcast, or a fusion of
# such): `%y = f32[9,4]{1,0} fusion(%x), kind=kLoop, ...`.
_UNARY_RE = re.compile(rf'^\s*{_NAME}\s*=\s*(\S+)\s+[\w\-]+\({_NAME}\)')


def StoredActivations(hlo_text, forward_body):
  """[(bytes, HLO type)]: what the forward loop stores for the backward loop.

  Read off the partitioned per-device module: the results of the forward
  while loop (body `forward_body`) that hold one slice per iteration
  (leading dim = its trip count: the buffer history, and with a storing
  remat policy the body's saved activations) and that another while loop
  (the backward loop) takes in, as is or through instructions of one
  operand that keep its dims (XLA:CPU converts a bfloat16 stack to float32
  whole before the loop that reads it: the CPU computes few bfloat16 ops;
  the stack counted is the forward loop's). The loop's other results (the
  outputs' rows, the carried weights) are not stored activations; a stored
  stack that reaches the backward loop another way is not found and stays
  among the other temporaries.
  """
  whiles, tuples, results, unary = [], {}, {}, {}
  for line in hlo_text.splitlines():
    loop = hlo.WHILE_RE.match(line)
    if loop and ' while(' in line:
      whiles.append((loop.group(1), loop.group(2),
                     hlo.WHILE_BODY_RE.search(line).group(1), line))
      continue
    gte = _GTE_RE.match(line)
    if gte:
      results[gte.group(1)] = (gte.group(3), int(gte.group(4)), gte.group(2))
      continue
    tup = _TUPLE_RE.match(line)
    if tup:
      tuples[tup.group(1)] = set(re.findall(r'%?([\w.\-]+)',
                                            re.sub(r'/\*.*?\*/', '',
                                                   tup.group(2))))
      continue
    one = _UNARY_RE.match(line)
    if one:
      unary.setdefault(one.group(3), []).append((one.group(1), one.group(2)))
  forward = [(name, line) for name, _, body, line in whiles
             if body == forward_body]
  if not forward:
    return []
  name, line = forward[0]
  trips = spmd_worker.TripCount(line)
  taken_in = set()
  for other, init, _, _ in whiles:
    if other != name:
      taken_in |= tuples.get(init, set()) | {init}
  stored = {}
  for result, (source, index, hlo_type) in results.items():
    shapes = hlo.ShapesOf(hlo_type)
    if (source == name and len(shapes) == 1 and shapes[0][:1] == (trips,) and
        _Reaches(result, shapes[0], taken_in, unary)):
      stored[index] = (hlo.TypeBytes(hlo_type), hlo_type)
  return [stored[i] for i in sorted(stored)]


def Rings(hlo_text, gradient_bodies, ring_size):
  """[(bytes, HLO type)]: the rings the 1f1b gradient loops carry.

  Each stage keeps its stage inputs (and what the remat policy stores) in
  rings of ring_size entries, per device [stages of the device, ring_size,
  ...] (gpipe.pipeline.one_f_one_b.rings.Ring): a loop's carried arrays of
  rank 3 or more whose second dim is ring_size. The gradient loops carry
  the same rings (a phase that only reads them may take them in
  otherwise): the largest set of one loop counts.
  """
  found = []
  for line in hlo_text.splitlines():
    loop = hlo.WHILE_RE.match(line)
    if not (loop and ' while(' in line and
            hlo.WHILE_BODY_RE.search(line).group(1) in gradient_bodies):
      continue
    carried = line.split(' while(')[0].split('=', 1)[1]
    rings = [(hlo.TypeBytes(t), t) for t in
             re.findall(r'[a-z]\w*\[[\d,]*\]', carried)
             if len(hlo.ShapesOf(t)[0]) >= 3 and
             hlo.ShapesOf(t)[0][1] == ring_size]
    if sum(b for b, _ in rings) > sum(b for b, _ in found):
      found = rings
  return found


def _Reaches(name, dims, targets, unary, most_steps=4):
  """Whether `name` is in targets, or leads there through instructions of
  one operand whose result keeps its dims."""
  frontier = [name]
  for _ in range(most_steps + 1):
    if any(n in targets for n in frontier):
      return True
    frontier = [user for n in frontier for user, hlo_type in unary.get(n, ())
                if hlo.ShapesOf(hlo_type) == [dims]]
  return False

