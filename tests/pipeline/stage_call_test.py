"""gpipe.pipeline.stage_call: the body's one call site, tested on its own."""

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe.pipeline import stage_call
from lingvo.core import base_layer
from lingvo.core import py_utils
from tests import reference_bodies
from tests import sessions

NestedMap = py_utils.NestedMap


class _Recorder(base_layer.BaseLayer):
  """y = 2 x; adds an aux loss and the same summary twice; records seeds."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('fail', False, 'Raise from FProp.')
    p.Define('wrong_output', False, 'Return an extra output.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.seeds = []

  def FProp(self, theta, x):
    if self.params.fail:
      raise ValueError('the body failed')
    self.seeds.append(py_utils.GetStepSeed())
    py_utils.AuxLossContext.Current().AddLoss(tf.reduce_sum(x))
    py_utils.AddTpuSummaryTensor('s', tf.reduce_mean(x))
    py_utils.AddTpuSummaryTensor('s', tf.reduce_max(x), weight=2.0)
    if self.params.wrong_output:
      return x, x
    return x * 2


def _Body(**kwargs):
  layer = _Recorder.Params().Set(name='rec', **kwargs).Instantiate()
  return stage_call.Body(layer, 'single_stage_body', 'pipe')


def _Context(seed=5):
  return stage_call.StageContext(tf.constant(seed, tf.int64), None)


def test_context_keeps_aux_losses_and_summaries_from_the_caller():
  with tf.Graph().as_default():
    body = _Body()
    x = tf.constant([1.0, 3.0])
    with py_utils.AuxLossContext() as caller_aux:
      with py_utils.TpuSummaryTensorContext():
        res = stage_call.CallStage(body, 'FProp', NestedMap(), [x], {},
                                   where='stage 0', context=_Context(5))
        caller_summaries = py_utils.GetTpuSummaryTensors()
    assert caller_aux.aux_losses == [] and not caller_summaries
    assert [name for name, _, _ in res.summaries] == ['s', 's_1']
    with sessions.AsBuilt() as sess:
      out, aux, seed, summaries = sess.run(
          (res.outputs, res.AuxLoss(), body.layer.seeds[0],
           [(v, w) for _, v, w in res.summaries]))
  np.testing.assert_array_equal(out[0], [2.0, 6.0])
  assert aux == 4.0 and seed == 5
  assert [tuple(vw) for vw in summaries] == [(2.0, 1.0), (3.0, 2.0)]


def test_without_context_the_body_runs_in_the_callers_contexts():
  with tf.Graph().as_default():
    body = _Body()
    with py_utils.AuxLossContext() as caller_aux:
      res = stage_call.CallStage(body, 'FProp', NestedMap(),
                                 [tf.constant([1.0])], {}, where='layer 0')
    assert len(caller_aux.aux_losses) == 1
    assert res.aux_losses == [] and res.summaries == []
    assert res.AuxLoss() is None


def test_wrong_outputs_name_the_param_and_the_body():
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match=r'The single_stage_body \(_Recorder\)'
                       r' must return the same structure.*nesting differs'):
      stage_call.CallStage(_Body(wrong_output=True), 'FProp', NestedMap(),
                           [tf.constant([1.0])], {}, where='stage 0',
                           context=_Context())


def test_body_errors_get_a_note_saying_where():
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match='the body failed') as info:
      stage_call.CallStage(_Body(fail=True), 'FProp', NestedMap(),
                           [tf.constant([1.0])], {}, where='stage 3',
                           context=_Context())
  notes = ' '.join(getattr(info.value, '__notes__', []))
  assert "_Recorder.FProp, the single_stage_body of pipelined layer 'pipe'" \
      in notes
  assert 'running stage 3' in notes


def test_non_trainable_assignments_come_back_instead_of_being_written():
  with tf.Graph().as_default():
    layer = reference_bodies.StatefulBody.Params().Set(
        name='st', dim=2).Instantiate()
    body = stage_call.Body(layer, 'single_stage_body', 'pipe')
    x = tf.constant([[1.0, 3.0]])
    res = stage_call.CallStage(
        body, 'FProp', layer.theta, [x], {}, where='stage 0',
        var_names=['moving', 'count'],
        var_values=[tf.constant([0.5, -0.5]), tf.constant(7)])
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      (moving, count), stored = sess.run(
          (res.new_vars, (layer.vars.moving, layer.vars.count)))
  np.testing.assert_allclose(moving, [0.8 * 0.5 + 0.2 * 1.0,
                                      0.8 * -0.5 + 0.2 * 3.0], rtol=1e-6)
  assert count == 8
  # The variables themselves are untouched.
  np.testing.assert_allclose(stored[0], [0.1, 0.1])
  assert stored[1] == 0
