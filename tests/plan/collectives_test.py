"""What a chip sends per collective, and the floors, by hand.

gpipe.plan.collectives reads the collectives of a partitioned module: the
bytes in the partitioner's dtype (XLA:CPU's widening of bfloat16 undone)
and a chip's share of a ring algorithm; gpipe.plan.traffic_floor derives
the least each mesh axis must carry from a model's shapes. Both on small
hand-written cases (no compile).
"""

import dataclasses
import types

import pytest

from gpipe.plan import collectives
from gpipe.plan import traffic_floor
from gpipe import schedule as schedule_lib
from gpipe.xla import hlo_text
from gpipe.xla import spmd_worker

# What XLA:CPU makes of bfloat16 collectives: an all-reduce widened by
# all-reduce-promotion (its reduction renamed ..._promoted), a permute fed
# by a fusion that converts a bfloat16 to float32, a tuple all-reduce of
# one converted element and one float32 element, a float32 permute of a
# genuine float32, and an all-gather of a converted bfloat16 broadcast;
# each widened one narrowed back to bfloat16 (gpipe.xla.widening).
_HLO = """
%add.clone_promoted (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%region.1 (a.1: f32[], b.1: f32[]) -> f32[] {
  %a.1 = f32[] parameter(0)
  %b.1 = f32[] parameter(1)
  ROOT %s.1 = f32[] add(%a.1, %b.1)
}

%fused_convert_broadcast (q: bf16[4]) -> f32[2,4] {
  %q = bf16[4]{0} parameter(0)
  %c2 = f32[4]{0} convert(%q)
  ROOT %b = f32[2,4]{1,0} broadcast(%c2), dimensions={1}
}

%fused_convert (p: bf16[2,8]) -> f32[16] {
  %p = bf16[2,8]{1,0} parameter(0)
  %c = f32[2,8]{1,0} convert(%p)
  ROOT %r = f32[16]{0} bitcast(%c)
}

ENTRY %main (x: bf16[2,8], y: f32[16], z: f32[4], w: bf16[4]) -> f32[16] {
  %x = bf16[2,8]{1,0} parameter(0)
  %y = f32[16]{0} parameter(1)
  %z = f32[4]{0} parameter(2)
  %w = bf16[4]{0} parameter(3)
  %wide2 = f32[2,4]{1,0} fusion(%w), kind=kLoop, calls=%fused_convert_broadcast
  %ag.1 = f32[2,16]{1,0} all-gather(%wide2), channel_id=5, replica_groups={{0,1,2,3}}, dimensions={1}
  %ag.1.back = bf16[2,16]{1,0} convert(%ag.1)
  %widened = f32[16]{0} fusion(%x), kind=kLoop, calls=%fused_convert
  %ar.1 = f32[16]{0} all-reduce(%y), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add.clone_promoted
  %cp.1 = f32[16]{0} collective-permute(%widened), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cp.1.back = bf16[16]{0} convert(%cp.1)
  %cvt = f32[2,8]{1,0} convert(%x)
  %ar.2 = (f32[2,8]{1,0}, f32[4]{0}) all-reduce(%cvt, %z), channel_id=3, replica_groups={{0,1},{2,3}}, to_apply=%region.1
  %ar.2.0 = f32[2,8]{1,0} get-tuple-element(%ar.2), index=0
  %ar.2.back = bf16[2,8]{1,0} convert(%ar.2.0)
  ROOT %cp.2 = f32[16]{0} collective-permute(%y), channel_id=4, source_target_pairs={{0,1},{1,0}}
}
"""


def _Collectives():
  """The module's five, by name."""
  found, _ = hlo_text.AnalyzeHlo(_HLO)
  assert [c.kind for c in found] == ['all-gather'] + [
      'all-reduce', 'collective-permute'] * 2
  return dict(zip(('ag.1', 'ar.1', 'cp.1', 'ar.2', 'cp.2'), found))


def test_widened_bfloat16_counts_at_its_own_bytes():
  c = _Collectives()
  assert c['ar.1'].wire_bytes == 32  # promoted: 16 x 2 bytes
  assert c['cp.1'].widened == (True,)
  assert c['cp.1'].wire_bytes == 32
  # The tuple: the converted element halves, the float32 one stays.
  assert c['ar.2'].widened == (True, False)
  assert c['ar.2'].wire_bytes == 32 + 16
  assert c['cp.2'].widened == (False,)
  assert c['cp.2'].wire_bytes == c['cp.2'].bytes == 64
  # Converted, then broadcast: still bfloat16's bytes.
  assert c['ag.1'].widened == (True,) and c['ag.1'].wire_bytes == 64


def test_a_chip_sends_its_ring_share():
  c = _Collectives()
  # All-reduce over 4 devices: 2 x 3/4 of its 32 bytes; over 2: once.
  assert collectives.SentBytes(c['ar.1'], 4) == 48
  assert collectives.SentBytes(c['ar.2'], 4) == 48
  assert collectives.SentBytes(c['cp.1'], 4) == 32
  gather = hlo_text.Collective('all-gather', 'f32[8]', 'c', -1,
                               groups=((0, 1, 2, 3),))
  assert collectives.SentBytes(gather, 4) == 24
  scatter = hlo_text.Collective('reduce-scatter', 'f32[2]', 'c', -1,
                                groups=((0, 1, 2, 3),))
  assert collectives.SentBytes(scatter, 4) == 24
  alone = hlo_text.Collective('all-reduce', 'f32[8]', 'c', -1,
                              groups=((0,),))
  assert collectives.SentBytes(alone, 4) == 0


def test_a_nested_loops_collective_counts_every_run():
  """A collective that runs 4 times per iteration of a 3-trip loop (in a
  loop nested in it) sends 12 times its bytes a step and counts 4 times
  per iteration; one whose nested loop has no known trip count cannot be
  counted, and says so."""
  nested = hlo_text.Collective('all-reduce', 'f32[8]', 'inner', 0,
                               groups=((0, 1, 2, 3),), runs=4)
  compiled = types.SimpleNamespace(collectives=[nested], loops=['outer'],
                                   num_devices=4)
  sent = collectives.PerAxis(compiled, {'outer': 3}, (4,), ('stage',))
  assert sent == {'stage': {'all-reduce': 3 * 4 * 1.5 * 32}}
  assert collectives.CountAndWireBytes([nested], lambda c: c.kind) == {
      'all-reduce': {'count': 4, 'bytes': 4 * 32}}
  compiled.collectives = [dataclasses.replace(nested, runs=None)]
  with pytest.raises(spmd_worker.UnknownTripCount, match='nested'):
    collectives.PerAxis(compiled, {'outer': 3}, (4,), ('stage',))


def _Shape(**changes):
  """A [2 stages, 2 data, 4 model] model: 8 rows of 16 tokens x 32 wide,
  bfloat16 between stages and in the body, 3 blocks of 2 reductions each
  and the ends' 2; a table of 100 x 32 gathered over all 16 chips in
  bfloat16, its gradient summed over all of them in float32; another a
  chip needs 50 x 32 of, gathered and summed over the stages."""
  return dataclasses.replace(traffic_floor.ModelShape(
      rows=8, row_elements=16 * 32, activation_bytes=2, model_reductions=6,
      compute_bytes=2, axis_roles={'stage': 0, 'data': 1, 'model': 2},
      tables=((100 * 32, (0, 1, 2), 2, (0, 1, 2), 4),
              (50 * 32, (0,), 2, (0,), 4)), end_reductions=2), **changes)


_SCHEDULE = schedule_lib.Schedule(num_stages=2, num_microbatches=4,
                                  circular_repeat=2)
_A = 8 / 4 / 2 * 16 * 32 * 2  # one microbatch on one chip
_RING = 2 * 3 / 4  # an all-reduce over the 4 model devices


def _FloorsOf(shape, policy='recompute', mesh=(2, 2, 4)):
  return {f.axes: f for f in traffic_floor.Floors(
      shape, _SCHEDULE, mesh, policy, gradient_bytes=1000)}


def test_floors_by_hand():
  floors = _FloorsOf(_Shape())
  assert {axes: f.bytes for axes, f in floors.items()} == pytest.approx({
      # Gathered in bfloat16 and summed in float32 over the stages.
      'stage': 2 * 4 * 2 * _A + 1 / 2 * 50 * 32 * 2 + 1 * 50 * 32 / 2 * 4,
      # Each call reduces 6 forward, 6 backward, and its recomputed
      # forward all but the last: 5.
      'model': ((2 * 6 + 5) * 4 * 2 + 2 * 4) * _RING * _A,
      'data': 1000,
      'stage+data+model': 15 / 16 * 100 * 32 * 2 + 15 * 100 * 32 / 16 * 4,
  })
  stored = _FloorsOf(_Shape(), 'save_dots')
  assert stored['model'].bytes == pytest.approx(
      (2 * 6 * 4 * 2 + 2 * 4) * _RING * _A)
  # Blocks recomputed from stored inputs: as many again as the model says.
  checkpointed = _FloorsOf(_Shape(checkpoint_reductions=3),
                           'save_checkpoints')
  assert checkpointed['model'].bytes == pytest.approx(
      ((2 * 6 + 3) * 4 * 2 + 2 * 4) * _RING * _A)
  # Axes of size 1 split nothing: no floor, and not named in the table's.
  assert set(_FloorsOf(_Shape(), mesh=(2, 1, 1))) == {'stage'}


def test_the_model_floor_without_its_recomputation():
  """The recomputed forward's reductions are a part of their own: the
  floor without them is what the model needs storing everything, the
  same under a policy that recomputes nothing; other axes have none."""
  floors = _FloorsOf(_Shape())
  model = floors['model']
  assert model.parts[traffic_floor.RECOMPUTED] == pytest.approx(
      5 * 4 * 2 * _RING * _A)
  assert model.without_recompute == pytest.approx(
      (2 * 6 * 4 * 2 + 2 * 4) * _RING * _A)
  assert model.without_recompute == pytest.approx(
      _FloorsOf(_Shape(), 'save_all')['model'].bytes)
  assert traffic_floor.RECOMPUTED not in _FloorsOf(_Shape(),
                                                   'save_dots')['model'].parts
  assert floors['stage'].without_recompute == floors['stage'].bytes


def test_a_tables_gradient_is_summed_where_its_copies_differ():
  """A table gathered over every axis but differentiated per stage (the
  model and data devices of a stage compute the same copy's gradient):
  the gather crosses every axis, the gradient only the stages, each chip
  receiving the other stage's share of its 1/16: 1 x E / 16, in the dtype
  the model sums it in. Summed over an axis it is not gathered over, it
  has no floor."""
  e = 64 * 32
  floors = _FloorsOf(_Shape(tables=((e, (0, 1, 2), 2, (0,), 4),)))
  assert floors['stage+data+model'].parts == {
      'tables gathered': 15 / 16 * e * 2}
  assert floors['stage'].parts['tables\' gradients summed'] == e / 16 * 4
  with pytest.raises(ValueError, match='not all among those it is gathered'):
    _FloorsOf(_Shape(tables=((e, (0,), 2, (0, 2), 4),)))


def test_ratios_and_what_sends_under_its_floor():
  floor = traffic_floor.Floor('stage', {'x': 2.0})
  assert traffic_floor.Ratios(
      {'stage': {'collective-permute': 3.0}, 'axis 3': {'all-reduce': 1.0}},
      [floor]) == {'axis 3': (1.0, None), 'stage': (3.0, floor)}
  low = traffic_floor.Floor('model', {'x': 100.0})
  sent = {'stage': {'all-reduce': 3.0}, 'model': {'all-reduce': 94.0}}
  assert traffic_floor.UnderFloor(sent, [floor, low]) == [
      ('model', 94.0, 100.0)]
  sent['model']['all-reduce'] = 95.0
  assert not traffic_floor.UnderFloor(sent, [floor, low])


def _Report(sent, floors):
  """A CandidateReport of one stage that sends `sent` against `floors`,
  fits, and holds nothing else to check."""
  from gpipe.plan import candidate  # pylint: disable=g-import-not-at-top
  report = candidate.CandidateReport(
      candidate=None, schedule=schedule_lib.Schedule(num_stages=1,
                                                     num_microbatches=1),
      compiled=types.SimpleNamespace(param_shard_shapes=[], collectives=[],
                                     peak_bytes=0),
      step=types.SimpleNamespace(args=[]), chip=None, hbm_bytes=1, seconds=0)
  report.sent_per_axis, report.traffic_floors = sent, floors
  report.prediction = types.SimpleNamespace(step_seconds_calibrated=1.0)
  return report


def test_a_step_under_its_floor_is_a_problem_and_not_recommended():
  """Sending less than 0.95 of a floor is the planner's error: a problem,
  which keeps the candidate from being recommended. The text and the JSON
  give the model floor with and without its recomputed part."""
  from gpipe.plan import report as report_lib  # pylint: disable=g-import-not-at-top
  model = traffic_floor.Floor('model', {'the body\'s reductions': 80.0,
                                        traffic_floor.RECOMPUTED: 20.0},
                              ('model',))
  honest = _Report({'model': {'all-reduce': 120.0}}, [model])
  under = _Report({'model': {'all-reduce': 90.0}}, [model])
  assert not honest.Problems()
  (problem,) = under.Problems()
  assert problem.startswith('model sends 0.90 x its floor (90 of 100 bytes')
  plan = report_lib.Plan(num_devices=1, chip=None, hbm_bytes=1,
                         reports=[under, honest], skipped=[])
  assert plan.recommended == 1
  assert report_lib._SentAndFloor(honest) == [  # pylint: disable=protected-access
      "model 120 B / floor 80.0 B = 1.50 [assumes Megatron-style tensor "
      "parallelism: a block's activations reduced after attention and "
      "feed-forward] (a recomputed forward's reductions counted as needed: "
      'floor 100 B, 1.20)']
  assert honest.FloorsJson() == {
      'collective_floor_per_step': {'model': {
          'bytes': 100.0, 'bytes_without_recompute': 80.0,
          'parts': model.parts, 'layout': model.layout}},
      'collective_sent_over_floor': {'model': 1.2},
      'collective_sent_over_floor_without_recompute': {'model': 1.5}}
