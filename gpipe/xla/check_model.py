"""check_partitioning for a registered model: its whole training step.

    python -m gpipe.check_partitioning --model lm.CopyLMMeshSmall

The model's task is built as for a TPU job (Lingvo's layers annotate their
weights only then; a Lingvo client builds gpipe's layer through the
switch) at its initial weights, and one batch comes from its input
generator. The step (the task's loss and the gradient of every trainable
weight, the pipelined stack's weights placed as the stack places them) is
partitioned for the stack's devices and run, and compared with the same
step run on one device. What a bare layer's check reports is reported for
the model, with one more check a mesh needs: a stage-stacked weight split
over fewer devices than its own annotation asks (whole on a model axis
that should split its heads) is named.
"""

import contextlib
import dataclasses

import numpy as np
import tensorflow as tf

from gpipe.lingvo_support import registered_models
from gpipe.lingvo_support import tpu_build
from gpipe.model_step import stacks
from gpipe.model_step import train_step
from gpipe import sharding
from gpipe.xla import partitioned_step


@dataclasses.dataclass(frozen=True)
class Model:
  cfg: object  # the registered model's Params (task and input)
  stack: object  # where its pipelined stack is (gpipe.model_step.stacks)
  stack_params: object  # the PipelinedLayer Params the stack amounts to


def FindModel(name):
  """The registered model `name` and its pipelined stack, as a Model.

  Raises:
    ValueError: no such model, or not one pipelined stack in it; one line.
  """
  try:
    cfg = registered_models.GetParams(name, 'Train')
    stack = stacks.FindStack(cfg.task, f'{name} task')
    return Model(cfg, stack, stack.StackParams(cfg.task))
  except (LookupError, stacks.StackError) as e:
    raise ValueError(f'--model {name}: {e}') from None


@contextlib.contextmanager
def _AsForTpuOnGpipe(model):
  """Built as for a TPU, with gpipe's layer switched in as the planner
  switches it for this kind of stack."""
  with tpu_build.AsOnTpu(), model.stack.Switch():
    yield


def BuildModelStep(model, seed=0):
  """A partitioned_step.PipelineStep of the model's training step."""
  cfg = model.cfg
  graph = tf.Graph()
  with graph.as_default(), _AsForTpuOnGpipe(model):
    tf.compat.v1.set_random_seed(seed)
    task = cfg.task.Instantiate()
    batch = cfg.input.Instantiate().GetPreprocessedInputBatch()
    step = train_step.TaskStep(task, train_step.SpecsOf(batch),
                               own_optimizer=False)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      weights = sess.run(task.theta.Flatten())
      inputs = sess.run(batch.Flatten())
  weight_names = [a.name for a in step.weight_args]
  grad_names = [a.name for a in step.trainable_args]
  return partitioned_step.PipelineStep(
      fn=step.Gradients, args=[np.asarray(v) for v in weights + inputs],
      weight_names=weight_names, grad_names=grad_names,
      num_inputs=len(inputs), variables=[],
      on_stages=[a.on_stages for a in step.weight_args],
      annotated_shards=[a.annotated_shard for a in step.weight_args],
      result_names=['loss'] + [f'd loss/d {n}' for n in grad_names])


def CheckModelPartitioning(model, num_devices, seed=0):
  """Partitions one training step of the model; a partitioned_step.Report."""
  step = BuildModelStep(model, seed)
  # Built for a TPU, the stages would run in their manual region, which
  # one device without the partitioner cannot run: the reference says not.
  with _AsForTpuOnGpipe(model), sharding.SpmdPartitioning(False):
    expected = partitioned_step.RunUnpartitioned(step)
  with _AsForTpuOnGpipe(model):
    run = partitioned_step.RunStepPartitioned(step, num_devices)
  return partitioned_step.Report(
      run=run, step=step, expected=expected,
      num_stages=model.stack_params.num_stages,
      **partitioned_step.StackMesh(model.stack_params, num_devices))
