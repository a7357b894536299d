"""One device: a training step under each backward schedule, side by side.

    .venv/bin/python -m benchmarks.backward_schedules [--quick]

For sections 1-2's two bodies (benchmarks.run: a residual MLP block, small
and compute-heavy), graph mode and jit, S in {2, 4}, M in {S, 4 S}, R in
{1, 2}: the training step (forward + backward) of the default layer
(backward_schedule='reverse', remat_policy='recompute') and of
backward_schedule='1f1b' with 'recompute' and with 'save_dots', timed in
rotation (benchmarks.measure.Interleaved), as ratios to the default. One
device, so stream_io would change nothing but add its rotations; it is
left off. A '1f1b' step runs one forward more than 'reverse' under the
same policy (docs/memory.md): about 5/4 the FLOPs of these bodies.
Prints a Markdown table (BENCHMARKS.md, section 6).
"""

import argparse
import dataclasses
import statistics
import sys
import time

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
from benchmarks import bodies
from benchmarks import measure
from benchmarks import run
from gpipe.lingvo_support import flags_and_seeds

_STEPS = (('reverse', dict()),
          ('1f1b', dict(backward_schedule='1f1b')),
          ('1f1b save_dots', dict(backward_schedule='1f1b',
                                  remat_policy='save_dots')))


@dataclasses.dataclass
class Row:
  body: str
  mode: str
  shape: tuple  # (S, M, R)
  seconds: list  # per _STEPS entry


def Rows(body_list, modes, shapes, warmup, reps):
  rows = []
  for body in body_list:
    for mode in modes:
      for s, m, r in shapes:
        steps = [measure.Step(
            mode, lambda kw=kw: bodies.Params(
                s, m, r, body.dim, body.hidden, **kw).Instantiate(),
            measure.Pipelined, body.batch, body.dim) for _, kw in _STEPS]
        seconds = measure.Interleaved(steps, warmup, reps)
        rows.append(Row(body.name, mode, (s, m, r), seconds))
        ratios = ', '.join(f'{name} {t / seconds[0]:.2f}'
                           for (name, _), t in zip(_STEPS[1:], seconds[1:]))
        print(f'  {body.name} {mode} S={s} M={m} R={r}: reverse '
              f'{seconds[0] * 1e3:.1f} ms; {ratios}', flush=True)
  return rows


def Markdown(rows):
  lines = ['| body | mode | S | M | R | reverse ms | 1f1b / reverse | '
           '1f1b save_dots / reverse |', '|---|---|---|---|---|---|---|---|']
  for row in rows:
    s, m, r = row.shape
    t = row.seconds
    lines.append(f'| {row.body} | {row.mode} | {s} | {m} | {r} | '
                 f'{t[0] * 1e3:.1f} | {t[1] / t[0]:.2f} | {t[2] / t[0]:.2f} |')
  lines += ['', '| body | mode | 1f1b / reverse, median (range) | '
            '1f1b save_dots / reverse, median (range) |', '|---|---|---|---|']
  for body in sorted({r.body for r in rows}):
    for mode in sorted({r.mode for r in rows}):
      group = [r for r in rows if r.body == body and r.mode == mode]
      if not group:
        continue
      cells = []
      for k in (1, 2):
        ratios = [r.seconds[k] / r.seconds[0] for r in group]
        cells.append(f'{statistics.median(ratios):.2f} '
                     f'({min(ratios):.2f}-{max(ratios):.2f})')
      lines.append(f'| {body} | {mode} | {cells[0]} | {cells[1]} |')
  return '\n'.join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--quick', action='store_true',
                      help='one small shape, to check the script runs')
  args = parser.parse_args(argv)
  flags_and_seeds.EnsureFlagsParsed()
  began = time.perf_counter()
  if args.quick:
    rows = Rows((run.SMALL,), ('jit',), ((2, 2, 1),), warmup=1, reps=2)
  else:
    shapes = [(s, m, r) for s in (2, 4) for m in (s, 4 * s) for r in (1, 2)]
    rows = Rows((run.SMALL, run.HEAVY), ('graph', 'jit'), shapes, warmup=2,
                reps=9)
  print(Markdown(rows))
  print(f'\n({(time.perf_counter() - began) / 60:.1f} minutes)')
  return 0


if __name__ == '__main__':
  sys.exit(main())
