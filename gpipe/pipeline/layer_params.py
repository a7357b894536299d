"""The Params of gpipe.layers.PipelinedLayer, each with its meaning.

Lingvo's LayerwiseShardablePipelinedLayer defines the first group, with the
same names and meanings, so that its configs carry over; the second group is
gpipe's own (lingvo_compat leaves it out when it builds Lingvo's layer).
"""


def DefineLingvos(p):
  """The Params Lingvo's LayerwiseShardablePipelinedLayer has too."""
  p.Define('num_stages', 1, 'Number of pipeline stages S.')
  p.Define(
      'single_stage_body', None,
      'Params of one stage. Its variables get a leading [num_stages] dim '
      '([num_stages, circular_repeat] when circular).')
  p.Define(
      'stage_parallel_body', None,
      'Params of a layer that computes all stages at once: its inputs and '
      'weights have a leading num_stages dim. Excludes single_stage_body.')
  p.Define(
      'num_microbatches', None,
      'Split the batch into this many microbatches. If neither this nor '
      'microbatch_size is set, the inputs are already [M, ...].')
  p.Define('microbatch_size', None,
           'Split the batch into microbatches of this size.')
  p.Define(
      'shard_stages_1d', False,
      'Split the stage dim of weights and buffer over num_stages devices.')
  p.Define(
      'pipeline_stage_mesh_dim', None,
      'Split the stage dim over this axis of device_mesh (instead of '
      'shard_stages_1d); the body annotates its tensors without the stage '
      'dim.')
  p.Define('per_stage_vars', False,
           'Separate variables per stage (children body_iter_00000, ...). '
           'With single_stage_body only.')
  p.Define('circular_repeat', 1,
           'R > 1 makes the pipeline circular: each microbatch passes '
           'through the S stages R times (S * R layers in all).')
  p.Define('unroll', 'eval_only',
           'never | eval_only | always: run the layers one after another '
           'instead of pipelining (always, or in eval only).')
  p.Define('aux_loss_microbatch_accumulation', 'mean',
           'mean | sum: how aux losses added by the body combine over '
           'microbatches.')


def DefineGpipes(p):
  """The Params only gpipe's layer has."""
  p.Define(
      'remat_policy', 'recompute',
      'What the forward pass stores per iteration for the backward pass '
      '(gpipe.loops.remat): recompute (only the buffer: activation memory = '
      'buffer x iterations, the forward runs twice), save_dots (also the '
      'body\'s matmul/einsum outputs; the elementwise rest is recomputed) '
      'or save_all (every activation the gradient reads; nothing is '
      'recomputed). Weights are never stored per iteration.')
  p.Define(
      'store_body_intermediates', False,
      'True is remat_policy=\'save_all\' (the older name).')
  p.Define(
      'backward_schedule', 'reverse',
      'reverse | 1f1b: how the backward pass runs '
      '(gpipe.pipeline.one_f_one_b). '
      'reverse: a loop in reverse order over the buffer the forward loop '
      'kept for every iteration (T stage inputs per stage: about R x the '
      'batch per device). 1f1b: the forward loop keeps nothing per '
      'iteration; its gradient is one loop in forward order in which each '
      'stage runs the forward of one microbatch again and the backward of '
      'another, keeping a ring of 2 R S - 1 stage inputs whatever M is, '
      'for one forward pass more (remat_policy says what a ring entry '
      'keeps of the body).')
  p.Define(
      'stream_io', False,
      'Split the microbatched inputs, the outputs and their gradients over '
      'the stages (Praxis\'s name; gpipe.pipeline.loop_io): each stage keeps '
      'ceil(M / S) of the M microbatches, which reach stage 0 (and leave '
      'the last stage) by one collective-permute per iteration, so that no '
      'device holds the whole batch; the outputs come back split over the '
      'stage devices on the batch dim. Per-example kwargs stay whole.')
  p.Define(
      'vectorize_stages', 'auto',
      'auto | always | never: on one device, run the S stages of an '
      'iteration as one computation vectorized over the stage dim '
      '(gpipe.pipeline.vectorized_stages; auto falls back to one stage after '
      'another, once, with a log line, where the body cannot be '
      'vectorized). Partitioned, each device runs its own stage anyway.')
  p.Define(
      'skip_bubbles', False,
      'On one device, run the first and last iterations (about S / 2 at '
      'each end, filling and draining the pipeline) on the half of the '
      'stages that holds their useful work '
      '(gpipe.schedule.Schedule.Phases): about half the bubble '
      'slots are not computed. Faster steps where M is close to S and the '
      'body is compute-bound, in graph mode and under XLA; slower for small '
      'bodies in graph mode (BENCHMARKS.md). Costs 2-3.5x the tracing and '
      'compile time (three loops instead of one). Partitioned, each device '
      'runs its own stage and this does nothing.')
  p.Define(
      'layer_by_layer', False,
      'On one device, loop over the S x R layers instead of the pipeline '
      'schedule, each layer running on all M microbatches as one vectorized '
      'computation (gpipe.pipeline.layer_by_layer): no bubbles at all, S x R '
      'iterations instead of M + S - 1 (circular: more). Every call is '
      'still one body call on one microbatch with its own step seed. The '
      'body\'s internal activations are those of the whole batch at once '
      '(the pipeline\'s: S microbatches). Runs the pipeline loop instead, '
      'with one log line, for non-trainable variables, a body that cannot '
      'be vectorized, vectorize_stages=\'never\', stage-parallel bodies, '
      'partitioned runs and, under XLA, calls with per-stage states '
      '(decoding), which are faster there in the pipeline loop.')
