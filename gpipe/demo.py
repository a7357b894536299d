"""Demo: pipeline a small stack of Lingvo layers, compare with running it plainly.

    python -m gpipe.demo [--stages 4] [--microbatches 6] [--circular-repeat 2]

Builds a PipelinedLayer over Lingvo's FCLayer (S stages x R circular
repeats), prints the schedule, then runs one forward+backward step in a
tf.compat.v1.Session and prints the largest difference between the pipelined
layer and the same weights applied layer after layer (via layer_theta).
"""

import argparse
import time

import numpy as np

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)
import tensorflow as tf
from gpipe import layers
from lingvo.core import layers as lingvo_layers


def _Args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--stages', type=int, default=4)
  parser.add_argument('--microbatches', type=int, default=6)
  parser.add_argument('--circular-repeat', type=int, default=2)
  parser.add_argument('--batch', type=int, default=24)
  parser.add_argument('--dim', type=int, default=16)
  return parser.parse_args(argv)


def _PipelineParams(args):
  body = lingvo_layers.FCLayer.Params().Set(
      input_dim=args.dim, output_dim=args.dim, activation='TANH')
  return layers.PipelinedLayer.Params().Set(
      name='pipeline',
      num_stages=args.stages,
      num_microbatches=args.microbatches,
      circular_repeat=args.circular_repeat,
      single_stage_body=body,
      unroll='never',
      random_seed=1)


def _Sequential(layer, theta, x):
  """The plain stack: each logical layer (repeat-major) after the other."""
  p = layer.params
  for r in range(p.circular_repeat):
    for s in range(p.num_stages):
      x = layer.body.FProp(layer.layer_theta(theta, r, s), x)
  return x


def main(argv=None):
  args = _Args(argv)
  p = _PipelineParams(args)
  with tf.Graph().as_default():
    layer = p.Instantiate()
    sched = layer.Schedule(args.microbatches)
    print(f'PipelinedLayer: {args.stages} stages x {args.circular_repeat} '
          f'circular repeats = {sched.num_layers} FCLayers of width {args.dim}; '
          f'batch {args.batch} in {args.microbatches} microbatches.')
    print(f'{sched.num_iterations} loop iterations, bubble fraction '
          f'{sched.bubble_fraction:.2f}. Schedule (microbatch/repeat):')
    print(sched.Render())

    rng = np.random.RandomState(0)
    x = tf.constant(rng.uniform(-1, 1, [args.batch, args.dim]), tf.float32)
    cotangent = tf.constant(rng.uniform(-1, 1, [args.batch, args.dim]),
                            tf.float32)
    variables = layer.vars.Flatten()
    results = {}
    for name, fn in (('pipelined', layer.FProp), ('sequential', None)):
      y = (fn(layer.theta, x) if fn else _Sequential(layer, layer.theta, x))
      loss = tf.reduce_sum(y * cotangent)
      results[name] = (y, tf.gradients(loss, variables + [x]))

    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      start = time.time()
      values = sess.run(results)
      elapsed = time.time() - start
  (y_p, g_p), (y_s, g_s) = values['pipelined'], values['sequential']
  fwd = float(np.abs(y_p - y_s).max())
  bwd = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
            for a, b in zip(g_p, g_s))
  print(f'max |pipelined - sequential|: outputs {fwd:.2e}, gradients '
        f'(all {len(variables)} variables and the input) {bwd:.2e}')
  print(f'(one forward+backward step of both: {elapsed:.2f} s)')
  ok = fwd <= 1e-5 and bwd <= 1e-4
  print('MATCH' if ok else 'MISMATCH')
  return 0 if ok else 1


if __name__ == '__main__':
  raise SystemExit(main())
