"""What the compute beside a collective hides, as a schedule reaches it, on
hand-written HLO whose answer is known (no compile).

A toy chip makes the figures round: a dot of [32,32] x [32,32] is 1 s of
work, of [32,64] x [64,32] 2 s; an all-reduce over 2 devices of f32[32,32]
is 1 s on the link, of f32[64,32] 2 s (a chip sends 2 (n - 1)/n of the
result's bytes at 4 KiB/s). HBM is free and an ICI hop takes no time but
where a test says. Each body is a loop of 3 trips unless it says; what a
body makes that nothing reads goes to its root (carried to the next
iteration), as XLA keeps it.
"""

import dataclasses
import math
import types

import pytest

from gpipe.plan import overlap
from gpipe.plan import roofline
from gpipe.xla import hlo_text

_CHIP = roofline.Chip('toy', peak_flops=2.0 * 32 * 32 * 32, hbm_bytes=2**30,
                      hbm_bandwidth=math.inf, ici_bandwidth=8192, ici_ports=1)
# Links 8 times as fast: an all-reduce of f32[64,32] takes 0.25 s.
_FAST = dataclasses.replace(_CHIP, name='fast', ici_bandwidth=8 * 8192)
_INPUTS = {'a': 'f32[32,32]', 'b': 'f32[32,32]', 'c': 'f32[32,64]',
           'd': 'f32[64,32]', 'e': 'f32[64,32]'}
_TWO = '{{0,1}}'  # on a 1-D mesh of 2
# On a [2, 2] mesh: the groups of axis 1 and of axis 0.
_AXIS_1, _AXIS_0 = '{{0,1},{2,3}}', '{{0,2},{1,3}}'

_MODULE = """
HloModule toy

%add (x: f32[], y: f32[]) -> f32[] {{
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}}

%body (t: {state}) -> {state} {{
  %t = {state} parameter(0)
{lines}
  ROOT %r = {state} tuple({outputs})
}}

%cond (t: {state}) -> pred[] {{
  %t = {state} parameter(0)
  ROOT %true = pred[] constant(true)
}}

ENTRY %main (i: {state}) -> {state} {{
  %i = {state} parameter(0)
  ROOT %loop = {state} while(%i), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"{trips}"}}}}
}}
"""


class _Body:
  """A loop body written instruction by instruction: its inputs %a..%e
  (_INPUTS), then what each call adds."""

  def __init__(self):
    self.types = dict(_INPUTS)
    self.lines = [f'  %{n} = {t}{{1,0}} get-tuple-element(%t), index={i}'
                  for i, (n, t) in enumerate(_INPUTS.items())]
    self.read = set()

  def Add(self, name, hlo_type, rest, operands, after=()):
    self.types[name] = hlo_type
    self.read.update(operands + tuple(after))
    control = (', control-predecessors={%s}' % ', '.join(
        f'%{a}' for a in after)) if after else ''
    self.lines.append(f'  %{name} = {hlo_type}{{1,0}} {rest}{control}')
    return self

  def Dot(self, name, lhs, rhs, after=()):
    rows = hlo_text.ShapesOf(self.types[lhs])[0][0]
    cols = hlo_text.ShapesOf(self.types[rhs])[0][1]
    return self.Add(name, f'f32[{rows},{cols}]',
                    f'dot(%{lhs}, %{rhs}), lhs_contracting_dims={{1}}, '
                    'rhs_contracting_dims={0}', (lhs, rhs), after)

  def AllReduce(self, name, operand, groups=_TWO, op='all-reduce'):
    return self.Add(name, self.types[operand],
                    f'{op}(%{operand}), channel_id={len(self.lines)}, '
                    f'replica_groups={groups}, to_apply=%add', (operand,))

  def Twice(self, name, operand):
    """[32,32] -> [64,32]: no time, but 2 s to all-reduce."""
    return self.Add(name, 'f32[64,32]',
                    f'concatenate(%{operand}, %{operand}), dimensions={{0}}',
                    (operand,))

  def Text(self, trips=3):
    made = [n for n in self.types if n not in _INPUTS and n not in self.read]
    outputs = list(_INPUTS) + made  # inputs passed on, the rest carried
    state = '(%s)' % ', '.join(f'{self.types[n]}{{1,0}}' for n in outputs)
    return _MODULE.format(state=state, lines='\n'.join(self.lines),
                          outputs=', '.join(f'%{n}' for n in outputs),
                          trips=trips)


def _Compiled(text, num_devices):
  found, loops = hlo_text.AnalyzeHlo(text)
  return types.SimpleNamespace(hlo=text, collectives=found, loops=loops,
                               num_devices=num_devices)


def _Hidden(text, chip=_CHIP, mesh_shape=(2,), **kwargs):
  """HiddenSeconds of a module, an ICI hop free unless `kwargs` say."""
  kwargs.setdefault('hop_seconds', 0.0)
  compiled = _Compiled(text, math.prod(mesh_shape))
  return overlap.HiddenSeconds(compiled, hlo_text.LoopTripCounts(text), chip,
                               mesh_shape=mesh_shape, **kwargs)


def _Schedules(text, chip=_CHIP, mesh_shape=(2,), **kwargs):
  kwargs.setdefault('hop_seconds', 0.0)
  compiled = _Compiled(text, math.prod(mesh_shape))
  return {s.computation: s for s in overlap.Schedules(
      compiled, hlo_text.LoopTripCounts(text), chip, mesh_shape=mesh_shape,
      **kwargs)}


def test_work_is_not_split_between_collectives():
  """A 2 s dot D beside A -> X -> B (A, B 1 s all-reduces on one axis, X
  a 1 s dot): X waits for A (1 s) and for the compute unit, which D holds
  to 2 s; B follows X: L = 4 = W 3 + C 2 - 1, so 1 s hidden a trip (the
  max flow credited 2: D beside A and B both)."""
  body = (_Body().Dot('big', 'c', 'd').AllReduce('A', 'a').Dot('X', 'A', 'b')
          .AllReduce('B', 'X'))
  assert _Schedules(body.Text())['body'].length == pytest.approx(4.0)
  assert _Hidden(body.Text()) == pytest.approx(3 * 1.0)


def _Crossed(groups_a, groups_b):
  """A feeds the dot q, B the dot p: 1 s each, A and B independent."""
  return (_Body().AllReduce('A', 'a', groups_a).AllReduce('B', 'b', groups_b)
          .Dot('q', 'A', 'b').Dot('p', 'B', 'a'))


def test_crossed_waits_are_credited_once():
  """One axis: A 0-1 s, B 1-2 s (in turn); q, ready at 1, runs 1-2 beside
  B; p, ready at 2, runs 2-3: L = 3, hidden W 2 + C 2 - 3 = 1 s a trip, and
  no schedule does better (the second collective ends at 2 at the
  earliest, its dot at 3). The flow credited each collective in full
  beside the other's dot: 2. On two axes A and B run at once, 0-1 s, and
  the dots in turn, 1-3 s: L = 3 again, 1 s hidden, now A's and B's
  overlap (the compute unit, not the link, is what waits)."""
  assert _Hidden(_Crossed(_TWO, _TWO).Text()) == pytest.approx(3 * 1.0)
  two_axes = _Crossed(_AXIS_1, _AXIS_0).Text()
  assert _Schedules(two_axes, mesh_shape=(2, 2))['body'].length == (
      pytest.approx(3.0))
  assert _Hidden(two_axes, mesh_shape=(2, 2)) == pytest.approx(3 * 1.0)


def test_collectives_on_two_axes_run_at_once_on_one_in_turn():
  """A 1 s all-reduce and a 2 s one, no compute: on axes 1 and 0 at
  once (L = 2, 1 s hidden a trip); on axis 1 both, in turn (L = 3, none):
  the shorter one's 1 s a trip apart."""
  apart = _Body().AllReduce('A', 'a', _AXIS_1).AllReduce('B', 'e', _AXIS_0)
  one = _Body().AllReduce('A', 'a', _AXIS_1).AllReduce('B', 'e', _AXIS_1)
  assert _Hidden(apart.Text(), mesh_shape=(2, 2)) == pytest.approx(3.0)
  assert _Hidden(one.Text(), mesh_shape=(2, 2)) == 0.0


def test_an_axis_with_more_links_holds_them_for_less():
  """The 2 s all-reduce along axis 1 of a [2, 2] mesh takes 1 s where the
  chip drives 2 links along that axis; along axis 0 (1 link) still 2 s.
  Beside a 1 s dot it now hides all of its 1 s a trip."""
  wide = dataclasses.replace(_CHIP, links_per_axis=(1, 2))
  for groups, seconds in [(_AXIS_1, 1.0), (_AXIS_0, 2.0)]:
    text = _Body().Dot('y', 'a', 'b').AllReduce('ar', 'e', groups).Text()
    assert _Schedules(text, wide, mesh_shape=(2, 2))['body'].collective == (
        pytest.approx(seconds))
    assert _Hidden(text, wide, mesh_shape=(2, 2)) == pytest.approx(3 * 1.0)
    assert _Schedules(text, _CHIP, mesh_shape=(2, 2))['body'].collective == (
        pytest.approx(2.0))


def test_a_reduction_carried_to_the_next_iteration_hides_in_its_own():
  """The dot y (1 s) feeds a 2 s all-reduce whose sum only the root
  carries (the next iteration adds it in); the dot z (1 s) is
  independent. In one iteration y 0-1 s, the all-reduce 1-3 s beside z
  1-2 s: L = 3, 1 s hidden a trip, 3 s in all. Overlapping the next
  iteration's y and z too (a collective pipeliner) would hide 2 s a trip:
  not credited."""
  body = _Body().Dot('y', 'a', 'b').Twice('y2', 'y')
  body.Add('prev', 'f32[64,32]', 'get-tuple-element(%t), index=5', ())
  body.Add('sum', 'f32[64,32]', 'add(%prev, %y2)', ('prev', 'y2'))
  body.AllReduce('acc', 'sum').Dot('z', 'b', 'a')
  text = body.Text()
  assert '(%a, %b, %c, %d, %e, %acc, %z)' in text  # %acc in slot 5
  assert _Hidden(text) == pytest.approx(3 * 1.0)


_NESTED = """
HloModule nested

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%inner (u: (f32[32,32]{1,0}, f32[32,32]{1,0}, f32[64,32]{1,0})) -> (f32[32,32]{1,0}, f32[32,32]{1,0}, f32[64,32]{1,0}) {
  %u = (f32[32,32]{1,0}, f32[32,32]{1,0}, f32[64,32]{1,0}) parameter(0)
  %ia = f32[32,32]{1,0} get-tuple-element(%u), index=0
  %ib = f32[32,32]{1,0} get-tuple-element(%u), index=1
  %ie = f32[64,32]{1,0} get-tuple-element(%u), index=2
  %iy = f32[32,32]{1,0} dot(%ia, %ib), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %iar = f32[64,32]{1,0} all-reduce(%ie), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  ROOT %ir = (f32[32,32]{1,0}, f32[32,32]{1,0}, f32[64,32]{1,0}) tuple(%iy, %ib, %iar)
}

%cond (c: (f32[32,32]{1,0}, f32[32,32]{1,0}, f32[64,32]{1,0})) -> pred[] {
  %c = (f32[32,32]{1,0}, f32[32,32]{1,0}, f32[64,32]{1,0}) parameter(0)
  ROOT %true = pred[] constant(true)
}

%outer (t: (f32[32,32]{1,0}, f32[32,32]{1,0}, f32[64,32]{1,0})) -> (f32[32,32]{1,0}, f32[32,32]{1,0}, f32[64,32]{1,0}) {
  %t = (f32[32,32]{1,0}, f32[32,32]{1,0}, f32[64,32]{1,0}) parameter(0)
  %oa = f32[32,32]{1,0} get-tuple-element(%t), index=0
  %oar = f32[32,32]{1,0} all-reduce(%oa), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  %in = (f32[32,32]{1,0}, f32[32,32]{1,0}, f32[64,32]{1,0}) while(%t), condition=%cond, body=%inner, backend_config={"known_trip_count":{"n":"2"}}
  %ob = f32[32,32]{1,0} get-tuple-element(%in), index=1
  %oe = f32[64,32]{1,0} get-tuple-element(%in), index=2
  ROOT %or = (f32[32,32]{1,0}, f32[32,32]{1,0}, f32[64,32]{1,0}) tuple(%oar, %ob, %oe)
}

ENTRY %main (i: (f32[32,32]{1,0}, f32[32,32]{1,0}, f32[64,32]{1,0})) -> (f32[32,32]{1,0}, f32[32,32]{1,0}, f32[64,32]{1,0}) {
  %i = (f32[32,32]{1,0}, f32[32,32]{1,0}, f32[64,32]{1,0}) parameter(0)
  ROOT %loop = (f32[32,32]{1,0}, f32[32,32]{1,0}, f32[64,32]{1,0}) while(%i), condition=%cond, body=%outer, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_a_loop_nested_in_a_loop_counts_every_run():
  """The inner body (2 trips) runs a 1 s dot beside a 2 s all-reduce:
  L = 2, 1 s hidden a run, and it runs 3 x 2 = 6 times: 6 s (once per
  outer iteration: 3; its own trips only: 2). The outer body's 1 s
  all-reduce runs beside nothing: the inner loop (2 s x 2) holds the
  compute unit and every link (L = 5; beside it, 3 s more)."""
  schedules = _Schedules(_NESTED)
  assert [(s.runs, s.length) for s in schedules.values()] == [
      (1, pytest.approx(15.0)), (3, pytest.approx(5.0)),
      (6, pytest.approx(2.0))]
  assert list(schedules) == ['main', 'outer', 'inner']
  assert _Hidden(_NESTED) == pytest.approx(6.0)


def test_latency_and_hbm_traffic_add_to_a_collective():
  """On fast links the all-reduce of f32[64,32] is 0.25 s, beside a 1 s
  dot: all of it hidden. A hop of 0.25 s adds 2 (n-1) = 2 ring steps,
  0.5 s; HBM at 128 KiB/s adds its 8 KiB read and written, 0.125 s; a
  collective-permute pays one hop."""
  text = _Body().Dot('y', 'a', 'b').AllReduce('ar', 'e').Text()
  slow_hbm = dataclasses.replace(_FAST, hbm_bandwidth=2 * 8192 / 0.125)
  for chip, hop, seconds in [(_FAST, 0.0, 0.25), (_FAST, 0.25, 0.75),
                             (slow_hbm, 0.0, 0.375), (slow_hbm, 0.25, 0.875)]:
    assert _Schedules(text, chip, hop_seconds=hop)['body'].collective == (
        pytest.approx(seconds))
    assert _Hidden(text, chip, hop_seconds=hop) == pytest.approx(3 * seconds)
  permute = _Body().Dot('y', 'a', 'b').Add(
      'cp', 'f32[64,32]', 'collective-permute(%e), channel_id=1, '
      'source_target_pairs={{0,1},{1,0}}', ('e',)).Text()
  assert _Schedules(permute, _FAST, hop_seconds=0.25)['body'].collective == (
      pytest.approx(0.25 + 0.25))  # all 8 KiB sent, and one hop


def test_an_independent_dot_hides_its_time_or_the_collectives():
  """A trip: 1 s of dot beside 2 s of all-reduce hides 1 s; 2 s of dot
  beside 1 s, 1 s; 1 s beside a fast 0.25 s, 0.25 s; an async pair is one
  collective at its start."""
  assert _Hidden(_Body().Dot('y', 'a', 'b').AllReduce('ar', 'e').Text()) == (
      pytest.approx(3 * 1.0))
  assert _Hidden(_Body().Dot('y', 'c', 'd').AllReduce('ar', 'a').Text()) == (
      pytest.approx(3 * 1.0))
  assert _Hidden(_Body().Dot('y', 'a', 'b').AllReduce('ar', 'e').Text(),
                 _FAST) == pytest.approx(3 * 0.25)
  pair = _Body().Dot('y', 'a', 'b').AllReduce('s', 'e', op='all-reduce-start')
  pair.Add('done', 'f32[64,32]', 'all-reduce-done(%s)', ('s',))
  assert _Hidden(pair.Text()) == pytest.approx(3 * 1.0)


def test_what_feeds_or_waits_for_a_collective_hides_nothing():
  """The dot that makes the all-reduce's operand; the dot that waits for
  it (a control dependency)."""
  feeds = _Body().Dot('y', 'a', 'b').Twice('y2', 'y').AllReduce('ar', 'y2')
  assert _Hidden(feeds.Text()) == 0.0
  waits = _Body().AllReduce('ar', 'e').Dot('y', 'a', 'b', after=('ar',))
  assert _Hidden(waits.Text()) == 0.0


def test_what_feeds_a_collective_runs_first():
  """z (1 s, first in the text) and y (1 s, feeding a 2 s all-reduce) are
  ready at once: y's path to the end is longer (3 s), so y runs 0-1 s,
  the all-reduce 1-3 s beside z: L = 3, 1 s hidden a trip (z first: L = 4,
  none)."""
  body = _Body().Dot('z', 'b', 'a').Dot('y', 'a', 'b').Twice('y2', 'y')
  assert _Hidden(body.AllReduce('ar', 'y2').Text()) == pytest.approx(3.0)


def test_matmul_efficiency_stretches_the_work():
  """At half the peak the 1 s dot takes 2 s: beside a 2 s all-reduce it
  hides 2 s a trip."""
  text = _Body().Dot('y', 'a', 'b').AllReduce('ar', 'e').Text()
  assert _Hidden(text, matmul_efficiency=0.5) == pytest.approx(3 * 2.0)


def test_the_overlapped_step_keeps_the_no_overlap_one_and_its_floor():
  """step 3 s = max(compute 2, memory 1) + collectives 1; 0.5 s hidden:
  2.5 s overlapped, and no more than the collectives can come off."""
  prediction = roofline.Prediction(
      compute_seconds=2.0, bubble_seconds=0.0, memory_seconds=1.0,
      collective_seconds=1.0, memory_traffic_bytes={}, model_flops=8.0,
      num_devices=2, peak_flops=1.0, hidden_collective_seconds=0.5)
  assert prediction.step_seconds == 3.0
  assert prediction.step_seconds_overlapped == 2.5
  assert prediction.mfu == pytest.approx(8 / 2 / 3)
  assert prediction.mfu_overlapped == pytest.approx(8 / 2 / 2.5)
  all_of_it = dataclasses.replace(prediction, hidden_collective_seconds=5.0)
  assert all_of_it.step_seconds_overlapped == 2.0
  json = prediction.ToJson()
  assert (json['step_seconds'], json['step_seconds_overlapped']) == (3.0, 2.5)
