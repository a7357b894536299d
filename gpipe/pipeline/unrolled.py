"""The unpipelined path: the S * R layers one after another, whole batch.

What `unroll='always'` (and 'eval_only' in eval) runs: no microbatches, no
loop, no bubbles (inputs that come already microbatched run microbatch by
microbatch, see RunMicrobatchByMicrobatch). Each logical layer
(repeat-major: layer r * S + s) calls the body through
`stage_call.CallStage` in the caller's own contexts, so aux losses and
step seeds behave as in the plain stack; its TPU summaries are added per
stage, named as the pipeline names them (StageSummaries).
"""

import contextlib
import threading

import tensorflow as tf

from gpipe import microbatch
from gpipe import nest
from gpipe.pipeline import layer_loop
from gpipe.pipeline import side_outputs
from gpipe.pipeline import stage_call
from lingvo.core import py_utils

_everywhere = threading.local()


@contextlib.contextmanager
def Everywhere(as_loop=False):
  """Inside, every PipelinedLayer call without per-stage states runs this
  path, as unroll='always' does: the plain stack's computation, with no
  bubble and nothing recomputed (gpipe.plan counts a model's FLOPs so).

  as_loop: run each stack's layers as one loop over the layer index where
  they can (gpipe.pipeline.layer_loop): the same FLOPs at one layer's
  compile, for counting them.
  """
  before = getattr(_everywhere, 'mode', None)
  _everywhere.mode = 'loop' if as_loop else 'unrolled'
  try:
    yield
  finally:
    _everywhere.mode = before


def Forced():
  """Whether calls run unrolled whatever their Params say (Everywhere)."""
  return getattr(_everywhere, 'mode', None) is not None


def _AsLoop():
  """Whether Everywhere(as_loop=True) asks for the stacks' layers as a loop."""
  return getattr(_everywhere, 'mode', None) == 'loop'


def CheckPerLayerStates(per_layer_states, num_layers):
  """Copies of the per-layer state lists, checked to have R * S entries."""
  checked = []
  for k, states in enumerate(per_layer_states):
    if not isinstance(states, (list, tuple)) or len(states) != num_layers:
      got = type(states).__name__
      if isinstance(states, (list, tuple)):
        got += f' of {len(states)}'
      raise ValueError(
          f'With unroll, padded_per_stage_states[{k}] must be a list of '
          f'{num_layers} per-layer states (num_stages * circular_repeat), '
          f'one per logical layer; got a {got}. Make them with the body '
          'method for each layer_theta.')
    checked.append(list(states))
  return checked


class StageSummaries:
  """Each layer's TPU summaries, added as the pipeline adds them.

  `<name>/stage_<s>`: the weighted mean over the layers of stage s (its
  repeats) and the microbatches run one by one (gpipe.pipeline.side_outputs), so
  that an unrolled eval names them as the pipelined training step does and
  TensorBoard shows them on one curve.
  """

  def __init__(self, num_stages):
    self._num_stages = num_stages
    self._terms = {}  # name: per stage, [(value * weight, weight)]

  @contextlib.contextmanager
  def Layer(self, stage):
    """Catches what the body adds while running a layer of `stage`."""
    with stage_call.OwnSummaries() as entries:
      yield
    for name, value, weight in stage_call.NamedSummaries(entries):
      terms = self._terms.setdefault(
          name, [[] for _ in range(self._num_stages)])
      terms[stage].append((value * weight, weight))

  def Add(self):
    """Adds `<name>/stage_<s>` to the caller's summary context."""
    zero = tf.zeros([], tf.float32)
    sums = lambda terms, k: tf.stack(
        [tf.add_n([t[k] for t in ts]) if ts else zero for ts in terms])
    side_outputs.AddStageSummaries(
        {name: (sums(terms, 0)[None], sums(terms, 1)[None])
         for name, terms in self._terms.items()}, self._num_stages)


def RunUnrolled(layout, body, fn_name, theta, args, kwargs, kwargs_no_batch,
                per_layer_states, var_names, carried, summaries=None):
  """Runs every logical layer in order.

  Args:
    layout: the layer's weight layout (gpipe.pipeline.layouts).
    body: the stage_call.Body.
    fn_name: the body method.
    theta: the layer's theta.
    args: the positional inputs, a tuple.
    kwargs: per-example kwargs (whole batch).
    kwargs_no_batch: kwargs passed as they are.
    per_layer_states: lists of R * S states, one list per state arg.
    var_names: the body's non-trainable variables.
    carried: their values, [S, (R,) ...].
    summaries: the StageSummaries to add the layers' summaries to; None:
      added per stage when the layers are done.

  Returns:
    (outputs tuple, per-layer state lists updated, carried values updated).
  """
  num_stages = layout.num_stages
  if _AsLoop() and layer_loop.Runs(layout, per_layer_states, carried):
    return (layer_loop.RunLayerLoop(layout, body, fn_name, theta, args,
                                    kwargs, kwargs_no_batch),
            per_layer_states, carried)
  caught = summaries or StageSummaries(num_stages)
  per_layer_states = CheckPerLayerStates(per_layer_states,
                                         num_stages * layout.repeats.count)
  outputs = tuple(args)
  for repeat in range(layout.repeats.count):
    for stage in range(num_stages):
      layer = repeat * num_stages + stage
      with tf.name_scope(f'layer_{layer:03d}'), caught.Layer(stage):
        states = tuple(s[layer] for s in per_layer_states)
        outputs, carried = layout.RunLayerOnBatch(
            body, fn_name, theta, repeat, stage, outputs + states, kwargs,
            kwargs_no_batch, var_names, carried)
        outputs, states = outputs[:len(args)], outputs[len(args):]
        for per_layer, state in zip(per_layer_states, states):
          per_layer[layer] = state
  if summaries is None:
    caught.Add()
  return outputs, per_layer_states, carried


def RunMicrobatchByMicrobatch(num_microbatches, layout, body, fn_name, theta,
                              args, kwargs, kwargs_no_batch, per_layer_states,
                              var_names, carried):
  """Run on each of already-microbatched [M, ...] inputs in turn.

  The body sees one microbatch at a time, exactly as in the pipeline (a
  per-microbatch scalar stays a scalar); non-trainable variables are
  carried from one microbatch to the next. Outputs and states are stacked
  back to [M, ...]. num_microbatches is M; the other args as RunUnrolled's.
  """
  outputs, states = [], []
  summaries = StageSummaries(layout.num_stages)
  for m in range(num_microbatches):
    take = lambda t, m=m: t[m]
    with tf.name_scope(f'microbatch_{m:03d}'):
      out, state, carried = RunUnrolled(
          layout, body, fn_name, theta, nest.MapTensors(take, args),
          nest.MapTensors(take, kwargs), kwargs_no_batch,
          nest.MapTensors(take, per_layer_states), var_names, carried,
          summaries)
    outputs.append(out)
    states.append(state)
  summaries.Add()
  return nest.Stack(outputs), nest.Stack(states), carried


def RunPremadeMicrobatches(aux_loss_accumulation, *run_args):
  """RunMicrobatchByMicrobatch on inputs that came [M, ...], their aux losses
  combined over microbatches as the pipeline combines them.

  Args:
    aux_loss_accumulation: the aux_loss_microbatch_accumulation param.
    *run_args: as for RunMicrobatchByMicrobatch.
  """
  _, _, _, _, args, kwargs, _, per_layer_states, _, _ = run_args
  num_mb = microbatch.NumPremadeMicrobatches((args, kwargs, per_layer_states))
  with py_utils.AuxLossContext(reentrant=True) as aux_ctx:
    result = RunMicrobatchByMicrobatch(num_mb, *run_args)
  if aux_ctx.aux_losses:
    side_outputs.AddAuxLoss(stage_call.SumAuxLosses(aux_ctx.aux_losses),
                            num_mb, aux_loss_accumulation)
  return result
