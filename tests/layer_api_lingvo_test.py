"""PipelinedLayer as a Lingvo layer: its weights, modes and layer API.

layer_theta and the variable layout (repeat-major, per-stage variables),
the unrolled modes, the sharding annotations it always emits, Lingvo's
layer API (BodyFProp, per-example kwargs with a batch of their own,
BodyFPropNoMicrobatching, PadMicrobatches), and the whole layer under TF1
behaviour (tf.compat.v1.disable_v2_behavior, Lingvo's trainer setting) in a
subprocess.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from lingvo.core import base_layer
from lingvo.core import cluster_factory
from lingvo.core import py_utils
from tests import layer_api_test
from tests import pipeline_harness as harness
from tests import reference_bodies
from tests import sessions

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_Params = layer_api_test.Params


# -- layer_theta and variable layout. ---------------------------------------


@pytest.mark.parametrize('per_stage_vars', [False, True])
@pytest.mark.parametrize('circular_repeat', [1, 3])
def test_layer_theta_is_repeat_major(per_stage_vars, circular_repeat):
  s_count = 3
  with tf.Graph().as_default():
    layer = _Params(num_stages=s_count, circular_repeat=circular_repeat,
                    per_stage_vars=per_stage_vars).Instantiate()
    theta = layer.theta
    picked = {(r, s): layer.layer_theta(theta, r, s)
              for r in range(circular_repeat) for s in range(s_count)}
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      picked_v, vars_v = sess.run([picked, layer.vars])
  values = {k: dict(v) for k, v in vars_v.items()}
  case = harness.Case(num_stages=s_count, circular_repeat=circular_repeat,
                      per_stage_vars=per_stage_vars)
  expected = harness.PerLayerWeights(case, values)
  for (r, s), got in picked_v.items():
    want = expected[r * s_count + s]
    for name in ('w', 'b'):
      np.testing.assert_array_equal(got[name], want[name])
  # Distinct layers really have distinct weights.
  assert not np.array_equal(expected[0]['w'], expected[-1]['w'])


def test_layer_theta_rejects_out_of_range_indices():
  with tf.Graph().as_default():
    layer = _Params(circular_repeat=2).Instantiate()
    with pytest.raises(ValueError, match=r'repeat_idx=2 is out of range'):
      layer.layer_theta(layer.theta, 2, 0)
    with pytest.raises(ValueError, match=r'stage_idx=-1 is out of range'):
      layer.layer_theta(layer.theta, 0, -1)


@pytest.mark.parametrize('circular_repeat', [1, 2])
def test_variable_shapes(circular_repeat):
  with tf.Graph().as_default():
    layer = _Params(num_stages=3, circular_repeat=circular_repeat).Instantiate()
    lead = [3, circular_repeat] if circular_repeat > 1 else [3]
    assert layer.vars.body.w.shape.as_list() == lead + [4, 4]
    assert layer.vars.body.b.shape.as_list() == lead + [4]
    layer = _Params(name='pipe2', num_stages=3, circular_repeat=circular_repeat,
                    per_stage_vars=True).Instantiate()
    lead = [circular_repeat] if circular_repeat > 1 else []
    for s in range(3):
      child = layer.vars['body_iter_%05d' % s]
      assert child.w.shape.as_list() == lead + [4, 4]
      assert child.w.name.startswith('pipe2/iter_%05d/' % s)


# -- Unrolled modes. ---------------------------------------------------------


def _OpTypes(graph):
  """Op types in the graph and in its functions (a compiled loop's)."""
  types = {op.type for op in graph.get_operations()}
  for function in graph.as_graph_def().library.function:
    types.update(node.op for node in function.node_def)
  return types


def test_unroll_eval_only_unrolls_in_eval_and_pipelines_in_training():
  for do_eval in (False, True):
    with tf.Graph().as_default() as graph:
      with cluster_factory.SetEval(do_eval):
        layer = _Params(unroll='eval_only').Instantiate()
        y = layer.FProp(layer.theta, tf.ones([4, 4]))
        y_ref = layer.FProp(layer.theta, tf.ones([4, 4]))  # same mode twice
      has_loop = any(t in _OpTypes(graph) for t in ('While', 'StatelessWhile'))
      assert has_loop == (not do_eval)
      with sessions.AsBuilt() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        a, b = sess.run([y, y_ref])
      np.testing.assert_array_equal(a, b)


def test_unroll_always_builds_no_loop():
  with tf.Graph().as_default() as graph:
    layer = _Params(unroll='always', circular_repeat=2).Instantiate()
    layer.FProp(layer.theta, tf.ones([4, 4]))
    assert not {'While', 'StatelessWhile'} & _OpTypes(graph)


# -- Sharding annotations are always emitted. --------------------------------


def _ShardingOps(graph):
  """XlaSharding ops in the graph and in its functions (loop bodies)."""
  count = sum(op.type == 'XlaSharding' for op in graph.get_operations())
  for fdef in graph.as_graph_def().library.function:
    count += sum(node.op == 'XlaSharding' for node in fdef.node_def)
  return count


@pytest.mark.parametrize('overrides,expected', [
    (dict(), False),
    (dict(shard_stages_1d=True), True),
    (dict(pipeline_stage_mesh_dim=0, device_mesh=np.arange(4).reshape(2, 2)),
     True),
])
def test_sharding_annotations_on_cpu(overrides, expected):
  with tf.Graph().as_default() as graph:
    layer = _Params(**overrides).Instantiate()
    layer.FProp(layer.theta, tf.ones([4, 4]))
    assert (_ShardingOps(graph) > 0) == expected

# -- Lingvo's layer API: BodyFProp, per-example kwargs of their own batch. ----


class _SourceBody(reference_bodies.DenseBody):
  """tanh(x @ w + b) + source, the source's rows tiled over x's rows.

  Lingvo's FProp order for several hypotheses per source ([multiplier,
  source_batch]): row t of x uses source row t mod source_batch.
  """

  def FProp(self, theta, x, source):
    y = super().FProp(theta, x)
    reps = py_utils.GetShape(x)[0] // py_utils.GetShape(source)[0]
    return y + tf.tile(source, [reps, 1])


@pytest.mark.parametrize('s,m,r,mode', [(2, 2, 1, 'graph'), (3, 4, 2, 'graph'),
                                        (2, 4, 2, 'jit'), (4, 2, 1, 'jit')])
def test_kwargs_with_a_batch_of_their_own(s, m, r, mode):
  """A source of 4 rows for 8 query rows: each microbatch keeps the tiling.

  Forward against NumPy on the whole batch; gradients (weights, query and
  source) against a plain loop over the layers' weights on the whole batch.
  """
  rng = np.random.RandomState(3)
  x_np = rng.uniform(-1, 1, [8, 4]).astype(np.float32)
  src_np = rng.uniform(-1, 1, [4, 4]).astype(np.float32)
  p = _Params(num_stages=s, num_microbatches=m, circular_repeat=r,
              single_stage_body=_SourceBody.Params())
  with tf.Graph().as_default():
    layer = p.Instantiate()
    x, src = tf.constant(x_np), tf.constant(src_np)
    wrt = layer.vars.Flatten() + [x, src]

    def Step():
      y = layer.FProp(layer.theta, x, source=src)
      return y, tf.gradients(tf.reduce_sum(y * tf.sin(y)), wrt)

    y, grads = (tf.function(Step, jit_compile=True, autograph=False)()
                if mode == 'jit' else Step())
    h = x
    for rep in range(r):
      for stage in range(s):
        h = layer.body.FProp(layer.layer_theta(layer.theta, rep, stage), h,
                             src)
    ref_grads = tf.gradients(tf.reduce_sum(h * tf.sin(h)), wrt)
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      y_v, g_v, ref_g, vars_v = sess.run([y, grads, ref_grads, layer.vars])
  expected = x_np
  for w in harness.PerLayerWeights(
      harness.Case(num_stages=s, circular_repeat=r),
      {k: dict(v) for k, v in vars_v.items()}):
    expected = (reference_bodies.DenseFn(reference_bodies.NP, w['w'], w['b'],
                                         expected) +
                np.tile(src_np, [2, 1]))
  np.testing.assert_allclose(y_v, expected, rtol=1e-5, atol=1e-5)
  for got, want in zip(g_v, ref_g):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert np.abs(g_v[-1]).max() > 0  # the source's gradient flows


class _AuxScaleBody(reference_bodies.DenseBody):
  """DenseBody adding sum(y) as an aux loss."""

  def FProp(self, theta, x, scale=None, shift=None):
    y = super().FProp(theta, x, scale, shift)
    py_utils.AuxLossContext.Current().AddLoss(tf.reduce_sum(y))
    return y


@pytest.mark.parametrize('s,m,r', [(2, 3, 1), (3, 2, 2), (2, 4, 3)])
def test_body_fprop_runs_one_iteration_of_every_stage(s, m, r):
  """Stage j gets args[j], the weights of its repeat at the iteration and
  its microbatch's slice of the kwargs, per gpipe.schedule; its aux loss
  lands in a [num_stages] loss (bubbles included, as in Lingvo's layer)."""
  rng = np.random.RandomState(5)
  args_np = rng.uniform(-1, 1, [s, 2, 4]).astype(np.float32)
  scale_np = rng.uniform(0.5, 1.5, [m, 2, 1]).astype(np.float32)
  p = _Params(num_stages=s, num_microbatches=m, circular_repeat=r,
              single_stage_body=_AuxScaleBody.Params())
  with tf.Graph().as_default():
    layer = p.Instantiate()
    schedule = layer.Schedule(m)
    iteration = tf.compat.v1.placeholder(tf.int32, [])
    with py_utils.AuxLossContext() as ctx:
      out, _ = layer.BodyFProp(layer.theta.body, 'FProp', iteration, m,
                               tf.constant(args_np),
                               scale=tf.constant(scale_np))
    aux, = ctx.aux_losses
    assert aux.shape.as_list() == [s]
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      vars_v = sess.run(layer.vars)
      runs = [sess.run([out, aux], {iteration: i})
              for i in range(schedule.num_iterations)]
  weights = harness.PerLayerWeights(
      harness.Case(num_stages=s, circular_repeat=r),
      {k: dict(v) for k, v in vars_v.items()})
  for i, (out_v, aux_v) in enumerate(runs):
    for j in range(s):
      mb = min(max(schedule.MicrobatchId(i, j), 0), m - 1)
      w = weights[schedule.LayerId(i, j)]
      want = reference_bodies.DenseFn(reference_bodies.NP, w['w'], w['b'],
                                      args_np[j], scale=scale_np[mb])
      np.testing.assert_allclose(out_v[j], want, rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(aux_v[j], want.sum(), rtol=1e-5, atol=1e-5)


class _Wrapper(base_layer.BaseLayer):
  """A body whose only child is named `body` (as the pipeline's is)."""

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('body', reference_bodies.DenseBody.Params())

  def FProp(self, theta, x):
    return self.body.FProp(theta.body, x)

  def InitStates(self, theta, batch_size):
    return tf.fill([batch_size], tf.reduce_sum(theta.body.w))


def test_body_fprop_no_microbatching_takes_either_theta():
  with tf.Graph().as_default():
    tf.compat.v1.set_random_seed(0)
    layer = _Params(num_stages=3,
                    single_stage_body=_Wrapper.Params()).Instantiate()
    per_stage = [layer.BodyFPropNoMicrobatching(theta, 'InitStates', 2)[0]
                 for theta in (layer.theta, layer.theta.body)]
    with pytest.raises(ValueError, match=r"theta must be the layer's theta "
                       r'or its stage-stacked body weights'):
      layer.BodyFPropNoMicrobatching(layer.theta.body.body, 'InitStates', 2)
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      (a, b), w = sess.run([per_stage, layer.vars.body.body.w])
  want = np.repeat(w.astype(np.float64).sum(axis=(1, 2))[:, None], 2, axis=1)
  # A float32 sum of 16 weights: its rounding is relative to the summands
  # (the sum itself may cancel to near 0).
  atol = 1e-6 * np.abs(w).sum(axis=(1, 2)).max()
  np.testing.assert_allclose(a, want, rtol=1e-6, atol=atol)
  np.testing.assert_allclose(b, want, rtol=1e-6, atol=atol)


def test_pad_microbatches_returns_non_tensors_unchanged():
  with tf.Graph().as_default():
    layer = _Params().Instantiate()
    assert layer.PadMicrobatches(None) is None
    assert layer.PadMicrobatches(3) == 3
    padded = layer.PadMicrobatches([None, tf.zeros([2, 2, 5])])
    assert padded[0] is None
    assert padded[1].shape.as_list() == [3, 2, 5]

# -- TF1 behaviour, as Lingvo's trainer runs. --------------------------------

_TF1_SCRIPT = """
import tensorflow as tf
tf.compat.v1.disable_v2_behavior()
from tests import pipeline_harness as h
for case in [
    h.Case(num_stages=3, num_microbatches=4, batch=8, circular_repeat=2,
           kwargs=True, shard_stages_1d=True),
    h.Case(body='multi', num_stages=2, num_microbatches=3, batch=6,
           circular_repeat=3, per_stage_vars=True),
    h.Case(body='stage_parallel', num_stages=3, num_microbatches=2, batch=4,
           circular_repeat=2, store_body_intermediates=True),
]:
  h.CheckCase(case, 'graph')
assert not tf.executing_eagerly()
print('TF1 OK', h.LargestErrors()['checks'])
from gpipe.apps import prompt_exit
prompt_exit.Exit(0)
"""


def test_tf1_behaviour_subprocess():
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  env['PYTHONPATH'] = str(_ROOT) + os.pathsep + env.get('PYTHONPATH', '')
  proc = subprocess.run([sys.executable, '-c', _TF1_SCRIPT],
                        cwd=_ROOT,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=600,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert 'TF1 OK' in proc.stdout


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
