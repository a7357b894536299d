"""Which float32 collectives XLA:CPU widened from bfloat16, where fusions
read their results: hand-written HLO whose answers are known (no compile).

gpipe.xla.widening counts a float32 collective fed by a convert from
bfloat16 at bfloat16's bytes only where every use narrows it back. A
fusion is one use per operand position, and inside it the parameter is
read as any other value: every use there must narrow it too. A fusion
that narrows one position, or one use of its parameter, and computes in
float32 with another reads float32 values a TPU would have to send, so
the collective stays at float32's bytes. Each module here feeds its
collectives from the same converts, so only the way out tells them apart.
"""

import pytest

from gpipe.xla import hlo_text

# The fused computations the modules below call, each with its parameters
# used as its name says.
_FUSED = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%add.bf16 (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}

%narrows_one_of_two (p: f32[16], q: f32[16]) -> bf16[16] {
  %p = f32[16]{0} parameter(0)
  %q = f32[16]{0} parameter(1)
  %p.n = bf16[16]{0} convert(%p)
  %q.sq = f32[16]{0} multiply(%q, %q)
  %q.n = bf16[16]{0} convert(%q.sq)
  ROOT %r = bf16[16]{0} add(%p.n, %q.n)
}

%mixed_uses (p: f32[16], s: f32[16]) -> bf16[16] {
  %p = f32[16]{0} parameter(0)
  %s = f32[16]{0} parameter(1)
  %p.n = bf16[16]{0} convert(%p)
  %sum = f32[16]{0} add(%p, %s)
  %sum.n = bf16[16]{0} convert(%sum)
  ROOT %r = bf16[16]{0} add(%p.n, %sum.n)
}

%narrows_every_use (p: f32[16], s: f32[16]) -> bf16[16] {
  %p = f32[16]{0} parameter(0)
  %s = f32[16]{0} parameter(1)
  %p.n = bf16[16]{0} convert(%p)
  %p.b = f32[4,4]{1,0} bitcast(%p)
  %p.bn = bf16[4,4]{1,0} convert(%p.b)
  %p.bnf = bf16[16]{0} bitcast(%p.bn)
  %s.n = bf16[16]{0} convert(%s)
  %sum = bf16[16]{0} add(%p.bnf, %s.n)
  ROOT %r = bf16[16]{0} add(%p.n, %sum)
}

%narrows_reshaped (p: f32[8]) -> bf16[2,4] {
  %p = f32[8]{0} parameter(0)
  %p.b = f32[2,4]{1,0} bitcast(%p)
  ROOT %p.n = bf16[2,4]{1,0} convert(%p.b)
}

%reduces_in_f32 (p: f32[16]) -> bf16[4,4] {
  %p = f32[16]{0} parameter(0)
  %p.b = f32[4,4]{1,0} bitcast(%p)
  %p.n = bf16[4,4]{1,0} convert(%p.b)
  %zero = f32[] constant(0)
  %rows = f32[4]{0} reduce(%p.b, %zero), dimensions={1}, to_apply=%add
  %rows.b = f32[4,4]{1,0} broadcast(%rows), dimensions={0}
  %rows.n = bf16[4,4]{1,0} convert(%rows.b)
  ROOT %r = bf16[4,4]{1,0} multiply(%p.n, %rows.n)
}

%reduces_in_bf16 (p: f32[16]) -> bf16[4,4] {
  %p = f32[16]{0} parameter(0)
  %p.b = f32[4,4]{1,0} bitcast(%p)
  %p.n = bf16[4,4]{1,0} convert(%p.b)
  %zero = bf16[] constant(0)
  %rows = bf16[4]{0} reduce(%p.n, %zero), dimensions={1}, to_apply=%add.bf16
  %rows.b = bf16[4,4]{1,0} broadcast(%rows), dimensions={0}
  ROOT %r = bf16[4,4]{1,0} multiply(%p.n, %rows.b)
}

%calls_reduces_in_f32 (p: f32[16]) -> bf16[4,4] {
  %p = f32[16]{0} parameter(0)
  %p.c = f32[16]{0} copy(%p)
  ROOT %r = bf16[4,4]{1,0} fusion(%p.c), kind=kLoop, calls=%reduces_in_f32
}

%calls_reduces_in_bf16 (p: f32[16]) -> bf16[4,4] {
  %p = f32[16]{0} parameter(0)
  %p.c = f32[16]{0} copy(%p)
  ROOT %r = bf16[4,4]{1,0} fusion(%p.c), kind=kLoop, calls=%reduces_in_bf16
}
"""

# Each module's entry opens so: a bfloat16 of 16 elements (and one of 8)
# converted to float32, as XLA:CPU feeds a widened collective, and a
# float32 of the program's own.
_ENTRY_HEAD = """
  %x = bf16[16]{0} parameter(0)
  %x8 = bf16[8]{0} parameter(1)
  %y = f32[16]{0} parameter(2)
  %wide = f32[16]{0} convert(%x)
  %wide8 = f32[8]{0} convert(%x8)
"""

# A sum, not promoted (XLA:CPU's promotion alone would say widened).
_GROUPS = 'replica_groups={{0,1}}, to_apply=%add'


def _Collectives(body, result='bf16[16]'):
  """{name: Collective} of the module whose entry goes on with `body`
  (its ROOT of type `result`)."""
  entry = (f'ENTRY %main (x: bf16[16], x8: bf16[8], y: f32[16]) -> {result} '
           '{' + _ENTRY_HEAD + body + '}\n')
  collectives, _ = hlo_text.AnalyzeHlo(_FUSED + entry)
  return {c.name: c for c in collectives}


def _Reduce(name, channel):
  """An all-reduce of %wide (16 float32 elements), as an entry's line."""
  return (f'  %{name} = f32[16]{{0}} all-reduce(%wide), '
          f'channel_id={channel}, {_GROUPS}\n')


def test_a_fusion_that_narrows_one_of_two_positions_keeps_float32():
  """The all-reduce read by one fusion at two positions, the first
  narrowed and the second squared in float32: not widened, 64 bytes; at
  two positions that both narrow every use, widened, 32."""
  c = _Collectives(
      _Reduce('ar.one', 1) + _Reduce('ar.both', 2) +
      '  %one = bf16[16]{0} fusion(%ar.one, %ar.one), kind=kLoop, '
      'calls=%narrows_one_of_two\n'
      '  %both = bf16[16]{0} fusion(%ar.both, %ar.both), kind=kLoop, '
      'calls=%narrows_every_use\n'
      '  ROOT %out = bf16[16]{0} add(%one, %both)\n')
  assert c['ar.one'].widened == (False,)
  assert c['ar.one'].wire_bytes == 64
  assert c['ar.both'].widened == (True,)
  assert c['ar.both'].wire_bytes == 32


def test_a_fusion_parameter_also_added_in_float32_keeps_float32():
  """Inside the fusion the parameter is narrowed and also added to a
  float32 before its own narrowing: not widened, 64 bytes."""
  c = _Collectives(
      _Reduce('ar', 1) +
      '  ROOT %out = bf16[16]{0} fusion(%ar, %y), kind=kLoop, '
      'calls=%mixed_uses\n')
  assert c['ar'].widened == (False,)
  assert c['ar'].wire_bytes == 64


def test_a_fusion_parameter_narrowed_by_every_use_is_widened():
  """The same fusion with the sum taken of the parameter narrowed
  (through a bitcast): widened, 32 bytes."""
  c = _Collectives(
      _Reduce('ar', 1) +
      '  ROOT %out = bf16[16]{0} fusion(%ar, %y), kind=kLoop, '
      'calls=%narrows_every_use\n')
  assert c['ar'].widened == (True,)
  assert c['ar'].wire_bytes == 32


def test_a_tuple_result_element_by_element():
  """A combined all-reduce of 8 and 16 float32 elements: element 0
  narrowed by each of its uses (a convert, a reshape and a fusion's
  bitcast), widened, 16 bytes; element 1 narrowed by a convert but read
  in float32 at one of a fusion's positions, not widened, 64: 80 in all
  (80 tells it from the elements swapped, 64)."""
  c = _Collectives(
      '  %ar = (f32[8]{0}, f32[16]{0}) all-reduce(%wide8, %wide), '
      f'channel_id=1, {_GROUPS}\n'
      '  %ar.0 = f32[8]{0} get-tuple-element(%ar), index=0\n'
      '  %ar.0.n = bf16[8]{0} convert(%ar.0)\n'
      '  %ar.0.r = f32[2,4]{1,0} reshape(%ar.0)\n'
      '  %ar.0.rn = bf16[2,4]{1,0} convert(%ar.0.r)\n'
      '  %ar.0.again = f32[8]{0} get-tuple-element(%ar), index=0\n'
      '  %ar.0.f = bf16[2,4]{1,0} fusion(%ar.0.again), kind=kLoop, '
      'calls=%narrows_reshaped\n'
      '  %ar.1 = f32[16]{0} get-tuple-element(%ar), index=1\n'
      '  %ar.1.n = bf16[16]{0} convert(%ar.1)\n'
      '  %ar.1.f = bf16[16]{0} fusion(%ar.1, %ar.1), kind=kLoop, '
      'calls=%narrows_one_of_two\n'
      '  ROOT %out = (bf16[8]{0}, bf16[2,4]{1,0}, bf16[2,4]{1,0}, '
      'bf16[16]{0}, bf16[16]{0}) tuple(%ar.0.n, %ar.0.rn, %ar.0.f, '
      '%ar.1.n, %ar.1.f)\n',
      result='(bf16[8], bf16[2,4], bf16[2,4], bf16[16], bf16[16])')
  assert c['ar'].widened == (True, False)
  assert c['ar'].wire_bytes == 16 + 64


def test_a_bitcast_inside_a_fusion_is_followed_to_each_of_its_uses():
  """Inside the fusion the parameter's bitcast is narrowed and also
  summed in float32 (a reduce): not widened, 64 bytes; the same with the
  sum of the narrowed bitcast, widened, 32. Either fusion called from
  inside another (through a copy): the same answers."""
  c = _Collectives(
      _Reduce('ar.f32', 1) + _Reduce('ar.bf16', 2) +
      _Reduce('ar.nested.f32', 3) + _Reduce('ar.nested.bf16', 4) +
      '  %f32 = bf16[4,4]{1,0} fusion(%ar.f32), kind=kLoop, '
      'calls=%reduces_in_f32\n'
      '  %bf16 = bf16[4,4]{1,0} fusion(%ar.bf16), kind=kLoop, '
      'calls=%reduces_in_bf16\n'
      '  %nested.f32 = bf16[4,4]{1,0} fusion(%ar.nested.f32), kind=kLoop, '
      'calls=%calls_reduces_in_f32\n'
      '  %nested.bf16 = bf16[4,4]{1,0} fusion(%ar.nested.bf16), '
      'kind=kLoop, calls=%calls_reduces_in_bf16\n'
      '  ROOT %out = (bf16[4,4]{1,0}, bf16[4,4]{1,0}, bf16[4,4]{1,0}, '
      'bf16[4,4]{1,0}) tuple(%f32, %bf16, %nested.f32, %nested.bf16)\n',
      result='(bf16[4,4], bf16[4,4], bf16[4,4], bf16[4,4])')
  assert {name: (c[name].widened, c[name].wire_bytes) for name in c} == {
      'ar.f32': ((False,), 64),
      'ar.bf16': ((True,), 32),
      'ar.nested.f32': ((False,), 64),
      'ar.nested.bf16': ((True,), 32),
  }


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
