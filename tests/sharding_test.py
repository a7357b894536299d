"""The annotation helpers emit the shardings they document, on CPU.

Checked on the graph they build (op types and OpSharding protos), without a
partitioner; what the partitioner makes of them is
tests/xla/partitioning_test.py.
"""

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import sharding
from tensorflow.compiler.xla import xla_data_pb2  # pylint: disable=g-direct-tensorflow-import

OpSharding = xla_data_pb2.OpSharding


def _Proto(t):
  """The OpSharding an XlaSharding op put on t."""
  assert t.op.type == 'XlaSharding', t.op.type
  proto = OpSharding()
  proto.ParseFromString(t.op.get_attr('sharding'))
  return proto


@pytest.fixture
def graph():
  with tf.Graph().as_default() as g:
    yield g


def test_split_tiles_one_dim(graph):
  del graph
  x = tf.zeros([4, 6])
  proto = _Proto(sharding.Split(x, 0, 4))
  assert proto.type == OpSharding.OTHER
  assert list(proto.tile_assignment_dimensions) == [4, 1]
  assert list(proto.tile_assignment_devices) == [0, 1, 2, 3]
  # One device: nothing to split, no op.
  assert sharding.Split(x, 0, 1) is x


def test_replicate(graph):
  del graph
  assert _Proto(sharding.Replicate(tf.zeros([3]))).type == OpSharding.REPLICATED


def test_mesh_split_partially_specified(graph):
  del graph
  mesh = np.arange(8).reshape(4, 2)
  y = sharding.MeshSplit(tf.zeros([4, 6, 2]), mesh, [0, -1, -1],
                         unspecified_dims=[1, 2])
  proto = _Proto(y)
  # Dim 0 over mesh axis 0; mesh axis 1 left to the partitioner.
  assert list(proto.tile_assignment_dimensions)[:3] == [4, 1, 1]
  assert list(y.op.get_attr('unspecified_dims')) == [1, 2]


def test_mesh_split_rejects_wrong_rank(graph):
  del graph
  with pytest.raises(ValueError, match='has 1 entries but the tensor has '
                     'rank 2'):
    sharding.MeshSplit(tf.zeros([2, 2]), np.arange(2), [0])


def test_split_stage_dim_on_a_mesh_axis(graph):
  del graph
  mesh = np.arange(8).reshape(4, 2)
  y = sharding.SplitStageDim(tf.zeros([4, 3]), 0, 4, mesh, 0)
  assert list(_Proto(y).tile_assignment_dimensions)[:2] == [4, 1]
  assert list(y.op.get_attr('unspecified_dims')) == [1]


def test_copy_sharding_from_an_annotated_tensor(graph):
  del graph
  source = sharding.Split(tf.zeros([4, 2]), 0, 4)
  copied = sharding.CopySharding(source, tf.ones([4, 2]))
  assert _Proto(copied) == _Proto(source)


def test_manual_stage_round_trip_shapes(graph):
  del graph
  mesh, dim = sharding.StageMesh(4)
  x = tf.zeros([4, 3, 5])
  manual = sharding.ToManualStage(x, mesh, dim)
  assert manual.shape.as_list() == [3, 5]
  back = sharding.FromManualStage(manual, mesh, dim)
  assert back.shape.as_list() == [4, 3, 5]
  assert back.op.type == 'XlaSpmdShardToFullShape'
  assert sharding.BroadcastToManualStage(
      tf.zeros([5]), mesh, dim).shape.as_list() == [5]


def test_spmd_partitioning_context():
  assert not sharding.IsSpmdPartitioning()
  with sharding.SpmdPartitioning():
    assert sharding.IsSpmdPartitioning()
    with sharding.SpmdPartitioning(False):
      assert not sharding.IsSpmdPartitioning()
  assert not sharding.IsSpmdPartitioning()


def test_manual_stage_region_subgroups_mesh_split(graph):
  del graph
  mesh = np.arange(8).reshape(4, 2)
  with sharding.ManualStageRegion(0):
    proto = _Proto(sharding.MeshSplit(tf.zeros([6, 3]), mesh, [1, -1]))
  # The stage axis (0) is a manual subgroup; the batch dim is split over 1.
  assert OpSharding.MANUAL in list(proto.last_tile_dims)
  assert list(proto.tile_assignment_dimensions)[:2] == [2, 1]


@pytest.mark.parametrize('shape,devices,expected', [
    ([8, 6], 4, 0),  # 8 splits evenly, 6 would need 2 padding
    ([6, 8], 4, 1),
    ([12, 8], 4, 0),  # both even: the larger
    ([3, 5], 4, 1),  # 3 < 4 cannot be split
    ([2, 3], 4, None),
    ([], 4, None),
    ([6, 7], 4, 1),  # padding 2 vs 1
])
def test_least_padding_dim(shape, devices, expected):
  assert sharding.LeastPaddingDim(shape, devices) == expected


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))


# -- StagePlacement: what each pipeline tensor gets, per sharding param. ----


def _Annotation(t):
  """None for an unannotated tensor, else 'replicated' or its tile dims."""
  if t.op.type != 'XlaSharding':
    return None
  proto = _Proto(t)
  if proto.type == OpSharding.REPLICATED:
    return 'replicated'
  return list(proto.tile_assignment_dimensions)


def test_unplaced_annotates_nothing(graph):
  del graph
  place = sharding.StagePlacement(4)
  x = tf.zeros([4, 6])
  for y in (place.SplitStages(x, 0), place.SplitOwnVariable(x),
            place.ReplicateLoopDim(x), place.ReplicateOverStages(x),
            place.ReplicateBookkeeping(x)):
    assert y is x
  assert place.mesh is None


def test_over_stage_devices_splits_and_replicates(graph):
  del graph
  place = sharding.StagePlacement(4, shard_stages_1d=True)
  x = tf.zeros([3, 4, 6])
  assert _Annotation(place.SplitStages(x, 1)) == [1, 4, 1]
  # Structures: every tensor placed, None kept.
  tree = place.SplitStages({'a': tf.zeros([4, 2]), 'b': None}, 0)
  assert _Annotation(tree['a']) == [4, 1] and tree['b'] is None
  assert _Annotation(place.ReplicateLoopDim(x)) == 'replicated'
  assert _Annotation(place.ReplicateOverStages(x)) == 'replicated'
  assert _Annotation(place.ReplicateBookkeeping(x)) == 'replicated'
  # A stage's own [6, 8] variable: 8 splits over 4 without padding.
  assert _Annotation(place.SplitOwnVariable(tf.zeros([6, 8]))) == [1, 4]
  mesh, axis = place.mesh
  np.testing.assert_array_equal(mesh, np.arange(4))
  assert axis == 0


@pytest.mark.parametrize('params,placed', [
    (dict(), False),
    (dict(shard_stages_1d=True), True),
    (dict(device_mesh=np.arange(8).reshape(4, 2), mesh_dim=0), True),
])
def test_the_stage_dim_is_split_only_placed_and_partitioned(params, placed):
  """Placed stages outside a graph for the partitioner run on one device:
  the rotation's cheaper whole-dim forms apply there too."""
  place = sharding.StagePlacement(4, **params)
  with sharding.SpmdPartitioning(False):
    assert not place.splits_stage_dim
  with sharding.SpmdPartitioning():
    assert place.splits_stage_dim == placed


def test_over_mesh_axis_decides_only_the_stage_axis_and_rows(graph):
  """The stage dim split; a [M, rows, ...] tensor's loop dim and rows whole
  and stage 0's read of one microbatch whole in its rows (its gradient
  not annotated); every other dim left to the partitioner (the other mesh
  axes may split the model dims)."""
  del graph
  device_mesh = np.arange(8).reshape(4, 2)
  place = sharding.StagePlacement(4, device_mesh=device_mesh, mesh_dim=0)
  x = tf.zeros([4, 6])
  y = place.SplitStages(x, 0)
  assert _Annotation(y)[:2] == [4, 1]
  assert list(y.op.get_attr('unspecified_dims')) == [1]
  looped = place.ReplicateLoopDim(tf.zeros([3, 4, 6]))
  # Tiles [1, 1, 1] of its dims, all 8 devices holding each.
  assert _Annotation(looped) == [1, 1, 1, 8]
  assert list(looped.op.get_attr('unspecified_dims')) == [2]
  with tf.GradientTape() as tape:
    tape.watch(x)
    read = place.ReplicateOverStages(x)
  annotated = read
  if annotated.op.type == 'IdentityN':  # tf.custom_gradient's wrapper
    annotated = annotated.op.inputs[0]
  assert _Annotation(annotated) == [1, 1, 8]
  assert list(annotated.op.get_attr('unspecified_dims')) == [1]
  dx = tape.gradient(read, x, output_gradients=tf.ones([4, 6]))
  assert dx.op.type != 'XlaSharding'
  assert _Annotation(place.ReplicateBookkeeping(x)) == 'replicated'
  assert place.mesh[1] == 0


def test_one_stage_on_a_mesh_leaves_the_rows_to_the_data_axis(graph):
  """A stage axis of one device (no pipeline): the [M, rows, ...] tensors
  keep only their loop dim whole, and stage 0's read leaves its rows open
  too, so that the data axis splits the batch (whole, every chip would
  hold all of it)."""
  del graph
  place = sharding.StagePlacement(
      1, device_mesh=np.arange(8).reshape(1, 4, 2), mesh_dim=0)
  looped = place.ReplicateLoopDim(tf.zeros([3, 4, 6]))
  assert list(looped.op.get_attr('unspecified_dims')) == [1, 2]
  read = place.ReplicateOverStages(tf.zeros([4, 6]))
  if read.op.type == 'IdentityN':  # tf.custom_gradient's wrapper
    read = read.op.inputs[0]
  assert list(read.op.get_attr('unspecified_dims')) == [0, 1]
