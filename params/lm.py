"""Lingvo model params: a decoder-only Transformer LM whose stack is pipelined.

The task is synthetic and needs real learning: copy a random sequence.

    ids:     t0 t1 ... tL-1 SEP t0 t1 ... tL-1
    input:   t0 t1 ... tL-1 SEP t0 ... tL-2
    label:   t1 t2 ...  SEP  t0 t1 ... tL-1
    weight:  0  0  ...   0   1  1  ...  1      (only the copy is scored)

The tokens are uniform, so the scored positions start at log(vocab - 2) nats
and fall only when attention learns to look L + 1 positions back.

Registered models (`model_registry.GetParams('lm.<Name>', 'Train')`):

  CopyLMSmall: 4 stages x 1 block of width 64 (Lingvo's time-major
      TransformerLayer, `StageBlocks`), float32, Adam; trains on a 2-core
      CPU in about a minute.
  CopyLMPod8x2: 8 stages x 2 circular repeats x 2 blocks (32 blocks, width
      4096, feed-forward 16384, 32 heads, vocab 32000, sequences of 1024:
      about 6.7 billion parameters, 25 GiB in float32), `shard_stages_1d`
      over 8 devices, Adam. Batch-major blocks with einsum projections
      (`pod_blocks.BatchMajorStage`) computing in bfloat16 on float32
      weights. Each device holds one stage's 2 x 2 blocks and 1/8 of the
      embedding and softmax (split by vocab), and embeds and scores 1/8 of
      the sequences. See `ParameterBytes`.
  CopyLMPod8x2Adafactor: the same model and batch, trained with Lingvo's
      factored Adafactor (beta1 = 0), as Lingvo's GShard LMs are.
"""

from lingvo import compat as tf
from lingvo import model_registry
from lingvo.core import base_model_params
from lingvo.core import optimizer
from params import large_lm
from params import pod_blocks
from params import published_runs
# The task and its builder, under the names this module has always had.
from params.copy_task_input import CopyTaskInput
from params.copy_task_input import FIRST_TOKEN_ID  # pylint: disable=unused-import
from params.copy_task_input import MakeCopyBatch  # pylint: disable=unused-import
from params.copy_task_input import PAD_ID  # pylint: disable=unused-import
from params.copy_task_input import SEP_ID  # pylint: disable=unused-import
from params.lm_blocks import CausalBlockParams  # pylint: disable=unused-import
from params.lm_blocks import StageBlocks  # pylint: disable=unused-import
from params.lm_params import CopyLMParams
from params.lm_params import HeldOut
from params.lm_task import ParameterBytes  # pylint: disable=unused-import
from params.lm_task import PipelinedLMTask  # pylint: disable=unused-import
from params import text_input
from params import text_lm


@model_registry.RegisterSingleTaskModel
class CopyLMSmall(base_model_params.SingleTaskModelParams):
  """Small default: 4 stages x 1 block of width 64; about a minute on CPU.

  Batch 32 in 4 microbatches of 8, so the 4-stage pipeline runs
  4 + 4 - 1 = 7 iterations a step (bubble fraction 3/7).
  """
  VOCAB_SIZE = 16
  COPY_LENGTH = 8

  def Train(self):
    return CopyTaskInput.Params().Set(
        vocab_size=self.VOCAB_SIZE, copy_length=self.COPY_LENGTH,
        batch_size=32, data_seed=1234)

  def Dev(self):
    return HeldOut(self.Train(), data_seed=4321, num_batches=2)

  def Test(self):
    return HeldOut(self.Train(), data_seed=8765, num_batches=2)

  def Task(self):
    return CopyLMParams(
        vocab_size=self.VOCAB_SIZE, model_dim=64, num_heads=4, hidden_dim=128,
        blocks_per_stage=1, num_stages=4, circular_repeat=1,
        num_microbatches=4, dropout_prob=0.0, shard_stages_1d=False,
        learning_rate=3e-3, max_steps=300, max_seq_len=2 * self.COPY_LENGTH)


@model_registry.RegisterSingleTaskModel
class TextLMSmall(base_model_params.SingleTaskModelParams):
  """Byte-level LM of text files, by default the standard library's source.

  The demo's model (`python -m gpipe.demo`): a circular pipeline of 4
  stages x 2 repeats x 1 block, 8 causal pre-LN Transformer blocks of width
  64 (4 heads, feed-forward 256, rotary positions), windows of 128 bytes,
  16 a step in 4 microbatches; Adam at 5e-3 after 100 warmup steps,
  decaying to a tenth over train.max_steps (1000, under 3 minutes on 2 CPU
  cores, layer by layer). Circular (R = 2) because that is what the demo
  shows: the recipe learns more per step the deeper the stack, though in
  the same 3 minutes on one device 4 blocks end lower, their steps costing
  half (docs/text-depth.md).
  `input.file_pattern` points it at other text (docs/own-text.md).
  """
  SEQ_LEN = 128
  BATCH_SIZE = 16
  HELD_OUT_BYTES = 32768  # about this many held-out bytes are scored
  MODEL_DIM = 64
  NUM_HEADS = 4
  NUM_STAGES = 4
  CIRCULAR_REPEAT = 2
  BLOCKS_PER_STAGE = 1
  NUM_MICROBATCHES = 4
  LEARNING_RATE = 5e-3
  WARMUP = 100
  MAX_STEPS = 1000

  def Train(self):
    return text_input.TextInput.Params().Set(
        seq_len=self.SEQ_LEN, batch_size=self.BATCH_SIZE, data_seed=1234,
        held_out_windows=self.HELD_OUT_BYTES // self.SEQ_LEN)

  def Dev(self):
    return text_lm.HeldOut(self.Train())

  def Test(self):
    return text_lm.HeldOut(self.Train())

  def Task(self):
    return text_lm.TextLMParams(
        seq_len=self.SEQ_LEN, model_dim=self.MODEL_DIM,
        num_heads=self.NUM_HEADS, hidden_dim=4 * self.MODEL_DIM,
        blocks_per_stage=self.BLOCKS_PER_STAGE, num_stages=self.NUM_STAGES,
        circular_repeat=self.CIRCULAR_REPEAT,
        num_microbatches=self.NUM_MICROBATCHES,
        learning_rate=self.LEARNING_RATE, max_steps=self.MAX_STEPS,
        warmup=self.WARMUP, decay_steps=self.MAX_STEPS)


@model_registry.RegisterSingleTaskModel
class TextLM30Min(TextLMSmall):
  """TextLMSmall's recipe for 30 minutes on 2 CPU cores (`python -m
  gpipe.demo --model lm.TextLM30Min --minutes 30`; `python -m
  benchmarks.text_long` records the run against the compressors): width
  96 (feed-forward 384), windows of 256 bytes, 3000 steps, the learning
  rate decaying over them. Of the widths tried while choosing it (64 x 16
  blocks, 96 and 128 x 8), the one whose held-out bits per byte fell
  lowest in 30 minutes; docs/text-long.md has its run."""
  SEQ_LEN = 256
  MODEL_DIM = 96
  MAX_STEPS = 3000


@model_registry.RegisterSingleTaskModel
class CopyLMPod8x2(base_model_params.SingleTaskModelParams):
  """Pod slice, Adam: 8 stages x 2 circular repeats x 2 blocks of width 4096.

  32 causal Transformer blocks (32 heads, feed-forward 16384) of Lingvo's
  batch-major layers with einsum projections (`pod_blocks.BatchMajorStage`),
  computing in bfloat16 on float32 weights; the loss, the Adam slots and the
  activations passed between stages are float32. Vocab 32000, sequences of
  1024: 6.7 billion parameters (25.0 GiB).

  Expects 8 devices along the stage dim (`shard_stages_1d`; a 1-D mesh
  [0..7]): device s holds the 2 x 2 blocks of stage s (stage-stacked
  weights [8, 2, ...] split on their first dim) and 1/8 of the embedding
  and softmax (split by vocab), 3.1 GiB of weights and twice that of Adam
  slots; it embeds and scores 1/8 of the sequences, so the logits are never
  whole on one chip. `ParameterBytes` gives the bytes.

  64 sequences (65536 tokens) a step, in 32 microbatches of 2: iterations =
  2 * 32 + 8 - 1 = 71, bubble fraction 7/71 = 0.099. `python -m gpipe.plan
  --model lm.CopyLMPod8x2 --num_devices 8` shows what the step needs per
  chip (a 23.3 GiB peak when this batch was chosen; 128 sequences needed
  32.7 GiB). Dropout 0.1 in the blocks, none on the embeddings: that mask
  would be drawn for the whole batch on every chip (XLA does not split a
  random-number generator's output).
  """
  VOCAB_SIZE = 32000
  COPY_LENGTH = 512
  BATCH_SIZE = 64

  def Train(self):
    return CopyTaskInput.Params().Set(
        vocab_size=self.VOCAB_SIZE, copy_length=self.COPY_LENGTH,
        batch_size=self.BATCH_SIZE)

  def Dev(self):
    return HeldOut(self.Train(), data_seed=4321, num_batches=4)

  def Test(self):
    return HeldOut(self.Train(), data_seed=8765, num_batches=4)

  def Optimizer(self):
    """The optimizer params; None: CopyLMParams' Adam."""
    return None

  def Task(self):
    return CopyLMParams(
        vocab_size=self.VOCAB_SIZE, model_dim=4096, num_heads=32,
        hidden_dim=16384, blocks_per_stage=2, num_stages=8, circular_repeat=2,
        num_microbatches=32, dropout_prob=0.1, input_dropout_prob=0.0,
        shard_stages_1d=True, learning_rate=1e-4, max_steps=100000,
        max_seq_len=2 * self.COPY_LENGTH, batch_major=True,
        fprop_dtype=tf.bfloat16, optimizer_tpl=self.Optimizer())


@model_registry.RegisterSingleTaskModel
class CopyLMPod8x2Adafactor(CopyLMPod8x2):
  """CopyLMPod8x2's model on 8 chips of 16 GiB (TPU v5e), with Adafactor.

  Lingvo's XLAShardingAdafactor, as Lingvo's GShard LMs train: factored
  second moments (a row and a column vector per matrix) and beta1 = 0 (no
  first moment), so the optimizer state is about 10 MiB per chip instead of
  Adam's two copies of the weights (6.2 GiB per chip here). 32 sequences
  (32768 tokens) a step, in 32 microbatches of 1: the same schedule
  (bubble 7/71), half the activations of CopyLMPod8x2's step. `python -m
  gpipe.plan --model lm.CopyLMPod8x2Adafactor --num_devices 8 --tpu v5e`:
  a 12.9 GiB peak per chip when this batch was chosen (64 sequences: 17.1).
  """
  BATCH_SIZE = 32

  def Optimizer(self):
    return optimizer.XLAShardingAdafactor.Params().Set(
        beta1=0.0, beta2=0.99, factored=True, clipping_threshold=1.0,
        multiply_by_parameter_scale=True, decay_exponent_pow=0.8)


@model_registry.RegisterSingleTaskModel
class CopyLMPod8x4(CopyLMPod8x2):
  """32 chips as a [8 stages, 4 model] mesh: a 13B LM on 16 GiB chips, Adam.

  Twice CopyLMPod8x2's depth at its width: 8 stages x 2 circular repeats x
  4 blocks = 64 blocks of width 4096 (32 heads, feed-forward 16384), vocab
  32000, sequences of 1024: 13.2 billion parameters (49 GiB in float32).
  The stage dim is split over mesh axis 0 (`pipeline_stage_mesh_dim`);
  within a stage the 4 chips of axis 2 split the heads and the
  feed-forward width (`pod_blocks.SplitBlockOverMesh`), so each chip holds
  1/32 of the stack; the embedding, softmax and loss are split over all
  32. 64 sequences a step in 32 microbatches of 2, as CopyLMPod8x2; the
  activations passed between stages are bfloat16 (`stack_dtype`, as the
  body computes), which halves the history the loop stores. `python -m
  gpipe.plan --model lm.CopyLMPod8x4 --num_devices 32 --hbm_gib 16 --tpu
  v5e`: a 14.4 GiB peak per chip, under a v5e's 16 GB (14.9 GiB).

  No dropout: XLA's SPMD partitioner stops on a stateless random-number
  op inside a stage whose other mesh axes are split (the random key gets
  a replicated sharding inside the manual-subgroup region: `Check failed:
  sharding.IsManualSubgroup()`), so a mesh body draws no random numbers.
  """
  MESH = pod_blocks.PodMesh(stages=8, model=4)
  BLOCKS_PER_STAGE = 4

  def Task(self):
    return CopyLMParams(
        vocab_size=self.VOCAB_SIZE, model_dim=4096, num_heads=32,
        hidden_dim=16384, blocks_per_stage=self.BLOCKS_PER_STAGE,
        num_stages=self.MESH.stages, circular_repeat=2, num_microbatches=32,
        dropout_prob=0.0, shard_stages_1d=False,
        learning_rate=1e-4, max_steps=100000,
        max_seq_len=2 * self.COPY_LENGTH, batch_major=True,
        fprop_dtype=tf.bfloat16, stack_dtype=tf.bfloat16,
        optimizer_tpl=self.Optimizer(), mesh=self.MESH)


@model_registry.RegisterSingleTaskModel
class CopyLMPod8x2x4(CopyLMPod8x4):
  """64 chips as [8 stages, 2 data, 4 model]: CopyLMPod8x4's model on two
  data-parallel replicas, each step twice the batch (128 sequences, each
  replica 64: CopyLMPod8x4's step). The replicas hold the same weights and
  Adam slots (not split over the data axis); their gradients are summed
  over it once a step, after the pipeline's loops.
  """
  MESH = pod_blocks.PodMesh(stages=8, data=2, model=4)
  BATCH_SIZE = 128


@model_registry.RegisterSingleTaskModel
class CopyLMMeshSmall(CopyLMPod8x4):
  """CopyLMPod8x4 in small, to check on a CPU: [2 stages, 2 model] (4 devices).

  The same layout (the batch-major body split over the model axis, the
  stage dim over mesh axis 0, 2 circular repeats) at width 32 (4 heads,
  feed-forward 48), float32, 12 sequences of 16 tokens in 3 microbatches:
  `python -m gpipe.check_partitioning --model lm.CopyLMMeshSmall` runs a
  training step partitioned on 4 virtual devices against the same step on
  one.
  """
  MESH = pod_blocks.PodMesh(stages=2, model=2)
  VOCAB_SIZE = 40
  COPY_LENGTH = 8
  BATCH_SIZE = 12

  def Task(self):
    return CopyLMParams(
        vocab_size=self.VOCAB_SIZE, model_dim=32, num_heads=4, hidden_dim=48,
        blocks_per_stage=1, num_stages=self.MESH.stages, circular_repeat=2,
        num_microbatches=3, dropout_prob=0.0, shard_stages_1d=False,
        learning_rate=1e-3, max_steps=100,
        max_seq_len=2 * self.COPY_LENGTH, batch_major=True, mesh=self.MESH)


@model_registry.RegisterSingleTaskModel
class CopyLMMeshSmallData(CopyLMMeshSmall):
  """CopyLMPod8x2x4 in small: CopyLMMeshSmall on [2 stages, 2 data, 2
  model] (8 devices), the batch split over the data axis too."""
  MESH = pod_blocks.PodMesh(stages=2, data=2, model=2)


@model_registry.RegisterSingleTaskModel
class CopyLMPod8x2OnMesh(CopyLMPod8x4):
  """CopyLMPod8x2's model and step (Adam, 64 sequences, 8 stages x 2
  repeats x 2 blocks) on an [8 stages, 1, 1] mesh with CopyLMPod8x4's body
  (no dropout, bfloat16 between stages), so that it also plans in the
  layouts a user who does not pipeline would pick (`--mesh 1x4x2
  --fsdp_mesh_dim 1 --circular_repeat 1`): benchmarks.largest."""
  MESH = pod_blocks.PodMesh(stages=8)
  BLOCKS_PER_STAGE = 2


@model_registry.RegisterSingleTaskModel
class CopyLMPod8x2AdafactorOnMesh(CopyLMPod8x2OnMesh):
  """CopyLMPod8x2Adafactor's model and step (32 sequences) the same way."""
  BATCH_SIZE = 32
  Optimizer = CopyLMPod8x2Adafactor.Optimizer


# -- The largest LMs that fit (params/large_lm.py: what lets them). ----------


@model_registry.RegisterSingleTaskModel
class LargestOn8x16GiB(CopyLMPod8x2Adafactor):
  """The largest LM that fits 8 chips of 16 GiB: 10.6 billion parameters,
  twice GPipe's 5.3 B on 8 accelerators of 16 GB. Its planned peak per
  chip and predicted step: docs/flagships.md.

  52 batch-major causal Transformer blocks of width 4096 (32 heads of 128,
  feed-forward 16384), vocab 32000 (one table for the embedding and the
  softmax), sequences of 1024, 32 sequences a step: 4 stages of 13 blocks
  on a [4 stages, 2 model] mesh (`pod_blocks.SplitBlockOverMesh`: heads
  and feed-forward width over the model axis), so each chip holds 1/8 of
  every weight. Microbatches of one sequence: 32 + 3 iterations, bubble
  3/35 = 0.086. Adafactor (factored, beta1 = 0), bfloat16 compute and
  activations between stages, float32 weights. What makes it fit
  (`large_lm.LargeLMTask`): backward_schedule='1f1b' with stream_io, each
  block recomputed once in the stage's backward pass from its stored input
  (remat_policy='save_checkpoints'), the embedding and the loss taken
  inside the pipeline's loop at its first and last stages (FPropWithLoss).
  No dropout (a mesh body draws no random numbers, see
  CopyLMPod8x4). Each block runs on the sequence's two halves as two
  chains (`sequence_halves.SequenceHalvesStage`), so that each half's
  model-axis all-reduces can run beside the other half's matmuls (the
  overlapped step, docs/flagships.md). `python -m gpipe.plan --model
  lm.LargestOn8x16GiB --num_devices 8 --hbm_gib 16 --tpu v5e` plans it
  (minutes);
  `python -m benchmarks.largest` plans both largest LMs and checks them.
  """
  MESH = pod_blocks.PodMesh(stages=4, model=2)
  MODEL_DIM = 4096
  HEAD_DIM = 128
  BLOCKS_PER_STAGE = 13
  NUM_MICROBATCHES = 32
  BATCH_SIZE = 32
  FPROP_DTYPE = tf.bfloat16
  RING_SPLIT_MESH_DIM = None  # the rings' entries whole on each chip
  SEQUENCE_PARALLEL = False  # (LargestOn8x16GiBSequenceParallel: True)
  DELAYED_SENDS = False  # (LargestOn8x16GiBDelayedSends: True)
  SEQUENCE_HALVES = True  # (LargestMeshSmall: False)

  def Task(self):
    return CopyLMParams(
        vocab_size=self.VOCAB_SIZE, model_dim=self.MODEL_DIM,
        num_heads=self.MODEL_DIM // self.HEAD_DIM,
        hidden_dim=4 * self.MODEL_DIM,
        blocks_per_stage=self.BLOCKS_PER_STAGE, num_stages=self.MESH.stages,
        circular_repeat=1, num_microbatches=self.NUM_MICROBATCHES,
        dropout_prob=0.0, shard_stages_1d=False, learning_rate=1e-4,
        max_steps=100000, max_seq_len=2 * self.COPY_LENGTH, batch_major=True,
        fprop_dtype=self.FPROP_DTYPE, stack_dtype=self.FPROP_DTYPE,
        optimizer_tpl=self.Optimizer(), mesh=self.MESH, remat_blocks=True,
        fused_qkv=True, sequence_parallel=self.SEQUENCE_PARALLEL,
        sequence_halves=self.SEQUENCE_HALVES,
        stack_options=dict(backward_schedule='1f1b', stream_io=True,
                           remat_policy='save_checkpoints',
                           ring_split_mesh_dim=self.RING_SPLIT_MESH_DIM,
                           delayed_sends=self.DELAYED_SENDS),
        task_cls=large_lm.LargeLMTask)


@model_registry.RegisterSingleTaskModel
class LargestOn32x16GiB(LargestOn8x16GiB):
  """The largest LM that fits 32 chips of 16 GiB: 43.7 billion parameters,
  twice GPipe's 21.0 B on 32 accelerators of 16 GB. Its planned peak per
  chip and predicted step: docs/flagships.md.

  96 blocks of width 6144 (48 heads of 128, feed-forward 24576), as
  LargestOn8x16GiB otherwise: 8 stages of 12 blocks on a [8 stages, 4
  model] mesh, 256 sequences a step in microbatches of one (256 + 7
  iterations, bubble 7/263 = 0.027). Its rings of stored block inputs are
  split over the model axis (ring_split_mesh_dim, docs/memory.md): whole,
  they would take 2.1 GiB of each chip instead of 0.5.
  """
  MESH = pod_blocks.PodMesh(stages=8, model=4)
  MODEL_DIM = 6144
  BLOCKS_PER_STAGE = 12
  NUM_MICROBATCHES = 256
  BATCH_SIZE = 256
  RING_SPLIT_MESH_DIM = pod_blocks.PodMesh.MODEL_AXIS


@model_registry.RegisterSingleTaskModel
class LargestMeshSmall(LargestOn8x16GiB):
  """LargestOn8x16GiB's layout in small, to check on a CPU: a [2 stages, 2
  data, 2 model] mesh (8 devices), 2 stages of 2 blocks of width 32 (4
  heads), float32, 16 sequences of 16 tokens in 4 microbatches, the loss
  taken at the last stage (`python -m gpipe.check_partitioning --model
  lm.LargestMeshSmall` runs a training step partitioned on 8 virtual
  devices against the same step on one). Its rings are split over the
  model axis, as LargestOn32x16GiB's. Its blocks run whole, not on the
  sequence's halves: its tests check the pipeline's layout, and
  tests/sequence_halves_test.py the halves against the whole block (at
  twice the compile time here).
  """
  MESH = pod_blocks.PodMesh(stages=2, data=2, model=2)
  SEQUENCE_HALVES = False
  RING_SPLIT_MESH_DIM = pod_blocks.PodMesh.MODEL_AXIS
  MODEL_DIM = 32
  HEAD_DIM = 8
  BLOCKS_PER_STAGE = 2
  NUM_MICROBATCHES = 4
  BATCH_SIZE = 16
  VOCAB_SIZE = 40
  COPY_LENGTH = 8
  FPROP_DTYPE = tf.float32


@model_registry.RegisterSingleTaskModel
class LargestOn8x16GiBSequenceParallel(LargestOn8x16GiB):
  """LargestOn8x16GiB with sequence-parallel blocks
  (params/sequence_parallel.py): between its matmuls each block's residual
  stream is split along the sequence over the model axis, each all-reduce
  a reduce-scatter and an all-gather. docs/flagships.md plans the two side
  by side."""
  SEQUENCE_PARALLEL = True
  SEQUENCE_HALVES = False


@model_registry.RegisterSingleTaskModel
class LargestOn8x16GiBDelayedSends(LargestOn8x16GiB):
  """LargestOn8x16GiB with delayed_sends=True: each stage's output handed
  on one iteration after it is made, beside the next iteration's calls,
  for 3 more bubble iterations (38 instead of 35). docs/planning.md plans
  the two side by side (#delayed-sends)."""
  DELAYED_SENDS = True


@model_registry.RegisterSingleTaskModel
class LargestMeshSmallSequenceParallel(LargestMeshSmall):
  """LargestMeshSmall with sequence-parallel blocks, to check on a CPU
  (tests/sequence_parallel_test.py partitions its step on 8 virtual
  devices). Its rings are whole: the stage inputs they store arrive split
  along the sequence over the model axis already."""
  SEQUENCE_PARALLEL = True
  SEQUENCE_HALVES = False
  RING_SPLIT_MESH_DIM = None


@model_registry.RegisterSingleTaskModel
class LargestMeshSmallFsdp(LargestMeshSmall):
  """LargestMeshSmall with FSDP (params/fsdp.py): on its [2 stages, 2 data,
  2 model] mesh every block weight and its slots are also split over the
  data axis (a chip holds 1/(2 x 2 x 2) of the stack's matrices), each
  block gathering its own over the data axis where it uses them; the tied
  table's width over the stage and data axes. Adam, whose slots are
  weight-shaped, so that each is split as its weight. To check on a CPU
  (tests/fsdp_test.py)."""
  MESH = pod_blocks.PodMesh(stages=2, data=2, model=2, fsdp=True)

  def Optimizer(self):
    return None  # CopyLMParams' Adam


@model_registry.RegisterSingleTaskModel
class LargestMeshSmallNoPipeline(LargestMeshSmallFsdp):
  """LargestMeshSmall's model as a user who does not pipeline would lay it
  out: a [1 stage, 4 data, 2 model] mesh (no pipeline: the 4 blocks one
  after another on every chip, the whole batch at once), FSDP over the data
  axis and tensor parallelism over the model axis, as MaxText's published
  runs split a model. To check on a CPU (tests/fsdp_test.py)."""
  MESH = pod_blocks.PodMesh(stages=1, data=4, model=2, fsdp=True)
  BLOCKS_PER_STAGE = 4
  NUM_MICROBATCHES = 1


# MaxText's published v5e runs, the planner's calibration
# (params/published_runs.py): lm.MaxText16BOnV5e256, lm.MaxText16BOnV5e16,
# ... lm.MaxText128BOnV5e64.
for _name, _cls in published_runs.RunClasses(__name__).items():
  globals()[_name] = model_registry.RegisterSingleTaskModel(_cls)
