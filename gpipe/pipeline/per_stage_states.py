"""PipelinedLayer's methods for per-stage states and loops of one's own.

Incremental decoding keeps a state per stage and microbatch (a decoder's
caches): `BodyFPropNoMicrobatching` makes every stage's on the whole
batch, `MicrobatchStates` and `PadMicrobatches` lay them out for the
pipeline's loop ([T, S, ...] per-call states, passed to FPropFn call
after call), `UnpadStates` gives each layer's back. `BodyFProp` runs one
iteration's stage calls for a caller that drives its own loop, as
Lingvo's layer offers it. A mixin of gpipe.layers.PipelinedLayer: it
reads the layer's layout, placement and loop spec.
"""

import tensorflow as tf

from gpipe import microbatch
from gpipe import nest
from gpipe.pipeline import side_outputs
from gpipe.pipeline import iteration as iteration_lib

_NotConvertedByAutograph = tf.autograph.experimental.do_not_convert


class PerStageStates:
  """The per-stage-state and one-iteration API of PipelinedLayer."""

  @_NotConvertedByAutograph
  def BodyFPropNoMicrobatching(self, theta, fn_name, *args, **kwargs):
    """Runs body method `fn_name` for every stage on the whole batch.

    For methods such as 'InitStates' that make per-stage states: stage s
    runs with its own weights (repeat 0 when circular), and every output
    gets a leading [num_stages] dim.

    Args:
      theta: the stage-stacked body weights, `theta.body` (as in Lingvo's
        layer), or this layer's theta.
      fn_name: the body method.
      *args: passed to every stage as they are.
      **kwargs: passed to every stage as they are.

    Returns:
      (outputs with a leading [num_stages] dim, a no-op), the pair Lingvo's
      layer returns.
    """
    theta = self._layout.AsLayerTheta(theta, self)
    out = self._layout.RunEveryStage(self._body, fn_name, theta, args, kwargs)
    return self._placement.SplitStages(out, 0), tf.no_op()

  @_NotConvertedByAutograph
  def BodyFProp(self, theta, fn_name, iteration, num_microbatches, *args,
                kwargs_no_batch=None, **kwargs):
    """Every stage's body call of one pipeline iteration, as Lingvo's has it.

    Stage s runs on args[s] with the weights, repeat, microbatch slice of
    the per-example kwargs and step seed the schedule gives it at
    `iteration` (on a bubble: the clamped microbatch, results to be
    dropped by the caller). For callers that drive their own loop.

    Args:
      theta: the stage-stacked body weights (`theta.body`, as Lingvo's layer
        takes them), or this layer's theta.
      fn_name: the body method.
      iteration: scalar int32 loop iteration.
      num_microbatches: M, for the schedule.
      *args: the stages' inputs, each with a leading [num_stages] dim.
      kwargs_no_batch: passed to every stage as they are.
      **kwargs: per-example kwargs, [M, ...]: stage s gets the slice of
        its microbatch.

    Returns:
      (outputs with a leading [num_stages] dim, a no-op). Each stage's aux
      losses go to the caller's AuxLossContext as one [num_stages] loss;
      the body's summaries as `<name>/stage_<i>`; non-trainable variables
      the stages assign are written back.
    """
    sched = self.Schedule(num_microbatches)
    spec = self._LoopSpec(sched, fn_name, nest.TensorLeaves(args), [],
                          kwargs, kwargs_no_batch or {})
    theta = self._layout.AsLayerTheta(theta, self)
    var_values = self._layout.NonTrainableValues(theta, spec.var_names)
    with tf.name_scope(self.params.name):
      iteration = self._placement.ReplicateBookkeeping(
          tf.convert_to_tensor(iteration, tf.int32))
      res = spec.runner.CallStages(
          spec, self._LoopTheta(theta),
          iteration_lib.StagesAt(
              spec, iteration_lib.RowAt(iteration_lib.Tables(sched.Rows()),
                                        iteration), args, var_values))
      side_outputs.AddIteration(res, self.params.num_stages)
      outputs = self._layout.AfterAssigning(self, spec.var_names, res.vars,
                                            res.outputs)
    outputs = tuple(self._placement.SplitStages(o, 0) for o in outputs)
    return (outputs[0] if len(outputs) == 1 else outputs), tf.no_op()

  def MicrobatchStates(self, per_stage_states):
    """[S, B, ...] states of the whole batch -> [M, S, B/M, ...].

    Microbatch m holds the same examples as the layer's inputs' microbatch m.
    """
    p = self.params
    return microbatch.SplitStates(per_stage_states, p.num_microbatches,
                                  p.microbatch_size)

  def PadMicrobatches(self, x):
    """[M, S, ...] per-(microbatch, stage) states -> [T, S, ...] per-call
    states.

    Entry [i, s] is the state of call (i, s), which stage s reads and
    writes at iteration i: that of the microbatch it works on then
    (diagrams: microbatch.PadStates). The padded states are opaque to the
    caller: pass them to FPropFn call after call; UnpadStates gives each
    layer's state back.
    """
    def Pad(t):
      sched = self.Schedule(t.shape.as_list()[0])
      return self._placement.SplitStages(microbatch.PadStates(t, sched), 1)

    return nest.MapTensors(Pad, x)

  def UnpadStates(self, padded, num_microbatches=None):
    """[T, S, ...] per-call states -> [R * S, B, ...]: each layer's state.

    The inverse of PadMicrobatches(MicrobatchStates(.)), per logical layer
    (repeat-major) and on the whole batch again.

    Args:
      padded: states as FPropFn returns them (a tensor or a structure).
      num_microbatches: M; defaults to p.num_microbatches.
    """
    num_mb = num_microbatches or self.params.num_microbatches
    if num_mb is None:
      raise ValueError('UnpadStates needs num_microbatches when the layer\'s '
                       'num_microbatches param is not set.')
    sched = self.Schedule(num_mb)
    return nest.MapTensors(
        lambda x: microbatch.LayerStatesToBatch(
            microbatch.UnpadStates(x, sched)), padded)
