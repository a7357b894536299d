"""Importing part of a traced graph into a loop body, some tensors fed.

gpipe.loops.cell_graph traces a loop's cell once; each loop imports the
part of it that its results need (`Import`), with the loop's values
substituted for the cell's placeholders and, in the backward loop, for the
activations the forward loop stored: the ops that computed those are cut
off (`_Prune`), so the import neither holds nor runs them.
"""

import tensorflow as tf

# pylint: disable=g-direct-tensorflow-import
from tensorflow.python.framework import importer
# pylint: enable=g-direct-tensorflow-import


def _TensorName(ref):
  """A GraphDef input reference ('op', 'op:1', '^op') as (op, tensor)."""
  if ref.startswith('^'):
    return ref[1:], None
  op, _, index = ref.partition(':')
  return op, f'{op}:{index or 0}'


def _Prune(graph_def, output_names, cut_names, source):
  """The nodes `output_names` need, not looking past `cut_names` tensors.

  Every cut tensor reached becomes a placeholder of its own (its consumers
  read that), so nothing upstream of it is kept; control edges to a node
  with a cut output are dropped (its values come from outside). `source`
  is the tf.Graph graph_def was made from: each stand-in takes its cut
  tensor's dtype and shape from there.

  Returns:
    (pruned GraphDef, {placeholder tensor name: cut tensor name}).
  """
  nodes = {n.name: n for n in graph_def.node}
  cut_ops = {_TensorName(n)[0] for n in cut_names}
  keep = set()
  stack = [_TensorName(n)[0] for n in output_names if n not in cut_names]
  while stack:
    op = stack.pop()
    if op in keep:
      continue
    keep.add(op)
    for ref in nodes[op].input:
      src, tensor = _TensorName(ref)
      if tensor in cut_names or (tensor is None and src in cut_ops):
        continue
      if src not in keep:
        stack.append(src)
  pruned = tf.compat.v1.GraphDef()
  pruned.versions.CopyFrom(graph_def.versions)
  pruned.library.CopyFrom(graph_def.library)
  fed = {}  # cut tensor name -> placeholder node name
  for node in graph_def.node:
    if node.name not in keep:
      continue
    copy = pruned.node.add()
    copy.CopyFrom(node)
    if '_class' in copy.attr:
      del copy.attr['_class']
    if '_lower_using_switch_merge' in copy.attr:
      # A cond or loop of the cell stays one op: XLA cannot compile the
      # Switch and Merge ops TensorFlow would lower it to in a Session
      # (gpipe.loops.compiled_loops).
      del copy.attr['_lower_using_switch_merge']
    del copy.input[:]
    for ref in node.input:
      src, tensor = _TensorName(ref)
      if tensor is None and src in cut_ops:
        continue
      if tensor in cut_names:
        if tensor not in fed:
          fed[tensor] = f'gpipe_fed_{len(fed)}'
        ref = fed[tensor]
      copy.input.append(ref)
  for tensor, name in fed.items():
    cut = source.get_tensor_by_name(tensor)
    _AddStandIn(pruned, name, cut.dtype, cut.shape)
  return pruned, {f'{name}:0': tensor for tensor, name in fed.items()}


def _AddStandIn(graph_def, name, dtype, shape):
  """A node whose output the import replaces: an empty constant.

  It stays behind, unused, in the importing graph, where XLA compiles it
  (it would refuse a Placeholder). Dtypes a constant cannot have (resource
  handles, variants) get a Placeholder.
  """
  node = graph_def.node.add()
  node.name = name
  node.attr['dtype'].type = dtype.as_datatype_enum
  if dtype in (tf.resource, tf.variant):
    node.op = 'Placeholder'
    node.attr['shape'].shape.CopyFrom(shape.as_proto())
  else:
    node.op = 'Const'
    node.attr['value'].tensor.CopyFrom(
        tf.make_tensor_proto([], dtype=dtype, shape=[0]))


def Import(graph_def, input_map, output_names, name, source):
  """Imports what `output_names` need, `input_map` tensors substituted.

  An output that is itself substituted is its substitute. Values from other
  graphs (outer graphs of a loop body) are captured by an identity.
  """
  pruned, fed = _Prune(graph_def, output_names, set(input_map), source)
  feeds = {ph: tf.identity(input_map[t]) for ph, t in fed.items()}
  wanted = [n for n in output_names if n not in input_map]
  imported = importer.import_graph_def(
      pruned, input_map=feeds, return_elements=wanted, name=name)
  by_name = dict(zip(wanted, imported))
  return [tf.identity(input_map[n]) if n in input_map else by_name[n]
          for n in output_names]
