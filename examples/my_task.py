"""Your own Lingvo task with a pipelined middle, start to finish.

    .venv/bin/python examples/my_task.py        # pipelined == plain stack?

A regression model: inputs x of 16 features, targets a fixed nonlinear
function of x; in the middle, a stack of 4 stages x 2 repeats of one block
(LayerNorm -> FeedForwardNet -> residual) pipelined over 8 microbatches.
The file is what docs/own-task.md walks through: the input generator, the
stage body, the task, its registration, and a check that the pipeline
computes what the plain stack computes. The rest is done with the
project's commands, each naming this file:

    python -m gpipe.lingvo_trainer --model_module=examples/my_task.py \\
        --model=my_task.MyRegression --run_locally=cpu --mode=sync \\
        --logdir=/tmp/my_task
    python -m gpipe.check_partitioning --model_module examples/my_task.py \\
        --model my_task.MyRegression
    python -m gpipe.plan --model_module examples/my_task.py \\
        --model my_task.MyRegression --num_devices 4
"""

# Optional: run as a script, it keeps TensorFlow's and Lingvo's start-up
# logs out of the output (`--verbose` shows them). Before TensorFlow loads.
if __name__ == '__main__':
  from gpipe import quiet
  quiet.UnlessVerbose()

# pylint: disable=g-import-not-at-top,g-bad-import-order
import numpy as np

import gpipe  # before lingvo: makes lingvo importable everywhere
from gpipe.layers import PipelinedLayer
from lingvo import compat as tf
from lingvo import model_registry
from lingvo.core import base_input_generator
from lingvo.core import base_layer
from lingvo.core import base_model
from lingvo.core import base_model_params
from lingvo.core import layers
from lingvo.core import optimizer
from lingvo.core import py_utils
# pylint: enable=g-import-not-at-top,g-bad-import-order

DIM = 16  # features in and out


# -- 1. The input generator. ---------------------------------------------------


class RegressionInput(base_input_generator.BaseInputGenerator):
  """Batches {x, y}: x random normal, y = sin(3 x A) for a fixed matrix A.

  Training batches are a function of the global step (a restored run sees
  the data it would have seen); a held-out set is a fixed seed's batch.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', DIM, 'Features of x and y.')
    p.Define('data_seed', 1, 'Seed of the random x.')
    p.Define('held_out', False, 'True: the same batch every read.')
    p.batch_size = 32
    return p

  def _InputBatch(self):
    p = self.params
    step = tf.constant(0, tf.int64) if p.held_out else tf.cast(
        py_utils.GetGlobalStep(), tf.int64)
    x = tf.random.stateless_normal(
        [p.batch_size, p.dim], tf.stack([tf.constant(p.data_seed, tf.int64),
                                         step]))
    a = np.random.default_rng(0).normal(size=[p.dim, p.dim]) / np.sqrt(p.dim)
    y = tf.sin(3.0 * tf.matmul(x, tf.constant(a, tf.float32)))
    return py_utils.NestedMap(x=x, y=y)


# -- 2. One stage of the stack. ------------------------------------------------


class ResidualFeedForward(base_layer.BaseLayer):
  """x + FeedForwardNet(LayerNorm(x)): takes and returns one [batch, dim].

  A stage body is any Lingvo layer whose FProp returns what it takes; the
  pipeline gives its variables a leading [repeat, stage] dim.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', DIM, 'Width of the input and output.')
    p.Define('hidden_dim', 64, 'Width inside the block.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateChild('norm', layers.LayerNorm.Params().Set(input_dim=p.dim))
    self.CreateChild('ffn', layers.FeedForwardNet.Params().Set(
        input_dim=p.dim, hidden_layer_dims=[p.hidden_dim, p.dim],
        activation=['RELU', 'NONE']))

  def FProp(self, theta, x):
    y = x + self.ffn.FProp(theta.ffn, self.norm.FProp(theta.norm, x))
    # A per-stage summary: the pipeline names it rms/stage_<s> (the task
    # adds the summaries to its metrics, below).
    py_utils.AddTpuSummaryTensor('rms', tf.sqrt(tf.reduce_mean(y * y)))
    return y


# -- 3. The task: the pipelined stack between an input and an output layer. ----


class RegressionTask(base_model.BaseTask):
  """Projects x, runs the pipelined stack, projects back; mean squared error."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', DIM, 'Features of x and y.')
    p.Define('stack', None, 'Params of the PipelinedLayer.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateChild('proj_in', layers.FCLayer.Params().Set(
        input_dim=p.dim, output_dim=p.dim, activation='NONE'))
    self.CreateChild('stack', p.stack)
    self.CreateChild('proj_out', layers.FCLayer.Params().Set(
        input_dim=p.dim, output_dim=p.dim, activation='NONE'))

  def ComputePredictions(self, theta, input_batch):
    h = self.proj_in.FProp(theta.proj_in, input_batch.x)
    h = self.stack.FProp(theta.stack, h)
    return py_utils.NestedMap(y=self.proj_out.FProp(theta.proj_out, h))

  def ComputeLoss(self, theta, predictions, input_batch):
    loss = tf.reduce_mean(tf.square(predictions.y - input_batch.y))
    batch = tf.cast(tf.shape(input_batch.x)[0], tf.float32)
    metrics = {'loss': (loss, batch)}
    metrics.update(py_utils.GetTpuSummaryTensors())  # the stages' summaries
    return metrics, {}


def StackParams():
  """4 stages x 2 repeats (8 logical layers), the batch in 8 microbatches."""
  return PipelinedLayer.Params().Set(
      num_stages=4, circular_repeat=2, num_microbatches=8,
      single_stage_body=ResidualFeedForward.Params(),
      shard_stages_1d=True)  # stage s's weights on device s of 4


# -- 4. Registration: what --model names (my_task.MyRegression). -------------


@model_registry.RegisterSingleTaskModel
class MyRegression(base_model_params.SingleTaskModelParams):
  """The task with its data; Lingvo's trainer stops after 20 steps."""

  def Train(self):
    return RegressionInput.Params().Set(batch_size=32, data_seed=1)

  def Dev(self):
    return RegressionInput.Params().Set(batch_size=32, data_seed=2,
                                        held_out=True, num_samples=32)

  def Task(self):
    p = RegressionTask.Params().Set(name='regression', stack=StackParams())
    p.train.max_steps = 20
    p.train.learning_rate = 3e-3
    p.train.optimizer = optimizer.Adam.Params()
    return p


# -- 5. Pipelined == the plain stack: the loss and every gradient. -----------


def LossAndGradients(task_params, batch):
  """The task's loss and the gradient of every weight, at seed-made weights."""
  with tf.Graph().as_default():
    tf.random.set_seed(1)
    task = task_params.Instantiate()
    batch = batch.Transform(tf.constant)
    metrics, _ = task.FPropDefaultTheta(batch)
    loss = metrics['loss'][0]
    names, variables = zip(*sorted(task.vars.FlattenItems()))
    gradients = tf.gradients(loss, variables)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      value, grads = sess.run((loss, gradients))
  return value, dict(zip(names, grads))


def CheckAgainstPlainStack():
  """Largest |difference| between the pipelined task and the same task with
  unroll='always' (the 8 layers run one after another on the whole batch)."""
  batch = py_utils.NestedMap(
      x=np.random.default_rng(3).normal(size=[32, DIM]).astype(np.float32),
      y=np.random.default_rng(4).normal(size=[32, DIM]).astype(np.float32))
  pipelined_p = MyRegression().Task()
  plain_p = pipelined_p.Copy()
  plain_p.stack.unroll = 'always'
  loss, grads = LossAndGradients(pipelined_p, batch)
  plain_loss, plain_grads = LossAndGradients(plain_p, batch)
  print(f'loss {loss:.6f} (plain stack {plain_loss:.6f})')
  largest = abs(loss - plain_loss)
  for name in sorted(grads):
    difference = float(np.max(np.abs(grads[name] - plain_grads[name])))
    largest = max(largest, difference)
    print(f'  d loss/d {name:<28} {str(list(grads[name].shape)):<16} '
          f'largest |difference| {difference:.1e}')
  return largest


if __name__ == '__main__':
  if CheckAgainstPlainStack() > 1e-5:
    raise SystemExit('MISMATCH: the pipeline differs from the plain stack.')
  print('OK')
