"""What the compute beside a collective hides, on hand-written HLO whose
answer is known (no compile).

A toy chip makes the figures round: a dot of [64,128] x [128,32] is 1 s of
work, an all-reduce of f32[64,32] over 2 devices 2 s on the link (a chip
sends 2 (n - 1)/n of its 8 KiB at 4 KiB/s). In a loop of 3 trips, the dot
beside the all-reduce hides 1 s of it each trip; a dot that feeds it hides
nothing; two all-reduces beside one dot share its 1 s.
"""

import dataclasses
import types

import pytest

from gpipe.plan import overlap
from gpipe.plan import roofline
from gpipe.xla import hlo_text

_DOT_FLOPS = 2.0 * 64 * 32 * 128
# ICI 2 x 4096 B/s over one port: 4096 B/s a link and direction.
_CHIP = roofline.Chip('toy', peak_flops=_DOT_FLOPS, hbm_bytes=2**30,
                      hbm_bandwidth=1e9, ici_bandwidth=8192, ici_ports=1)

_MODULE = """
HloModule toy

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

%fused_dot (p0: f32[64,128], p1: f32[128,32]) -> f32[64,32] {{
  %p0 = f32[64,128]{{1,0}} parameter(0)
  %p1 = f32[128,32]{{1,0}} parameter(1)
  ROOT %d = f32[64,32]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%body (t: (f32[64,128], f32[128,32], f32[64,32])) -> (f32[64,128], f32[128,32], f32[64,32]) {{
  %t = (f32[64,128]{{1,0}}, f32[128,32]{{1,0}}, f32[64,32]{{1,0}}) parameter(0)
  %x = f32[64,128]{{1,0}} get-tuple-element(%t), index=0
  %w = f32[128,32]{{1,0}} get-tuple-element(%t), index=1
  %g = f32[64,32]{{1,0}} get-tuple-element(%t), index=2
  %y = f32[64,32]{{1,0}} fusion(%x, %w), kind=kCustom, calls=%fused_dot
{collectives}
  ROOT %r = (f32[64,128]{{1,0}}, f32[128,32]{{1,0}}, f32[64,32]{{1,0}}) tuple(%x, %w, %out)
}}

%cond (c: (f32[64,128], f32[128,32], f32[64,32])) -> pred[] {{
  %c = (f32[64,128]{{1,0}}, f32[128,32]{{1,0}}, f32[64,32]{{1,0}}) parameter(0)
  ROOT %true = pred[] constant(true)
}}

ENTRY %main (i: (f32[64,128], f32[128,32], f32[64,32])) -> (f32[64,128], f32[128,32], f32[64,32]) {{
  %i = (f32[64,128]{{1,0}}, f32[128,32]{{1,0}}, f32[64,32]{{1,0}}) parameter(0)
  ROOT %loop = (f32[64,128]{{1,0}}, f32[128,32]{{1,0}}, f32[64,32]{{1,0}}) while(%i), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"3"}}}}
}}
"""

_ALL_REDUCE = ('  %{name} = f32[64,32]{{1,0}} all-reduce(%{operand}), '
               'channel_id={channel}, replica_groups={{{{0,1}}}}, '
               'to_apply=%add')
_ADD = '  %{name} = f32[64,32]{{1,0}} add(%{a}, %{b})'

# The all-reduce of %g beside the dot: nothing ties them.
_BESIDE = [_ALL_REDUCE.format(name='ar', operand='g', channel=1),
           _ADD.format(name='out', a='ar', b='y')]
# The dot feeds the all-reduce.
_FEEDS = [_ALL_REDUCE.format(name='ar', operand='y', channel=1),
          _ADD.format(name='out', a='ar', b='g')]
# Two all-reduces beside the one dot.
_TWO = [_ALL_REDUCE.format(name='ar', operand='g', channel=1),
        _ALL_REDUCE.format(name='ar.2', operand='g', channel=2),
        _ADD.format(name='sum', a='ar', b='ar.2'),
        _ADD.format(name='out', a='sum', b='y')]


def _Hidden(lines, chip=_CHIP):
  """HiddenSeconds of the toy module with these collective lines."""
  text = _MODULE.format(collectives='\n'.join(lines))
  found, loops = hlo_text.AnalyzeHlo(text)
  compiled = types.SimpleNamespace(hlo=text, collectives=found, loops=loops,
                                   num_devices=2)
  return overlap.HiddenSeconds(compiled, hlo_text.LoopTripCounts(text), chip)


def test_an_independent_dot_hides_its_time_or_the_collectives():
  """3 trips x min(2 s of all-reduce, 1 s of dot); on links 8 times as
  fast, 3 x min(0.25 s, 1 s): the whole all-reduce."""
  assert _Hidden(_BESIDE) == pytest.approx(3.0)
  fast = roofline.Chip('fast', _DOT_FLOPS, 2**30, 1e9, 8 * 8192, 1)
  assert _Hidden(_BESIDE, fast) == pytest.approx(3 * 0.25)


def test_a_dot_that_feeds_the_collective_hides_nothing():
  assert _Hidden(_FEEDS) == 0.0


def test_two_collectives_share_the_work_beside_them():
  """Two 2 s all-reduces beside one 1 s dot: 1 s hidden a trip, not 2."""
  assert _Hidden(_TWO) == pytest.approx(3.0)


def test_hidden_is_the_best_sharing_not_the_first():
  """A (1 s) can run beside the dots p and q, B (1 s) beside p only, each
  dot 1 s: A behind q and B behind p hides 2 s, where A taking p first
  would leave B nothing."""
  hidden = overlap.Hidden({'A': 1.0, 'B': 1.0},
                          {'A': {'p', 'q'}, 'B': {'p'}},
                          {'p': 1.0, 'q': 1.0})
  assert hidden == pytest.approx(2.0)
  assert overlap.Hidden({'A': 1.0}, {'A': set()}, {'p': 5.0}) == 0.0


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
