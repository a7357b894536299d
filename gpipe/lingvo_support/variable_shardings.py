"""A variable's own XLA sharding: read off it, and put on a tensor of it.

Lingvo's layers annotate a variable where they create it, when built for a
TPU (its `tensor_split_dims_mapping` over `device_mesh`; under a pipelined
layer with the stage dim's axis in front). On a TPU the variable lives so:
its annotation is where each chip keeps its share, whatever the ops that
read it ask for, and a layout that keeps a weight split finer than its uses
(FSDP: split over the data axis too, gathered where a block uses it)
depends on it. A step that takes the weights in as tensors (the planner's,
the partitioning check's) loses it: the tensors carry no annotation, and
XLA's propagation gives them the sharding their first use asks for.
`AsTheirVariables` puts it back.
"""

import tensorflow as tf
# pylint: disable=g-direct-tensorflow-import
from tensorflow.compiler.xla import xla_data_pb2
from tensorflow.python.compiler.xla.experimental import xla_sharding
# pylint: enable=g-direct-tensorflow-import


def OwnSharding(variable):
  """The OpSharding proto `variable` was annotated with, or None (not a
  variable, or created without an annotation)."""
  if variable is None or not hasattr(variable, 'op'):
    return None
  try:
    serialized = xla_sharding.get_op_sharding(variable.op)
  except (ValueError, AttributeError):
    return None
  if not serialized:
    return None
  proto = xla_data_pb2.OpSharding()
  proto.ParseFromString(serialized)
  return proto


def ShardShape(variable):
  """The per-device shape `variable`'s own annotation asks for, or None."""
  proto = OwnSharding(variable)
  if proto is None:
    return None
  shape = variable.shape.as_list()
  tiles = list(proto.tile_assignment_dimensions)[:len(shape)]
  if len(tiles) != len(shape):
    return None
  return tuple(-(-size // n) for size, n in zip(shape, tiles))


def AsTheirVariables(tree, variables):
  """`tree` (a NestedMap shaped like `variables`, e.g. theta or one
  optimizer slot of each weight) with each tensor annotated as its
  variable is, where the variable has an annotation and the tensor its
  shape (a factored slot of another shape is left as it is)."""
  values, owners = tree.Flatten(), variables.Flatten()
  if len(values) != len(owners):
    raise ValueError(
        f'AsTheirVariables: {len(values)} tensors for {len(owners)} '
        'variables; give a tree shaped like the variables.')
  return tree.Pack([_AsItsVariable(v, owner)
                    for v, owner in zip(values, owners)])


def _AsItsVariable(value, variable):
  if not isinstance(value, tf.Tensor) or value.shape != variable.shape:
    return value
  proto = OwnSharding(variable)
  if proto is None:
    return value
  return xla_sharding.Sharding(proto).apply_to_tensor(
      value, use_sharding_op=True)
