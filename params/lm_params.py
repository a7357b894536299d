"""The Params of the pipelined LMs: `CopyLMParams` builds a task's.

The task is params/lm_task.py's PipelinedLMTask (or a subclass: the text
LM's, the large LMs'); params/lm.py registers the models built from here.
"""

from gpipe import layers as gpipe_layers
from lingvo import compat as tf
from lingvo.core import optimizer
from lingvo.core import schedule
from params import lm_blocks
from params import lm_task
from params import pod_blocks
from params import sequence_halves as sequence_halves_lib
from params import sequence_parallel as sequence_parallel_lib


def CopyLMParams(name='copy_lm', *, vocab_size, model_dim, num_heads,
                 hidden_dim, blocks_per_stage, num_stages, circular_repeat,
                 num_microbatches, dropout_prob, shard_stages_1d,
                 learning_rate, max_steps, max_seq_len=64, batch_major=False,
                 fprop_dtype=None, input_dropout_prob=None,
                 stack_dtype=tf.float32, optimizer_tpl=None, mesh=None,
                 remat_blocks=False, stack_options=None, task_cls=None,
                 fused_qkv=False, rotary=False, sequence_parallel=False,
                 sequence_halves=False, head_dim=None):
  """Task params of the pipelined copy LM (without input params).

  Args:
    batch_major: the stage body. False: `StageBlocks` of Lingvo's time-major
      TransformerLayer (the copy LM's). True: `pod_blocks.BatchMajorStage`,
      batch-major blocks with einsum projections (the pod configs').
    fprop_dtype: the batch-major blocks' activation dtype (e.g.
      tf.bfloat16; weights and optimizer state stay float32). None: float32.
    input_dropout_prob: dropout on the embeddings; None: dropout_prob.
    stack_dtype: the activations' dtype between stages (the task's
      `stack_dtype`).
    optimizer_tpl: the optimizer params; None: Adam (0.9, 0.98).
    mesh: a pod_blocks.PodMesh to split the model over (stages on its
      axis 0, the batch on axis 1, heads and feed-forward width on axis 2;
      with its fsdp, the blocks' weights stored split over axis 1 too,
      params/fsdp.py), for the batch-major body; None: the stack as
      shard_stages_1d says.
    remat_blocks: the batch-major stage recomputes each block in its
      backward pass (pod_blocks.BatchMajorStage.remat_blocks).
    fused_qkv: the batch-major blocks project queries, keys and values
      with one weight (pod_blocks.PodBlockParams).
    rotary: the batch-major blocks' attention rotates queries and keys by
      their position (pod_blocks.PodBlockParams).
    head_dim: the batch-major blocks' head width (None: model_dim /
      num_heads; pod_blocks.PodBlockParams).
    sequence_parallel: on the mesh's model axis, the blocks' residual
      stream is split along the sequence, their all-reduces a
      reduce-scatter and an all-gather each
      (params/sequence_parallel.py).
    sequence_halves: the batch-major blocks run on the sequence's halves
      as two chains, each half's model-axis all-reduces beside the other
      half's matmuls (params/sequence_halves.py).
    stack_options: more PipelinedLayer params for the stack (e.g.
      backward_schedule, stream_io).
    task_cls: the task class; None: PipelinedLMTask.
    (The others name what they set.)
  """
  _CheckOptions(model_dim, num_heads, batch_major, mesh, shard_stages_1d,
                fprop_dtype=fprop_dtype, rotary=rotary,
                sequence_parallel=sequence_parallel,
                sequence_halves=sequence_halves, head_dim=head_dim)
  if batch_major:
    stage = _PodStage(
        pod_blocks.PodBlockParams(model_dim, num_heads, hidden_dim,
                                  dropout_prob, fprop_dtype, fused_qkv,
                                  rotary, head_dim),
        blocks_per_stage, fprop_dtype, mesh=mesh, remat_blocks=remat_blocks,
        sequence_parallel=sequence_parallel, sequence_halves=sequence_halves)
  else:
    stage = lm_blocks.StageBlocks.Params().Set(
        num_blocks=blocks_per_stage, block_tpl=lm_blocks.CausalBlockParams(
            model_dim, num_heads, hidden_dim, dropout_prob))
  stack = gpipe_layers.PipelinedLayer.Params().Set(
      name='stack', num_stages=num_stages, single_stage_body=stage,
      circular_repeat=circular_repeat, num_microbatches=num_microbatches,
      shard_stages_1d=shard_stages_1d, unroll='never').Set(
          **(stack_options or {}))
  if mesh is not None:
    stack.Set(device_mesh=mesh.device_mesh,
              pipeline_stage_mesh_dim=pod_blocks.PodMesh.STAGE_AXIS)
  p = (task_cls or lm_task.PipelinedLMTask).Params().Set(
      name=name, vocab_size=vocab_size, model_dim=model_dim, stack=stack,
      max_seq_len=max_seq_len, stack_dtype=stack_dtype,
      input_dropout_prob=(dropout_prob if input_dropout_prob is None else
                          input_dropout_prob))
  _SetTraining(p.train, learning_rate, max_steps, optimizer_tpl)
  return p


def _SetTraining(tp, learning_rate, max_steps, optimizer_tpl):
  """The task's train params: the optimizer (None: Adam (0.9, 0.98)), a
  50-step warm-up, clipping at a global norm of 1."""
  tp.max_steps = max_steps  # Lingvo's trainer stops here.
  tp.learning_rate = learning_rate
  tp.optimizer = optimizer_tpl or optimizer.Adam.Params().Set(beta1=0.9,
                                                              beta2=0.98)
  tp.lr_schedule = schedule.LinearRampupExponentialDecay.Params().Set(
      warmup=50, decay_start=100000, decay_end=200000, min=1.0)
  tp.clip_gradient_norm_to_value = 1.0
  tp.grad_norm_tracker = None


def _PodStage(block, blocks_per_stage, fprop_dtype, *, mesh, remat_blocks,
              sequence_parallel, sequence_halves):
  """The batch-major stage of `block` (PodBlockParams), as CopyLMParams'
  options say."""
  fsdp_axis = None
  if mesh is not None:
    block = pod_blocks.SplitBlockOverMesh(block)
    fsdp_axis = pod_blocks.PodMesh.DATA_AXIS if mesh.fsdp else None
  stage = pod_blocks.PodStageParams(blocks_per_stage, block, fprop_dtype,
                                    remat_blocks, fsdp_mesh_dim=fsdp_axis)
  if sequence_parallel:
    stage = sequence_parallel_lib.SequenceParallel(stage)
  if sequence_halves:
    stage = sequence_halves_lib.SequenceHalves(stage)
  return stage


def _CheckOptions(model_dim, num_heads, batch_major, mesh, shard_stages_1d,
                  **batch_major_options):
  """Raises a one-line ValueError for CopyLMParams' options that do not go
  together."""
  if model_dim % num_heads and batch_major_options.get('head_dim') is None:
    raise ValueError(f'CopyLMParams: model_dim={model_dim} is not divisible '
                     f'by num_heads={num_heads}; pick a divisor.')
  for arg, value in batch_major_options.items():
    if value not in (None, False) and not batch_major:
      raise ValueError(f'CopyLMParams: {arg} is for the batch-major body; '
                       'set batch_major=True.')
  if mesh is not None and (not batch_major or shard_stages_1d):
    raise ValueError('CopyLMParams: a mesh is for the batch-major body and '
                     'replaces shard_stages_1d; set batch_major=True, '
                     'shard_stages_1d=False.')
  if mesh is not None and mesh.fsdp and model_dim % mesh.data:
    raise ValueError(f'CopyLMParams: the mesh\'s fsdp splits every block '
                     f'weight\'s model_dim={model_dim} over the data axis '
                     f'of {mesh.data} devices; pick a model_dim divisible by '
                     f'{mesh.data} or another data axis.')
  if batch_major_options.get('sequence_parallel') and mesh is None:
    raise ValueError('CopyLMParams: sequence_parallel splits the sequence '
                     'over a mesh\'s model axis; give a mesh.')
  if (batch_major_options.get('sequence_parallel') and
      batch_major_options.get('sequence_halves')):
    raise ValueError('CopyLMParams: sequence_halves runs each block\'s '
                     'whole-sequence layout in two halves; it does not '
                     'combine with sequence_parallel.')


def HeldOut(train_p, data_seed, num_batches):
  """Held-out copy data: num_batches fixed batches; the evaler and decoder
  read all of them for every checkpoint (num_samples)."""
  return train_p.Set(data_seed=data_seed, held_out_batches=num_batches,
                     num_samples=num_batches * train_p.batch_size)
