"""Every stage of an iteration as one computation, on one device.

On one device the S stages of an iteration are independent: each runs the
same body on its own slot of the [S, ...] buffer with its own weights. So
the body is traced once, for one stage, and vectorized over the leading
stage dim (`tf.vectorized_map`): a matmul of one stage becomes one batched
matmul of all S, instead of S small computations one after another.

    stage-by-stage      body(w[0], x[0]); body(w[1], x[1]); ...; stack
    vectorized          pfor_s body(w[s], x[s])  ->  [S, ...] at once

The numbers are the same up to float rounding (the same ops, batched), and
so are the step seeds, the aux losses, summaries and non-trainable
variables: every stage's own, as stage by stage.

An op TensorFlow's vectorizer has no batched form for (e.g. the stateless
random ops of dropout) runs once per stage inside the vectorized
computation, in a loop of its own. What cannot be vectorized at all runs
stage by stage (`gpipe.pipeline.stage_runners.RunOneByOne`), decided once per
layer and said in one log line (`Vectorizing`): a body the vectorizer stops on,
a stateful random op (vectorized, it would draw other numbers), a custom
gradient (the vectorizer rewrites the op and drops its gradient), or,
under XLA, control flow whose condition differs between stages. The
layer's `vectorize_stages` param can force either path.
"""

import contextlib

from absl import logging
import tensorflow as tf
# pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import control_flow_assert
from tensorflow.python.ops import gen_logging_ops
from tensorflow.python.ops.parallel_for import control_flow_ops as pfor_ops
from tensorflow.python.ops.parallel_for import pfor as pfor_lib
# pylint: enable=g-direct-tensorflow-import

from gpipe.loops import cell_graph
from gpipe.loops import compiled_loops
from gpipe import microbatch
from gpipe import nest
from gpipe.pipeline import stage_call
from gpipe.pipeline import stage_runners
from gpipe import sharding
from lingvo import compat as lingvo_tf


class CannotVectorize(ValueError):
  """The body cannot run vectorized over the stages; says why."""


class Vectorizing(stage_runners.StageRunner):
  """A layer's one-device runner: vectorized or stage by stage.

  'auto' tries the vectorized run and, if the body cannot take it, falls
  back to stage by stage for good, logging why once; 'always' raises
  instead; 'never' runs stage by stage.
  """
  any_stage_range = True

  def __init__(self, mode, owner):
    self.mode = mode  # checked with the layer's other params
    self.owner = owner
    self.reason = None  # why the body runs stage by stage, once known
    self.vectorized = False  # whether a call has run vectorized

  @property
  def vectorizes(self):
    return self.mode != 'never'

  @property
  def stage_dim_inside(self):
    """Once a call has run vectorized (and none fell back)."""
    return self.vectorized and self.reason is None

  def CallStages(self, spec, theta, it):
    if (self.mode == 'never' or self.reason is not None or
        it.num_stages == 1 or tf.executing_eagerly()):
      return stage_runners.RunOneByOne(spec, theta, it)
    try:
      result = RunVectorized(spec, theta, it)
      self.vectorized = True
      return result
    except CannotVectorize as e:
      if self.mode == 'always':
        raise ValueError(
            f'PipelinedLayer {self.owner!r}: vectorize_stages=\'always\', '
            f'but {e} Set vectorize_stages=\'auto\' (or \'never\') to run '
            'the stages one after another.') from None
      self.reason = str(e)
      logging.info('PipelinedLayer %r runs its stages one after another '
                   '(not vectorized): %s', self.owner, self.reason)
      return stage_runners.RunOneByOne(spec, theta, it)


def RunVectorized(spec, theta, it):
  """All stages of one iteration in one vectorized call of the body.

  Raises:
    CannotVectorize: the body cannot be vectorized (nothing is returned
      then; the caller runs stage by stage).
  """
  kwargs = {k: nest.MapTensors(
      lambda t: microbatch.SliceForStages(t, it.mb_ids), v)
            for k, v in spec.mb_kwargs.items()}
  theta = tf.nest.map_structure(
      lambda t: spec.repeats.TakeFromSR(t, it.repeat_ids), theta)
  per_stage = dict(theta=theta, args=it.args, kwargs=kwargs, seed=it.seeds,
                   repeat=it.repeat_ids, vars=list(it.var_values))
  return VectorizedCalls(spec, per_stage, {}, it.num_stages,
                         'every stage at once (vectorized)')


def VectorizedCalls(spec, per_call, shared, num_calls, where):
  """num_calls calls of the body as one vectorized computation.

  Args:
    spec: the loop_spec.LoopSpec.
    per_call: {theta, args, kwargs, seed, repeat, vars}, or some of them,
      each with a leading [num_calls] dim: call i gets entry [i] of each.
    shared: the rest of those entries, the same for every call (weights
      read by every call stay one tensor, not num_calls copies).
    num_calls: how many calls.
    where: which calls these are, for error notes.

  Returns:
    A stage_runners.RunnerResult, each entry [num_calls, ...].

  Raises:
    CannotVectorize: the body cannot be vectorized (nothing is returned
      then; the caller runs the calls some other way).
  """
  leaves, rebuild = _TensorLeaves(per_call)
  traced = {}

  def OneCall(sliced):
    x = dict(rebuild(sliced), **shared)
    ops_before = len(tf.compat.v1.get_default_graph().get_operations())
    res = _CallOnce(spec, x, where)
    outputs, traced['outputs'] = _TensorLeaves(res.outputs)
    traced['shapes'] = [o.shape for o in outputs]
    aux = res.AuxLoss()
    traced['aux'] = aux is not None
    traced['names'] = [name for name, _, _ in res.summaries]
    traced['ops'] = tf.compat.v1.get_default_graph().get_operations()[
        ops_before:]
    return dict(
        outputs=outputs,
        aux=tf.constant(0.0, tf.float32) if aux is None else aux,
        values=[v for _, v, _ in res.summaries],
        weights=[w for _, _, w in res.summaries],
        vars=[spec.repeats.Put(v, x['repeat'], new)
              for v, new in zip(x['vars'], res.new_vars)])

  graph = tf.compat.v1.get_default_graph()
  num_ops = len(graph.get_operations())
  try:
    with sharding.VectorizedOverStages(), _PlainAsserts():
      out = _VectorizedMap(OneCall, leaves, num_calls)
  except Exception as e:  # pylint: disable=broad-except
    if 'ops' not in traced:
      raise  # the body's own error, raised while tracing it
    raise CannotVectorize(
        f'TensorFlow\'s vectorizer stopped on it: {_FirstLine(e)}') from e
  _CheckTracedOps(traced['ops'])
  _CheckVectorizedOps(graph.get_operations()[num_ops:])
  for o, shape in zip(out['outputs'], traced['shapes']):
    o.set_shape(tf.TensorShape([num_calls]).concatenate(shape))
  return stage_runners.RunnerResult(
      outputs=traced['outputs'](out['outputs']),
      aux=out['aux'] if traced['aux'] else None,
      summaries=list(zip(traced['names'], out['values'], out['weights'])),
      vars=out['vars'])


def _VectorizedMap(fn, leaves, num_stages):
  """fn over the leading [num_stages] dim of each leaf, vectorized.

  As tf.vectorized_map, an op without a batched form running in a loop
  over the stages; built in the graph at hand: under XLA it would wrap
  the vectorization in a function of its own, which keeps the traced,
  unvectorized body in its graph, and XLA compiles that too (its
  one-stage sharding annotations do not fit the vectorized ranks). Here
  the traced body is left dead in the pipeline's cell graph, which
  imports only what its outputs need.
  """

  def LoopFn(i):
    return fn([tf.gather(x, i) for x in leaves])

  with _EinsumsMergingTheCallDim():
    return pfor_ops._pfor_impl(  # pylint: disable=protected-access
        LoopFn, num_stages, fallback_to_while_loop=True)


@contextlib.contextmanager
def _EinsumsMergingTheCallDim():
  """pfor vectorizes an einsum whose one operand differs per call by a new
  leading axis of its own, 'bd,dh->bh' -> 'Nbd,dh->Nbh'. Its gradients are
  einsums XLA lowers to a transposed copy of their [N, b, h] operand fused
  with the elementwise ops before it, a slow loop (a gelu body called
  layer by layer, under jit:
  docs/benchmarks.md#measured-behind-the-codes-choices). Where the
  operand's first axis leads the output too, the call axis is merged into
  it instead: 'bd,dh->bh' on [N * b, d], the plain stack's einsum (and
  gradients) on the whole batch.
  Other einsums are vectorized as pfor does.
  """
  registry = pfor_lib._pfor_converter_registry  # pylint: disable=protected-access
  original = registry['Einsum']
  registry['Einsum'] = (
      lambda pfor_input: _MergedEinsum(pfor_input) or original(pfor_input))
  try:
    yield
  finally:
    registry['Einsum'] = original


def _MergedEinsum(pfor_input):
  """The einsum on the call axis merged into its stacked operand's first
  axis, or None where that does not apply (see _EinsumsMergingTheCallDim)."""
  if pfor_input.num_inputs != 2:
    return None
  (a, a_stacked, _), (b, b_stacked, _) = [pfor_input.input(i)
                                          for i in range(2)]
  equation = pfor_input.get_attr('equation').decode('utf-8')
  if a_stacked == b_stacked or '...' in equation:
    return None
  inputs, output = equation.split('->')
  exprs = inputs.split(',')
  i = 0 if a_stacked else 1
  mine, other = exprs[i], exprs[1 - i]
  if (not mine or not output or mine[0] != output[0] or
      mine[0] in other or mine.count(mine[0]) != 1 or
      output.count(mine[0]) != 1):
    return None
  x = (a, b)[i]
  calls_and_first = tf.shape(x)[:2]
  merged = tf.reshape(x, tf.concat([[-1], tf.shape(x)[2:]], 0))
  y = tf.einsum(equation, *((merged, b) if i == 0 else (a, merged)))
  result = tf.reshape(y, tf.concat([calls_and_first, tf.shape(y)[1:]], 0))
  result.set_shape(x.shape[:2].concatenate(y.shape[1:]))
  return pfor_lib.wrap(result, True)


def _CallOnce(spec, x, where):
  """The body on one call's slice (a stage's: its repeat's weights already
  taken), as RunOneByOne calls it."""
  kw = dict(x['kwargs'])
  kw.update(spec.kwargs_no_batch)
  return stage_call.CallStage(
      spec.body, spec.fn_name, x['theta'], x['args'], kw,
      where=where, var_names=spec.var_names,
      var_values=[spec.repeats.Take(v, x['repeat']) for v in x['vars']],
      context=stage_call.StageContext(x['seed'], spec.global_step))


def _CheckTracedOps(ops):
  """Raises CannotVectorize for what vectorizes without an error but would
  compute something else than stage by stage."""
  random = sorted({op.type for op in ops
                   if op.type in cell_graph.STATEFUL_RANDOM_OPS})
  if random:
    raise CannotVectorize(
        f'the body draws random numbers with stateful ops ({", ".join(random)}'
        '); vectorized, they would draw other numbers than stage by stage.')
  custom = sorted({op.type for op in ops if _HasCustomGradient(op)})
  if custom:
    raise CannotVectorize(
        f'the body has custom gradients (on {", ".join(custom)} ops), '
        'which the vectorizer does not carry over.')


# What a tf.cond or tf.while_loop whose condition differs between stages
# vectorizes into: shapes known only at run time, which XLA cannot compile.
_DYNAMIC_SHAPE_OPS = frozenset(['DynamicPartition', 'DynamicStitch'])


def _CheckVectorizedOps(ops):
  """Raises CannotVectorize if the vectorized body would not compile under
  XLA, where it is built for XLA."""
  dynamic = sorted({op.type for op in ops if op.type in _DYNAMIC_SHAPE_OPS})
  if dynamic and compiled_loops.UnderXla():
    raise CannotVectorize(
        'its control flow (a tf.cond or tf.while_loop whose condition differs '
        f'between stages) vectorizes into {", ".join(dynamic)} ops, of '
        'shapes known only at run time, which XLA cannot compile.')


@contextlib.contextmanager
def _PlainAsserts():
  """TensorFlow's Assert builds a plain Assert op, never a tf.cond guard.

  tf.debugging.Assert guards an assertion on float data with a tf.cond;
  vectorized, the guard's condition differs between stages, which makes it
  a dynamic-shape op XLA cannot compile (Lingvo's checks in attention are
  such asserts: `py_utils.ApplyPadding`'s). The plain op checks the same
  condition. The function is replaced under every name a body may call it
  by (`_AssertModules`).
  """

  def PlainAssert(condition, data, summarize=None, name=None):
    if tf.executing_eagerly():
      return saved(condition, data, summarize, name)
    with tf.name_scope(name or 'Assert'):
      return gen_logging_ops._assert(condition, data, summarize)  # pylint: disable=protected-access

  saved = control_flow_assert.Assert
  modules = [m for m in _AssertModules() if getattr(m, 'Assert') is saved]
  for module in modules:
    module.Assert = PlainAssert
  try:
    yield
  finally:
    for module in modules:
      module.Assert = saved


def _AssertModules():
  """The modules whose `Assert` is TensorFlow's: its own and the API names
  a body calls (tf.Assert, tf.debugging.Assert, tf.compat.v1.Assert, and
  Lingvo's compat module, through which Lingvo's layers call it)."""
  return (control_flow_assert, tf, tf.debugging, tf.compat.v1,
          tf.compat.v1.debugging, lingvo_tf)


def _HasCustomGradient(op):
  try:
    return bool(op.get_attr('_gradient_op_type'))
  except ValueError:
    return False


def _TensorLeaves(tree):
  """(the tensor leaves of tree, rebuild(new leaves) -> tree).

  None and non-tensor leaves (a kwarg's bool flag) stay in place.
  """
  flat = tf.nest.flatten(tree)
  index = [i for i, x in enumerate(flat) if nest.IsTensor(x)]

  def Rebuild(new_leaves):
    rebuilt = list(flat)
    for i, x in zip(index, new_leaves):
      rebuilt[i] = x
    return tf.nest.pack_sequence_as(tree, rebuilt)

  return [flat[i] for i in index], Rebuild


def _FirstLine(error):
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  return (lines[0].rstrip('.') + '.') if lines else type(error).__name__
