"""Reading a partitioned module's collectives: how often each runs, and in
which dtype, on hand-written HLO whose answers are known (no compile).

gpipe.xla.hlo_text counts a collective in a loop nested in another as
often as the inner loop runs per outer iteration (`Collective.runs`);
gpipe.xla.widening counts a float32 collective at bfloat16's bytes only
where XLA:CPU widened it: fed by a convert from bfloat16 and narrowed
back to bfloat16 by every use (a float32 the program sums itself stays
float32).
"""

import pytest

from gpipe.xla import hlo_text

_TRIPS = 'backend_config={{"known_trip_count":{{"n":"{}"}}}}'

# An outer loop of 3 trips; in its body a permute, an inner loop of 4 trips
# holding an all-reduce, and a call (twice) of a computation holding an
# all-gather; a loop of unknown trips inside the inner loop's body holds a
# reduce-scatter. Outside, one all-reduce.
_NESTED = f"""
%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

%cond (c: (s32[], f32[8])) -> pred[] {{
  %c = (s32[], f32[8]{{0}}) parameter(0)
  ROOT %t = pred[] constant(true)
}}

%unknown_body (u: (s32[], f32[8])) -> (s32[], f32[8]) {{
  %u = (s32[], f32[8]{{0}}) parameter(0)
  %u.0 = s32[] get-tuple-element(%u), index=0
  %u.1 = f32[8]{{0}} get-tuple-element(%u), index=1
  %rs = f32[2]{{0}} reduce-scatter(%u.1), channel_id=5, replica_groups={{{{0,1,2,3}}}}, dimensions={{0}}, to_apply=%add
  ROOT %u.2 = (s32[], f32[8]{{0}}) tuple(%u.0, %u.1)
}}

%inner_body (i: (s32[], f32[8])) -> (s32[], f32[8]) {{
  %i = (s32[], f32[8]{{0}}) parameter(0)
  %i.0 = s32[] get-tuple-element(%i), index=0
  %i.1 = f32[8]{{0}} get-tuple-element(%i), index=1
  %ar.inner = f32[8]{{0}} all-reduce(%i.1), channel_id=2, replica_groups={{{{0,1}},{{2,3}}}}, to_apply=%add
  %w.unknown = (s32[], f32[8]{{0}}) while(%i), condition=%cond, body=%unknown_body
  ROOT %i.2 = (s32[], f32[8]{{0}}) tuple(%i.0, %ar.inner)
}}

%gathers (g: f32[2]) -> f32[8] {{
  %g = f32[2]{{0}} parameter(0)
  ROOT %ag = f32[8]{{0}} all-gather(%g), channel_id=3, replica_groups={{{{0,1,2,3}}}}, dimensions={{0}}
}}

%outer_body (o: (s32[], f32[8])) -> (s32[], f32[8]) {{
  %o = (s32[], f32[8]{{0}}) parameter(0)
  %o.0 = s32[] get-tuple-element(%o), index=0
  %o.1 = f32[8]{{0}} get-tuple-element(%o), index=1
  %cp = f32[8]{{0}} collective-permute(%o.1), channel_id=1, source_target_pairs={{{{0,1}},{{1,2}},{{2,3}},{{3,0}}}}
  %w.inner = (s32[], f32[8]{{0}}) while(%o), condition=%cond, body=%inner_body, {_TRIPS.format(4)}
  %o.2 = f32[2]{{0}} slice(%cp), slice={{[0:2]}}
  %call.1 = f32[8]{{0}} call(%o.2), to_apply=%gathers
  %call.2 = f32[8]{{0}} call(%o.2), to_apply=%gathers
  ROOT %o.3 = (s32[], f32[8]{{0}}) tuple(%o.0, %call.1)
}}

ENTRY %main (x: f32[8]) -> f32[8] {{
  %x = f32[8]{{0}} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{{0}}) tuple(%zero, %x)
  %w.outer = (s32[], f32[8]{{0}}) while(%init), condition=%cond, body=%outer_body, {_TRIPS.format(3)}
  %last = f32[8]{{0}} get-tuple-element(%w.outer), index=1
  ROOT %ar.outside = f32[8]{{0}} all-reduce(%last), channel_id=4, replica_groups={{{{0,1,2,3}}}}, to_apply=%add
}}
"""


def test_a_nested_loop_counts_its_trips():
  """Per iteration of the outer loop: the permute once, the inner loop's
  all-reduce 4 times, the called all-gather once per call; outside, once.
  A loop XLA knows no trip count of leaves its collectives' runs unknown
  (None), not 1."""
  collectives, loops = hlo_text.AnalyzeHlo(_NESTED)
  assert loops == ['outer_body']
  runs = {(c.kind, c.computation): (c.loop, c.runs) for c in collectives}
  assert runs == {
      ('collective-permute', 'outer_body'): (0, 1),
      ('all-reduce', 'inner_body'): (0, 4),
      ('all-gather', 'gathers'): (0, 2),
      ('reduce-scatter', 'unknown_body'): (0, None),
      ('all-reduce', 'main'): (-1, 1),
  }
  # Each named as its instruction (what gpipe.xla.dependencies reads).
  assert [c.name for c in collectives if c.computation == 'outer_body'] == [
      'cp']


# bfloat16 collectives as XLA:CPU leaves them (widened: converted in and
# narrowed back out) and float32 ones a program asks for itself.
_DTYPES = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%widen (p: bf16[16]) -> f32[16] {
  %p = bf16[16]{0} parameter(0)
  %c = f32[16]{0} convert(%p)
  ROOT %r = f32[16]{0} copy(%c)
}

%narrow_inside (q: f32[16], s: f32[16]) -> bf16[4,4] {
  %q = f32[16]{0} parameter(0)
  %s = f32[16]{0} parameter(1)
  %qb = f32[4,4]{1,0} bitcast(%q)
  ROOT %qn = bf16[4,4]{1,0} convert(%qb)
}

%uses_wide (v: f32[16]) -> f32[16] {
  %v = f32[16]{0} parameter(0)
  ROOT %v2 = f32[16]{0} multiply(%v, %v)
}

ENTRY %main (x: bf16[16], y: f32[16]) -> f32[16] {
  %x = bf16[16]{0} parameter(0)
  %y = f32[16]{0} parameter(1)
  %wide = f32[16]{0} fusion(%x), kind=kLoop, calls=%widen
  %cp.widened = f32[16]{0} collective-permute(%wide), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %cp.back = bf16[16]{0} convert(%cp.widened)
  %ag.widened = f32[16]{0} all-gather(%wide), channel_id=2, replica_groups={{0,1}}, dimensions={0}
  %ag.back = bf16[4,4]{1,0} fusion(%ag.widened, %y), kind=kLoop, calls=%narrow_inside
  %sum.f32 = f32[16]{0} all-reduce(%wide), channel_id=3, replica_groups={{0,1}}, to_apply=%add
  %kept = f32[16]{0} add(%sum.f32, %y)
  %cp.both = f32[16]{0} collective-permute(%wide), channel_id=4, source_target_pairs={{0,1},{1,0}}
  %cp.both.back = bf16[16]{0} convert(%cp.both)
  %cp.both.wide = f32[16]{0} fusion(%cp.both), kind=kLoop, calls=%uses_wide
  %a2a = (f32[16]{0}, f32[16]{0}) all-to-all(%wide, %wide), channel_id=5, replica_groups={{0,1}}
  %a2a.0 = f32[16]{0} get-tuple-element(%a2a), index=0
  %a2a.0.back = bf16[16]{0} convert(%a2a.0)
  %a2a.1 = f32[16]{0} get-tuple-element(%a2a), index=1
  %unused = f32[16]{0} collective-permute(%wide), channel_id=6, source_target_pairs={{0,1},{1,0}}
  ROOT %out = f32[16]{0} add(%kept, %a2a.1)
}
"""


def test_only_what_xla_narrows_back_counts_as_bfloat16():
  """Fed by the same convert from bfloat16: the permute and the gather
  narrowed back (the latter inside a fusion, through a bitcast) were
  widened by XLA:CPU, 32 bytes on the wire; the all-reduce the program
  adds in float32, a permute also used in float32, a permute nothing
  reads were not, 64; a tuple's elements each by their own uses."""
  collectives, _ = hlo_text.AnalyzeHlo(_DTYPES)
  assert [c.kind for c in collectives] == [
      'collective-permute', 'all-gather', 'all-reduce', 'collective-permute',
      'all-to-all', 'collective-permute']
  assert [c.widened for c in collectives] == [
      (True,), (True,), (False,), (False,), (True, False), (False,)]
  assert [c.wire_bytes for c in collectives] == [32, 32, 64, 64, 32 + 64, 64]


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
