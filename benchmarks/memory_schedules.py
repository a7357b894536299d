"""What a chip holds under each backward schedule: docs/memory.md's table.

    .venv/bin/python -m benchmarks.memory_schedules

plans the activation-heavy stack below (8 stages of one tanh(x w + b)
layer, width 512, a batch of 4096 rows: 8 MiB of activations, 1 MiB of
weights a stage) for 8 devices with the planner (gpipe.plan: the training
step with Adam, compiled by XLA's SPMD partitioner from shapes, not run),
under backward_schedule 'reverse' and '1f1b', with and without stream_io,
for two remat policies and M = 64 and 128, and prints a Markdown table.
Every figure is measured by XLA:CPU on the partitioned module; the bound
is the one 1f1b with stream_io is built to meet (4/S of the batch's
activations, 2 R S + 8 microbatch activations, 4 MiB for the weights'
gradients and update). About two minutes on 2 cores.

The same stack on the command line:

    .venv/bin/python -m gpipe.plan --params benchmarks.memory_schedules.StackParams \\
        --input_shape 4096,512 --num_devices 8 --num_microbatches 64,128 \\
        --backward_schedule reverse,1f1b --stream_io false,true
"""

import sys
import time

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
from gpipe import layers
from gpipe.lingvo_support import flags_and_seeds
from gpipe import plan
from gpipe.plan import roofline
from tests import reference_bodies

NUM_STAGES = 8
BATCH = 4096
DIM = 512
MIB = 2**20


def StackParams():
  """The activation-heavy stack: 8 stages of tanh(x w + b), width 512."""
  return layers.PipelinedLayer.Params().Set(
      name='stack', num_stages=NUM_STAGES, num_microbatches=64,
      shard_stages_1d=True, unroll='never',
      single_stage_body=reference_bodies.DenseBody.Params().Set(dim=DIM))


def Bound(num_microbatches, circular_repeat=1):
  """Bytes: 4/S of the batch, 2 R S + 8 microbatch activations, 4 MiB."""
  batch = BATCH * DIM * 4
  return (4 * batch / NUM_STAGES +
          (2 * circular_repeat * NUM_STAGES + 8) * batch / num_microbatches +
          4 * MIB)


def _Candidates():
  return [plan.Candidate(m, 1, policy, backward_schedule=schedule,
                         stream_io=stream_io)
          for schedule in ('reverse', '1f1b')
          for stream_io in (False, True)
          for policy in ('recompute', 'save_dots')
          for m in (64, 128)]


def Table(reports):
  """The Markdown table of the reports; FLOPs against the default's
  ('reverse', 'recompute', no stream_io) at the same M."""
  base = {r.candidate.num_microbatches: r.flops_per_device for r in reports
          if r.backward_schedule == 'reverse' and not r.stream_io and
          r.candidate.remat_policy == 'recompute'}
  lines = [
      '| backward_schedule | stream_io | remat_policy | M | temp MiB | '
      'stored MiB | peak MiB | bound MiB | FLOP/device | / default |',
      '|---|---|---|---|---|---|---|---|---|---|']
  for r in reports:
    c = r.candidate
    flops = r.flops_per_device
    lines.append(
        f'| {r.backward_schedule} | {r.stream_io} | {c.remat_policy} | '
        f'{c.num_microbatches} | {r.per_device_bytes["temp"] / MIB:.2f} | '
        f'{r.stored_activation_bytes / MIB:.2f} | '
        f'{r.per_device_bytes["peak"] / MIB:.2f} | '
        f'{Bound(c.num_microbatches) / MIB:.2f} | {flops:.3g} | '
        f'{flops / base[c.num_microbatches]:.3f} |')
  return '\n'.join(lines)


def main():
  flags_and_seeds.EnsureFlagsParsed()
  start = time.time()
  result = plan.MakePlan(
      plan.LayerTarget(StackParams(), [(BATCH, DIM)]), _Candidates(),
      NUM_STAGES, roofline.CHIPS['v5e'], 16 * 2**30,
      log=lambda m: print(m, file=sys.stderr, flush=True))
  print(Table(result.reports))
  print(f'\n(planned in {time.time() - start:.0f} s)')
  return 0


if __name__ == '__main__':
  sys.exit(main())
