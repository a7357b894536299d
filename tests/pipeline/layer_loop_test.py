"""layer_loop: the plain stack as one loop over its layers (the FLOP count's).

Under unrolled.Everywhere(as_loop=True) a stack's S x R layers run as one
while loop over the layer index (gpipe.pipeline.layer_loop). Checked
against the harness's references, which run no gpipe code: S 1..4, R
1..3, M dividing the batch and not, graph mode and jit, kwargs, nested
inputs; each of those checks the loop did run. Layouts it cannot index
(per_stage_vars, stage_parallel_body) and stacks with non-trainable state
run unrolled instead, still equal to the references. Aux losses come to
the caller as their sum over the layers, against NumPy. Last, what it is
for: the forward pass's FLOPs as XLA counts them, the loop's against the
unrolled stack's, layer for layer.
"""

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import layers
from gpipe import plan
from gpipe.pipeline import layer_loop
from gpipe.pipeline import unrolled
from gpipe.plan import model_flops
from gpipe.xla import partitioning
from lingvo.core import py_utils
from tests import close
from tests import pipeline_harness as harness
from tests import reference_bodies
from tests import sessions
from tests.plan import plan_test

# (S, M, R, mode, case fields).
_SWEEP = [
    (1, 2, 1, 'graph', {}),
    (1, 3, 3, 'jit', {}),
    (2, 3, 2, 'graph', dict(kwargs=True, kwargs_no_batch=True)),
    (3, 4, 1, 'graph', dict(body='multi')),
    (3, 2, 2, 'jit', dict(body='multi')),
    (2, 4, 3, 'jit', dict(kwargs=True, kwargs_no_batch=True)),
    (4, 4, 3, 'graph', dict(shard_stages_1d=True)),
    (4, 3, 2, 'jit', {}),
]


@pytest.fixture
def loops_run(monkeypatch):
  """The number of stacks run as a layer loop since the test began."""
  ran = []
  original = layer_loop.RunLayerLoop

  def Counting(*args, **kwargs):
    ran.append(1)
    return original(*args, **kwargs)

  monkeypatch.setattr(layer_loop, 'RunLayerLoop', Counting)
  return ran


@pytest.mark.parametrize('s,m,r,mode,fields', _SWEEP)
def test_the_loop_equals_the_reference(s, m, r, mode, fields, loops_run):
  case = harness.Case(num_stages=s, num_microbatches=m, circular_repeat=r,
                      batch=6, **fields)
  with unrolled.Everywhere(as_loop=True):
    harness.CheckCase(case, mode)
  assert loops_run  # not unrolled


@pytest.mark.parametrize('fields', [
    dict(per_stage_vars=True), dict(body='stage_parallel')])
def test_layouts_it_cannot_index_run_unrolled(fields, loops_run):
  case = harness.Case(num_stages=3, num_microbatches=2, circular_repeat=2,
                      **fields)
  with unrolled.Everywhere(as_loop=True):
    harness.CheckCase(case, 'graph')
  assert not loops_run


def _StatefulValues(as_loop):
  """StatefulBody's outputs and final moving averages, unrolled (or asked
  for as a loop): its non-trainable state keeps it unrolled."""
  with tf.Graph().as_default():
    tf.compat.v1.set_random_seed(0)
    layer = layers.PipelinedLayer.Params().Set(
        name='pipe', num_stages=2, num_microbatches=2, random_seed=7,
        single_stage_body=reference_bodies.StatefulBody.Params().Set(
            dim=4)).Instantiate()
    x = tf.constant(np.random.RandomState(3).randn(4, 4), tf.float32)
    with unrolled.Everywhere(as_loop=as_loop):
      y = layer.FProp(layer.theta, x)
    with tf.control_dependencies([y]):
      moving = tf.identity(layer.vars.body.moving)
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      return sess.run([y, moving])


def test_non_trainable_state_runs_unrolled(loops_run):
  asked, plain = _StatefulValues(True), _StatefulValues(False)
  assert not loops_run
  close.AssertClose(asked, plain, close.FLOAT32, 'as unrolled')


def test_aux_losses_reach_the_caller_as_their_sum():
  num_stages, repeats, dim = 2, 2, 4
  x = np.random.RandomState(0).randn(6, dim).astype(np.float32)
  with tf.Graph().as_default():
    layer = layers.PipelinedLayer.Params().Set(
        name='pipe', num_stages=num_stages, num_microbatches=3,
        circular_repeat=repeats,
        single_stage_body=reference_bodies.TrainingBody.Params().Set(
            dim=dim)).Instantiate()
    with py_utils.AuxLossContext() as aux, unrolled.Everywhere(True):
      y = layer.FProp(layer.theta, tf.constant(x))
    assert len(aux.aux_losses) == 1  # one sum, not a loss per layer
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      got, got_aux, w, b = sess.run([y, aux.aux_losses[0],
                                     layer.vars.body.w, layer.vars.body.b])
  # Layer l = r * S + s: weights [s, r]; aux loss: mean(y^2) per layer.
  h, expected_aux = x.astype(np.float64), 0.0
  for l in range(num_stages * repeats):
    s, r = l % num_stages, l // num_stages
    h = np.tanh(h @ w[s, r] + b[s, r])
    expected_aux += np.mean(h ** 2)
  close.AssertClose(got, h, close.FLOAT32, 'outputs')
  close.AssertClose(got_aux, expected_aux, close.FLOAT32, 'aux loss sum')


@pytest.mark.parametrize('repeats', [1, 2])
def test_its_flops_are_the_unrolled_stacks_and_its_counters(repeats):
  """XLA's FLOPs of the forward pass as a loop (each iteration counted) and
  unrolled: the same layers' work; the loop adds its index arithmetic, a
  few scalar FLOPs an iteration (the unrolled layers index by constants).
  A loop counted once, or a layer skipped, is off by a layer's FLOPs:
  4 stages of DIM x DIM matmuls on BATCH rows, 2 * 24 * 64 * 64 each."""
  if not partitioning.IsAvailable():
    pytest.fail('jax and jaxlib are needed (they are in the test extra).')
  target = plan.LayerTarget(
      plan_test.LayerParams(circular_repeat=repeats),
      [(plan_test.BATCH, plan_test.DIM)])
  step = target.Build(plan.Candidate(8, repeats), 'num_blocks')
  loop = model_flops.ForwardFlops(step, as_loop=True)
  whole = model_flops.ForwardFlops(step, as_loop=False)
  num_layers = plan_test.NUM_STAGES * repeats
  layer_flops = 2 * plan_test.BATCH * plan_test.DIM**2
  assert whole > num_layers * layer_flops
  assert 0 <= loop - whole <= 64 * num_layers, (loop, whole)
