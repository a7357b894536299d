"""On one device: each layer on every microbatch at once, no bubbles.

A pipeline's skew (stage s works on microbatch i - s at iteration i) is
what lets S devices work at once; on one device it only adds the bubbles of
its fill and drain. Here the loop runs over the S x R logical layers
instead, and each iteration runs its layer's body on all M microbatches as
one vectorized computation (gpipe.pipeline.vectorized_stages.VectorizedCalls),
the layer's weights read once by all of them::

    pipeline (S=3, M=4)                    layer by layer
    iteration  0  1  2  3  4  5            iteration  0     1     2
    stage 0    m0 m1 m2 m3 .  .            layer 0    m0-3
    stage 1    .  m0 m1 m2 m3 .            layer 1          m0-3
    stage 2    .  .  m0 m1 m2 m3           layer 2                m0-3
    T = M + S - 1 iterations of S calls    S x R iterations of M calls

Every call is still one call of the body on one microbatch, with the step
seed of its (layer, microbatch), so outputs, gradients, aux losses and
summaries are the pipeline's up to float rounding. The price is memory: the
body's internal activations are those of the whole batch at once (the
pipeline's, of S microbatches). Per-stage states (a decoder's caches) go
with their (microbatch, layer) call. What it cannot run (non-trainable
variables, which update microbatch after microbatch, a body that cannot be
vectorized, a partitioned run) runs in the pipeline loop, and so does a
call with per-stage states under XLA, where the pipeline loop is faster.
"""

from typing import Optional

from absl import logging
import tensorflow as tf
from gpipe.loops import compiled_loops
from gpipe import microbatch
from gpipe import nest
from gpipe.pipeline import loop_spec
from gpipe.pipeline import vectorized_stages
from gpipe import recurrent
from lingvo.core import py_utils

NestedMap = py_utils.NestedMap

# What layer_by_layer=None (the Param's default) means in this program:
# False (the pod's schedule) unless a program that trains on one device
# says otherwise (gpipe.lingvo_trainer with --run_locally).
_program_default = False


def SetProgramDefault(enabled: bool) -> None:
  """Makes layers whose layer_by_layer Param is None run layer by layer
  (True) or the pipeline schedule (False) on one device; layers built
  before keep what they chose."""
  global _program_default
  _program_default = bool(enabled)


def Resolve(param) -> bool:
  """The Param's value, or the program's default for None."""
  return _program_default if param is None else bool(param)


class LayerByLayer:
  """Whether a layer's calls run layer by layer, and what they found: the
  layer (gpipe.layers.PipelinedLayer) asks Runs(spec) before each call and
  runs the pipeline loop where it says no, which it says in one log line
  per reason.

  A body that cannot be vectorized over the microbatches is found out once
  (by trying: CannotVectorize) and runs the pipeline loop from then on; the
  other reasons are read off each call's LoopSpec (WhyNot).
  """

  def __init__(self, enabled, owner, remat_policy):
    self.enabled = enabled
    self.owner = owner
    self.remat_policy = remat_policy  # the layers' loop's (gpipe.loops.remat)
    self.reason = None  # why the last call ran the pipeline loop
    self.ran = False  # whether a call has run layer by layer
    self._cannot_vectorize = None
    self._said = set()

  def Runs(self, spec) -> bool:
    """Whether this call runs layer by layer (if not, says why once)."""
    if not self.enabled:
      return False
    reason = self._cannot_vectorize or WhyNot(spec)
    if reason is not None:
      self._Say(reason)
    return reason is None

  def Ran(self):
    self.ran = True

  def CannotVectorize(self, error):
    """The body turned out not to vectorize: the pipeline loop from now on."""
    self._cannot_vectorize = str(error)
    self._Say(self._cannot_vectorize)

  def _Say(self, reason):
    self.reason = reason
    if reason not in self._said:
      self._said.add(reason)
      logging.info('PipelinedLayer %r runs the pipeline loop, not layer by '
                   'layer: %s', self.owner, reason)


def WhyNot(spec) -> Optional[str]:
  """Why the call cannot run layer by layer, or None if it can."""
  runner = spec.runner
  if runner.stage_parallel:
    return 'its stage-parallel body runs every stage in one call.'
  if runner.manual_mesh is not None:
    return 'it is partitioned: each device runs its own stage.'
  if not runner.vectorizes:
    return ("vectorize_stages='never' (layer by layer vectorizes over the "
            'microbatches).')
  if spec.var_names:
    return ('the body has non-trainable variables (' +
            ', '.join(spec.var_names) + '), updated microbatch after '
            'microbatch.')
  if tf.nest.flatten(spec.states) and compiled_loops.UnderXla():
    return ('under XLA a call with per-stage states (decoding) runs faster '
            'in the pipeline loop, which reads and writes the state slots in '
            'place (docs/benchmarks.md#measured-behind-the-codes-choices).')
  if spec.first_stage is not None:
    return ('its first stage makes its inputs inside the 1f1b loop '
            '(FirstStageInput).')
  return None


def RunLayerByLayer(spec, theta, mb_leaves, state_leaves,
                    remat_policy) -> loop_spec.LoopResult:
  """The S x R layers one after another, each on all microbatches.

  Args:
    spec: the loop_spec.LoopSpec (WhyNot(spec) is None).
    theta: the stage-stacked weights, [S, (R,) ...].
    mb_leaves: the [M, ...] tensor leaves of the microbatched inputs.
    state_leaves: the [T, S, ...] padded per-stage state leaves (each
      layer reads and writes its calls' own:
      microbatch.ReadStatesByLayer, WriteStatesByLayer).
    remat_policy: what each layer's iteration stores for the backward pass
      (a gpipe.loops.remat policy; the pipeline's is spec.remat_policy).

  Raises:
    vectorized_stages.CannotVectorize: the body cannot be vectorized over
      the microbatches.
  """
  sched = spec.schedule
  offsets = [[sched.StepSeedOffset(layer, m)
              for m in range(sched.num_microbatches)]
             for layer in range(sched.num_layers)]
  inputs = NestedMap(
      weights=nest.MapTensors(lambda w: _PerLayer(w, sched), theta),
      seeds=spec.base_seed + tf.constant(offsets, spec.base_seed.dtype),
      states=[microbatch.ReadStatesByLayer(x, sched) for x in state_leaves])
  # S x R iterations of whole-batch calls: little loop overhead for XLA to
  # save in a Session, and on small bodies its launches cost more than that
  # (docs/benchmarks.md#measured-behind-the-codes-choices),
  # so these loops run op by op.
  with compiled_loops.Allowed(False):
    _, final, extras = recurrent.Recurrent(
        NestedMap(), NestedMap(x=list(mb_leaves)), inputs,
        lambda th, st, inp: _Layer(spec, st, inp),
        remat_policy=remat_policy, return_states=False)
  per_stage = lambda x: tf.reshape(x, [sched.circular_repeat,
                                       sched.num_stages])
  return loop_spec.LoopResult(
      outputs=list(final.x),
      states=[microbatch.WriteStatesByLayer(old, new, sched)
              for old, new in zip(state_leaves, extras.states)],
      aux_loss=tf.reduce_sum(extras.aux),
      summaries={name: (per_stage(v), per_stage(w))
                 for name, (v, w) in extras.summaries.items()},
      vars=[])


def _PerLayer(w, sched):
  """[S, (R,) ...] stage-stacked -> [S x R, ...] in layer order r * S + s."""
  if sched.circular_repeat == 1:
    return w
  shape = py_utils.GetShape(w)
  perm = [1, 0] + list(range(2, len(shape)))
  return tf.reshape(tf.transpose(w, perm), [-1] + shape[2:])


def _Layer(spec, state, inp):
  """One layer on every microbatch: (new state; its aux loss, summaries and
  the calls' new per-stage states)."""
  args = spec.args.Rebuild(state.x)
  num_args = len(args)
  args += tuple(tf.nest.pack_sequence_as(spec.states, inp.states))
  res = vectorized_stages.VectorizedCalls(
      spec,
      per_call=dict(args=args, kwargs=spec.mb_kwargs, seed=inp.seeds),
      shared=dict(theta=inp.weights, repeat=None, vars=[]),
      num_calls=spec.schedule.num_microbatches,
      where='every microbatch of one layer at once (layer by layer)')
  aux = (tf.constant(0.0, tf.float32) if res.aux is None else
         tf.reduce_sum(res.aux))
  summaries = {name: (tf.reduce_sum(value * weight), tf.reduce_sum(weight))
               for name, value, weight in res.summaries}
  outs, new_states = res.outputs[:num_args], res.outputs[num_args:]
  return (NestedMap(x=spec.args.Of(outs)),
          NestedMap(aux=aux, summaries=summaries,
                    states=tf.nest.flatten(new_states)))
