"""The one way the pipeline calls its body.

Whether it runs one logical layer on the whole batch (unrolled), one stage
of a loop iteration on one device, every device's own stage in a manual
region, or all stages at once (a stage_parallel_body), the body method is
called through `CallStage`. It gives the body its non-trainable variables
(see gpipe.pipeline.non_trainable_vars), optionally an isolating
`StageContext` (step seed, global step, aux losses and summaries of its
own), checks that the outputs have the inputs' structure, and returns a
`CallResult`. An exception raised
by the body gets a note saying which call of which layer raised it.
"""

import contextlib
import dataclasses
from typing import Any, List, Optional, Sequence, Tuple

import tensorflow as tf

from gpipe import nest
from gpipe.pipeline import non_trainable_vars
from lingvo.core import py_utils


@dataclasses.dataclass(frozen=True)
class CallResult:
  """What one call of the body produced.

  Attributes:
    outputs: a tuple with the structure of the call's args.
    new_vars: the new values of the non-trainable variables passed in.
    aux_losses: the aux losses the body added (empty without a context).
    summaries: [(name, value, weight)], float32, the TPU summaries it added
      (empty without a context).
  """
  outputs: Tuple[Any, ...]
  new_vars: List[tf.Tensor]
  aux_losses: List[tf.Tensor]
  summaries: List[Tuple[str, tf.Tensor, tf.Tensor]]

  def AuxLoss(self):
    """One stage's aux losses summed to a float32 scalar, or None."""
    return SumAuxLosses(self.aux_losses)


def SumAuxLosses(aux_losses):
  """Aux losses summed to a float32 scalar, or None if there are none."""
  if not aux_losses:
    return None
  return tf.add_n([tf.reduce_sum(tf.cast(l, tf.float32)) for l in aux_losses])


@dataclasses.dataclass(frozen=True)
class Body:
  """The body layer of a pipeline, and how to name it in errors."""
  layer: Any        # the child layer whose methods run
  param: str        # 'single_stage_body' or 'stage_parallel_body'
  owner: str        # the pipelined layer's name


def CallStage(body: Body, fn_name: str, theta, args: Sequence[Any], kwargs,
              *, where: str, var_names: Sequence[str] = (),
              var_values: Sequence[tf.Tensor] = (),
              context: Optional['StageContext'] = None) -> CallResult:
  """Runs `body.layer.<fn_name>(theta, *args, **kwargs)` once.

  Args:
    body: the body and its names.
    fn_name: the body method, e.g. 'FProp' or 'ExtendStep'.
    theta: the weights this call uses.
    args: the positional inputs (tensors or structures).
    kwargs: keyword inputs, as the body method takes them.
    where: which call this is, for error notes (e.g. 'stage 2').
    var_names: the body's non-trainable variables this call carries.
    var_values: their current values for this call.
    context: a StageContext isolating the call (its aux losses and summaries
      come back in the result), or None to run in the caller's contexts.
  """
  args = tuple(args)
  fn = getattr(body.layer, fn_name)
  ctx = context if context is not None else contextlib.nullcontext()
  # In the loop (with a context), the ops the body adds are checked below.
  in_loop_graph = context is not None and not tf.executing_eagerly()
  graph = tf.compat.v1.get_default_graph()
  num_ops = len(graph.get_operations()) if in_loop_graph else 0
  try:
    with ctx:
      out, new_vars = non_trainable_vars.CallWithStageVars(
          body.layer, fn, theta, list(var_names), list(var_values), args,
          kwargs)
  except Exception as e:
    e.add_note(f'(raised by {type(body.layer).__name__}.{fn_name}, the '
               f'{body.param} of pipelined layer {body.owner!r}, running '
               f'{where})')
    raise
  if in_loop_graph:
    _CheckNoV1Summaries(body, fn_name, graph.get_operations()[num_ops:])
  outputs = CheckBodyOutputs(body, args, out)
  if context is None:
    return CallResult(outputs, new_vars, [], [])
  return CallResult(outputs, new_vars, list(context.aux_losses),
                     context.Summaries())


_V1_SUMMARY_OPS = frozenset({
    'ScalarSummary', 'HistogramSummary', 'ImageSummary', 'AudioSummary',
    'AudioSummaryV2', 'TensorSummary', 'TensorSummaryV2', 'MergeSummary'})


def _CheckNoV1Summaries(body, fn_name, new_ops):
  """tf.compat.v1.summary ops inside the loop cannot be fetched: say so now.

  They would build, and then fail at fetch time with a graph error naming
  a tensor inside the loop body.
  """
  found = sorted({op.type for op in new_ops if op.type in _V1_SUMMARY_OPS})
  if found:
    raise ValueError(
        f'{type(body.layer).__name__}.{fn_name} (the {body.param} of '
        f'pipelined layer {body.owner!r}) adds tf.compat.v1.summary ops '
        f'({", ".join(found)}) inside the pipeline loop, where they cannot '
        'be fetched. Use py_utils.AddTpuSummaryTensor(name, value, weight) '
        'instead: the pipeline averages it over each stage\'s valid '
        'iterations and reports <name>/stage_<i>.')


def CheckBodyOutputs(body: Body, inputs, out):
  """The body's outputs as a tuple like inputs, or a clear error."""
  out = nest.AsTuple(out, len(inputs))
  problem = nest.StructureMismatch(inputs, out)
  if problem:
    raise ValueError(
        f'The {body.param} ({type(body.layer).__name__}) must return '
        'the same structure as its inputs (one output per input, same '
        f'nesting, None where the input is None, same dtype): {problem}.')
  return out


class StageContext(contextlib.ExitStack):
  """What the body sees while computing one stage (or all, in one call).

  Its own step seed (the (layer, microbatch) stream), the caller's global
  step, and its own AuxLossContext and TPU summary context, so that the aux
  losses and summaries it adds can be masked on bubbles and combined by the
  pipeline instead of reaching the caller once per iteration.
  """

  def __init__(self, step_seed, global_step):
    super().__init__()
    self._step_seed = step_seed
    self._global_step = global_step
    self._aux_ctx = None
    self._entries = []

  def __enter__(self):
    super().__enter__()
    py_utils.ResetStepSeed(self._step_seed)
    if self._global_step is not None:
      self.enter_context(py_utils.GlobalStepContext(self._global_step))
    self._aux_ctx = self.enter_context(
        py_utils.AuxLossContext(reentrant=True))
    self._entries = self.enter_context(OwnSummaries())
    return self

  @property
  def aux_losses(self):
    return self._aux_ctx.aux_losses

  def Summaries(self):
    """[(name, value, weight)] the body added, float32 (NamedSummaries)."""
    return NamedSummaries(self._entries)


@contextlib.contextmanager
def OwnSummaries():
  """A TPU summary context of its own; yields the list its entries go to
  (read them with NamedSummaries)."""
  with py_utils.TpuSummaryTensorContext():
    # Lingvo keeps the innermost context's entries on this stack; its public
    # getter folds the (in-loop, meaningless) name scope into each key.
    yield py_utils._TPU_SUMMARY_CONTEXTS.stack[-1]  # pylint: disable=protected-access


def NamedSummaries(entries):
  """[(name, value, weight)] of TPU summary entries, float32, in order.

  A name added twice gets a suffix (_1, _2, ...), so names are unique.
  """
  out, seen = [], {}
  for entry in entries:
    value, weight = entry.value
    name = entry.name
    if name in seen:
      seen[name] += 1
      name = f'{name}_{seen[name]}'
    else:
      seen[name] = 0
    out.append((name, tf.cast(value, tf.float32),
                tf.cast(weight, tf.float32)))
  return out
