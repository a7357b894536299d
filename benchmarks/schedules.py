"""The bubble each backward schedule leaves: 1f1b, zero bubble, branches.

    python -m benchmarks.schedules    # about 10 s: one block compiled 3 times

Prints, at S = 4, 8; M = S, 2S, 4S; R = 1, 2, the weighted bubble of the
gradient loop (gpipe.schedule.ZeroBubble: the loop in lockstep less one
stage's work, in units of one call's F + B + W) of 1f1b, of zero bubble,
of zero bubble with per-stage branches, and the fill's bound h (S - 1) F,
for two weightings of F, B and W:

  * equal: F = B = W;
  * the pod block's FLOPs: params.pod_blocks' block at
    lm.LargestOn8x16GiB's sizes (width 4096, 32 heads, feed-forward 16384,
    one sequence of 1024), compiled for one CPU device from shapes: F its forward, B its input gradient alone, W
    the rest of its whole backward. A count of XLA's cost analysis, not a
    time: a TPU's B and W also differ in how well their matmuls run.

The figures are modelled (the schedule's arithmetic weighted by those
costs), not measured: no step here is run, or timed.
"""

import argparse
import sys

from gpipe import quiet  # pylint: disable=g-bad-import-order

if __name__ == '__main__':
  quiet.UnlessVerbose()

import tensorflow as tf  # pylint: disable=g-import-not-at-top
from gpipe import schedule as schedule_lib  # pylint: disable=g-import-not-at-top
from gpipe.lingvo_support import flags_and_seeds  # pylint: disable=g-import-not-at-top
from gpipe.xla import partitioning  # pylint: disable=g-import-not-at-top
from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
from params import pod_blocks  # pylint: disable=g-import-not-at-top

GRID = [(s, m, r) for s in (4, 8) for m in (s, 2 * s, 4 * s) for r in (1, 2)]
POD_BLOCK = dict(model_dim=4096, num_heads=32, hidden_dim=16384,
                 seq_len=1024)


def BlockFlops(model_dim, num_heads, hidden_dim, seq_len, batch=1):
  """{'forward', 'input gradient', 'weight gradient'}: XLA's FLOPs of one
  pod block (params.pod_blocks) on [batch, seq_len, model_dim]."""
  flags_and_seeds.EnsureFlagsParsed()
  block = pod_blocks.PodStageParams(1, pod_blocks.PodBlockParams(
      model_dim, num_heads, hidden_dim, 0.0, fused_qkv=True)).Set(
          name='block').Instantiate()
  theta = block.theta
  weights = theta.Flatten()
  w_specs = [tf.TensorSpec(w.shape, w.dtype) for w in weights]
  x_spec = tf.TensorSpec([batch, seq_len, model_dim], tf.float32)

  def Forward(x, *w):
    with py_utils.GlobalStepContext(tf.constant(0, tf.int64)):
      return block.FProp(theta.Pack(list(w)), x, tf.zeros(x.shape[:2]))[0]

  def Gradients(wrt_weights):
    def Fn(x, dy, *w):
      w = list(w)
      with tf.GradientTape() as tape:
        tape.watch([x] + w)
        y = Forward(x, *w)
      # y too, so that the module computes all of the forward pass (a
      # gradient alone need not: the last matmul's product, say).
      return [y] + tape.gradient(y, [x] + (w if wrt_weights else []),
                                 output_gradients=dy)
    return Fn

  def Flops(fn, specs):
    proto = partitioning.LowerFromShapes(fn, specs)
    return partitioning.CompileFromShapes(proto, 1).Cost('flops')

  forward = Flops(Forward, [x_spec] + w_specs)
  input_only = Flops(Gradients(False), [x_spec, x_spec] + w_specs)
  both = Flops(Gradients(True), [x_spec, x_spec] + w_specs)
  return {'forward': forward, 'input gradient': input_only - forward,
          'weight gradient': both - input_only}


def Table(costs):
  """Rows of the grid: (S, M, R, {name: bubble in calls}, {name: its share
  of the gradient loop}), from gpipe.schedule.ZeroBubble."""
  rows = []
  for s, m, r in GRID:
    zb = schedule_lib.ZeroBubble(schedule_lib.Schedule(s, m, r))
    bubbles, useful = zb.Bubbles(costs), zb.UsefulSeconds(costs)
    rows.append((s, m, r, {k: v / costs.call for k, v in bubbles.items()},
                 {k: v / (useful + v) for k, v in bubbles.items()}))
  return rows


def Render(title, costs):
  """The grid as a table: each bubble in calls (its share of the loop)."""
  lines = [title,
           '   S   M   R |  1f1b (share) | zero_bubble (share, of 1f1b) | '
           'per-stage | fill bound',
           '-' * 80]
  for s, m, r, b, share in Table(costs):
    lines.append(
        f'{s:4d}{m:4d}{r:4d} | {b["1f1b"]:5.2f} ({share["1f1b"]:5.1%}) | '
        f'{b["zero_bubble"]:11.2f} ({share["zero_bubble"]:5.1%}, '
        f'{b["zero_bubble"] / b["1f1b"]:4.2f}) | '
        f'{b["per-stage branches"]:9.2f} | {b["fill bound"]:10.2f}')
  return '\n'.join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(prog='python -m benchmarks.schedules',
                                   description=__doc__.split('\n')[0])
  parser.add_argument('--equal_only', action='store_true',
                      help='F = B = W only (no compile)')
  args = parser.parse_args(argv)
  print(Render('F = B = W (weighted bubble, in calls of F + B + W; '
               'modelled)', schedule_lib.TaskCosts()))
  if args.equal_only:
    return 0
  flops = BlockFlops(**POD_BLOCK)
  f, b, w = (flops['forward'], flops['input gradient'],
             flops['weight gradient'])
  print(f'\nthe pod block (width {POD_BLOCK["model_dim"]}, sequence '
        f'{POD_BLOCK["seq_len"]}), XLA FLOPs: F {f:.3e}, B {b:.3e}, '
        f'W {w:.3e} (F : B : W = 1 : {b / f:.2f} : {w / f:.2f})')
  print(Render('the pod block\'s F : B : W (weighted bubble, in calls; '
               'modelled)', schedule_lib.TaskCosts(1.0, b / f, w / f)))
  return 0


if __name__ == '__main__':
  sys.exit(main())
