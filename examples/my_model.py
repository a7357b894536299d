"""Your own model, pipelined: a residual MLP block of Lingvo layers.

    .venv/bin/python examples/my_model.py

Copy this file and replace `ResidualMlp` with your stage body. It

1. defines one stage of the stack: LayerNorm -> FC (relu) -> FC, plus the
   input (a residual block written with Lingvo's layers);
2. wraps it in a `PipelinedLayer` (`PipelineParams`): 2 stages, each run
   twice (circular_repeat=2: 4 logical layers), the batch of 16 split into
   4 microbatches, the stage dim split over 2 devices;
3. checks that the pipelined outputs and gradients equal, to float32
   rounding (1e-5), those of the 4 logical layers run one after another on
   the whole batch, each on its own weights (`stack.layer_theta(theta,
   repeat, stage)`);
4. partitions one training step for 2 virtual devices with XLA's SPMD
   partitioner (`gpipe.check_partitioning`) and prints what each device
   holds and sends;
5. plans it (`gpipe.plan`): per-device memory, FLOPs and a predicted step
   time on TPU v5e chips.

The same Params from the command line, by module or by file:

    python -m gpipe.check_partitioning \\
        --params examples.my_model.PipelineParams --input_shape 16,8
    python -m gpipe.plan --params examples/my_model.py:PipelineParams \\
        --input_shape 16,8 --num_microbatches 2,4
"""

import sys

# Optional: run as a script, it keeps TensorFlow's and Lingvo's start-up
# logs out of the output (`--verbose` shows them). Before TensorFlow loads.
if __name__ == '__main__':
  from gpipe import quiet
  quiet.UnlessVerbose()

# pylint: disable=g-import-not-at-top,g-bad-import-order
import numpy as np

import gpipe  # before lingvo: makes lingvo importable everywhere
import tensorflow as tf
from gpipe.layers import PipelinedLayer
from lingvo.core import base_layer
from lingvo.core import layers as lingvo_layers
# pylint: enable=g-import-not-at-top,g-bad-import-order

BATCH, DIM = 16, 8  # the input: [BATCH, DIM]


class ResidualMlp(base_layer.BaseLayer):
  """One stage: x + FC(relu(FC(LayerNorm(x)))), all Lingvo layers.

  A stage body is any Lingvo layer whose FProp returns what it takes (here
  one [batch, dim] tensor): the pipeline feeds each stage's output to the
  next stage.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', DIM, 'Width of the input and output.')
    p.Define('hidden_dim', 32, 'Width inside the block.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    # Children and variables are created as in any Lingvo layer; the
    # pipeline gives each a leading [num_stages] dim (or [repeat, stage]).
    self.CreateChild('norm', lingvo_layers.LayerNorm.Params().Set(
        input_dim=p.dim))
    self.CreateChild('up', lingvo_layers.FCLayer.Params().Set(
        input_dim=p.dim, output_dim=p.hidden_dim, activation='RELU'))
    self.CreateChild('down', lingvo_layers.FCLayer.Params().Set(
        input_dim=p.hidden_dim, output_dim=p.dim, activation='NONE'))

  def FProp(self, theta, x):
    h = self.norm.FProp(theta.norm, x)
    h = self.up.FProp(theta.up, h)
    return x + self.down.FProp(theta.down, h)


def PipelineParams():
  """The pipelined stack: what --params names on the command line."""
  return PipelinedLayer.Params().Set(
      name='stack',
      num_stages=2,
      circular_repeat=2,  # 2 stages x 2 repeats = 4 logical layers
      num_microbatches=4,  # the batch of 16 as 4 microbatches of 4
      single_stage_body=ResidualMlp.Params(),
      shard_stages_1d=True)  # stage s's weights on device s


def CheckAgainstLayersInTurn():
  """Pipelined vs the logical layers run one after another: outputs and the
  gradients of a loss w.r.t. the input and every weight; returns the largest
  absolute difference."""
  stack = PipelineParams().Instantiate()
  p = stack.params
  variables = stack.vars.Flatten()
  x = tf.random.stateless_normal([BATCH, DIM], seed=[1, 2])
  cotangent = tf.random.stateless_normal([BATCH, DIM], seed=[3, 4])

  def LossAndGradients(forward):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = forward(x)
      loss = tf.reduce_sum(y * cotangent)  # a fixed random projection
    return [y] + tape.gradient(loss, [x] + variables)

  def Pipelined(inputs):
    return stack.FProp(stack.theta, inputs)

  def LayersInTurn(inputs):
    # Logical layer r * num_stages + s is repeat r of stage s.
    for r in range(p.circular_repeat):
      for s in range(p.num_stages):
        inputs = stack.body.FProp(stack.layer_theta(stack.theta, r, s),
                                  inputs)
    return inputs

  # The pipeline is a while loop with its own gradient: it runs in a graph.
  got = tf.function(lambda: LossAndGradients(Pipelined), autograph=False)()
  want = tf.function(lambda: LossAndGradients(LayersInTurn),
                     autograph=False)()
  names = ['output', 'd loss/d input'] + [
      f'd loss/d {n}' for n, _ in stack.vars.FlattenItems()]
  largest = 0.0
  for name, a, b in zip(names, got, want):
    diff = float(np.max(np.abs(a.numpy() - b.numpy())))
    largest = max(largest, diff)
    print(f'  {name:<25} {list(a.shape)!s:<14} largest |difference| '
          f'{diff:.2g}')
  return largest


def CheckPartitioning():
  """One training step partitioned for 2 virtual devices; its problems."""
  from gpipe import check_partitioning  # pylint: disable=g-import-not-at-top
  report = check_partitioning.CheckPartitioning(
      PipelineParams(), [(BATCH, DIM)], num_devices=2)
  print(report.Summary())
  return report.Problems(tolerance=1e-4)


def Plan():
  """Per-device memory, FLOPs and a predicted step time on TPU v5e."""
  from gpipe import plan  # pylint: disable=g-import-not-at-top
  from gpipe.plan import roofline  # pylint: disable=g-import-not-at-top
  chip = roofline.CHIPS['v5e']
  target = plan.LayerTarget(PipelineParams(), [(BATCH, DIM)])
  # One candidate (num_microbatches, circular_repeat) here; list several to
  # compare them (each takes seconds to compile).
  result = plan.MakePlan(target, [plan.Candidate(4, 2)], num_devices=2,
                         chip=chip, hbm_bytes=chip.hbm_bytes)
  print(result.Render())
  return result


def main():
  print('1. Pipelined vs the 4 layers in turn (2 stages x 2 repeats):')
  largest = CheckAgainstLayersInTurn()
  if largest > 1e-5:
    print(f'MISMATCH: {largest:.2g} > 1e-5')
    return 1
  print('2. Partitioned for 2 devices (gpipe.check_partitioning):')
  problems = CheckPartitioning()
  if problems:
    print('\n'.join(problems))
    return 1
  print('3. Planned for 2 TPU v5e chips (gpipe.plan):')
  Plan()
  print('OK')
  return 0


if __name__ == '__main__':
  sys.exit(main())
