"""MaxText's published v5e runs as this project's models (params/published_runs.py).

The dims follow MaxText's base config and its global_parameter_scale rule,
worked by hand here; the parameter counts are checked against the names
the runs were published under (16B ... 128B), and the registered model's
own variables, counted where it is built, against MaxText's count of its
model (what differs: biases, LayerNorm's bias, a position table and a
softmax bias, under 0.3 %).
"""

import math

import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe.lingvo_support import flags_and_seeds
from gpipe.lingvo_support import tpu_build
from gpipe.plan import torus
import params.lm as lm
from params import published_runs

flags_and_seeds.EnsureFlagsParsed()


@pytest.mark.parametrize('scale, dims', [
    # log2 = 3 b + r: heads and feed-forward doubled b + (r > 0) times,
    # width b + (r > 1), layers b.
    (16, dict(model_dim=5120, num_heads=32, hidden_dim=32768,
              num_layers=32)),   # b 1, r 1
    (32, dict(model_dim=10240, num_heads=32, hidden_dim=32768,
              num_layers=32)),   # b 1, r 2
    (64, dict(model_dim=10240, num_heads=32, hidden_dim=32768,
              num_layers=64)),   # b 2, r 0
    (128, dict(model_dim=10240, num_heads=64, hidden_dim=65536,
               num_layers=64)),  # b 2, r 1
])
def test_the_dims_follow_the_scale_rule(scale, dims):
  assert published_runs.MaxTextDims(scale) == dict(
      dims, head_dim=256, vocab_size=32768)


def test_each_run_has_the_parameters_of_its_name():
  for run, published in published_runs.RUNS.items():
    count = published_runs.MaxTextParameters(
        published_runs.MaxTextDims(published.scale))
    assert abs(count / (float(run[:-1]) * 1e9) - 1) < 0.03, (run, count)
  # 16B by hand: table 32768 x 5120; per layer 4 x 5120 x 32 x 256 +
  # 2 x 5120 x 32768 + 5120 + 3 x 256; 32 layers; the final norm.
  per_layer = 4 * 5120 * 32 * 256 + 2 * 5120 * 32768 + 5120 + 768
  assert published_runs.MaxTextParameters(published_runs.MaxTextDims(16)) == (
      32768 * 5120 + 32 * per_layer + 5120)


def test_the_counted_flops_are_maxtexts_formula():
  """6 N tokens + 12 heads layers head_dim seq tokens (unmasked, as the
  table's runs counted it), halved attention when causal."""
  dims = published_runs.MaxTextDims(16)
  n = published_runs.MaxTextParameters(dims)
  tokens = 6 * 2048
  attention = 12 * 32 * 32 * 256 * 2048 * tokens
  assert published_runs.CountedFlops(dims, tokens) == 6 * n * tokens + (
      attention)
  assert published_runs.CountedFlops(dims, tokens, causal=True) == (
      6 * n * tokens + attention / 2)
  # The 16B run's published 120 TFLOP/s a chip: a step of about 10.7 s.
  assert published_runs.CountedFlops(dims, tokens) / 120e12 == (
      pytest.approx(10.66, abs=0.01))


@pytest.mark.runs_long
def test_the_registered_16b_model_is_maxtexts_16b():
  """lm.MaxText16BOnV5e256 built (variables made, none allocated): its
  parameters within 0.3 % of MaxText's count; its mesh, batch and
  sequence as published."""
  cfg = lm.model_registry.GetParams('lm.MaxText16BOnV5e256', 'Train')
  assert cfg.input.batch_size == 6 * 256
  assert cfg.input.copy_length * 2 == published_runs.SEQ_LEN
  stack = cfg.task.stack
  assert tuple(stack.device_mesh.shape) == (1, 256, 1)
  assert stack.single_stage_body.fsdp_mesh_dim == 1
  assert stack.single_stage_body.num_blocks == 32
  with tf.Graph().as_default(), tpu_build.AsOnTpu():
    task = cfg.task.Instantiate()
    ours = sum(math.prod(v.shape.as_list()) for v in task.vars.Flatten())
  theirs = published_runs.MaxTextParameters(published_runs.MaxTextDims(16))
  assert 0 < ours / theirs - 1 < 0.003, (ours, theirs)


def test_fewer_chips_keep_the_per_chip_batch_and_layout():
  for run, chips in published_runs.FEWER_CHIPS.items():
    cfg = lm.model_registry.GetParams(f'lm.MaxText{run}OnV5e{chips}', 'Train')
    published = published_runs.RUNS[run]
    assert cfg.input.batch_size == published.per_device_batch * chips
    mesh = cfg.task.stack.device_mesh.shape
    assert mesh == (1, chips // published.model, published.model), run


def test_fewer_chips_keep_the_links_of_the_published_pod():
  """FSDP over all 256 chips of the pod spans both closed dimensions: 4
  links; 128B's FSDP 16 x tensor 16 one closed dimension each: 2, 2. On
  fewer chips the same figures: the plan stands in for the pod's step."""
  want = {'16B': (1, 4, 1), '32B': (1, 4, 1), '64B': (1, 4, 1),
          '128B': (1, 2, 2)}
  for run, chips in published_runs.FEWER_CHIPS.items():
    for on in (chips, published_runs.RUNS[run].chips):
      cls = lm.model_registry.GetClass(f'lm.MaxText{run}OnV5e{on}')
      assert torus.LinksPerAxis(cls.PublishedMeshShape()) == want[run], (
          run, on)


def test_fewer_layers_keep_each_layer_and_the_run():
  """128B planned at 16 of its 64 layers: only the depth differs from the
  full run on as many chips (width, heads, feed-forward, batch, mesh,
  links); the counted FLOPs are the shallow model's."""
  assert published_runs.FewerChipsName('128B') == 'MaxText128BOnV5e64At16Layers'
  assert published_runs.FewerChipsName('16B') == 'MaxText16BOnV5e16'
  shallow = lm.model_registry.GetClass('lm.MaxText128BOnV5e64At16Layers')
  whole = lm.model_registry.GetClass('lm.MaxText128BOnV5e64')
  assert shallow.Dims() == dict(whole.Dims(), num_layers=16)
  assert whole.Dims()['num_layers'] == 64
  assert shallow.Mesh().device_mesh.shape == whole.Mesh().device_mesh.shape
  assert shallow.PublishedMeshShape() == whole.PublishedMeshShape()
  cfg = lm.model_registry.GetParams('lm.MaxText128BOnV5e64At16Layers',
                                    'Train')
  assert cfg.input.batch_size == 64
  assert cfg.task.stack.single_stage_body.num_blocks == 16
