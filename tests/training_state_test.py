"""Non-trainable state inside the loop: updated as the plain stack updates it.

The body (tests/reference_bodies.py StatefulBody) reads and updates moving
statistics, the way batch norm keeps them, and a step counter. The
pipelined layer's outputs, gradients and final state are compared with the
plain stack run microbatch by microbatch (rows m, m + M, ... of the batch),
each layer's weights and state picked from the variables by their
documented layout: in NumPy for the outputs and the final state, and in a
TensorFlow plain loop (the updates read by later microbatches, never
differentiated) for the gradients. Over S, M, R, per-stage variables and
the backward schedules, in graph mode and under jit (a pairwise covering).
"""

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import layers
from tests import covering
from tests import reference_bodies
from tests import sessions

STATEFUL_SWEEP = [
    (1, 2, 1, False, 'reverse'), (2, 3, 1, False, 'reverse'),
    (3, 4, 2, False, 'reverse'), (2, 3, 3, False, 'reverse'),
    (3, 2, 1, True, 'reverse'), (2, 5, 2, True, 'reverse'),
    (3, 4, 2, False, '1f1b'), (2, 5, 2, True, '1f1b+stream_io'),
]
_FULL_STATEFUL = [c + (mode,) for c in STATEFUL_SWEEP
                  for mode in ('graph', 'jit')]


# Pairwise over (S, the kind of M, R, per_stage_vars, schedule, mode)
# (covering.py): 12 of the product's 16; both 1f1b schedules in graph mode
# kept (1f1b's gradient waves with the state carried: tools/mutants.py).
_STATEFUL_FEATURES = (lambda c: c[0], covering.MicrobatchKindOfRow,
                      lambda c: c[2], lambda c: c[3], lambda c: c[4],
                      lambda c: c[5])
_STATEFUL = covering.Pairwise(
    _FULL_STATEFUL, _STATEFUL_FEATURES,
    must=[c for c in _FULL_STATEFUL if c[4] != 'reverse' and c[5] == 'graph'])


class _StatefulStack:
  """A PipelinedLayer of StatefulBody, its inputs and its references."""

  def __init__(self, num_stages, num_microbatches, circular_repeat,
               per_stage_vars, schedule):
    self.num_stages = num_stages
    self.num_microbatches = num_microbatches
    self.circular_repeat = circular_repeat
    self.per_stage_vars = per_stage_vars
    self.params = layers.PipelinedLayer.Params().Set(
        name='pipe', num_stages=num_stages, num_microbatches=num_microbatches,
        circular_repeat=circular_repeat, per_stage_vars=per_stage_vars,
        unroll='never',
        single_stage_body=reference_bodies.StatefulBody.Params(),
        random_seed=5, backward_schedule=schedule.split('+')[0],
        stream_io=schedule.endswith('stream_io'))
    rng = np.random.RandomState(1)
    rows = 2
    self.x_np = rng.uniform(-1, 1, [rows * num_microbatches, 4]).astype(
        np.float32)
    self.cot = rng.uniform(-1, 1, self.x_np.shape).astype(np.float32)

  def Layout(self, vars_np, name, layer):
    """Layer `layer`'s variable `name`, by the documented layout."""
    r, s = divmod(layer, self.num_stages)
    if self.per_stage_vars:
      v = vars_np['body_iter_%05d' % s][name]
      return v[r] if self.circular_repeat > 1 else v
    v = vars_np['body'][name]
    return v[s][r] if self.circular_repeat > 1 else v[s]

  def Reference(self, vars_np):
    """NumPy, microbatch by microbatch: outputs and final state."""
    num_microbatches, x_np = self.num_microbatches, self.x_np
    layers_count = self.num_stages * self.circular_repeat
    moving = [self.Layout(vars_np, 'moving', l).copy()
              for l in range(layers_count)]
    outs = []
    for m in range(num_microbatches):
      h = x_np[m::num_microbatches]
      for l in range(layers_count):
        h, moving[l] = reference_bodies.StatefulFn(
            reference_bodies.NP, self.Layout(vars_np, 'w', l),
            self.Layout(vars_np, 'b', l), moving[l], h)
      outs.append(h)
    out = np.stack(outs, axis=1).reshape(x_np.shape)
    return out, moving

  def TfReference(self, theta_vars, initial, x):
    """TF plain loop (same math) for the gradients."""
    num_microbatches = self.num_microbatches
    layers_count = self.num_stages * self.circular_repeat
    moving = [self.Layout(initial, 'moving', l) for l in range(layers_count)]
    outs = []
    for m in range(num_microbatches):
      h = x[m::num_microbatches]
      for l in range(layers_count):
        h, new_moving = reference_bodies.StatefulFn(
            reference_bodies.TF, self.Layout(theta_vars, 'w', l),
            self.Layout(theta_vars, 'b', l), moving[l], h)
        # A variable update: read by later microbatches, never differentiated.
        moving[l] = tf.stop_gradient(new_moving)
      outs.append(h)
    return tf.reshape(tf.stack(outs, axis=1), self.x_np.shape)

  def Build(self, pipe, watch=None):
    """The layer on the inputs, as a dict of tensors."""
    x = tf.constant(self.x_np)
    if watch:
      watch(x)
    initial = {k: dict(v.FlattenItems()) for k, v in pipe.vars.items()}
    initial = tf.nest.map_structure(lambda v: v.read_value(), initial)
    with tf.control_dependencies(tf.nest.flatten(initial)):
      out = pipe.FProp(pipe.theta, x)
    trainable = [v for v in pipe.vars.Flatten() if v.trainable]
    loss = tf.reduce_sum(out * self.cot)
    return dict(out=out, x=x, initial=initial, loss=loss, trainable=trainable)

  def RefGrads(self, pipe, theta_values, initial):
    """The TF reference op by op (eagerly) on the values of the layer's
    theta and initial state: its outputs and its gradients w.r.t. the
    trainable variables' theta and the input."""
    theta = pipe.theta.Pack([tf.constant(v) for v in theta_values])
    assert ([k for k, _ in theta.FlattenItems()] ==
            [k for k, _ in pipe.vars.FlattenItems()])
    trainable = [t for (_, t), (_, v) in zip(theta.FlattenItems(),
                                             pipe.vars.FlattenItems())
                 if v.trainable]
    x = tf.constant(self.x_np)
    with tf.GradientTape() as tape:
      tape.watch(trainable + [x])
      theta_vars = {k: dict(v.FlattenItems()) for k, v in theta.items()}
      ref = self.TfReference(theta_vars, initial, x)
      ref_loss = tf.reduce_sum(ref * self.cot)
    ref_grads = tape.gradient(ref_loss, trainable + [x])
    return ref.numpy(), [tf.convert_to_tensor(g).numpy() for g in ref_grads]

  @staticmethod
  def Final(pipe):
    """The values of the layer's variables."""
    return {k: {n: v.read_value() for n, v in child.FlattenItems()}
            for k, child in pipe.vars.items()}

  def Run(self, mode):
    """One step in `mode`: {out, ref, initial, grads, ref_grads, final}."""
    if mode == 'graph':
      with tf.Graph().as_default():
        pipe = self.params.Instantiate()
        t = self.Build(pipe)
        grads = tf.gradients(t['loss'], t['trainable'] + [t['x']])
        with sessions.AsBuilt() as sess:
          sess.run(tf.compat.v1.global_variables_initializer())
          res, theta_values = sess.run((
              dict(out=t['out'], initial=t['initial'], grads=grads),
              pipe.theta.Flatten()))
          res['final'] = sess.run(self.Final(pipe))
    else:
      pipe = self.params.Instantiate()
      theta_values = [tf.convert_to_tensor(v).numpy()
                      for v in pipe.theta.Flatten()]

      @tf.function(jit_compile=True, autograph=False)
      def Step():
        with tf.GradientTape() as tape:
          t = self.Build(pipe, tape.watch)
        grads = tape.gradient(t['loss'], t['trainable'] + [t['x']])
        return dict(out=t['out'], initial=t['initial'],
                    grads=[tf.convert_to_tensor(g) for g in grads])

      res = tf.nest.map_structure(lambda v: v.numpy(), Step())
      res['final'] = tf.nest.map_structure(lambda v: v.numpy(),
                                           self.Final(pipe))
    res['ref'], res['ref_grads'] = self.RefGrads(pipe, theta_values,
                                                 res['initial'])
    return res


@pytest.mark.parametrize(
    'num_stages,num_microbatches,circular_repeat,per_stage_vars,schedule,mode',
    _STATEFUL,
    ids=[f'S{s}-M{m}-R{r}{"-per_stage_vars" if v else ""}-{b}-{mode}'
         for s, m, r, v, b, mode in _STATEFUL])
def test_non_trainable_state_updates_like_the_plain_stack(
    num_stages, num_microbatches, circular_repeat, per_stage_vars, schedule,
    mode):
  stack = _StatefulStack(num_stages, num_microbatches, circular_repeat,
                         per_stage_vars, schedule)
  res = stack.Run(mode)
  ref_out, ref_moving = stack.Reference(res['initial'])
  np.testing.assert_allclose(res['out'], ref_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(res['out'], res['ref'], rtol=1e-5, atol=1e-5)
  for g, r in zip(res['grads'], res['ref_grads']):
    assert np.abs(r).max() > 0
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
  for l, want in enumerate(ref_moving):
    got = stack.Layout(res['final'], 'moving', l)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                               err_msg=f'moving of layer {l}')
    # Every layer saw every microbatch once: M updates, no bubble, no
    # backward recompute counted.
    assert stack.Layout(res['final'], 'count', l) == num_microbatches


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
