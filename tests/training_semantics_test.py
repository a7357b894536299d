"""Training semantics inside the loop: aux losses, summaries, dropout, bubbles.

The reference is the plain stack run microbatch by microbatch: for each
microbatch m (rows m, m + M, ... of the batch), the body's own FProp is
applied layer after layer with that layer's weights sliced from the
variables by their documented layout (layer r * S + s: body/<v>[s, r]), each
call in its own AuxLossContext / TpuSummaryTensorContext, with the step seed
the documented stream of (layer, microbatch):
base + Schedule.StepSeedOffset(layer, microbatch). Nothing of the pipeline's
code runs in the reference.

The body (tests/reference_bodies.py TrainingBody) adds an aux loss and a
summary, may apply dropout, and may multiply by x / x: 1 on real data, NaN
on the zeros a careless pipeline would feed its bubbles. A body's
non-trainable state is checked in training_state_test.py.
"""

import dataclasses

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import layers
from gpipe import schedule as schedule_lib
from lingvo.core import py_utils
from tests import close
from tests import covering
from tests import reference_bodies
from tests import sessions

DIM = reference_bodies.TrainingBody.Params().dim
BASE_SEED = 1000
GLOBAL_STEP = 7


@dataclasses.dataclass(frozen=True)
class Case:
  num_stages: int
  num_microbatches: int
  circular_repeat: int = 1
  accumulation: str = 'mean'
  keep_prob: float = 1.0
  divide_by_input: bool = False
  shard_stages_1d: bool = False
  rows: int = 2  # per microbatch
  backward_schedule: str = 'reverse'
  stream_io: bool = False
  # ((param, value), ...): another one-device path (e.g. layer_by_layer).
  path: tuple = ()

  @property
  def num_layers(self):
    return self.num_stages * self.circular_repeat

  @property
  def batch(self):
    return self.rows * self.num_microbatches

  def Params(self):
    return layers.PipelinedLayer.Params().Set(
        name='pipe',
        num_stages=self.num_stages,
        num_microbatches=self.num_microbatches,
        circular_repeat=self.circular_repeat,
        aux_loss_microbatch_accumulation=self.accumulation,
        shard_stages_1d=self.shard_stages_1d,
        backward_schedule=self.backward_schedule,
        stream_io=self.stream_io,
        unroll='never',
        single_stage_body=reference_bodies.TrainingBody.Params().Set(
            keep_prob=self.keep_prob, divide_by_input=self.divide_by_input),
        random_seed=3).Set(**dict(self.path))


def _LayerTheta(case, theta, layer):
  """Layer `layer`'s weights, sliced by the documented variable layout."""
  r, s = divmod(layer, case.num_stages)
  if case.circular_repeat > 1:
    return tf.nest.map_structure(lambda v: v[s, r], theta.body)
  return tf.nest.map_structure(lambda v: v[s], theta.body)


def _Reference(case, pipe, theta, x):
  """The plain stack, microbatch by microbatch, with per-call contexts."""
  m_count = case.num_microbatches
  sched = schedule_lib.Schedule(case.num_stages, m_count, case.circular_repeat)
  outs, aux_total = [], 0.0
  summaries = []  # (stage, value, weight)
  layer_thetas = [_LayerTheta(case, theta, layer)
                  for layer in range(case.num_layers)]
  for m in range(m_count):
    h = x[m::m_count]
    for layer in range(case.num_layers):
      py_utils.ResetStepSeed(BASE_SEED + sched.StepSeedOffset(layer, m))
      with py_utils.AuxLossContext(reentrant=True) as aux_ctx:
        with py_utils.TpuSummaryTensorContext():
          h = pipe.body.FProp(layer_thetas[layer], h)
          (value, weight), = py_utils.GetTpuSummaryTensors().values()
      aux_total += tf.add_n(aux_ctx.aux_losses)
      summaries.append((layer % case.num_stages, value, weight))
    outs.append(h)
  if case.accumulation == 'mean':
    aux_total /= m_count
  # Microbatch m holds rows m, m + M, ...: interleave back.
  out = tf.reshape(tf.stack(outs, axis=1), [case.batch, DIM])
  per_stage = []
  for stage in range(case.num_stages):
    vw = [(v, w) for s, v, w in summaries if s == stage]
    total_w = tf.add_n([w for _, w in vw])
    per_stage.append(tf.add_n([v * w for v, w in vw]) / total_w)
  return out, aux_total, per_stage


def _Pipelined(case, pipe, theta, x):
  py_utils.ResetStepSeed(BASE_SEED)
  with py_utils.AuxLossContext() as aux_ctx:
    with py_utils.TpuSummaryTensorContext():
      out = pipe.FProp(theta, x)
      summaries = py_utils.GetTpuSummaryTensors()
  assert len(aux_ctx.aux_losses) == 1, aux_ctx.aux_losses
  per_stage = []
  for stage in range(case.num_stages):
    keys = [k for k in summaries if k.startswith(f'mean_sq/stage_{stage}/')]
    assert len(keys) == 1, (stage, sorted(summaries))
    per_stage.append(summaries[keys[0]][0])
  assert len(summaries) == case.num_stages, sorted(summaries)
  return out, aux_ctx.aux_losses[0], per_stage


def _Inputs(case, seed=0):
  rng = np.random.RandomState(seed)
  x = rng.uniform(0.2, 1.0, [case.batch, DIM]) * rng.choice([-1, 1],
                                                         [case.batch, DIM])
  cot = rng.uniform(-1, 1, [case.batch, DIM])
  return x.astype(np.float32), cot.astype(np.float32)


def _PipelinedStep(case, pipe, x_np, cot_np, watch=None):
  """The layer's outputs and gradients, as a dict of tensors."""
  variables = pipe.vars.Flatten()
  x = tf.constant(x_np)
  if watch:
    watch(x)
  with py_utils.GlobalStepContext(tf.constant(GLOBAL_STEP, tf.int64)):
    out, aux, summaries = _Pipelined(case, pipe, pipe.theta, x)
  loss = tf.reduce_sum(out * cot_np) + aux
  return dict(out=out, aux=aux, summaries=summaries, loss=loss,
              x=x), variables


def _ReferenceStep(case, pipe, theta, x_np, cot_np):
  """The reference's outputs and gradients w.r.t. `theta`'s leaves (the
  values of the layer's weights) and the input, as a dict of tensors."""
  leaves = theta.Flatten()
  x = tf.constant(x_np)
  with tf.GradientTape() as tape:
    tape.watch(leaves + [x])
    with py_utils.GlobalStepContext(tf.constant(GLOBAL_STEP, tf.int64)):
      out, aux, summaries = _Reference(case, pipe, theta, x)
    loss = tf.reduce_sum(out * cot_np) + aux
  grads = tape.gradient(loss, leaves + [x])
  return dict(out=out, aux=aux, summaries=summaries,
              grads=[tf.convert_to_tensor(g) for g in grads])


def _ThetaMatchesVars(pipe):
  """The theta leaves the reference differentiates are the variables'."""
  assert ([k for k, _ in pipe.theta.FlattenItems()] ==
          [k for k, _ in pipe.vars.FlattenItems()])


def Run(case, mode, weights=None):
  """Returns {pipe|ref: {out, aux, summaries, grads}} as NumPy.

  The reference runs op by op (eagerly: TensorFlow's own kernels, never
  the layer's loops) on the values of the layer's weights, whatever mode
  the layer ran in; but with dropout under jit, in the same compiled
  function as the layer, since XLA draws other stateless random numbers
  than TensorFlow's kernels do."""
  x_np, cot_np = _Inputs(case)
  if mode == 'graph':
    with tf.Graph().as_default():
      pipe = case.Params().Instantiate()
      _ThetaMatchesVars(pipe)
      t, variables = _PipelinedStep(case, pipe, x_np, cot_np)
      grads = tf.gradients(t['loss'], variables + [t['x']])
      fetch = dict(out=t['out'], aux=t['aux'], summaries=t['summaries'],
                   grads=grads)
      with sessions.AsBuilt() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        if weights is not None:
          _Load(pipe, case, weights, sess)
        got, theta_values = sess.run((fetch, pipe.theta.Flatten()))
  else:
    pipe = case.Params().Instantiate()
    _ThetaMatchesVars(pipe)
    if weights is not None:
      _Load(pipe, case, weights)
    compiled_ref = case.keep_prob < 1.0

    @tf.function(jit_compile=True, autograph=False)
    def Step():
      with tf.GradientTape() as tape:
        t, variables = _PipelinedStep(case, pipe, x_np, cot_np,
                                      watch=tape.watch)
      grads = tape.gradient(t['loss'], variables + [t['x']])
      fetch = dict(pipe=dict(out=t['out'], aux=t['aux'],
                             summaries=t['summaries'],
                             grads=[tf.convert_to_tensor(g) for g in grads]))
      if compiled_ref:
        fetch['ref'] = _ReferenceStep(case, pipe, pipe.theta, x_np, cot_np)
      return fetch

    fetched = tf.nest.map_structure(lambda t: t.numpy(), Step())
    if compiled_ref:
      return fetched
    got = fetched['pipe']
    theta_values = [tf.convert_to_tensor(v).numpy()
                    for v in pipe.theta.Flatten()]
  theta = pipe.theta.Pack([tf.constant(v) for v in theta_values])
  ref = _ReferenceStep(case, pipe, theta, x_np, cot_np)
  return dict(pipe=got, ref=tf.nest.map_structure(lambda t: t.numpy(), ref))


def _Load(pipe, case, weights, sess=None):
  """Sets layer l's weights to weights[l] ({'w': .., 'b': ..})."""
  for name, var in pipe.vars.body.FlattenItems():
    if name.startswith('dropout'):
      continue
    value = np.zeros(var.shape.as_list(), np.float32)
    for layer, w in enumerate(weights):
      r, s = divmod(layer, case.num_stages)
      if case.circular_repeat > 1:
        value[s, r] = w[name]
      else:
        value[s] = w[name]
    if sess is None:
      var.assign(value)
    else:
      var.load(value, sess)


def _AssertMatches(res):
  pipe, ref = res['pipe'], res['ref']
  for key in ('out', 'aux', 'summaries', 'grads'):
    for got in tf.nest.flatten(pipe[key]):
      assert np.all(np.isfinite(got)), key
    close.AssertClose(pipe[key], ref[key], close.FLOAT32, key)
  for i, g in enumerate(ref['grads']):
    assert np.abs(g).max() > 0, f'reference gradient {i} is all zero'


SWEEP = [
    Case(1, 1),
    Case(1, 3, accumulation='sum'),
    Case(2, 1, 2),
    Case(2, 3),
    Case(3, 4, 2),
    Case(3, 2, 3, accumulation='sum'),
    Case(4, 4),
    Case(4, 6, 2, shard_stages_1d=True),
]


def _Id(case):
  return (f'S{case.num_stages}-M{case.num_microbatches}-R'
          f'{case.circular_repeat}-{case.accumulation}'
          f'{"-shard" if case.shard_stages_1d else ""}'
          f'{"-1f1b" if case.backward_schedule == "1f1b" else ""}'
          f'{"-stream_io" if case.stream_io else ""}' +
          ''.join(f'-{k}={v}' for k, v in case.path))


# The bodies: x / x, NaN if a bubble computes on zeros, exactly 1 on real
# data (in the value and, cut from the gradient, in the gradient), so the
# same numbers as the plain body's; or dropout, which must really run.
_BODIES = {'x_over_x': dict(divide_by_input=True),
           'dropout': dict(keep_prob=0.5)}

# The same cases under backward_schedule='1f1b', with and without stream_io.
_ONE_F_ONE_B = [
    dataclasses.replace(c, backward_schedule='1f1b', stream_io=i % 2 == 1)
    for i, c in enumerate(SWEEP[2:])]

# Some on each of the other one-device paths: the stages one after another,
# the fill and drain on half the stages, layer by layer.
_PATHS = [
    dataclasses.replace(c, path=path)
    for path in ((('vectorize_stages', 'never'),), (('skip_bubbles', True),),
                 (('layer_by_layer', True),))
    for c in (SWEEP[3], SWEEP[5], SWEEP[6])
]


def _Rows(cases, bodies, jit_cases):
  """(case, body, mode): each case with each body in graph mode, the
  `jit_cases` under jit too (XLA compiles each for seconds; they keep the
  circular, sharded and uneven-microbatch schedules)."""
  return ([(c, b, 'graph') for c in cases for b in bodies] +
          [(c, b, 'jit') for c in jit_cases for b in bodies])


# Every case with the x / x body, the later ones with dropout, and the 1f1b
# and other-path cases with both.
_FULL_SWEEP = (_Rows(SWEEP, ['x_over_x'], SWEEP[2:]) +
               _Rows(SWEEP[3:], ['dropout'], SWEEP[4:6]) +
               _Rows(_ONE_F_ONE_B, list(_BODIES), _ONE_F_ONE_B[2:4]) +
               _Rows(_PATHS, list(_BODIES), _PATHS[1::3]))


def _Schedule(case):
  return (case.num_stages, case.num_microbatches, case.circular_repeat,
          case.accumulation, case.shard_stages_1d)


def _Variant(case):
  """The backward schedule, stream_io and one-device path."""
  return (case.backward_schedule, case.stream_io, case.path)


# Pairwise (covering.py) over (S-M-R-accumulation-shard, backward schedule
# or path, body, mode): 26 of _FULL_SWEEP's 61 rows. Each S-M-R-... still
# meets every backward schedule or path, body and mode it met there, each
# backward schedule or path every body and mode, and each body each mode.
_SWEEP_FEATURES = (lambda r: _Schedule(r[0]), lambda r: _Variant(r[0]),
                   lambda r: r[1], lambda r: r[2])
_SWEEP = covering.Pairwise(_FULL_SWEEP, _SWEEP_FEATURES)


def _Params(test):
  """The rows of _SWEEP a test runs, as pytest params (case, [body,] mode):
  'x_over_x' and 'dropout' the default schedule's with that body, '1f1b' and
  'paths' the others' with both bodies."""
  params = []
  for case, body, mode in _SWEEP:
    if test in _BODIES:
      if case.backward_schedule == 'reverse' and not case.path and (
          body == test):
        params.append(pytest.param(case, mode, id=f'{_Id(case)}-{mode}'))
    elif (case.backward_schedule == '1f1b') == (test == '1f1b') and (
        bool(case.path) == (test == 'paths')):
      params.append(pytest.param(case, body, mode,
                                 id=f'{_Id(case)}-{body}-{mode}'))
  return params


@pytest.mark.parametrize('case, mode', _Params('x_over_x'))
def test_aux_losses_and_summaries_equal_the_reference(case, mode):
  """And the bubbles cannot poison anything: the body multiplies by x / x,
  NaN on zeros (bubbles must never compute on zeros, and masking must keep
  their finite values out of every result), exactly 1 on real data (in
  the value and, cut from the gradient, in the gradient), so the numbers
  are the plain body's."""
  _AssertMatches(Run(dataclasses.replace(case, divide_by_input=True), mode))


@pytest.mark.parametrize('case, mode', _Params('dropout'))
def test_dropout_streams_equal_the_reference(case, mode):
  res = Run(dataclasses.replace(case, keep_prob=0.5), mode)
  _AssertMatches(res)
  # Dropout really ran: some outputs are exactly zero.
  assert (res['pipe']['out'] == 0).any()


def _AssertBubblesOrDropout(case, body, mode):
  """Everything equals the reference, with the x / x body or with dropout,
  which really ran."""
  res = Run(dataclasses.replace(case, **_BODIES[body]), mode)
  _AssertMatches(res)
  if body == 'dropout':
    assert (res['pipe']['out'] == 0).any()


@pytest.mark.parametrize('case, body, mode', _Params('1f1b'))
def test_1f1b_aux_losses_summaries_dropout_and_bubbles(case, body, mode):
  _AssertBubblesOrDropout(case, body, mode)


@pytest.mark.parametrize('case, body, mode', _Params('paths'))
def test_every_one_device_path_aux_losses_summaries_dropout_and_bubbles(
    case, body, mode):
  _AssertBubblesOrDropout(case, body, mode)


@pytest.mark.parametrize('num_stages, circular_repeat', [(2, 2), (3, 1)])
def test_unrolled_summaries_are_named_and_averaged_per_stage(
    num_stages, circular_repeat):
  """unroll='always' (an eval's default path) adds `<name>/stage_<s>`, as
  the pipeline does, so that TensorBoard overlays train and eval: the
  weighted mean over stage s's layers of the plain stack's summaries on
  the whole batch."""
  case = Case(num_stages, 2, circular_repeat)
  x_np, _ = _Inputs(case)
  with tf.Graph().as_default():
    pipe = case.Params().Set(unroll='always').Instantiate()
    x = tf.constant(x_np)
    with py_utils.AuxLossContext(), py_utils.TpuSummaryTensorContext():
      pipe.FProp(pipe.theta, x)
      got = {k: v[0] for k, v in py_utils.GetTpuSummaryTensors().items()}
    want = [[] for _ in range(num_stages)]
    h = x
    for layer in range(case.num_layers):
      with py_utils.AuxLossContext(), py_utils.TpuSummaryTensorContext():
        h = pipe.body.FProp(_LayerTheta(case, pipe.theta, layer), h)
        (value, weight), = py_utils.GetTpuSummaryTensors().values()
      want[layer % num_stages].append((value, weight))
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      got, want = sess.run((got, want))
  assert len(got) == num_stages, sorted(got)
  for stage, terms in enumerate(want):
    [key] = [k for k in got if k.startswith(f'mean_sq/stage_{stage}/')]
    mean = (sum(v * w for v, w in terms) / sum(w for _, w in terms))
    np.testing.assert_allclose(got[key], mean, rtol=1e-6)


def test_dropout_is_repeatable_and_independent_of_num_stages():
  rng = np.random.RandomState(5)
  weights = [dict(w=rng.normal(0, 0.5, [DIM, DIM]).astype(np.float32),
                  b=rng.normal(0, 0.5, [DIM]).astype(np.float32))
             for _ in range(4)]
  outs = []
  for s, r in [(4, 1), (2, 2), (1, 4), (4, 1)]:
    case = Case(s, 4, r, keep_prob=0.5)
    res = Run(case, 'graph', weights)
    _AssertMatches(res)
    outs.append(res['pipe']['out'])
  for out in outs[1:]:
    np.testing.assert_allclose(out, outs[0], rtol=1e-5, atol=1e-6)


def test_dropout_masks_differ_across_layers_and_microbatches():
  sched = schedule_lib.Schedule(3, 5, 2)
  offsets = {
      sched.StepSeedOffset(layer, m)
      for layer in range(sched.num_layers)
      for m in range(sched.num_microbatches)
  }
  assert len(offsets) == sched.num_layers * sched.num_microbatches
  # Far enough apart for the seeds a body draws per call.
  assert min(np.diff(sorted(offsets))) >= schedule_lib.STEP_SEEDS_PER_CALL


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
