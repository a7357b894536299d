"""FPropWithLoss: the ends made in the loop equal the plain stack's.

A LastStageLoss (a softmax cross entropy over a projection of the outputs,
weighted per position, and a count) is taken by the pipelined layer, its
inputs given or made by a FirstStageInput (an embedding lookup, scaled per
example); the references are independent of the layer: the loss's sums
computed in NumPy on a NumPy loop over the logical layers (values), and TF
autodiff of the same loss on a plain TF loop over them (gradients of every
body variable, the input or the embedding table, and the loss's own
weights), float32, |err| <= 1e-5 + 1e-5 |ref|. With backward_schedule
'1f1b' stage 0 makes each microbatch's inputs and the last stage scores it
inside the gradient loop (no forward loop runs); with the reverse schedule
the layer returns loss.fn of FProp's outputs. Partitioned over 4 virtual
devices, each device makes and scores its own stage's and the step equals
the one-device step.
"""

import types

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import sharding
from gpipe.pipeline import stage_ends
from gpipe.pipeline import one_f_one_b
from lingvo.core import py_utils
from tests import close
from tests import covering
from tests import pipeline_harness as harness
from tests import reference_bodies
from tests import sessions

NestedMap = py_utils.NestedMap
Case = harness.Case
VOCAB = 5


def _Xent(xp, logits, labels):
  """Softmax cross entropy per position, over an array namespace."""
  top = xp.max(logits, -1, keepdims=True)
  lse = xp.log(xp.sum(xp.exp(logits - top), -1)) + top[..., 0]
  return lse - xp.take_label(logits, labels)


_NP = types.SimpleNamespace(
    max=np.max, log=np.log, sum=np.sum, exp=np.exp, einsum=np.einsum,
    take_label=lambda z, l: np.take_along_axis(z, l[..., None], -1)[..., 0])
_TF = types.SimpleNamespace(
    max=lambda x, a, keepdims: tf.reduce_max(x, a, keepdims=keepdims),
    log=tf.math.log, sum=tf.reduce_sum, exp=tf.exp, einsum=tf.einsum,
    take_label=lambda z, l: tf.reduce_sum(
        z * tf.one_hot(l, VOCAB, dtype=z.dtype), -1))


def _LossSums(xp, weights, outputs, inputs):
  """The loss: weighted cross entropy of the (first) output's projection,
  and for a multi-input body plus its nested 'b'; and the weights' sum."""
  y = outputs[0] if isinstance(outputs, (list, tuple)) else outputs
  logits = xp.einsum('...d,dv->...v', y, weights['out'])
  xent = _Xent(xp, logits, inputs['labels'])
  loss = xp.sum(xent * inputs['weights'])
  if isinstance(outputs, (list, tuple)):
    loss = loss + xp.sum(outputs[2]['b'] * inputs['weights'])
  return {'loss': loss, 'count': xp.sum(inputs['weights'])}


def _Fn(weights, outputs, inputs):
  return NestedMap(_LossSums(_TF, weights, outputs, inputs))


def _Made(xp, weights, inputs, body):
  """The first stage's inputs: the ids' rows of the table, scaled per
  example; for the multi-input body also their sine and row sums."""
  x = xp.take(weights['table'], inputs['ids']) * inputs['scale']
  if body == 'multi':
    nested = {'a': xp.sin(x), 'b': xp.sum(x, -1)}
    return (x, None, NestedMap(nested) if xp is _TF else nested)
  return x


_NP.take = lambda t, i: t[i]
_NP.sin = np.sin
_TF.take = tf.gather
_TF.sin = tf.sin


def _Data(case):
  rng = np.random.RandomState(case.seed + 7)
  positions = (case.batch,) + tuple(case.example_shape[:-1])
  return dict(
      out=rng.normal(size=(case.dim, VOCAB)).astype(np.float32),
      labels=rng.randint(0, VOCAB, positions).astype(np.int32),
      weights=rng.uniform(0, 1, positions).astype(np.float32),
      table=rng.uniform(-1, 1, (7, case.dim)).astype(np.float32),
      ids=rng.randint(0, 7, positions).astype(np.int32),
      scale=rng.uniform(0.5, 1.5, (case.batch,) + (1,) * len(
          case.example_shape)).astype(np.float32))


def _Build(layer, case, data, args, first, watch=None):
  """(pipelined sums, [variables, the input or the first stage's table,
  loss weight]): the sums and what their gradients are taken by."""
  t = lambda v: None if v is None else tf.constant(v)
  p_args = list(tf.nest.map_structure(t, args))
  w_out, table = tf.constant(data['out']), tf.constant(data['table'])
  if watch:
    watch([p_args[0], w_out, table])
  loss = stage_ends.LastStageLoss(
      _Fn, NestedMap(out=w_out),
      NestedMap(labels=tf.constant(data['labels']),
                weights=tf.constant(data['weights'])))
  first_stage = stage_ends.FirstStageInput(
      lambda w, inputs: _Made(_TF, w, inputs, case.body),
      NestedMap(table=table),
      NestedMap(ids=tf.constant(data['ids']), scale=tf.constant(data['scale'])))
  if first:
    sums = layer.FPropWithLoss(layer.theta, loss, first_stage=first_stage)
  else:
    if case.body == 'multi':
      p_args[2] = NestedMap(p_args[2])
    sums = layer.FPropWithLoss(layer.theta, loss, *p_args)
  return sums, tf.nest.flatten(layer.vars) + [
      table if first else p_args[0], w_out]


def _TfReference(case, data, args, first, var_values):
  """The TF reference op by op (eagerly) on the layer's weight values:
  the loss's sums on a plain loop over the logical layers (of the inputs
  given, or made from the table), and by TF's autodiff their loss's
  gradients w.r.t. the same list as _Build's."""
  stacked = tf.nest.map_structure(tf.constant, var_values)
  tf_data = {k: tf.constant(v) for k, v in data.items()}
  t_args = list(tf.nest.map_structure(
      lambda v: None if v is None else tf.constant(v), args))
  by = tf.nest.flatten(stacked) + [
      tf_data['table'] if first else t_args[0], tf_data['out']]
  with tf.GradientTape() as tape:
    tape.watch(by)
    if first:
      made = _Made(_TF, tf_data, tf_data, case.body)
      t_args = list(made) if case.body == 'multi' else [made]
    out = harness.SequentialReference(
        reference_bodies.TF, case, harness.PerLayerWeights(case, stacked),
        t_args, {}, {})
    sums = _LossSums(_TF, tf_data, out if case.body == 'multi' else out[0],
                     tf_data)
  grads = tape.gradient(sums['loss'], by)
  return ({k: v.numpy() for k, v in sums.items()},
          [tf.convert_to_tensor(g).numpy() for g in grads])


def _Run(case, mode, first=False):
  """NumPy results: sums, ref sums, grads, ref grads, variable values."""
  args, _, _ = harness._Inputs(case)  # pylint: disable=protected-access
  data = _Data(case)
  if first:
    made = _Made(_NP, data, data, case.body)
    args = list(made) if case.body == 'multi' else [made]
  dense = lambda gs: [tf.convert_to_tensor(g) for g in gs]
  if mode == 'graph':
    with tf.Graph().as_default():
      tf.compat.v1.set_random_seed(case.seed)
      layer = case.Params().Instantiate()
      sums, xs = _Build(layer, case, data, args, first)
      fetches = dict(sums=sums, grads=dense(tf.gradients(sums.loss, xs)),
                     vars={n: dict(c.items()) for n, c in layer.vars.items()})
      with sessions.AsBuilt() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        ops = [op.name for op in tf.compat.v1.get_default_graph()
               .get_operations()]
        res = sess.run(fetches)
        res['op_names'] = ops
  else:
    tf.random.set_seed(case.seed)
    layer = case.Params().Instantiate()

    @tf.function(jit_compile=True)
    def Step():
      with tf.GradientTape() as tape:
        sums, xs = _Build(layer, case, data, args, first, watch=tape.watch)
      return dict(sums=sums, grads=dense(tape.gradient(sums.loss, xs)))

    res = tf.nest.map_structure(lambda v: v.numpy(), Step())
    res['vars'] = {n: {k: v.numpy() for k, v in c.items()}
                   for n, c in layer.vars.items()}
  res['ref'], res['ref_grads'] = _TfReference(case, data, args, first,
                                              res['vars'])
  np_out = harness.SequentialReference(
      reference_bodies.NP, case, harness.PerLayerWeights(case, res['vars']),
      args, {}, {})
  res['np_ref'] = _LossSums(_NP, data, np_out if case.body == 'multi' else
                            np_out[0], data)
  return res


def _Check(case, mode, first=False):
  res = _Run(case, mode, first)
  for key in ('loss', 'count'):
    close.AssertClose(res['sums'][key], res['np_ref'][key], close.FLOAT32,
                      f'{key} vs NumPy reference')
    close.AssertClose(res['sums'][key], res['ref'][key], close.FLOAT32,
                      f'{key} vs TF reference')
  assert len(res['grads']) == len(res['ref_grads'])
  for i, (g, r) in enumerate(zip(res['grads'], res['ref_grads'])):
    assert np.abs(r).max() > 0, f'reference gradient {i} is all zero'
    close.AssertClose(g, r, close.FLOAT32, f'gradient {i}')
  return res


def _Counts(num_stages):
  return sorted({1, num_stages, num_stages + 1, 2 * num_stages + 1})


# The inputs: (made at stage 0, streamed).
_IO = [(False, False), (False, True), (True, False), (True, True)]
_FULL_SWEEP = [(s, m, r, io) for s in (1, 2, 3, 4) for m in _Counts(s)
               for r in (1, 2, 3) for io in _IO]
# Pairwise (covering.py) over (S, M as 1, S, S + 1 or 2 S + 1, R, inputs
# given or made, streamed or not): 18 of the product's 180.
_SWEEP_FEATURES = (lambda c: c[0], covering.MicrobatchKindOfRow,
                   lambda c: c[2], lambda c: c[3])
_SWEEP = covering.Pairwise(_FULL_SWEEP, _SWEEP_FEATURES)


@pytest.mark.parametrize(
    'num_stages,num_microbatches,circular_repeat,io', _SWEEP,
    ids=[f'S{s}-M{m}-R{r}-{"made" if first else "given"}'
         f'{"-stream_io" if stream else ""}' for s, m, r, (first, stream)
         in _SWEEP])
def test_1f1b_sweep_graph(num_stages, num_microbatches, circular_repeat, io):
  """Shapes with the loss at the last stage, its inputs given or made at
  stage 0, streamed or not; no forward loop is built."""
  first, stream_io = io
  res = _Check(Case(num_stages=num_stages, num_microbatches=num_microbatches,
                    circular_repeat=circular_repeat,
                    batch=2 * num_microbatches, backward_schedule='1f1b',
                    stream_io=stream_io), 'graph', first=first)
  assert not [n for n in res['op_names'] if one_f_one_b.FORWARD_LOOP in n]


# (S, M, R, inputs made at stage 0, streamed, body): the multi-input body's
# row is the one with its inputs both made and streamed.
_JIT = [(1, 1, 1, True, False, 'dense'), (2, 3, 2, False, True, 'dense'),
        (3, 4, 1, True, True, 'multi'), (4, 5, 2, False, True, 'dense'),
        (2, 2, 3, True, False, 'dense')]


@pytest.mark.parametrize(
    'num_stages,num_microbatches,circular_repeat,first,stream_io,body', _JIT,
    ids=[f'S{s}-M{m}-R{r}-{"made" if f else "given"}'
         f'{"-stream_io" if io else ""}-{b}' for s, m, r, f, io, b in _JIT])
def test_1f1b_sweep_jit(num_stages, num_microbatches, circular_repeat, first,
                        stream_io, body):
  """Under XLA: shapes, inputs given or made, streamed or not; the
  multi-input body's outputs in the layer's structure (a tuple with a None
  and a NestedMap), its nested leaf read by the loss."""
  _Check(Case(num_stages=num_stages, num_microbatches=num_microbatches,
              circular_repeat=circular_repeat, batch=2 * num_microbatches,
              backward_schedule='1f1b', stream_io=stream_io, body=body),
         'jit', first=first)


@pytest.mark.parametrize('first,policy', [(False, 'save_dots'),
                                          (True, 'save_all')])
def test_a_body_of_nested_inputs(first, policy):
  """The loss sees the outputs in the layer's structure (a tuple with a
  None and a NestedMap) and reads a nested leaf; the first stage makes
  that structure. Circular, with ring entries that keep activations
  (remat_policy save_dots, save_all). Under XLA: test_1f1b_sweep_jit's
  multi-input row."""
  _Check(Case(num_stages=3, num_microbatches=4, circular_repeat=2, batch=8,
              body='multi', backward_schedule='1f1b', remat_policy=policy),
         'graph', first=first)


@pytest.mark.parametrize('case', [
    Case(num_stages=3, num_microbatches=4, batch=8),
    Case(num_stages=2, num_microbatches=3, circular_repeat=2, batch=6,
         stream_io=True),
    Case(num_stages=3, num_microbatches=2, batch=4,
         backward_schedule='1f1b', unroll='always'),
], ids=['reverse', 'reverse-stream_io', '1f1b-unrolled'])
@pytest.mark.parametrize('first', [False, True])
def test_other_paths_score_the_outputs(case, first):
  """The reverse schedule and the unrolled stack return loss.fn of the
  outputs (of what the first stage makes), equal to the references too."""
  _Check(case, 'graph', first=first)


def test_partitioned_step_equals_one_device():
  """Split over 4 virtual devices (a circular 4-stage layer, streamed),
  each device makes its inputs (where it reads them) and scores its own
  stage's outputs in the manual region: the loss's sums and every
  gradient equal the one-device step's. One program takes the step with
  the inputs given and with them made by the first stage."""
  from gpipe import sharding  # pylint: disable=g-import-not-at-top
  from gpipe.xla import partitioning  # pylint: disable=g-import-not-at-top
  if not partitioning.IsAvailable():
    pytest.skip('needs jax')
  case = Case(num_stages=4, num_microbatches=4, circular_repeat=2, batch=8,
              shard_stages_1d=True, backward_schedule='1f1b', stream_io=True)
  args, _, _ = harness._Inputs(case)  # pylint: disable=protected-access
  data = _Data(case)
  tf.random.set_seed(case.seed)
  layer = case.Params().Instantiate()
  theta = layer.theta
  weights = [tf.convert_to_tensor(v).numpy() for v in theta.Flatten()]

  def Step(*flat):
    w = list(flat[:len(weights)])
    given, table, w_out = flat[len(weights):]
    outputs = []
    for first, x in ((False, given), (True, table)):
      with tf.GradientTape() as tape:
        tape.watch(w + [x, w_out])
        loss = stage_ends.LastStageLoss(
            _Fn, NestedMap(out=w_out),
            NestedMap(labels=tf.constant(data['labels']),
                      weights=tf.constant(data['weights'])))
        if first:
          sums = layer.FPropWithLoss(
              theta.Pack(w), loss, first_stage=stage_ends.FirstStageInput(
                  lambda weights, inputs: _Made(_TF, weights, inputs,
                                                'dense'),
                  NestedMap(table=x),
                  NestedMap(ids=tf.constant(data['ids']),
                            scale=tf.constant(data['scale']))))
        else:
          sums = layer.FPropWithLoss(theta.Pack(w), loss, x)
      outputs += [sums.loss, sums.count] + tape.gradient(
          sums.loss, w + [x, w_out])
    return outputs

  values = weights + [args[0], data['table'], data['out']]
  one = tf.function(Step, jit_compile=True)(*[tf.constant(v) for v in values])

  def Partitioned(*flat):
    with sharding.SpmdPartitioning():
      return Step(*flat)

  run = partitioning.RunPartitioned(Partitioned, values, 4)
  assert len(run.outputs) == len(one) == 2 * (len(weights) + 4)
  for i, (got, want) in enumerate(zip(run.outputs, one)):
    assert np.abs(want.numpy()).max() > 0, i
    close.AssertClose(got, want.numpy(), close.FLOAT32, f'output {i}')


class _Recorded(sharding.OverStageDevices):
  """S stage devices whose annotations are recorded, not made: what each
  tensor is asked to be split on, on one device."""

  def __init__(self, num_stages):
    super().__init__(num_stages)
    self.splits = []

  def _SplitOne(self, x, stage_dim):
    self.splits.append((x, stage_dim))
    return x


@pytest.mark.parametrize('shape', [(3, 8), (2, 3, 16)])
def test_the_ends_gradient_exchange_sends_each_device_its_block(shape):
  """The ends' weights copied per stage (stage_ends.ForTheLoop) get their
  gradient back as each stage's parts exchanged over the S devices (an
  all-to-all) and summed: device k must receive, from every stage, the
  k-th block of the last dim (the block it keeps of the sum, split on
  that dim) and nothing else, and end with its block of the sum. Read off
  the annotations on one device (the tensor split for the exchange,
  device k's share of it as the partitioner splits a dim: the k-th of S
  even pieces); a kind and bytes of the collective are the same for parts
  cut another way (strided), which this tells apart."""
  num_stages = 4
  placement = _Recorded(num_stages)
  rng = np.random.RandomState(0)
  value = tf.constant(rng.normal(size=shape).astype(np.float32))
  dy = rng.normal(size=(num_stages,) + shape).astype(np.float32)
  with tf.GradientTape() as tape:
    tape.watch(value)
    copies = stage_ends._StackedOverStages(value, placement, num_stages)  # pylint: disable=protected-access
    loss = tf.reduce_sum(copies * dy)
  grad = tape.gradient(loss, value).numpy()
  (parts, dim), = [(x.numpy(), d) for x, d in placement.splits
                   if x.shape.rank == len(shape) + 2]
  kept, kept_dim = placement.splits[-1]
  assert (tuple(kept.shape), kept_dim) == (shape, len(shape) - 1)
  close.AssertClose(grad, dy.sum(0), close.FLOAT32, 'the summed gradient')
  blocks = np.split(dy, num_stages, axis=-1)  # device k's, from each stage
  ends = np.split(grad, num_stages, axis=-1)  # device k's of the sum
  for k, received in enumerate(np.array_split(parts, num_stages, axis=dim)):
    assert received.size == blocks[k].size, (k, received.shape)
    np.testing.assert_array_equal(received.reshape(blocks[k].shape),
                                  blocks[k], err_msg=f'device {k}')
    close.AssertClose(received.reshape(blocks[k].shape).sum(0), ends[k],
                      close.FLOAT32, f'device {k} ends with')


def test_bad_losses_say_what_to_fix():
  case = Case(num_stages=2, num_microbatches=2, batch=4,
              backward_schedule='1f1b')
  args, _, _ = harness._Inputs(case)  # pylint: disable=protected-access
  x = tf.constant(args[0])
  with tf.Graph().as_default():
    layer = case.Params().Instantiate()
    x = tf.constant(args[0])
    for fn, said in (
        (lambda w, y, i: NestedMap(count=tf.reduce_sum(y)), "'loss'"),
        (lambda w, y, i: NestedMap(loss=tf.reduce_sum(y, -1)),
         'must be a float scalar'),
        (lambda w, y, i: [tf.reduce_sum(y)], 'NestedMap')):
      with pytest.raises(ValueError, match=said):
        layer.FPropWithLoss(layer.theta,
                            stage_ends.LastStageLoss(fn), x)
    with pytest.raises(ValueError, match='not both'):
      layer.FPropWithLoss(
          layer.theta, stage_ends.LastStageLoss(_Fn), x,
          first_stage=stage_ends.FirstStageInput(lambda w, i: x))
    with pytest.raises(ValueError, match='loss.inputs'):
      layer.FPropWithLoss(
          layer.theta, stage_ends.LastStageLoss(_Fn), x,
          **{stage_ends.LOSS_INPUTS: x})


def test_a_body_with_aux_losses_is_refused_under_1f1b():
  p = Case(num_stages=2, num_microbatches=2, batch=4,
           backward_schedule='1f1b').Params()
  p.single_stage_body = reference_bodies.TrainingBody.Params().Set(dim=4)
  with tf.Graph().as_default():
    layer = p.Instantiate()
    fn = lambda w, y, i: NestedMap(loss=tf.reduce_sum(y))
    with pytest.raises(ValueError, match='aux losses'):
      layer.FPropWithLoss(layer.theta, stage_ends.LastStageLoss(fn),
                          tf.zeros([4, 3, 4]))
