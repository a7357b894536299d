"""Published measured runs, as pod LMs the planner can plan: its calibration.

A planned step is a model's prediction; it becomes one a user can trust
only once it has been held against steps that were measured. MaxText
published four dense LM runs on one TPU v5e-256 with their configs
(AI-Hypercomputer/maxtext, `MaxText/configs/v5e/README.md` and
`16b.sh` ... `128b.sh`, as of commit 76bd53b0 of 2023-12-15, the table
first measured with the code of 2023-10-27):

    run    TFLOP/s a chip  MFU      per-device batch  mesh (ICI)
    16B    120             61.10 %  6                 FSDP 256
    32B    132             66.86 %  4                 FSDP 256
    64B    118             59.90 %  2                 FSDP 256
    128B   110             56.06 %  1                 FSDP 16 x tensor 16

All four: sequences of 2048, `remat_policy=full` (each layer recomputed
from its input in the backward pass), flash attention, bfloat16 compute on
float32 weights, AdamW (float32 moments), synthetic data, no pipeline.
The model is MaxText's base config (`base.yml`: width 2560, 8 heads of 256,
feed-forward 8192 with one ReLU, 16 layers, vocab 32768, tied embedding)
grown by `global_parameter_scale` (pyconfig's `get_individual_scales`,
`MaxTextDims` here): the scale's log2 = 3 b + r doubles the heads and the
feed-forward b + (r > 0) times, the width b + (r > 1) times, the layers b
times; the head width stays 256.

`MaxTextRun` registers each as a model of this project on the same
numbers: one stage of all its blocks on a [1, data, model] PodMesh with
FSDP over the data axis (params/fsdp.py) and tensor parallelism over the
model axis, the per-chip batch and sequence as published, each block
recomputed in the backward pass from its stored input (remat_blocks with
'save_checkpoints', what `full` stores: a step runs the forward twice and
the backward once, as MaxText's does), Adam, the embedding tied
(large_lm.LargeLMTask, the reverse schedule: its loss one sequence a chip
at a time). Not backward_schedule='1f1b': with one stage its gradient loop
would run each block's forward a third time. What differs, none of it in
the matrix work: Lingvo's blocks are sequential (attention, then the
feed-forward) where MaxText's are parallel, normalize with LayerNorm where
MaxText uses RMSNorm (and normalizes queries, keys and values), add
biases, a learned position table beside the rotary embedding, and a
softmax bias (`ParameterCount` says by how much); the attention is a dense
einsum, which computes all of the 2048 x 2048 scores as the run's flash
kernel of 2023-10-27 did (it ran unmasked, and MaxText then counted the
whole of it: `CountedFlops`).
"""

import dataclasses
import math

from lingvo import compat as tf
from lingvo.core import base_model_params
from params import large_lm
from params import pod_blocks
from params.copy_task_input import CopyTaskInput
from params.lm_params import CopyLMParams

# base.yml's model at commit 76bd53b0.
BASE = dict(model_dim=2560, num_heads=8, hidden_dim=8192, num_layers=16,
            head_dim=256, vocab_size=32768)
SEQ_LEN = 2048
V5E_PEAK = 197e12  # bf16 FLOP/s a chip: the MFU figures' denominator


def MaxTextDims(scale):
  """{model_dim, num_heads, hidden_dim, num_layers, head_dim, vocab_size}
  of `global_parameter_scale` = scale, by get_individual_scales."""
  log2 = int(math.log2(scale))
  if 2**log2 != scale:
    raise ValueError(f'global_parameter_scale={scale} must be a power of 2.')
  base, rem = divmod(log2, 3)
  heads = base + int(rem > 0)
  return dict(BASE, model_dim=BASE['model_dim'] * 2**(base + int(rem > 1)),
              num_heads=BASE['num_heads'] * 2**heads,
              hidden_dim=BASE['hidden_dim'] * 2**heads,
              num_layers=BASE['num_layers'] * 2**base)


def MaxTextParameters(dims):
  """MaxText's parameter count of the model: the tied table once, per
  layer q, k, v, o [d, heads, head] and the feed-forward's two matrices,
  its norms (one [d] before the block, the q, k, v norms [head]), the
  final norm."""
  d, h, hd = dims['model_dim'], dims['num_heads'], dims['head_dim']
  per_layer = 4 * d * h * hd + 2 * d * dims['hidden_dim'] + d + 3 * hd
  return dims['vocab_size'] * d + dims['num_layers'] * per_layer + d


def CountedFlops(dims, tokens, seq_len=SEQ_LEN, causal=False):
  """The FLOPs MaxText's train.py counts for a step of `tokens` tokens
  (Chowdhery et al.'s appendix B): 6 x parameters x tokens, plus the
  attention's 12 x heads x layers x head x seq x tokens; causal halves the
  attention (the code of 2023-12-15; the table's runs of 2023-10-27 ran
  the attention unmasked and counted it whole). No recomputation counted."""
  attention = (12 * dims['num_heads'] * dims['num_layers'] *
               dims['head_dim'] * seq_len * tokens)
  return (6 * MaxTextParameters(dims) * tokens +
          attention * (0.5 if causal else 1.0))


@dataclasses.dataclass(frozen=True)
class Published:
  """One published run: its figures and settings."""
  scale: int  # global_parameter_scale
  tflops_per_chip: float
  mfu: float
  per_device_batch: int
  data: int  # ICI FSDP
  model: int = 1  # ICI tensor parallelism
  chips: int = 256


RUNS = {
    '16B': Published(16, 120, 0.6110, 6, data=256),
    '32B': Published(32, 132, 0.6686, 4, data=256),
    '64B': Published(64, 118, 0.5990, 2, data=256),
    '128B': Published(128, 110, 0.5606, 1, data=16, model=16),
}


class MaxTextRun(base_model_params.SingleTaskModelParams):
  """A published run (RUN, a key of RUNS) on CHIPS chips (None: its own
  slice), the per-chip batch and the FSDP x tensor layout kept: on fewer
  chips the data axis shrinks with them."""
  RUN = '16B'
  CHIPS = None
  LAYERS = None  # None: the run's own; else the layers planned

  @classmethod
  def Run(cls):
    return RUNS[cls.RUN]

  @classmethod
  def Mesh(cls):
    run = cls.Run()
    chips = cls.CHIPS or run.chips
    return pod_blocks.PodMesh(stages=1, data=chips // run.model,
                              model=run.model, fsdp=True)

  @classmethod
  def Dims(cls):
    dims = MaxTextDims(cls.Run().scale)
    return dict(dims, num_layers=cls.LAYERS or dims['num_layers'])

  @classmethod
  def PublishedMeshShape(cls):
    """The [1, data, model] mesh the run had on its own slice, a whole v5e
    pod: where its collectives ran (benchmarks.calibration plans any chips
    with the links this mesh has there, gpipe.plan.torus)."""
    run = cls.Run()
    return (1, run.chips // run.model, run.model)

  def Train(self):
    run, mesh = self.Run(), self.Mesh()
    return CopyTaskInput.Params().Set(
        vocab_size=self.Dims()['vocab_size'], copy_length=SEQ_LEN // 2,
        batch_size=run.per_device_batch * mesh.num_devices)

  def Task(self):
    dims, mesh = self.Dims(), self.Mesh()
    return CopyLMParams(
        name=f'maxtext_{self.RUN.lower()}', vocab_size=dims['vocab_size'],
        model_dim=dims['model_dim'], num_heads=dims['num_heads'],
        head_dim=dims['head_dim'], hidden_dim=dims['hidden_dim'],
        blocks_per_stage=dims['num_layers'], num_stages=1,
        circular_repeat=1, num_microbatches=1, dropout_prob=0.0,
        shard_stages_1d=False, learning_rate=1e-4, max_steps=100000,
        max_seq_len=SEQ_LEN, batch_major=True, fprop_dtype=tf.bfloat16,
        stack_dtype=tf.bfloat16, mesh=mesh, remat_blocks=True, rotary=True,
        stack_options=dict(remat_policy='save_checkpoints'),
        task_cls=large_lm.LargeLMTask)


# The chips each run is also planned on: its per-chip step and layout, the
# data axis shrunk (16B to 64B: FSDP 16, 15/16 of the slice's gathered
# bytes a chip; 128B: tensor 16 x FSDP 4).
FEWER_CHIPS = {'16B': 16, '32B': 16, '64B': 16, '128B': 64}
# The layers a run is planned with on FEWER_CHIPS where all of them are
# out of this host's memory to compile (128B: 16 of its 64; each layer's
# work and collectives a chip as in the whole run, the tied table's share
# of the step four times as large).
FEWER_LAYERS = {'128B': 16}


def RunName(run, chips, layers=None):
  """MaxText<run>OnV5e<chips>[At<layers>Layers]: a registered run's name."""
  return f'MaxText{run}OnV5e{chips}' + (f'At{layers}Layers' if layers else '')


def FewerChipsName(run):
  """The name `run` is planned under on FEWER_CHIPS (at FEWER_LAYERS where
  it has the run), e.g. MaxText16BOnV5e16, MaxText128BOnV5e64At16Layers."""
  return RunName(run, FEWER_CHIPS[run], FEWER_LAYERS.get(run))


def RunClasses(module):
  """{name: model params class} of every run on its slice, on FEWER_CHIPS
  and, where FEWER_LAYERS has it, on FEWER_CHIPS at fewer layers (RunName),
  to register in `module` (params/lm.py: lm.MaxText16BOnV5e256)."""
  classes = {}
  for run, published in RUNS.items():
    layouts = [(published.chips, None), (FEWER_CHIPS[run], None)]
    if run in FEWER_LAYERS:
      layouts.append((FEWER_CHIPS[run], FEWER_LAYERS[run]))
    for chips, layers in layouts:
      name = RunName(run, chips, layers)
      depth = f', {layers} of its layers' if layers else ''
      classes[name] = type(name, (MaxTextRun,), dict(
          RUN=run, CHIPS=chips, LAYERS=layers, __module__=module, __doc__=(
              f"MaxText's published {run} v5e run ({published.mfu:.2%} MFU "
              f'measured on {published.chips} chips), planned on {chips}'
              f'{depth}: params/published_runs.py.')))
  return classes
