"""One device, any body: the default schedule against Lingvo's layer, and
layer_by_layer against the plain stack, for bodies of several activations.

    python -m benchmarks.one_device [--bodies gelu,tanh] [--modes graph]

Each row times four training steps in rotation (measure.Interleaved): the
plain stack on the whole batch, our layer with default Params (the pod's
schedule), our layer with layer_by_layer=True, and Lingvo's
LayerwiseShardablePipelinedLayer with the same Params (R > 1: unrolled, the
only way it runs a circular schedule on one device).
"""

import argparse
import dataclasses
import sys

import numpy as np

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
import tensorflow as tf
from benchmarks import bodies
from benchmarks import measure
from benchmarks import report
from gpipe.lingvo_support import flags_and_seeds
from lingvo.core import base_layer
from lingvo.core import gshard_layers
from lingvo.core import py_utils

ACTIVATIONS = {
    'gelu': tf.nn.gelu,
    'tanh': tf.tanh,
    'relu': tf.nn.relu,
    'softmax': tf.nn.softmax,
}

SEQUENCE = 8  # attention bodies read rows as sequences of this length
# Each row's rounds take at least this long: the relu body's steps take
# 0.2-0.6 ms, where 15 rounds gave medians 1.5x apart from one run to the
# next.
MIN_SECONDS = 2.0


def _LayerNorm(x):
  mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
  return (x - mean) * tf.math.rsqrt(variance + 1e-6)


def _Attention(x, wq, wk, wv):
  """Single-head softmax attention over rows read as [b, SEQUENCE, d]."""
  seqs = tf.reshape(x, [-1, SEQUENCE, x.shape[-1]])
  q = tf.einsum('btd,dh->bth', seqs, wq)
  k = tf.einsum('btd,dh->bth', seqs, wk)
  v = tf.einsum('btd,dh->bth', seqs, wv)
  probs = tf.nn.softmax(tf.einsum('bth,bsh->bts', q, k) /
                        np.sqrt(wq.shape[-1]))
  return tf.reshape(tf.einsum('bts,bsh->bth', probs, v), [-1, wv.shape[-1]])


class ActivationBody(base_layer.BaseLayer):
  """A residual block of one kind (`kind`), width dim, internal hidden:

      gelu, tanh, relu, softmax:  x + 0.5 act(x w1) w2
      layernorm:                  x + 0.5 relu(LN(x) w1) w2
      attention:                  x + attention(x) w2  (einsum, one head)
      transformer:                y = x + attention(LN(x)) wo;
                                  y + gelu(LN(y) w1) w2
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 32, 'Model (buffer) width.')
    p.Define('hidden', 64, 'Internal width.')
    p.Define('kind', 'relu', 'See the class doc.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    init = py_utils.WeightInit.Gaussian(1.0 / np.sqrt(p.dim))
    shapes = dict(w2=[p.hidden, p.dim])
    if p.kind != 'attention':
      shapes['w1'] = [p.dim, p.hidden]
    if p.kind in ('attention', 'transformer'):
      shapes.update(wq=[p.dim, p.hidden], wk=[p.dim, p.hidden],
                    wv=[p.dim, p.hidden])
    if p.kind == 'transformer':
      shapes['wo'] = [p.hidden, p.dim]
    for name, shape in sorted(shapes.items()):
      self.CreateVariable(name, py_utils.WeightParams(shape, init))

  def FProp(self, theta, x):
    kind = self.params.kind
    if kind in ACTIVATIONS:  # einsums, as Lingvo's and GShard's layers
      return x + 0.5 * tf.einsum('bh,hd->bd', ACTIVATIONS[kind](
          tf.einsum('bd,dh->bh', x, theta.w1)), theta.w2)
    if kind == 'layernorm':
      return x + 0.5 * tf.matmul(tf.nn.relu(tf.matmul(_LayerNorm(x),
                                                      theta.w1)), theta.w2)
    if kind == 'attention':
      return x + tf.matmul(_Attention(x, theta.wq, theta.wk, theta.wv),
                           theta.w2)
    y = x + tf.matmul(_Attention(_LayerNorm(x), theta.wq, theta.wk, theta.wv),
                      theta.wo)
    return y + tf.matmul(tf.nn.gelu(tf.matmul(_LayerNorm(y), theta.w1)),
                         theta.w2)


@dataclasses.dataclass
class Body:
  kind: str
  dim: int
  hidden: int
  batch: int


# The three bodies, then the ordinary ops the vectorized
# layer-by-layer step is checked on, and a Transformer block.
BODIES = (Body('gelu', 128, 512, 2048), Body('tanh', 64, 256, 128),
          Body('relu', 32, 64, 32), Body('softmax', 64, 256, 128),
          Body('layernorm', 64, 256, 128), Body('attention', 64, 64, 256),
          Body('transformer', 64, 256, 256))
SHAPES = ((4, 16, 1), (4, 8, 2), (8, 32, 1), (2, 8, 1))


@dataclasses.dataclass
class Row:
  kind: str
  mode: str
  stages: int
  microbatches: int
  repeats: int
  plain_ms: float
  default_ms: float
  by_layer_ms: float
  lingvo_ms: float

  @property
  def default_vs_lingvo(self):
    return self.default_ms / self.lingvo_ms

  @property
  def by_layer_vs_plain(self):
    return self.by_layer_ms / self.plain_ms


def _LingvoParams(r):
  """Lingvo's layer runs a circular schedule only partitioned (it asserts
  so), so on one device its R > 1 rows are its unrolled stack."""
  extra = dict(cls=gshard_layers.LayerwiseShardablePipelinedLayer)
  if r > 1:
    extra['unroll'] = 'always'
  return extra


def LayerParams(body, s, m, r, **kwargs):
  """Params of a layer of S/M/R stacking `body`, plus kwargs."""
  stage = ActivationBody.Params().Set(
      dim=body.dim, hidden=body.hidden, kind=body.kind)
  return bodies.Params(s, m, r, body.dim, body.hidden, body=stage, **kwargs)


def MeasureRow(body, mode, s, m, r, warmup=3, reps=15):
  """The four steps of one body, mode and S/M/R, timed in rotation."""

  def Step(forward, **kwargs):
    make = lambda: LayerParams(body, s, m, r, **kwargs).Instantiate()
    return measure.Step(mode, make, forward, body.batch, body.dim)

  steps = [
      Step(bodies.PlainStack),
      Step(measure.Pipelined),
      Step(measure.Pipelined, layer_by_layer=True),
      Step(measure.Pipelined, **_LingvoParams(r)),
  ]
  ms = [t * 1e3 for t in measure.Interleaved(steps, warmup, reps,
                                               min_seconds=MIN_SECONDS)]
  return Row(body.kind, mode, s, m, r, *ms)


def Measure(kinds, modes, shapes, reps=15, warmup=3, log=print):
  """Rows for the bodies named in `kinds`, in BODIES' order."""
  rows = []
  for body in BODIES:
    if body.kind not in kinds:
      continue
    for mode in modes:
      for s, m, r in shapes:
        w = MeasureRow(body, mode, s, m, r, warmup=warmup, reps=reps)
        rows.append(w)
        log(f'  one device {w.kind} {mode} {s}/{m}/{r}: default / Lingvo '
            f'{w.default_vs_lingvo:.2f}, layers / plain '
            f'{w.by_layer_vs_plain:.2f}')
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--bodies', default=','.join(b.kind for b in BODIES))
  parser.add_argument('--modes', default='graph,jit')
  parser.add_argument('--shapes', default=None,
                      help='S/M/R triples, e.g. 4/16/1,2/8/1')
  parser.add_argument('--reps', type=int, default=15)
  args = parser.parse_args(argv)
  flags_and_seeds.EnsureFlagsParsed()
  shapes = SHAPES
  if args.shapes:
    shapes = [tuple(int(v) for v in t.split('/'))
              for t in args.shapes.split(',')]
  rows = Measure(args.bodies.split(','), args.modes.split(','), shapes,
                 reps=args.reps, log=lambda line: print(line, flush=True))
  print(report.OneDeviceTable(rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
