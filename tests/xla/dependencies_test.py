"""What may run beside a collective, and its FLOPs, on hand-written HLO
(no compile).

gpipe.xla.dependencies reads a computation's dependency graph: beside a
collective runs what neither feeds it nor waits for it, transitively; the
work an instruction is worth is its matrix FLOPs (a dot in a fusion, a
loop's body times its trips), none for one holding a collective.
"""

from gpipe.xla import dependencies

# One loop body: an all-reduce of %g beside a dot of %x and %w (in a
# fusion, as XLA:CPU leaves it); a dot that feeds a second all-reduce; a
# dot that waits for the first one (through a control dependency); a loop
# of 3 trips of a convolution; a call of a computation holding an
# all-gather (and a dot).
_HLO = """
HloModule toy

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_dot (p0: f32[64,128], p1: f32[128,32]) -> f32[64,32] {
  %p0 = f32[64,128]{1,0} parameter(0)
  %p1 = f32[128,32]{1,0} parameter(1)
  ROOT %d = f32[64,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%conv_body (c: (s32[], f32[1,8,8,4], f32[3,3,4,16])) -> (s32[], f32[1,8,8,4], f32[3,3,4,16]) {
  %c = (s32[], f32[1,8,8,4]{3,2,1,0}, f32[3,3,4,16]{3,2,1,0}) parameter(0)
  %c.x = f32[1,8,8,4]{3,2,1,0} get-tuple-element(%c), index=1
  %c.k = f32[3,3,4,16]{3,2,1,0} get-tuple-element(%c), index=2
  %conv = f32[1,8,8,16]{3,2,1,0} convolution(%c.x, %c.k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
  ROOT %c.r = (s32[], f32[1,8,8,4]{3,2,1,0}, f32[3,3,4,16]{3,2,1,0}) tuple(%c.x, %c.k)
}

%cond (q: (s32[], f32[1,8,8,4], f32[3,3,4,16])) -> pred[] {
  %q = (s32[], f32[1,8,8,4]{3,2,1,0}, f32[3,3,4,16]{3,2,1,0}) parameter(0)
  ROOT %true = pred[] constant(true)
}

%gathers (g.0: f32[64,128], g.1: f32[128,32]) -> f32[64,32] {
  %g.0 = f32[64,128]{1,0} parameter(0)
  %g.1 = f32[128,32]{1,0} parameter(1)
  %g.d = f32[64,32]{1,0} dot(%g.0, %g.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %ag = f32[64,32]{1,0} all-gather(%g.d), channel_id=3, replica_groups={{0,1}}, dimensions={0}
}

%body (t: (s32[], f32[64,128], f32[128,32], f32[64,32], (s32[], f32[1,8,8,4], f32[3,3,4,16]))) -> f32[64,32] {
  %t = (s32[], f32[64,128]{1,0}, f32[128,32]{1,0}, f32[64,32]{1,0}, (s32[], f32[1,8,8,4]{3,2,1,0}, f32[3,3,4,16]{3,2,1,0})) parameter(0)
  %x = f32[64,128]{1,0} get-tuple-element(%t), index=1
  %w = f32[128,32]{1,0} get-tuple-element(%t), index=2
  %g = f32[64,32]{1,0} get-tuple-element(%t), index=3
  %loop.in = (s32[], f32[1,8,8,4]{3,2,1,0}, f32[3,3,4,16]{3,2,1,0}) get-tuple-element(%t), index=4
  %ar = f32[64,32]{1,0} all-reduce(%g), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %beside = f32[64,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot
  %feeds = f32[64,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot
  %ar.2 = f32[64,32]{1,0} all-reduce(%feeds), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  %waits = f32[64,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot, control-predecessors={%ar}
  %convs = (s32[], f32[1,8,8,4]{3,2,1,0}, f32[3,3,4,16]{3,2,1,0}) while(%loop.in), condition=%cond, body=%conv_body, backend_config={"known_trip_count":{"n":"3"}}
  %gathered = f32[64,32]{1,0} call(%x, %w), to_apply=%gathers
  %sum = f32[64,32]{1,0} add(%ar, %ar.2)
  ROOT %out = f32[64,32]{1,0} add(%sum, %waits)
}
"""

_DOT = 2.0 * 64 * 32 * 128  # result elements x contracted length x 2
_CONV = 3 * 2.0 * 8 * 8 * 16 * (3 * 3 * 4)  # trips x result x kernel / out


def test_beside_a_collective_is_what_neither_feeds_it_nor_waits_for_it():
  """Beside the first all-reduce: the dots that do not touch it (one feeds
  the other all-reduce, which is still independent of this one), the loop
  and the call; not %g (its operand), nor %waits (a control dependency)
  or the adds (its users). Beside the second: not the dot that feeds it."""
  module = dependencies.Module(_HLO)
  first = module.Beside('body', 'ar')
  assert {'beside', 'feeds', 'ar.2', 'convs', 'gathered'} <= first
  assert not {'ar', 'g', 't', 'waits', 'sum', 'out'} & first
  second = module.Beside('body', 'ar.2')
  assert {'beside', 'waits', 'ar', 'g', 'convs'} <= second
  assert not {'feeds', 'x', 'w', 'sum', 'out'} & second


def test_work_is_matrix_flops_and_a_collectives_holder_does_none():
  """The dot fusions 2 x 64 x 32 x 128 each, the loop 3 trips of its
  convolution; the call holds an all-gather: it hides nothing, though it
  computes a dot; the adds count for nothing."""
  work = dependencies.Module(_HLO).Work('body')
  assert work == {'beside': _DOT, 'feeds': _DOT, 'waits': _DOT,
                  'convs': _CONV}
