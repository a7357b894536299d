"""Benchmarks of the pipelined layer: overhead, Lingvo, memory, compile, SPMD.

    python -m benchmarks.run [--out BENCHMARKS.md] [--quick]

Every figure is a ratio of two things measured in this run, on this machine;
times are medians of several repetitions after warm-up. Sections:

1. Overhead: a training step (forward + backward) of the pipelined layer vs
   the plain stack of the same S * R layers on the same batch and weights,
   divided by the schedule's unavoidable factor: every one of the T
   iterations computes all S stages although only M * R of the T * S slots
   do useful work, so ideal = T / (M * R); and the backward pass recomputes
   the body, so ideal *= 4 / 3 (forward 1, backward 2, recompute 1).
2. Lingvo: the same steps with lingvo's LayerwiseShardablePipelinedLayer
   where it runs on CPU (R = 1), and the configurations only we run.
3. Memory: XLA's buffer assignment for a training step (temporary bytes,
   i.e. activations and workspace), as M grows and as the body's hidden
   width grows with the buffer fixed, per remat policy; against a plain
   tf.while_loop pipeline differentiated by TensorFlow.
3b. Remat policies on a compute-heavy body: step time per policy against
   the plain stack run microbatch by microbatch (the same matmul sizes), over
   the ideal T / (M R) (x 4/3 when the forward is recomputed), and temporary
   bytes, as M, the body's hidden width and R grow.
4. Compile time: tracing plus XLA compilation of a training step vs M, for
   the pipeline and for unroll='always'.
5. Partitioned: XLA's SPMD partitioner on virtual CPU devices: weight bytes
   per device and collective-permute bytes per iteration vs the buffer.
6. One device, any body: default Params against Lingvo's layer and
   layer_by_layer against the plain stack, for bodies of several activations
   and ops (benchmarks.one_device).
"""

import argparse
import dataclasses
import sys
import time

import numpy as np

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
import tensorflow as tf
from benchmarks import bodies
from benchmarks import measure
from benchmarks import one_device
from benchmarks import report
from gpipe import check_partitioning
from gpipe import layers
from gpipe.lingvo_support import flags_and_seeds
from gpipe import schedule
from gpipe.xla import hlo_text
from lingvo.core import gshard_layers

# -----------------------------------------------------------------------------
# 1 + 2. Overhead and Lingvo.


def _Maker(*args, **kwargs):
  """A function instantiating the benchmark layer bodies.Params(...)."""
  return lambda: bodies.Params(*args, **kwargs).Instantiate()


def Overhead(cfg):
  """Sections 1 and 2, for each body size: our layer with its stages
  vectorized (the default) and one after another, Lingvo's, the baseline."""
  rows = []
  for body in cfg.bodies:
    for mode in cfg.modes:
      for s in body.stages:
        for m in (s, 4 * s):
          for r in (1, 2):
            rows.append(_OverheadRow(cfg, body, mode, s, m, r))
            print(f'  overhead {body.name} {mode} S={s} M={m} R={r}: '
                  f'{rows[-1].vs_ideal:.2f}x ideal, stage by stage '
                  f'{rows[-1].steps_vs_ideal:.2f}x, skipping bubbles '
                  f'{rows[-1].skip_vs_ideal:.2f}x, layer by layer '
                  f'{rows[-1].layers_vs_ideal:.2f}x', flush=True)
  return rows


def _OverheadRow(cfg, body, mode, s, m, r):
  """One configuration's steps, timed in rotation (measure.Interleaved)."""
  def Step(forward, **kwargs):
    make = _Maker(s, m, r, body.dim, body.hidden, **kwargs)
    return measure.Step(mode, make, forward, body.batch, body.dim)

  # The schedule's one loop, recomputing as a pod's does (on one device the
  # defaults skip bubbles under jit and keep the dots' outputs for a
  # compute-bound body: the "skip" column skips, section 6 runs the
  # defaults).
  pod_loop = dict(remat_policy='recompute')
  one_loop = dict(skip_bubbles=False, **pod_loop)
  steps = [Step(body.baseline), Step(measure.Pipelined, **one_loop),
           Step(measure.Pipelined, vectorize_stages='never', **one_loop),
           Step(measure.Pipelined, skip_bubbles=True, **pod_loop),
           Step(measure.Pipelined, layer_by_layer=True)]
  if r == 1:
    steps.append(Step(measure.Pipelined,
                      cls=gshard_layers.LayerwiseShardablePipelinedLayer))
  ms = [t * 1e3 for t in measure.Interleaved(steps, cfg.warmup, cfg.reps)]
  baseline, vectorized, one_by_one, skipping, by_layer = ms[:5]
  lingvo = ms[5] if r == 1 else None
  sched = schedule.Schedule(s, m, r)
  return report.OverheadRow(
      body.name, mode, s, m, r, sched.num_iterations, baseline, vectorized,
      one_by_one, skipping,
      sched.CallsComputed(sched.Phases()) / (sched.num_iterations * s),
      by_layer, lingvo)


def _LingvoOnlyFailures(cfg):
  """Configurations Lingvo's layer refuses or fails on this CPU."""
  cases = [
      ('circular_repeat=2', dict(circular_repeat=2)),
      ('circular_repeat=2, shard_stages_1d',
       dict(circular_repeat=2, shard_stages_1d=True)),
      ('shard_stages_1d (graph mode)', dict(shard_stages_1d=True)),
  ]
  out = []
  for name, extra in cases:
    ours = theirs = 'runs'
    for cls in (layers.PipelinedLayer,
                gshard_layers.LayerwiseShardablePipelinedLayer):
      try:
        with tf.Graph().as_default():
          p = bodies.Params(2, 4, 1, cfg.dim, cfg.hidden, cls=cls)
          p.Set(**extra)
          layer = p.Instantiate()
          x = tf.ones([8, cfg.dim])
          fetch = measure.TrainStep(lambda t, l=layer: l.FProp(l.theta, t),
                                    layer.vars.Flatten(), x)
          with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(fetch)
      except Exception as e:  # pylint: disable=broad-except
        first_line = (str(e).splitlines() or [''])[0][:70]
        message = f'fails ({type(e).__name__}{": " if first_line else ""}' \
                  f'{first_line})'
        if cls is layers.PipelinedLayer:
          ours = message
        else:
          theirs = message
    out.append((name, ours, theirs))
  return out


# -----------------------------------------------------------------------------
# 3. Memory.


def Memory(cfg):
  rows = []
  for m in cfg.memory_microbatches:
    rows.append(_MemoryRow(cfg, 'M', m, m, 4))
  for expansion in cfg.memory_expansions:
    rows.append(_MemoryRow(cfg, 'expansion', expansion, 8, expansion))
  return rows


_POLICIES = ('recompute', 'save_dots', 'save_all')


def _MemoryRow(cfg, what, value, m, expansion):
  s, rows_per_mb = cfg.memory_stages, cfg.memory_rows
  batch = m * rows_per_mb
  body = bodies.WideBody.Params().Set(dim=cfg.dim, expansion=expansion)
  results = {'naive': measure.TempBytes(
      _Maker(s, m, 1, cfg.dim, 0, body=body), bodies.NaiveWhileLoopPipeline,
      batch, cfg.dim)}
  for policy in _POLICIES:
    results[policy] = measure.TempBytes(
        _Maker(s, m, 1, cfg.dim, 0, body=body, remat_policy=policy),
        measure.Pipelined, batch, cfg.dim)
  results['layer_by_layer'] = measure.TempBytes(
      _Maker(s, m, 1, cfg.dim, 0, body=body, layer_by_layer=True),
      measure.Pipelined, batch, cfg.dim)
  # What save_all stores of a WideBody per stage and iteration: tanh(x w1)
  # and the mean ([rows, dim] each), the sine's input [rows, k, dim].
  stored = s * rows_per_mb * cfg.dim * (expansion + 2) * 4
  row = report.MemoryRow(what, value, s * rows_per_mb * cfg.dim * 4,
                         schedule.Schedule(s, m, 1).num_iterations, results,
                         stored)
  print(f'  memory {what}={value}: ' +
        ', '.join(f'{k} {v}' for k, v in results.items()), flush=True)
  return row


# -----------------------------------------------------------------------------
# 3b. Remat policies on a compute-heavy body.


def RematPolicies(cfg):
  """Step time and memory per policy vs the plain stack per microbatch."""
  rows = []
  cases = [('M', m, m, 1, cfg.remat_hidden) for m in cfg.remat_microbatches]
  cases += [('hidden', h, cfg.remat_m, 1, h) for h in cfg.remat_hiddens]
  cases += [('R', r, cfg.remat_m, r, cfg.remat_hidden)
            for r in cfg.remat_repeats]
  s, dim = cfg.remat_stages, cfg.remat_dim
  for what, value, m, r, hidden in cases:
    batch = m * cfg.remat_rows
    make = lambda policy, m=m, r=r, hidden=hidden: _Maker(
        s, m, r, dim, hidden, remat_policy=policy)
    temp = {p: measure.TempBytes(make(p), measure.Pipelined, batch, dim)
            for p in _POLICIES}
    temp['plain'] = measure.TempBytes(make('recompute'),
                                      bodies.PlainStackPerMicrobatch, batch,
                                      dim)
    for mode in cfg.modes:
      timed = lambda mk, fwd, mode=mode, batch=batch: measure.Step(  # pylint: disable=g-long-lambda
          mode, mk, fwd, batch, dim).Time(cfg.warmup, cfg.reps) * 1e3
      plain = timed(make('recompute'), bodies.PlainStackPerMicrobatch)
      times = {p: timed(make(p), measure.Pipelined) for p in _POLICIES}
      row = report.RematRow(mode, what, value, s, m, r, hidden,
                            schedule.Schedule(s, m, r).num_iterations, plain,
                            times, temp)
      rows.append(row)
      print(f'  remat {mode} {what}={value}: ' + ', '.join(
          f'{p} {row.VsIdeal(p):.2f}x ideal' for p in _POLICIES), flush=True)
  return rows


# -----------------------------------------------------------------------------
# 4. Compile time.


def CompileTimes(cfg):
  rows = []
  for s in cfg.compile_stages:
    for unroll in ('never', 'always'):
      per_m = {}
      for m in cfg.compile_microbatches:
        step = measure.JitStep(
            _Maker(s, m, 1, cfg.dim, cfg.hidden, unroll=unroll),
            measure.Pipelined, m * 2, cfg.dim)
        per_m[m] = step.Compile()
      rows.append((s, unroll, per_m))
      print(f'  compile S={s} unroll={unroll}: ' + ', '.join(
          f'M={m} {t[1]:.2f}s' for m, t in per_m.items()), flush=True)
  return rows


# -----------------------------------------------------------------------------
# 5. Partitioned.


def _Float32Bytes(hlo_type):
  """Bytes of an f32 HLO result type (the buffer here is float32)."""
  return 4 * sum(int(np.prod(s)) for s in hlo_text.ShapesOf(hlo_type))


def Partitioned(cfg):
  rows = []
  for s, r in cfg.partition_cases:
    m, rows_per_mb = 2 * s, 4
    p = bodies.Params(s, m, r, cfg.dim, cfg.hidden, shard_stages_1d=True)
    result = check_partitioning.CheckPartitioning(
        p, [(m * rows_per_mb, cfg.dim)], s)
    per_device, total = result.WeightBytes()
    permutes = [c for c in result.run.collectives
                if c.kind == 'collective-permute' and c.loop == 0]
    permute_bytes = sum(_Float32Bytes(c.shape) for c in permutes)
    buffer_bytes = rows_per_mb * cfg.dim * 4  # one stage's slot
    rows.append((s, r, per_device, total, len(permutes), permute_bytes,
                 buffer_bytes, result.max_abs_diff))
    print(f'  partitioned S={s} R={r}: {per_device}/{total} weight bytes, '
          f'{len(permutes)} permute(s) of {permute_bytes} bytes', flush=True)
  return rows




@dataclasses.dataclass(frozen=True)
class Body:
  """A body size of sections 1-2 and the baseline it is timed against."""
  name: str
  dim: int
  hidden: int
  batch: int
  stages: tuple
  baseline: object  # (layer, theta, x) -> y: the unpipelined stack


SMALL = Body('small', 64, 256, 128, (2, 4, 8), bodies.PlainStack)
# Compute-heavy, against the plain stack run microbatch by microbatch: the
# same matmul sizes, so the ratio is the schedule's and the loop's alone.
HEAVY = Body('compute-heavy', 128, 512, 2048, (2, 4),
             bodies.PlainStackPerMicrobatch)


@dataclasses.dataclass
class Config:
  flag: str = ''
  modes: tuple = ('graph', 'jit')
  bodies: tuple = (SMALL, HEAVY)
  dim: int = 64
  hidden: int = 256
  batch: int = 128
  warmup: int = 2
  reps: int = 15
  memory_stages: int = 4
  memory_rows: int = 32  # per microbatch
  memory_microbatches: tuple = (4, 8, 16, 32)
  memory_expansions: tuple = (1, 4, 16)
  remat_stages: int = 4
  remat_dim: int = 256
  remat_hidden: int = 1024
  remat_rows: int = 64  # per microbatch
  remat_m: int = 8
  remat_microbatches: tuple = (4, 8, 16)
  remat_hiddens: tuple = (256, 2048)
  remat_repeats: tuple = (2,)
  compile_stages: tuple = (2, 4, 8)
  compile_microbatches: tuple = (4, 16, 64)
  partition_cases: tuple = ((2, 1), (4, 1), (4, 2), (8, 1))
  one_device_bodies: tuple = tuple(b.kind for b in one_device.BODIES)
  one_device_shapes: tuple = one_device.SHAPES


def QuickConfig():
  return Config(flag=' --quick', modes=('jit',),
                bodies=(dataclasses.replace(SMALL, stages=(2,)),), reps=2,
                warmup=1, memory_microbatches=(4, 8), memory_expansions=(1, 4),
                remat_dim=64, remat_hidden=128, remat_rows=16,
                remat_microbatches=(4,), remat_hiddens=(), remat_repeats=(2,),
                compile_stages=(2,), compile_microbatches=(4, 16),
                partition_cases=((2, 1),), one_device_bodies=('relu',),
                one_device_shapes=((2, 8, 1),))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default='BENCHMARKS.md')
  parser.add_argument('--quick', action='store_true',
                      help='a small subset, to check the script runs')
  args = parser.parse_args(argv)
  flags_and_seeds.EnsureFlagsParsed()  # Lingvo's layer reads --xla_device.
  cfg = QuickConfig() if args.quick else Config()
  began = time.perf_counter()
  print('1-2. overhead and Lingvo', flush=True)
  overhead = Overhead(cfg)
  failures = _LingvoOnlyFailures(cfg)
  print('3. memory', flush=True)
  memory = Memory(cfg)
  print('3b. remat policies', flush=True)
  remat_rows = RematPolicies(cfg)
  print('4. compile time', flush=True)
  compile_rows = CompileTimes(cfg)
  print('5. partitioned', flush=True)
  partitioned = Partitioned(cfg)
  print('6. one device, any body', flush=True)
  one_device_rows = one_device.Measure(
      cfg.one_device_bodies, cfg.modes, cfg.one_device_shapes, cfg.reps,
      cfg.warmup, log=lambda line: print(line, flush=True))
  text = report.Markdown(cfg, overhead, failures, memory, remat_rows,
                         compile_rows, partitioned, one_device_rows,
                         time.perf_counter() - began)
  with open(args.out, 'w') as f:
    f.write(text)
  print(text)
  print(f'wrote {args.out}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
