"""What a pipelined call hands its caller besides the outputs.

The body's aux losses and TPU summaries are caught per stage call (see
gpipe.pipeline.stage_call.StageContext), bubbles masked, and accumulated by the
loop; here they reach the caller's own contexts: one aux loss for the whole
call, and each summary as `<name>/stage_<i>`.
"""

import tensorflow as tf

from lingvo.core import py_utils


def AddStageSummaries(accumulated, num_stages):
  """Adds `<name>/stage_<i>`: the body's summary averaged over stage i.

  Each is the weighted mean over the valid iterations of stage i (every
  microbatch, and with circular_repeat > 1 every repeat of the stage), with
  the summed weight as its weight.

  Args:
    accumulated: {name: (value * weight, weight)}, each [T, S] (or [1, S]).
    num_stages: S.
  """
  for name, (weighted, weight) in accumulated.items():
    weighted = tf.reduce_sum(weighted, axis=0)
    weight = tf.reduce_sum(weight, axis=0)
    mean = tf.math.divide_no_nan(weighted, weight)
    for stage in range(num_stages):
      py_utils.AddTpuSummaryTensor(f'{name}/stage_{stage}', mean[stage],
                                   weight[stage])


def AddAuxLoss(total, num_microbatches, accumulation):
  """Adds a call's aux loss to the caller's AuxLossContext, if there is one.

  Args:
    total: the aux losses of every valid stage call, summed.
    num_microbatches: M.
    accumulation: the aux_loss_microbatch_accumulation param: 'sum', or
      'mean' over the microbatches.
  """
  ctx = py_utils.AuxLossContext.Current()
  if ctx is None:
    return
  if accumulation == 'mean':
    total = total / num_microbatches
  ctx.AddLoss(total)


def AddIteration(result, num_stages):
  """What one iteration's stages added (a stage_runners.RunnerResult, as
  BodyFProp runs it): the aux losses as one [S] loss, the summaries."""
  ctx = py_utils.AuxLossContext.Current()
  if result.aux is not None and ctx is not None:
    ctx.AddLoss(result.aux)
  AddStageSummaries({name: ((value * weight)[None], weight[None])
                     for name, value, weight in result.summaries},
                    num_stages)
