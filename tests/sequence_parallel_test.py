"""Sequence-parallel pod blocks (params/sequence_parallel.py).

The sequence-parallel stage equals the stage it splits (values and every
gradient) on one device, in graph mode and under jit, and partitioned on 8
virtual devices with a model axis of 2 and of 4. Partitioned, each block
gathers before its two column-parallel matmuls and reduce-scatters after
its two row-parallel ones, forward and backward: no activation is summed
whole over the model axis, the stage's output stays split along the
sequence, and the wire carries what the split stage's all-reduces carried.
lm.LargestMeshSmallSequenceParallel (1f1b, the loss and embedding in the
loop, each block recomputed) partitioned equals it on one device, and its
stages send each other 1/P of an activation.
"""

import functools

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import sharding
from gpipe.lingvo_support import flags_and_seeds
from gpipe.lingvo_support import tpu_build
from gpipe.xla import hlo_text
from gpipe.xla import reduce_scatters
from gpipe.xla import partitioning
import params.lm as lm
from params import pod_blocks
from params import sequence_parallel
from tests import close
from tests import pod_stages
from tests import sessions

flags_and_seeds.EnsureFlagsParsed()

BATCH = 4
TIME, DIM, BLOCKS = pod_stages.TIME, pod_stages.DIM, pod_stages.BLOCKS


def _StageParams(mesh, split, **kwargs):
  """pod_stages' stage on `mesh`; with `split`, sequence-parallel."""
  return pod_stages.StageParams(
      mesh, sequence_parallel.SequenceParallel if split else None, **kwargs)


def _Build(split, mesh, **kwargs):
  """The stage and its initial weights as arrays."""
  return pod_stages.Build(_StageParams(mesh, split, **kwargs))


def _OnOneDevice(split, mesh, mode, weights=None, **kwargs):
  """(the stage's step at `weights` (None: its own initial ones), those
  weights), in a graph of its own."""
  return pod_stages.OnOneDevice(_StageParams(mesh, split, **kwargs), BATCH,
                                mode, weights)


@pytest.mark.parametrize('mode, dropout, remat', [
    ('graph', 0.1, False), ('graph', 0.0, True), ('jit', 0.0, False)])
def test_the_split_stage_equals_the_stage_on_one_device(mode, dropout, remat):
  """The annotations run as identities on one device: the same numbers
  (dropout draws the same masks; recomputed blocks the same gradients)."""
  mesh = pod_blocks.PodMesh(stages=1, data=2, model=4)
  want, weights = _OnOneDevice(False, mesh, mode, dropout=dropout,
                               remat=remat)
  got, _ = _OnOneDevice(True, mesh, mode, weights, dropout=dropout,
                        remat=remat)
  assert np.abs(want[1]).max() > 0
  close.AssertClose(got, want, close.FLOAT32, f'split stage ({mode})')


def _Decoded(split, mesh, weights=None):
  """Two positions through the stage's ExtendStep, in a graph of its own."""
  x, _ = pod_stages.Inputs(BATCH)
  with tf.Graph().as_default():
    stage, initial = _Build(split, mesh)
    weights = initial if weights is None else weights
    theta = stage.theta.Pack([tf.constant(w) for w in weights])
    states = stage.InitStates(theta, BATCH, 2)
    for t in range(2):
      y, states = stage.ExtendStep(theta, tf.constant(x[:, t]), states, t)
    with sessions.AsBuilt() as sess:
      return sess.run(y), weights


def test_decoding_one_position_keeps_the_whole_layout():
  """ExtendStep's single position cannot be split: the same numbers as
  the stage it splits, its position left whole."""
  mesh = pod_blocks.PodMesh(stages=1, data=1, model=2)
  want, weights = _Decoded(False, mesh)
  got, _ = _Decoded(True, mesh, weights)
  close.AssertClose(got, want, close.FLOAT32, 'decoded')
  assert sequence_parallel.SplitsSequence(tf.zeros([BATCH, TIME, DIM]),
                                          mesh.device_mesh)
  assert not sequence_parallel.SplitsSequence(tf.zeros([BATCH, 1, DIM]),
                                              mesh.device_mesh)


@functools.lru_cache(maxsize=None)
def _Partitioned(split, data, model):
  """(run, expected): the stage's step on [1, data, model] partitioned for
  its 8 devices, and the same step on one device (jit)."""
  mesh = pod_blocks.PodMesh(stages=1, data=data, model=model)
  x, paddings = pod_stages.Inputs(BATCH)
  with tf.Graph().as_default(), tpu_build.AsOnTpu():
    stage, weights = _Build(split, mesh)
  step = pod_stages.StepFn(stage, paddings)

  def Partitioned(*args):
    with tpu_build.AsOnTpu(), sharding.SpmdPartitioning():
      return step(*args)

  args = weights + [x]
  run = partitioning.RunPartitioned(Partitioned, args, mesh.num_devices)
  with tpu_build.AsOnTpu():
    expected = tf.function(step, jit_compile=True, autograph=False)(
        *[tf.constant(a) for a in args])
  return run, [e.numpy() for e in expected]


def _ModelAxisActivations(run, data, model, shapes=None):
  """The model axis's collectives of activations (of `shapes`; default
  [b/data, t, d] on each device, whole along t), in the step's order:
  [(kind, bytes, sliced)], sliced: the shape every device reads of an
  all-reduce's result, or None where it reads it whole."""
  shapes = shapes or {(BATCH // data, TIME, DIM)}
  scattered = reduce_scatters.ScatteredElements(run.hlo)
  found = []
  for c in run.collectives:
    if c.MeshAxes((1, data, model)) != (pod_blocks.PodMesh.MODEL_AXIS,):
      continue
    for i, shape in enumerate(hlo_text.ShapesOf(c.shape)):
      if shape in shapes:
        sliced = (scattered[(c.computation, c.name)][i]
                  if c.kind == 'all-reduce' else None)
        found.append((c.kind, 4 * int(np.prod(shape)), sliced))
  return found


@pytest.mark.parametrize('data, model', [(4, 2), (2, 4)])
def test_partitioned_the_blocks_gather_and_scatter_along_the_sequence(
    data, model):
  """8 devices, [1, data, model]: the step equals the one-device step;
  each block's two gathers and two scatters forward and their two and two
  backward are the model axis's only activation collectives, every
  reduction read 1/model of along time; the output stays split."""
  run, expected = _Partitioned(True, data, model)
  for i, (got, want) in enumerate(zip(run.outputs, expected)):
    close.AssertClose(got, want, close.FLOAT32_AT_SCALE, f'output {i}')
  assert run.output_shard_shapes[0] == (BATCH // data, TIME // model, DIM)
  found = _ModelAxisActivations(run, data, model)
  kinds = [kind for kind, _, _ in found]
  assert kinds.count('all-gather') == 4 * BLOCKS, found
  assert kinds.count('all-reduce') == 4 * BLOCKS, found
  assert set(kinds) == {'all-gather', 'all-reduce'}, found
  part = (BATCH // data, TIME // model, DIM)
  assert {s for k, _, s in found if k == 'all-reduce'} == {part}, found


def test_partitioned_the_wire_carries_what_the_all_reduces_did():
  """An all-reduce sends 2(n-1)/n of its bytes around a ring of n, a
  reduce-scatter and an all-gather (n-1)/n each: the split stage's
  collectives of activations carry as many bytes as the stage's."""
  data, model = 2, 4
  ring = (model - 1) / model
  wire = lambda found: sum(nbytes * ring * (2 if sliced is None and k ==
                                            'all-reduce' else 1)
                           for k, nbytes, sliced in found)
  split = _ModelAxisActivations(_Partitioned(True, data, model)[0], data,
                                model)
  # The stage's feed-forward layer runs on tokens as rows: some of its
  # activations are [b/data x t, d].
  whole = _ModelAxisActivations(
      _Partitioned(False, data, model)[0], data, model,
      {(BATCH // data, TIME, DIM), (BATCH // data * TIME, DIM)})
  assert len(whole) == 4 * BLOCKS and len(split) == 8 * BLOCKS
  assert wire(split) == wire(whole) > 0


@pytest.mark.runs_long
def test_the_largest_layout_sequence_parallel_partitioned():
  """lm.LargestMeshSmallSequenceParallel on [2 stages, 2 data, 2 model]:
  the loss and every gradient equal the one-device step's; in the
  pipeline's loops no activation is summed whole over the model axis,
  and the stage-to-stage sends carry [rows, t/2, d]."""
  from gpipe.xla import check_model  # pylint: disable=g-import-not-at-top
  if not partitioning.IsAvailable():
    pytest.fail('jax and jaxlib are needed (they are in the test extra).')
  name = 'lm.LargestMeshSmallSequenceParallel'
  cls = lm.model_registry.GetClass(name)
  checked = check_model.CheckModelPartitioning(check_model.FindModel(name), 8)
  for result, got, want in zip(checked.step.ResultNames(),
                               checked.run.outputs, checked.expected):
    assert np.abs(want).max() > 0, f'{result} is all zero: nothing checked'
    close.AssertClose(got, want, close.FLOAT32_AT_SCALE, result)
  assert checked.Problems(1e-5) == []
  rows = cls.BATCH_SIZE // cls.NUM_MICROBATCHES // cls.MESH.data
  seq, dim = 2 * cls.COPY_LENGTH, cls.MODEL_DIM
  scattered = reduce_scatters.ScatteredElements(checked.run.hlo)
  in_loops = [c for c in checked.run.collectives if c.loop >= 0]
  summed_whole = [
      c.op_name for c in in_loops if c.kind == 'all-reduce' and
      c.MeshAxes(checked.mesh_shape) == (pod_blocks.PodMesh.MODEL_AXIS,)
      for shape, sliced in zip(hlo_text.ShapesOf(c.shape),
                               scattered[(c.computation, c.name)])
      if shape == (rows, seq, dim) and sliced is None]
  assert not summed_whole, summed_whole
  sends = {s for c in in_loops if c.kind == 'collective-permute'
           for s in hlo_text.ShapesOf(c.shape) if s[-1] == dim}
  assert sends == {(1, rows, seq // cls.MESH.model, dim)}, sends


def test_sequence_parallel_needs_a_mesh():
  with pytest.raises(ValueError, match='give a mesh'):
    pod_stages.TinyCopyLMParams(sequence_parallel=True)


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
