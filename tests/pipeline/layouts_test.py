"""gpipe.pipeline.layouts: each layout's variables, slices and write-back.

Each layout is hosted by a bare Lingvo layer (no pipeline) and checked
against the documented layout, with NumPy slicing as the reference:

    stacked         body/<v>           [S, (R,) ...]   layer r*S+s: v[s, r]
    per_stage_vars  iter_<s>/<v>       [(R,) ...]      layer r*S+s: v_s[r]
    stage_parallel  body/<v>           [(R,) S, ...]   layer r*S+s: v[r, s]
"""

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import layers
from gpipe.pipeline import layouts
from gpipe.pipeline import repeats
from gpipe import sharding
from lingvo.core import base_layer
from tests import reference_bodies
from tests import sessions

S, D = 3, 2
KINDS = ['stacked', 'per_stage', 'stage_parallel']


class _Host(base_layer.BaseLayer):
  """Creates a layout's children, as the pipelined layer does."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('pipe', None, 'PipelinedLayer params of the layout.')
    return p

  def __init__(self, params):
    super().__init__(params)
    pipe = self.params.pipe
    self.layout = layouts.LayoutFor(pipe, repeats.RepeatsFor(pipe.circular_repeat))
    self.layout.CreateChildren(self)

  def _child_variable_scope_override(self):
    res = super()._child_variable_scope_override()
    res.update(self.layout.ChildScopeOverrides(self.params.name))
    return res


def _Host_(kind, r, body=None):
  pipe = layers.PipelinedLayer.Params().Set(num_stages=S, circular_repeat=r)
  if kind == 'stage_parallel':
    pipe.stage_parallel_body = (
        reference_bodies.StageParallelDenseBody.Params().Set(dim=D,
                                                             num_stages=S))
  else:
    pipe.single_stage_body = (
        body or reference_bodies.DenseBody.Params().Set(dim=D))
    pipe.per_stage_vars = kind == 'per_stage'
  return _Host.Params().Set(name='host', pipe=pipe).Instantiate()


def _Shape(kind, r, per_layer):
  rep = [r] if r > 1 else []
  return {'stacked': [S] + rep, 'per_stage': rep,
          'stage_parallel': rep + [S]}[kind] + per_layer


@pytest.mark.parametrize('r', [1, 2])
@pytest.mark.parametrize('kind', KINDS)
def test_variables_have_lingvos_names_and_shapes(kind, r):
  with tf.Graph().as_default():
    host = _Host_(kind, r)
    got = {k: v.shape.as_list() for k, v in host.vars.FlattenItems()}
    names = sorted(v.name for v in host.vars.Flatten())
  if kind == 'per_stage':
    want = {f'body_iter_{s:05d}.{v}': _Shape(kind, r, shape)
            for s in range(S) for v, shape in (('w', [D, D]), ('b', [D]))}
    assert names[0].startswith('host/iter_00000/')
  else:
    want = {f'body.{v}': _Shape(kind, r, shape)
            for v, shape in (('w', [D, D]), ('b', [D]))}
    assert names[0].startswith('host/body/')
  assert got == want


@pytest.mark.parametrize('r', [1, 2])
@pytest.mark.parametrize('kind', KINDS)
def test_layer_theta_and_loop_theta_follow_the_layout(kind, r):
  with tf.Graph().as_default():
    host = _Host_(kind, r)
    layout = host.layout
    picks = {(rep, s): layout.LayerTheta(host.theta, rep, s).w
             for rep in range(r) for s in range(S)}
    loop_w = layout.LoopTheta(host.theta, sharding.StagePlacement(S)).w
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      values, picks, loop_w = sess.run((host.vars, picks, loop_w))
  for (rep, s), got in picks.items():
    if kind == 'per_stage':
      w = values[f'body_iter_{s:05d}'].w
      want = w[rep] if r > 1 else w
    elif kind == 'stage_parallel':
      want = values.body.w[rep, s] if r > 1 else values.body.w[s]
    else:
      want = values.body.w[s, rep] if r > 1 else values.body.w[s]
    np.testing.assert_array_equal(got, want, err_msg=str((rep, s)))
  # The loop sees the stacked layout: per-stage variables stacked on dim 0.
  if kind == 'per_stage':
    want = np.stack([values[f'body_iter_{s:05d}'].w for s in range(S)])
  else:
    want = values.body.w
  np.testing.assert_array_equal(loop_w, want)


@pytest.mark.parametrize('kind', ['stacked', 'per_stage'])
def test_non_trainable_values_and_their_write_back(kind):
  with tf.Graph().as_default():
    host = _Host_(kind, 2, reference_bodies.StatefulBody.Params().Set(dim=D))
    layout = host.layout
    names = layout.NonTrainableNames(host)
    assert names == ['count', 'moving']
    values = layout.NonTrainableValues(host.theta, names)
    assert [v.shape.as_list() for v in values] == [[S, 2], [S, 2, D]]
    new = [tf.reshape(tf.range(S * 2), [S, 2]),
           tf.reshape(tf.range(S * 2 * D, dtype=tf.float32), [S, 2, D])]
    assigns = layout.AssignOps(host, names, new)
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      sess.run(assigns)
      got, want = sess.run((layout.NonTrainableValues(host.theta, names),
                            new))
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
