"""Each one-device default against what it replaces, side by side.

    python -m benchmarks.one_device_defaults [--bodies gelu,tanh] [--modes jit]

On one device, remat_policy=None keeps the dots' outputs for a body of at
least loop_choices.MIN_FLOPS_PER_CALL_TO_SAVE_DOTS a microbatch, and
skip_bubbles=None skips the fill's and drain's bubbles under XLA for
one of at least MIN_FLOPS_PER_CALL_TO_SKIP_BUBBLES. For section 6's bodies
and shapes (benchmarks.one_device) this times, in rotation in one process,
the default step, the same step recomputing (remat_policy='recompute') and
the same step in one loop (skip_bubbles=False), and prints the ratios: the
check that each threshold sits where its choice starts to pay.
"""

import argparse
import dataclasses
import sys

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
import tensorflow as tf
from benchmarks import measure
from benchmarks import one_device
from gpipe.lingvo_support import flags_and_seeds
from gpipe.pipeline import loop_choices

ALTERNATIVES = (('recompute', dict(remat_policy='recompute')),
                ('one loop', dict(skip_bubbles=False)))


@dataclasses.dataclass
class Row:
  kind: str
  mode: str
  shape: str
  slot_mflops: float
  default_ms: float
  recompute_ms: float
  one_loop_ms: float


def SlotMflops(body, s, m, r):
  """loop_choices.CallFlops of the body on one microbatch, in millions."""
  with tf.Graph().as_default():
    layer = one_device.LayerParams(body, s, m, r).Instantiate()
    sched = layer.Schedule(m)
    rows = tf.zeros([m, body.batch // m, body.dim])
    return loop_choices.CallFlops(sched, layer.theta.Flatten(), [rows]) / 1e6


def MeasureRow(body, mode, s, m, r, reps):
  steps = [measure.Step(mode, lambda kw=kw: one_device.LayerParams(
                            body, s, m, r, **kw).Instantiate(),
                        measure.Pipelined, body.batch, body.dim)
           for kw in [{}] + [kw for _, kw in ALTERNATIVES]]
  ms = [t * 1e3 for t in measure.Interleaved(
      steps, 3, reps, min_seconds=one_device.MIN_SECONDS)]
  return Row(body.kind, mode, f'{s}/{m}/{r}', SlotMflops(body, s, m, r), *ms)


def Table(rows):
  lines = ['| body | mode | S/M/R | MFLOPs a call | default ms | '
           'recompute ms | one loop ms | default / recompute | '
           'default / one loop |', '|---|---|---|---|---|---|---|---|---|']
  for w in rows:
    lines.append(
        f'| {w.kind} | {w.mode} | {w.shape} | {w.slot_mflops:.2f} | '
        f'{w.default_ms:.2f} | {w.recompute_ms:.2f} | {w.one_loop_ms:.2f} | '
        f'{w.default_ms / w.recompute_ms:.2f} | '
        f'{w.default_ms / w.one_loop_ms:.2f} |')
  return '\n'.join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--bodies',
                      default=','.join(b.kind for b in one_device.BODIES))
  parser.add_argument('--modes', default='graph,jit')
  parser.add_argument('--reps', type=int, default=15)
  args = parser.parse_args(argv)
  flags_and_seeds.EnsureFlagsParsed()
  rows = []
  kinds = args.bodies.split(',')
  for body in [b for b in one_device.BODIES if b.kind in kinds]:
    for mode in args.modes.split(','):
      for s, m, r in one_device.SHAPES:
        rows.append(MeasureRow(body, mode, s, m, r, args.reps))
        w = rows[-1]
        print(f'  {w.kind} {mode} {w.shape}: {w.slot_mflops:.2f} MFLOPs a '
              f'slot, default / recompute '
              f'{w.default_ms / w.recompute_ms:.2f}, default / one loop '
              f'{w.default_ms / w.one_loop_ms:.2f}', flush=True)
  print(Table(rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
