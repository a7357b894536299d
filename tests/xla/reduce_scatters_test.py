"""gpipe.xla.reduce_scatters.ScatteredElements on a module written by hand.

The partitioner's reduce-scatter spelling as XLA:CPU leaves it: an
all-reduce each device reads only a dynamic-slice of, that slice fused
into its reader, behind a convert where the reduction ran widened from
bfloat16, or one element of a combined (tuple) all-reduce. An all-reduce
any reader takes whole is not one.
"""

import dataclasses

from gpipe.plan import collectives
from gpipe.xla import hlo_text
from gpipe.xla import reduce_scatters

# What AsTpuRuns reads of a CompiledModule.
_Compiled = dataclasses.make_dataclass(
    '_Compiled', ['hlo', 'collectives', 'loops', 'num_devices'])

# pylint: disable=line-too-long
_MODULE = '''HloModule m

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

%sliced_add (p0: f32[2,8,4], p1: s32[], p2: f32[2,2,4]) -> f32[2,2,4] {
  %p0 = f32[2,8,4]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = f32[2,2,4]{2,1,0} dynamic-slice(%p0, %zero, %p1, %zero), dynamic_slice_sizes={2,2,4}
  %p2 = f32[2,2,4]{2,1,0} parameter(2)
  ROOT %sum = f32[2,2,4]{2,1,0} add(%ds, %p2)
}

%narrowed (q0: f32[2,8,4]) -> bf16[2,8,4] {
  %q0 = f32[2,8,4]{2,1,0} parameter(0)
  ROOT %c = bf16[2,8,4]{2,1,0} convert(%q0)
}

ENTRY %main (x: f32[2,8,4], y: f32[2,2,4], w: f32[4]) -> f32[2,2,4] {
  %x = f32[2,8,4]{2,1,0} parameter(0)
  %y = f32[2,2,4]{2,1,0} parameter(1)
  %w = f32[4]{0} parameter(2)
  %pid = s32[] constant(3)
  %fused = f32[2,8,4]{2,1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%sum
  %f = f32[2,2,4]{2,1,0} fusion(%fused, %pid, %y), kind=kLoop, calls=%sliced_add
  %widened = f32[2,8,4]{2,1,0} all-reduce(%x), channel_id=2, replica_groups={{0,1,2,3}}, to_apply=%sum
  %n = bf16[2,8,4]{2,1,0} fusion(%widened), kind=kLoop, calls=%narrowed
  %zero = s32[] constant(0)
  %ds = bf16[2,2,4]{2,1,0} dynamic-slice(%n, %zero, %pid, %zero), dynamic_slice_sizes={2,2,4}
  %both = (f32[2,8,4]{2,1,0}, f32[4]{0}) all-reduce(%x, %w), channel_id=3, replica_groups={{0,1,2,3}}, to_apply=%sum
  %g0 = f32[2,8,4]{2,1,0} get-tuple-element(%both), index=0
  %g1 = f32[4]{0} get-tuple-element(%both), index=1
  %ds2 = f32[2,2,4]{2,1,0} dynamic-slice(%g0, %zero, %pid, %zero), dynamic_slice_sizes={2,2,4}
  %whole = f32[2,8,4]{2,1,0} all-reduce(%x), channel_id=4, replica_groups={{0,1,2,3}}, to_apply=%sum
  %half = f32[2,8,4]{2,1,0} add(%whole, %whole)
  %ds3 = f32[2,2,4]{2,1,0} dynamic-slice(%whole, %zero, %pid, %zero), dynamic_slice_sizes={2,2,4}
  ROOT %out = f32[2,2,4]{2,1,0} add(%f, %ds2)
}
'''
# pylint: enable=line-too-long


def test_scattered_elements_read_the_partitioners_reduce_scatters():
  found = reduce_scatters.ScatteredElements(_MODULE)
  part = (2, 2, 4)
  assert found == {('main', 'fused'): (part,),
                   ('main', 'widened'): (part,),
                   ('main', 'both'): (part, None),
                   ('main', 'whole'): (None,)}, found
  names = {c.name: c.kind for c in hlo_text.AnalyzeHlo(_MODULE)[0]}
  assert names == dict.fromkeys(['fused', 'widened', 'both', 'whole'],
                                'all-reduce')


def test_a_tpu_runs_each_sliced_all_reduce_as_a_reduce_scatter():
  """AsTpuRuns: `fused` a reduce-scatter of its [2, 2, 4] slice (a chip
  sends 3 x 64 B of it over the 4 devices, where the all-reduce sends
  2 x 3/4 x 256 B); `both` in two parts, its sliced element a
  reduce-scatter and its whole one an all-reduce, under the one name;
  `whole` as it is."""
  found, loops = hlo_text.AnalyzeHlo(_MODULE)
  compiled = _Compiled(_MODULE, found, loops, 4)
  runs = reduce_scatters.AsTpuRuns(compiled)
  kinds = sorted((c.name, c.kind, c.shape) for c in runs.collectives)
  assert kinds == [
      ('both', 'all-reduce', '(f32[4])'),
      ('both', 'reduce-scatter', '(f32[2,2,4])'),
      ('fused', 'reduce-scatter', '(f32[2,2,4])'),
      ('whole', 'all-reduce', 'f32[2,8,4]{2,1,0}'),
      ('widened', 'reduce-scatter', '(f32[2,2,4])')], kinds
  fused = next(c for c in runs.collectives if c.name == 'fused')
  assert collectives.SentBytes(fused, 4) == 3 * 64
  before = next(c for c in found if c.name == 'fused')
  assert collectives.SentBytes(before, 4) == 2 * 3 / 4 * 256
