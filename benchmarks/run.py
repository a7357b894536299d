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
   width grows with the buffer fixed; against a plain tf.while_loop
   pipeline differentiated by TensorFlow, and store_body_intermediates.
4. Compile time: tracing plus XLA compilation of a training step vs M, for
   the pipeline and for unroll='always'.
5. Partitioned: XLA's SPMD partitioner on virtual CPU devices: weight bytes
   per device and collective-permute bytes per iteration vs the buffer.
"""

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import time

import numpy as np

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
import tensorflow as tf
from gpipe import check_partitioning
from gpipe import layers
from gpipe import partitioning
from gpipe import schedule
from gpipe import trainer
from lingvo.core import base_layer
from lingvo.core import gshard_layers
from lingvo.core import py_utils
from lingvo.core import scatter_update

NestedMap = py_utils.NestedMap

# Team targets the tables are reported against.
TARGET_OVERHEAD_JIT = 1.15   # measured / ideal, jit
TARGET_VS_LINGVO = 1.0       # our time / Lingvo's
TARGET_COMPILE_GROWTH = 1.3  # compile time at M=64 / at M=4


# -----------------------------------------------------------------------------
# The body: a residual MLP block on [rows, dim], hidden width `hidden`.


class MlpBody(base_layer.BaseLayer):
  """x + tanh(x @ w1) @ w2: its activations are [rows, hidden] internally."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 64, 'Model (buffer) width.')
    p.Define('hidden', 256, 'Internal width.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    init = py_utils.WeightInit.Gaussian(1.0 / np.sqrt(p.dim))
    self.CreateVariable('w1', py_utils.WeightParams([p.dim, p.hidden], init))
    self.CreateVariable('w2', py_utils.WeightParams([p.hidden, p.dim], init))

  def FProp(self, theta, x):
    return x + tf.einsum('bh,hd->bd', tf.tanh(
        tf.einsum('bd,dh->bh', x, theta.w1)), theta.w2) * 0.5


class WideBody(base_layer.BaseLayer):
  """Internal activations [rows, expansion, dim], weights fixed at [dim, dim].

  x + mean_k(sin(tanh(x @ w1) * f_k)) @ w2: its internals grow with
  `expansion` while its weights and its input/output (the buffer) do not.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 64, 'Model (buffer) width.')
    p.Define('expansion', 4, 'Internal width / dim.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    init = py_utils.WeightInit.Gaussian(1.0 / np.sqrt(p.dim))
    self.CreateVariable('w1', py_utils.WeightParams([p.dim, p.dim], init))
    self.CreateVariable('w2', py_utils.WeightParams([p.dim, p.dim], init))

  def FProp(self, theta, x):
    p = self.params
    h = tf.tanh(tf.einsum('bd,de->be', x, theta.w1))
    freqs = tf.constant(np.linspace(0.5, 2.0, p.expansion), tf.float32)
    wide = tf.sin(h[:, None, :] * freqs[None, :, None])  # [b, k, d]
    return x + tf.einsum('bd,de->be', tf.reduce_mean(wide, axis=1),
                         theta.w2) * 0.5


def _Params(num_stages, num_microbatches, circular_repeat, dim, hidden,
            cls=layers.PipelinedLayer, body=None, **kwargs):
  body = body or MlpBody.Params().Set(dim=dim, hidden=hidden)
  return cls.Params().Set(
      name='pipe', num_stages=num_stages, num_microbatches=num_microbatches,
      circular_repeat=circular_repeat, unroll='never', random_seed=1,
      single_stage_body=body).Set(**kwargs)


def _PlainStack(layer, theta, x):
  """The unpipelined reference: every logical layer after the other."""
  p = layer.params
  for r in range(p.circular_repeat):
    for s in range(p.num_stages):
      x = layer.body.FProp(layer.layer_theta(theta, r, s), x)
  return x


# -----------------------------------------------------------------------------
# Timing.


def _Median(fn, warmup, reps):
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(reps):
    began = time.perf_counter()
    fn()
    times.append(time.perf_counter() - began)
  return statistics.median(times)


def _TrainStep(forward, variables, x):
  """Loss and gradients w.r.t. the variables and the input."""
  y = forward(x)
  loss = tf.reduce_sum(y * y)
  return [loss] + tf.gradients(loss, variables + [x])


class _GraphStep:
  """A training step in a tf.Graph run by a Session (Lingvo's home)."""

  def __init__(self, make_layer, forward_of, batch, dim):
    self.graph = tf.Graph()
    with self.graph.as_default():
      began = time.perf_counter()
      layer = make_layer()
      x = tf.constant(np.random.RandomState(0).uniform(
          -1, 1, [batch, dim]).astype(np.float32))
      self.fetch = _TrainStep(lambda t: forward_of(layer, layer.theta, t),
                              layer.vars.Flatten(), x)
      self.build_seconds = time.perf_counter() - began
      self.sess = tf.compat.v1.Session(graph=self.graph)
      self.sess.run(tf.compat.v1.global_variables_initializer())

  def Time(self, warmup, reps):
    t = _Median(lambda: self.sess.run(self.fetch), warmup, reps)
    self.sess.close()
    return t


class _JitStep:
  """A training step as tf.function(jit_compile=True), run eagerly."""

  def __init__(self, make_layer, forward_of, batch, dim):
    with tf.init_scope():
      self.layer = make_layer()
    self.x = tf.constant(np.random.RandomState(0).uniform(
        -1, 1, [batch, dim]).astype(np.float32))
    layer = self.layer
    theta = layer.theta
    self.weights = [tf.convert_to_tensor(v) for _, v in theta.FlattenItems()]

    def Step(weights, x):
      with tf.GradientTape() as tape:
        tape.watch(weights + [x])
        y = forward_of(layer, theta.Pack(weights), x)
        loss = tf.reduce_sum(y * y)
      return [loss] + tape.gradient(loss, weights + [x])

    self.fn = tf.function(Step, jit_compile=True, autograph=False)

  def Compile(self):
    """(trace seconds, trace + XLA compile + first run seconds)."""
    began = time.perf_counter()
    with _NoInplaceUpdate():
      self.fn.get_concrete_function(self.weights, self.x)
    traced = time.perf_counter() - began
    self.Run()
    return traced, time.perf_counter() - began

  def Run(self):
    with _NoInplaceUpdate():
      out = self.fn(self.weights, self.x)
    out[0].numpy()

  def Time(self, warmup, reps):
    return _Median(self.Run, warmup, reps)


def _NoInplaceUpdate():
  """Lingvo's Recurrent uses InplaceUpdate, which XLA:CPU cannot compile."""
  return scatter_update.SetInplaceUpdate(False)


def _Pipelined(layer, theta, x):
  return layer.FProp(theta, x)


def _Step(mode, make_layer, forward_of, batch, dim):
  cls = _GraphStep if mode == 'graph' else _JitStep
  return cls(make_layer, forward_of, batch, dim)


# -----------------------------------------------------------------------------
# 1 + 2. Overhead and Lingvo.


@dataclasses.dataclass
class OverheadRow:
  mode: str
  s: int
  m: int
  r: int
  iterations: int
  seq_ms: float
  pipe_ms: float
  lingvo_ms: float = None

  @property
  def ideal(self):
    return self.iterations / (self.m * self.r) * 4.0 / 3.0

  @property
  def ratio(self):
    return self.pipe_ms / self.seq_ms

  @property
  def vs_ideal(self):
    return self.ratio / self.ideal


def _LingvoParams(s, m, dim, hidden):
  return _Params(s, m, 1, dim, hidden,
                 cls=gshard_layers.LayerwiseShardablePipelinedLayer)


def Overhead(cfg):
  rows = []
  for mode in cfg.modes:
    for s in cfg.stages:
      for m in (s, 4 * s):
        for r in (1, 2):
          make = lambda s=s, m=m, r=r: _Params(s, m, r, cfg.dim,  # pylint: disable=g-long-lambda
                                               cfg.hidden).Instantiate()
          seq = _Step(mode, make, _PlainStack, cfg.batch, cfg.dim)
          seq_t = seq.Time(cfg.warmup, cfg.reps)
          pipe = _Step(mode, make, _Pipelined, cfg.batch, cfg.dim)
          pipe_t = pipe.Time(cfg.warmup, cfg.reps)
          lingvo_t = None
          if r == 1:
            make_l = lambda s=s, m=m: _LingvoParams(s, m, cfg.dim,  # pylint: disable=g-long-lambda
                                                    cfg.hidden).Instantiate()
            lingvo = _Step(mode, make_l, _Pipelined, cfg.batch, cfg.dim)
            lingvo_t = lingvo.Time(cfg.warmup, cfg.reps) * 1e3
          sched = schedule.Schedule(s, m, r)
          rows.append(OverheadRow(mode, s, m, r, sched.num_iterations,
                                  seq_t * 1e3, pipe_t * 1e3, lingvo_t))
          print(f'  overhead {mode} S={s} M={m} R={r}: '
                f'{rows[-1].ratio:.2f}x plain, ideal {rows[-1].ideal:.2f}',
                flush=True)
  return rows


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
          p = _Params(2, 4, 1, cfg.dim, cfg.hidden, cls=cls)
          p.Set(**extra)
          layer = p.Instantiate()
          x = tf.ones([8, cfg.dim])
          fetch = _TrainStep(lambda t, l=layer: l.FProp(l.theta, t),
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


def _NaiveWhileLoopPipeline(layer, theta, x):
  """A plain pipeline: tf.while_loop over a shifting [S, ...] buffer, each
  stage's body called on its slot, differentiated by TF, which keeps every
  iteration's intermediates for the backward pass."""
  p = layer.params
  s_count = p.num_stages
  m = p.num_microbatches
  mb = tf.reshape(x, [m, -1, x.shape[-1]])
  iterations = schedule.Schedule(s_count, m, 1).num_iterations
  padded = tf.concat([mb, tf.zeros([s_count - 1] + mb.shape.as_list()[1:])],
                     axis=0)

  def Body(i, buf, outs):
    shifted = tf.concat([padded[i][None], buf[:-1]], axis=0)
    new = tf.stack([
        layer.body.FProp(layer.layer_theta(theta, 0, s), shifted[s])
        for s in range(s_count)
    ])
    outs = outs.write(i, new[-1])
    return i + 1, new, outs

  buf0 = tf.zeros([s_count] + mb.shape.as_list()[1:])
  outs0 = tf.TensorArray(tf.float32, size=iterations)
  _, _, outs = tf.while_loop(lambda i, *_: i < iterations, Body,
                             [tf.constant(0), buf0, outs0],
                             maximum_iterations=iterations)
  y = outs.stack()[s_count - 1:]
  return tf.reshape(y, x.shape)


def _TempBytes(make_layer, forward_of, batch, dim):
  """XLA's temporary bytes of a jit training step (1 device)."""
  step = _JitStep(make_layer, forward_of, batch, dim)
  args = [w.numpy() for w in step.weights] + [step.x.numpy()]
  n = len(step.weights)
  fn = lambda *a: step.fn(list(a[:n]), a[n])  # pylint: disable=unnecessary-lambda
  return partitioning.CompiledMemory(fn, args)['temp_size_in_bytes']


@dataclasses.dataclass
class MemoryRow:
  what: str
  value: int
  buffer_bytes: int  # [S, rows, dim] float32
  iterations: int
  naive: int
  ours: int
  stored: int


_MEMORY_STAGES = 4
_MEMORY_ROWS = 32  # rows per microbatch


def Memory(cfg):
  rows = []
  for m in cfg.memory_microbatches:
    rows.append(_MemoryRow(cfg, 'M', m, m, 4))
  for expansion in cfg.memory_expansions:
    rows.append(_MemoryRow(cfg, 'expansion', expansion, 8, expansion))
  return rows


def _MemoryRow(cfg, what, value, m, expansion):
  s, rows_per_mb = _MEMORY_STAGES, _MEMORY_ROWS
  batch = m * rows_per_mb
  body = WideBody.Params().Set(dim=cfg.dim, expansion=expansion)
  results = {}
  for name, forward, extra in (
      ('naive', _NaiveWhileLoopPipeline, {}),
      ('ours', _Pipelined, {}),
      ('stored', _Pipelined, dict(store_body_intermediates=True))):
    make = lambda: _Params(s, m, 1, cfg.dim, 0, body=body, **extra  # pylint: disable=cell-var-from-loop
                           ).Instantiate()
    results[name] = _TempBytes(make, forward, batch, cfg.dim)
  row = MemoryRow(what, value, s * rows_per_mb * cfg.dim * 4,
                  schedule.Schedule(s, m, 1).num_iterations,
                  results['naive'], results['ours'], results['stored'])
  print(f'  memory {what}={value}: naive {row.naive}, ours {row.ours}, '
        f'stored {row.stored}', flush=True)
  return row


# -----------------------------------------------------------------------------
# 4. Compile time.


def CompileTimes(cfg):
  rows = []
  for s in cfg.compile_stages:
    for unroll in ('never', 'always'):
      per_m = {}
      for m in cfg.compile_microbatches:
        make = lambda s=s, m=m, u=unroll: _Params(  # pylint: disable=g-long-lambda
            s, m, 1, cfg.dim, cfg.hidden, unroll=u).Instantiate()
        step = _JitStep(make, _Pipelined, m * 2, cfg.dim)
        per_m[m] = step.Compile()
      rows.append((s, unroll, per_m))
      print(f'  compile S={s} unroll={unroll}: ' + ', '.join(
          f'M={m} {t[1]:.2f}s' for m, t in per_m.items()), flush=True)
  return rows


# -----------------------------------------------------------------------------
# 5. Partitioned.


def _Float32Bytes(hlo_type):
  """Bytes of an f32 HLO result type (the buffer here is float32)."""
  return 4 * sum(int(np.prod(s)) for s in partitioning.ShapesOf(hlo_type))


def Partitioned(cfg):
  rows = []
  for s, r in cfg.partition_cases:
    m, rows_per_mb = 2 * s, 4
    p = _Params(s, m, r, cfg.dim, cfg.hidden, shard_stages_1d=True)
    report = check_partitioning.CheckPartitioning(
        p, [(m * rows_per_mb, cfg.dim)], s)
    per_device, total = report.WeightBytes()
    permutes = [c for c in report.run.collectives
                if c.kind == 'collective-permute' and c.loop == 0]
    permute_bytes = sum(_Float32Bytes(c.shape) for c in permutes)
    buffer_bytes = rows_per_mb * cfg.dim * 4  # one stage's slot
    rows.append((s, r, per_device, total, len(permutes), permute_bytes,
                 buffer_bytes, report.max_abs_diff))
    print(f'  partitioned S={s} R={r}: {per_device}/{total} weight bytes, '
          f'{len(permutes)} permute(s) of {permute_bytes} bytes', flush=True)
  return rows


# -----------------------------------------------------------------------------
# Report.


def _Fmt(x, digits=2):
  return '-' if x is None else f'{x:.{digits}f}'


def Markdown(cfg, overhead, failures, memory, compile_rows, partitioned,
             seconds):
  lines = ['# Benchmarks', '']
  lines += [
      f'Measured {datetime.date.today()} on {platform.machine()}, '
      f'{os.cpu_count()} CPU cores, Python {platform.python_version()}, '
      f'TensorFlow {tf.__version__}; one CPU device (partitioned figures: '
      'virtual CPU devices). Reproduce with',
      '', '```', f'.venv/bin/python -m benchmarks.run{cfg.flag}', '```', '',
      f'({seconds / 60:.1f} minutes). Every figure is a ratio of two '
      'measurements of this run; times are medians of '
      f'{cfg.reps} repetitions after {cfg.warmup} warm-up runs. Body: a '
      f'residual MLP block, width {cfg.dim}, hidden {cfg.hidden}; '
      f'batch {cfg.batch}.', '']
  lines += _OverheadTable(overhead)
  lines += _LingvoTable(overhead, failures)
  lines += _MemoryTable(memory)
  lines += _CompileTable(compile_rows)
  lines += _PartitionedTable(partitioned)
  return '\n'.join(lines) + '\n'


def _OverheadTable(rows):
  out = ['## 1. Overhead vs the plain stack', '',
         'Training step (forward + backward). ratio = pipelined / plain; '
         'ideal = T / (M R) x 4/3 (bubbles, and the recomputed forward); '
         f'target measured/ideal <= {TARGET_OVERHEAD_JIT} under jit.', '',
         '| mode | S | M | R | T | plain ms | pipelined ms | ratio | ideal '
         '| measured/ideal |', '|---|---|---|---|---|---|---|---|---|---|']
  for r in rows:
    out.append(f'| {r.mode} | {r.s} | {r.m} | {r.r} | {r.iterations} | '
               f'{r.seq_ms:.1f} | {r.pipe_ms:.1f} | {r.ratio:.2f} | '
               f'{r.ideal:.2f} | {r.vs_ideal:.2f} |')
  for mode in sorted({r.mode for r in rows}):
    vals = [r.vs_ideal for r in rows if r.mode == mode]
    out.append('')
    out.append(f'{mode}: median measured/ideal {statistics.median(vals):.2f} '
               f'(range {min(vals):.2f}-{max(vals):.2f}).')
  return out + ['']


def _LingvoTable(rows, failures):
  out = ['## 2. Against Lingvo\'s LayerwiseShardablePipelinedLayer', '',
         'Same Params, same step; Lingvo\'s layer runs on CPU with R = 1 '
         f'only. Target: ours / Lingvo <= {TARGET_VS_LINGVO}.', '',
         '| mode | S | M | ours ms | Lingvo ms | ours / Lingvo |',
         '|---|---|---|---|---|---|']
  ratios = {}
  for r in rows:
    if r.lingvo_ms is None:
      continue
    ratio = r.pipe_ms / r.lingvo_ms
    ratios.setdefault(r.mode, []).append(ratio)
    out.append(f'| {r.mode} | {r.s} | {r.m} | {r.pipe_ms:.1f} | '
               f'{r.lingvo_ms:.1f} | {ratio:.2f} |')
  for mode, vals in sorted(ratios.items()):
    out += ['', f'{mode}: median ours / Lingvo {statistics.median(vals):.2f} '
            f'(range {min(vals):.2f}-{max(vals):.2f}).']
  out += ['', 'Only we run (graph mode, one CPU):', '',
          '| configuration | gpipe | Lingvo |', '|---|---|---|']
  for name, ours, theirs in failures:
    out.append(f'| {name} | {ours} | {theirs} |')
  return out + ['']


def _MemoryTable(rows):
  out = ['## 3. Activation memory', '',
         'XLA temporary bytes of a jit training step (buffer assignment, one '
         'device): naive = a tf.while_loop pipeline differentiated by '
         'TensorFlow; ours = recompute (default); stored = '
         f'store_body_intermediates. S = {_MEMORY_STAGES}, microbatches of '
         f'{_MEMORY_ROWS} rows; the body (WideBody) has internal activations '
         '[rows, expansion, dim] and fixed [dim, dim] weights. buffer x T = '
         'one [S, rows, dim] buffer per iteration. Varying M: expansion 4; '
         'varying the expansion: M = 8.', '',
         '| varied | value | T | buffer x T KiB | naive KiB | ours KiB | '
         'stored KiB | ours / (buffer x T) |',
         '|---|---|---|---|---|---|---|---|']
  for r in rows:
    bt = r.buffer_bytes * r.iterations
    out.append(f'| {r.what} | {r.value} | {r.iterations} | {bt / 1024:.0f} '
               f'| {r.naive / 1024:.0f} | {r.ours / 1024:.0f} | '
               f'{r.stored / 1024:.0f} | {r.ours / bt:.2f} |')
  wide = [r for r in rows if r.what == 'expansion']
  if len(wide) > 1:
    first, last = wide[0], wide[-1]
    out += ['', f'Body internals x{last.value // first.value}: ours '
            f'x{last.ours / first.ours:.2f}, naive x{last.naive / first.naive:.2f}'
            f', stored x{last.stored / first.stored:.2f}.']
  return out + ['']


def _CompileTable(rows):
  out = ['## 4. Compile time', '',
         'Tracing + XLA compilation + first run of a jit training step, '
         'seconds; growth = at the largest M / at the smallest. Target '
         f'growth <= {TARGET_COMPILE_GROWTH}.', '']
  ms = list(rows[0][2]) if rows else []
  out.append('| S | path | ' + ' | '.join(f'M={m}' for m in ms) +
             ' | growth |')
  out.append('|---|---|' + '---|' * len(ms) + '---|')
  for s, unroll, per_m in rows:
    path = 'pipelined' if unroll == 'never' else "unroll='always'"
    vals = [per_m[m][1] for m in ms]
    out.append(f'| {s} | {path} | ' + ' | '.join(f'{v:.2f}' for v in vals) +
               f' | {vals[-1] / vals[0]:.2f} |')
  return out + ['']


def _PartitionedTable(rows):
  out = ['## 5. Partitioned (XLA SPMD partitioner, virtual CPU devices)', '',
         'shard_stages_1d over S devices, M = 2S microbatches of 4 rows. '
         'Permute bytes: the forward loop\'s collective-permutes per '
         'iteration, per device; buffer: one stage\'s slot of the buffer.', '',
         '| S = devices | R | weight bytes / device | total | share | '
         'permutes / iteration | permute bytes | buffer bytes | max |diff| |',
         '|---|---|---|---|---|---|---|---|---|']
  for s, r, per_device, total, n, pb, bb, diff in rows:
    out.append(f'| {s} | {r} | {per_device} | {total} | '
               f'{per_device / total:.3f} | {n} | {pb} | {bb} | {diff:.1e} |')
  return out + ['']


# -----------------------------------------------------------------------------


@dataclasses.dataclass
class Config:
  flag: str = ''
  modes: tuple = ('graph', 'jit')
  stages: tuple = (2, 4, 8)
  dim: int = 64
  hidden: int = 256
  batch: int = 128
  warmup: int = 2
  reps: int = 7
  memory_microbatches: tuple = (4, 8, 16, 32)
  memory_expansions: tuple = (1, 4, 16)
  compile_stages: tuple = (2, 4, 8)
  compile_microbatches: tuple = (4, 16, 64)
  partition_cases: tuple = ((2, 1), (4, 1), (4, 2), (8, 1))


def QuickConfig():
  return Config(flag=' --quick', modes=('jit',), stages=(2,), reps=2,
                warmup=1, memory_microbatches=(4, 8), memory_expansions=(1, 4),
                compile_stages=(2,), compile_microbatches=(4, 16),
                partition_cases=((2, 1),))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default='BENCHMARKS.md')
  parser.add_argument('--quick', action='store_true',
                      help='a small subset, to check the script runs')
  args = parser.parse_args(argv)
  trainer.EnsureFlagsParsed()  # Lingvo's layer reads --xla_device.
  cfg = QuickConfig() if args.quick else Config()
  began = time.perf_counter()
  print('1-2. overhead and Lingvo', flush=True)
  overhead = Overhead(cfg)
  failures = _LingvoOnlyFailures(cfg)
  print('3. memory', flush=True)
  memory = Memory(cfg)
  print('4. compile time', flush=True)
  compile_rows = CompileTimes(cfg)
  print('5. partitioned', flush=True)
  partitioned = Partitioned(cfg)
  text = Markdown(cfg, overhead, failures, memory, compile_rows, partitioned,
                  time.perf_counter() - began)
  with open(args.out, 'w') as f:
    f.write(text)
  print(text)
  print(f'wrote {args.out}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
