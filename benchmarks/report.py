"""Writes the benchmark results as BENCHMARKS.md tables."""

import dataclasses
import datetime
import os
import platform
import statistics

import tensorflow as tf

# Team targets the tables are reported against.
TARGET_OVERHEAD = {  # measured / ideal, per (body, mode)
    ('small', 'graph'): 2.0, ('small', 'jit'): 1.15,
    ('compute-heavy', 'graph'): 1.15, ('compute-heavy', 'jit'): 1.05}
TARGET_VS_LINGVO = 0.95      # our time / Lingvo's, median (1.05 each)
TARGET_COMPILE_GROWTH = 1.3  # compile time at M=64 / at M=4


@dataclasses.dataclass
class OverheadRow:
  body: str
  mode: str
  s: int
  m: int
  r: int
  iterations: int
  seq_ms: float  # the baseline (the plain stack)
  pipe_ms: float  # ours, the stages vectorized (the default)
  steps_ms: float  # ours, the stages one after another
  skip_ms: float  # ours, skip_bubbles=True
  skip_slots: float  # modelled: the share of T x S slots it computes
  layers_ms: float  # ours, layer_by_layer=True
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

  @property
  def steps_vs_ideal(self):
    return self.steps_ms / self.seq_ms / self.ideal

  @property
  def skip_vs_ideal(self):
    return self.skip_ms / self.seq_ms / self.ideal

  @property
  def layers_vs_ideal(self):
    return self.layers_ms / self.seq_ms / self.ideal


@dataclasses.dataclass
class MemoryRow:
  what: str
  value: int
  buffer_bytes: int  # [S, rows, dim] float32
  iterations: int
  temp: dict  # 'naive' and each remat policy -> XLA temporary bytes
  stored_bytes: int  # modelled: what save_all stores per iteration

  @property
  def extra_vs_model(self):
    """(save_all - recompute) / (iterations x stored per iteration)."""
    extra = self.temp['save_all'] - self.temp['recompute']
    return extra / (self.iterations * self.stored_bytes)


# The forward runs twice per step under 'recompute' (forward 1, backward 2,
# recomputed forward 1); the other policies store the matmul outputs.
RECOMPUTE_FACTOR = {'recompute': 4.0 / 3.0, 'save_dots': 1.0, 'save_all': 1.0}


@dataclasses.dataclass
class RematRow:
  mode: str
  what: str
  value: int
  s: int
  m: int
  r: int
  hidden: int
  iterations: int
  plain_ms: float  # the plain stack, microbatch by microbatch
  ms: dict  # policy -> step ms
  temp: dict  # policy (and 'plain') -> XLA temporary bytes (jit)

  def Ideal(self, policy):
    return self.iterations / (self.m * self.r) * RECOMPUTE_FACTOR[policy]

  def VsIdeal(self, policy):
    return self.ms[policy] / self.plain_ms / self.Ideal(policy)


def Markdown(cfg, overhead, failures, memory, remat_rows, compile_rows,
             partitioned, one_device_rows, seconds):
  lines = ['# Benchmarks', '']
  lines += [
      f'Measured {datetime.date.today()} on {platform.machine()}, '
      f'{os.cpu_count()} CPU cores, Python {platform.python_version()}, '
      f'TensorFlow {tf.__version__}; one CPU device (partitioned figures: '
      'virtual CPU devices). Reproduce with',
      '', '```', f'.venv/bin/python -m benchmarks.run{cfg.flag}', '```', '',
      f'({seconds / 60:.1f} minutes). Every figure is a ratio of two '
      'measurements of this run; times are medians of '
      f'{cfg.reps} repetitions after {cfg.warmup} warm-up runs, the steps '
      'compared in a row of sections 1-2 timed in rotation (one run of each '
      'per round). Bodies: a '
      'residual MLP block; sections 1-2: ' + '; '.join(
          f'{b.name}, width {b.dim}, hidden {b.hidden}, batch {b.batch}'
          for b in cfg.bodies) + '; sections 3-6 say their own.', '']
  lines += [
      'Nothing here is predicted. The pod-scale figures (the step time and '
      'MFU of the planned flagships and largest LMs) are predictions of the '
      "planner's roofline model of a TPU from the step XLA compiles for "
      'virtual CPU devices, not measurements: [docs/flagships.md]'
      '(docs/flagships.md) (`python -m benchmarks.flagships`, '
      '`python -m benchmarks.largest`).', '']
  lines += _OverheadTable(overhead)
  lines += _LingvoTable(overhead, failures)
  lines += _MemoryTable(cfg, memory)
  lines += _RematTable(cfg, remat_rows)
  lines += _CompileTable(cfg, compile_rows)
  lines += _PartitionedTable(partitioned)
  lines += _OneDeviceSection(one_device_rows)
  return '\n'.join(lines) + '\n'


def _OneDeviceSection(rows):
  return [
      '## 6. One device, any body', '',
      'Training step, graph mode (a Session) and jit, each row\'s four steps '
      'timed in rotation: the plain stack on the whole batch, our layer '
      'with default Params (the schedule a pod runs; in graph mode its loops '
      'compiled by XLA: `compile_loops`), our layer with '
      '`layer_by_layer=True`, and Lingvo\'s LayerwiseShardablePipelinedLayer '
      'with the same Params. Lingvo\'s layer runs a circular schedule only '
      'partitioned (it asserts so), so its R = 2 rows are its unrolled '
      'stack, i.e. the plain stack: there the pipeline\'s bubbles, its '
      'loop and (for bodies under 2 MFLOPs a microbatch) its recomputed '
      'forward are the gap. The defaults on one device: under jit the fill '
      'and drain skip their bubble slots for a body of at least 1 MFLOP a '
      'microbatch (`skip_bubbles`), and the loop keeps its dots\' outputs '
      'rather than recomputing them for one of at least 2 MFLOPs (gelu, '
      'transformer: `remat_policy`). Bodies: x + 0.5 act(x w1) w2 for '
      'gelu (width 128, hidden 512, batch 2048), tanh (64, 256, 128), relu '
      '(32, 64, 32: microbatches of 1-4 rows) and softmax (64, 256, 128); '
      'layernorm: x + 0.5 relu(LN(x) w1) w2; attention: x + einsum '
      'softmax attention over rows read as sequences of 8, w2 (64, 64, '
      '256); transformer: attention and a gelu MLP, each after a layer norm '
      'with a residual (64, 256, 256). Targets per body and mode: default / '
      f'Lingvo median <= {DEFAULT_VS_LINGVO[0]}, every row <= '
      f'{DEFAULT_VS_LINGVO[1]}; layers / plain median <= '
      f'{LAYERS_VS_PLAIN[0]}, every row <= {LAYERS_VS_PLAIN[1]} (the '
      'recomputed forward included).', '', OneDeviceTable(rows), '']


# Section 6's targets, per body and mode over the S/M/R shapes: ours /
# Lingvo's layer with default Params, and layer by layer / the plain stack
# (median, every row).
DEFAULT_VS_LINGVO = (0.95, 1.1)
LAYERS_VS_PLAIN = (1.25, 1.4)


def OneDeviceTable(rows):
  """Section 6's table (benchmarks.one_device rows) and, per body and
  mode, its two verdicts."""
  lines = [
      '| body | mode | S | M | R | plain ms | default ms | layers ms | '
      'Lingvo ms | default / Lingvo | layers / plain |',
      '|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for w in rows:
    lines.append(
        f'| {w.kind} | {w.mode} | {w.stages} | {w.microbatches} | '
        f'{w.repeats} | {w.plain_ms:.2f} | {w.default_ms:.2f} | '
        f'{w.by_layer_ms:.2f} | {w.lingvo_ms:.2f} | '
        f'{w.default_vs_lingvo:.2f} | {w.by_layer_vs_plain:.2f} |')
  lines.append('')
  for kind, mode in dict.fromkeys((w.kind, w.mode) for w in rows):
    mine = [w for w in rows if (w.kind, w.mode) == (kind, mode)]
    vs_lingvo = [w.default_vs_lingvo for w in mine]
    vs_plain = [w.by_layer_vs_plain for w in mine]
    lines.append(
        f'- {kind}, {mode}: default / Lingvo '
        f'{_Targeted(vs_lingvo, *DEFAULT_VS_LINGVO)}; layers / plain '
        f'{_Targeted(vs_plain, *LAYERS_VS_PLAIN)}')
  return '\n'.join(lines)


def _Targeted(values, median_target, each_target):
  """'median m (range lo-hi), target <= t, each <= e (verdict)'."""
  return (f'{_Spread(values)}, target <= {median_target}, each <= '
          f'{each_target} {_Verdict(values, median_target, each_target)}')


def _OverheadTable(rows):
  out = ['## 1. Overhead vs the plain stack', '',
         'Training step (forward + backward). ratio = pipelined / baseline; '
         'ideal = T / (M R) x 4/3 (bubbles, and the recomputed forward). '
         'Ours runs the S stages of an iteration as one vectorized '
         'computation (the default) in one loop that recomputes its '
         'forward, as a pod\'s does (skip_bubbles=False, '
         'remat_policy=\'recompute\': on one device the defaults skip '
         'bubbles under jit for a body of a million FLOPs a microbatch, as '
         '"skip" does, and keep the dots\' outputs for one of two; section '
         '6 runs the defaults); "one by one" is the same layer with '
         'vectorize_stages=\'never\'; "skip" with skip_bubbles=True, which '
         'computes the share "slots" of the T x S slots (modelled: '
         'Schedule.Phases), so its ideal is lower than the one given; '
         '"layers" with layer_by_layer=True, which computes no bubble at all '
         'and by default keeps its dots\' outputs (its ideal is 1 to 4/3). '
         'The '
         'small body\'s baseline is the '
         'plain stack on the whole batch; the compute-heavy body\'s, the '
         'plain stack run microbatch by microbatch (the same matmul sizes). '
         'Targets (measured/ideal): ' + ', '.join(
             f'{b} {m} <= {t}' for (b, m), t in TARGET_OVERHEAD.items()) +
         '.', '']
  for body in _Ordered({r.body for r in rows}):
    body_rows = [r for r in rows if r.body == body]
    out += [f'{body} body:', '',
            '| mode | S | M | R | T | baseline ms | ours ms | one by one ms '
            '| skip ms | layers ms | slots | ideal | ours/ideal | '
            'one by one/ideal | skip/ideal | layers/ideal | '
            'ours / one by one |',
            '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|'
            '---|---|']
    for r in body_rows:
      out.append(
          f'| {r.mode} | {r.s} | {r.m} | {r.r} | {r.iterations} | '
          f'{r.seq_ms:.1f} | {r.pipe_ms:.1f} | {r.steps_ms:.1f} | '
          f'{r.skip_ms:.1f} | {r.layers_ms:.1f} | {r.skip_slots:.2f} | '
          f'{r.ideal:.2f} | {r.vs_ideal:.2f} | {r.steps_vs_ideal:.2f} | '
          f'{r.skip_vs_ideal:.2f} | {r.layers_vs_ideal:.2f} | '
          f'{r.pipe_ms / r.steps_ms:.2f} |')
    for mode in sorted({r.mode for r in body_rows}):
      mode_rows = [r for r in body_rows if r.mode == mode]
      target = TARGET_OVERHEAD[(body, mode)]
      out += ['', f'{body}, {mode}: ours/ideal ' + _Spread(
          [r.vs_ideal for r in mode_rows]) + f'; target <= {target} ' +
              _Verdict([r.vs_ideal for r in mode_rows], target) +
              '; one by one ' + _Spread(
                  [r.steps_vs_ideal for r in mode_rows]) + '; skip ' +
              _Spread([r.skip_vs_ideal for r in mode_rows]) + '; layers ' +
              _Spread([r.layers_vs_ideal for r in mode_rows]) + '.']
    out.append('')
  return out


def _Spread(values):
  """'median m (range lo-hi)'."""
  return (f'median {statistics.median(values):.2f} (range '
          f'{min(values):.2f}-{max(values):.2f})')


def _Verdict(values, median_target, each_target=None):
  """'(met)' or '(MISSED: ...)': where a target is missed, said with it."""
  misses = []
  median = statistics.median(values)
  if median > median_target:
    misses.append(f'median {median:.2f} > {median_target}')
  if each_target is not None:
    above = [v for v in values if v > each_target]
    if above:
      misses.append(f'{len(above)} of {len(values)} above {each_target}')
  return f'(MISSED: {", ".join(misses)})' if misses else '(met)'


def _Ordered(names):
  return sorted(names, key=lambda n: (n != 'small', n))


def _LingvoTable(rows, failures):
  out = ['## 2. Against Lingvo\'s LayerwiseShardablePipelinedLayer', '',
         'Same Params, same step (ours: one loop, as in section 1; skip: '
         'ours with skip_bubbles=True; '
         'layers: ours with layer_by_layer=True); '
         'Lingvo\'s layer runs on CPU with R = 1 '
         f'only. Target: ours / Lingvo <= {TARGET_VS_LINGVO} at the median, '
         '<= 1.05 at every configuration.', '',
         '| body | mode | S | M | ours ms | one by one ms | skip ms | '
         'layers ms | Lingvo ms | ours / Lingvo | one by one / Lingvo | '
         'skip / Lingvo | layers / Lingvo |',
         '|---|---|---|---|---|---|---|---|---|---|---|---|---|']
  ratios = {}
  for r in rows:
    if r.lingvo_ms is None:
      continue
    ratio, skip = r.pipe_ms / r.lingvo_ms, r.skip_ms / r.lingvo_ms
    by_layer = r.layers_ms / r.lingvo_ms
    ratios.setdefault((r.body, r.mode), []).append((ratio, skip, by_layer))
    out.append(f'| {r.body} | {r.mode} | {r.s} | {r.m} | {r.pipe_ms:.1f} | '
               f'{r.steps_ms:.1f} | {r.skip_ms:.1f} | {r.layers_ms:.1f} | '
               f'{r.lingvo_ms:.1f} | {ratio:.2f} | '
               f'{r.steps_ms / r.lingvo_ms:.2f} | {skip:.2f} | '
               f'{by_layer:.2f} |')
  for (body, mode), vals in sorted(ratios.items(),
                                   key=lambda kv: (kv[0][0] != 'small', kv[0])):
    out += ['', f'{body}, {mode}: ours / Lingvo ' +
            _Spread([v[0] for v in vals]) + ' ' +
            _Verdict([v[0] for v in vals], TARGET_VS_LINGVO, 1.05) +
            '; skip / Lingvo ' +
            _Spread([v[1] for v in vals]) + '; layers / Lingvo ' +
            _Spread([v[2] for v in vals]) + '.']
  out += ['', 'Only we run (graph mode, one CPU):', '',
          '| configuration | gpipe | Lingvo |', '|---|---|---|']
  for name, ours, theirs in failures:
    out.append(f'| {name} | {ours} | {theirs} |')
  return out + ['']


_POLICIES = ('recompute', 'save_dots', 'save_all')


def _MemoryTable(cfg, rows):
  out = ['## 3. Activation memory', '',
         'XLA temporary bytes of a jit training step (buffer assignment, one '
         'device), per remat_policy; naive = a tf.while_loop pipeline '
         'differentiated by TensorFlow (which stores every intermediate, '
         'per-iteration weight slices included). '
         f'S = {cfg.memory_stages}, microbatches of {cfg.memory_rows} rows; '
         'the body (WideBody) has internal activations [rows, expansion, '
         'dim] and fixed [dim, dim] weights. buffer x T = one [S, rows, dim] '
         'buffer per iteration. Varying M: expansion 4; varying the '
         'expansion: M = 8. stored x T (modelled, not measured): what '
         'save_all stores of this body, S x rows x dim x (expansion + 2) '
         'floats per iteration (tanh(x w1), the sine\'s input, the mean); '
         'extra / stored = (save_all - recompute) / (stored x T): at most 1 '
         'when nothing but activations is stored. layer by layer: '
         'layer_by_layer=True (recompute), which stores one [M, rows, dim] '
         'input per layer but runs the body on all M microbatches at once.',
         '',
         '| varied | value | T | buffer x T KiB | naive KiB | ' +
         ' | '.join(f'{p} KiB' for p in _POLICIES) +
         ' | layer by layer KiB | save_all / naive | recompute / (buffer x T) '
         '| stored x T KiB | extra / stored |',
         '|---|---|---|---|---|' + '---|' * len(_POLICIES) +
         '---|---|---|---|---|']
  for r in rows:
    bt = r.buffer_bytes * r.iterations
    out.append(f'| {r.what} | {r.value} | {r.iterations} | {bt / 1024:.0f} '
               f'| {r.temp["naive"] / 1024:.0f} | ' +
               ' | '.join(f'{r.temp[p] / 1024:.0f}' for p in _POLICIES) +
               f' | {r.temp["layer_by_layer"] / 1024:.0f}'
               f' | {r.temp["save_all"] / r.temp["naive"]:.2f} | '
               f'{r.temp["recompute"] / bt:.2f} | '
               f'{r.stored_bytes * r.iterations / 1024:.0f} | '
               f'{r.extra_vs_model:.2f} |')
  wide = [r for r in rows if r.what == 'expansion']
  if len(wide) > 1:
    first, last = wide[0], wide[-1]
    growth = ', '.join(
        f'{k} x{last.temp[k] / first.temp[k]:.2f}'
        for k in ('naive',) + _POLICIES + ('layer_by_layer',))
    out += ['', f'Body internals x{last.value // first.value}: {growth}.']
  return out + ['']


def _RematTable(cfg, rows):
  out = ['## 3b. Remat policies on a compute-heavy body', '',
         'Training step of a residual MLP (width '
         f'{cfg.remat_dim}, hidden as listed), S = {cfg.remat_stages}, '
         f'microbatches of {cfg.remat_rows} rows. Baseline: the plain stack '
         'run microbatch by microbatch (gradient accumulation: the same '
         'matmul sizes as the pipeline). x ideal = (policy / baseline) / '
         '(T / (M R) x f), f = 4/3 for recompute (the forward runs again), 1 '
         'for save_dots and save_all (the matmuls run once; save_dots redoes '
         'the tanh). Temporary bytes: XLA buffer assignment of the jit step, '
         'one device (plain = the baseline).', '',
         '| mode | varied | M | R | hidden | T | plain ms | ' +
         ' | '.join(f'{p} ms (x ideal)' for p in _POLICIES) + ' | ' +
         ' | '.join(f'{p} MiB' for p in ('plain',) + _POLICIES) + ' |',
         '|---|---|---|---|---|---|---|' + '---|' * (2 * len(_POLICIES) + 1)]
  for r in rows:
    out.append(
        f'| {r.mode} | {r.what} | {r.m} | {r.r} | {r.hidden} | '
        f'{r.iterations} | {r.plain_ms:.1f} | ' +
        ' | '.join(f'{r.ms[p]:.1f} ({r.VsIdeal(p):.2f})' for p in _POLICIES) +
        ' | ' + ' | '.join(f'{r.temp[p] / 2**20:.1f}'
                           for p in ('plain',) + _POLICIES) + ' |')
  for mode in sorted({r.mode for r in rows}):
    line = []
    for p in _POLICIES:
      vals = [r.VsIdeal(p) for r in rows if r.mode == mode]
      line.append(f'{p} {statistics.median(vals):.2f} '
                  f'({min(vals):.2f}-{max(vals):.2f})')
    out += ['', f'{mode}: median x ideal: ' + '; '.join(line) + '.']
  return out + ['']


def _CompileTable(cfg, rows):
  out = ['## 4. Compile time', '',
         'Tracing + XLA compilation + first run of a jit training step '
         f'(width {cfg.dim}, hidden {cfg.hidden}, microbatches of 2 rows), '
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
