"""The Params of gpipe.layers.PipelinedLayer, each with its meaning.

Lingvo's LayerwiseShardablePipelinedLayer defines the first group, with the
same names and meanings, so that its configs carry over; the second group is
gpipe's own (lingvo_compat leaves it out when it builds Lingvo's layer).

The help strings are what users read: the README's Configuration table is
generated from them (tools/readme_params.py; tests/readme_params_test.py
fails when it is stale), in Define order, with the terms the README defines
above it: S stages, M microbatches, R circular repeats, T iterations.
"""

# Params of Lingvo's BaseLayer that the README's table shows too: name ->
# (the Param defined here that its row goes just before, its meaning).
BASE_LAYER_PARAMS = {
    'device_mesh': (
        'pipeline_stage_mesh_dim',
        'A NumPy array of device ids (Lingvo\'s base-layer Param): the mesh '
        'the stages and the body\'s own annotations are placed on '
        '([docs/meshes.md](docs/meshes.md)).'),
}


def DefineLingvos(p):
  """The Params Lingvo's LayerwiseShardablePipelinedLayer has too."""
  p.Define('num_stages', 1, 'Number of pipeline stages S.')
  p.Define(
      'single_stage_body', None,
      'Params of one stage. Its variables get a leading `[S]` dim (`[S, R]` '
      'when circular) under child `body`.')
  p.Define(
      'stage_parallel_body', None,
      'Params of a layer that computes all S stages at once (inputs and '
      'weights with a leading `[S]` dim). Circular: weights `[R, S, ...]`. '
      'Set exactly one of this and `single_stage_body`.')
  p.Define(
      'num_microbatches', None,
      'Split the batch into M microbatches (batch must be divisible).')
  p.Define(
      'microbatch_size', None,
      'Or: split it into microbatches of this size. With neither set, inputs '
      'are already `[M, ...]` (unrolled, e.g. in eval, they run microbatch '
      'by microbatch, as the pipeline computes them, and come back '
      '`[M, ...]`).')
  p.Define(
      'per_stage_vars', False,
      'Separate variables per stage: children `body_iter_00000`, ... '
      '(variable scope `iter_00000`, ...). `[R, ...]` when circular. With '
      '`single_stage_body` only.')
  p.Define(
      'circular_repeat', 1,
      'R > 1 makes the pipeline circular: each microbatch passes through the '
      'S stages R times (S x R layers in all); bubbles shrink by about R.')
  p.Define(
      'unroll', 'eval_only',
      '`\'never\'`, `\'eval_only\'` (plain stack in eval), `\'always\'`: run '
      'the layers one after another instead of pipelining.')
  p.Define(
      'aux_loss_microbatch_accumulation', 'mean',
      '`\'mean\'` or `\'sum\'` of the body\'s aux losses over microbatches.')
  p.Define(
      'shard_stages_1d', False,
      'Split the stage dim of weights and buffer over S devices.')
  p.Define(
      'pipeline_stage_mesh_dim', None,
      'Split the stage dim over this axis of `device_mesh` instead (of '
      '`shard_stages_1d`); the body annotates its tensors without the stage '
      'dim, and its own annotations keep working on the other axes.')


def DefineGpipes(p):
  """The Params only gpipe's layer has."""
  _DefineMemory(p)
  _DefineOneDevice(p)


def _DefineMemory(p):
  """What the backward pass keeps, and where the batch lives."""
  p.Define(
      'remat_policy', None,
      'What the forward pass stores per iteration for the backward pass '
      '(`gpipe.loops.remat`): `recompute` (only the buffer: activation '
      'memory = buffer x iterations, the forward runs twice), '
      '`save_checkpoints` (also what the body marks with '
      '`gpipe.loops.remat.Checkpoint`, e.g. each block\'s input, for a '
      'body whose blocks recompute themselves), `save_dots` '
      '(also the body\'s matmul/einsum outputs; the elementwise rest is '
      'recomputed) or `save_all` (every activation the gradient reads; '
      'nothing is recomputed). Weights are never stored per iteration. '
      'None (the default): `recompute` in the pipeline\'s loop, but '
      '`save_dots` on one device for a body of at least 2 MFLOPs a '
      'microbatch with the reverse schedule (2 x positions x one layer\'s '
      'weights: `gpipe.pipeline.loop_choices.ChosenRematPolicy`; faster '
      'steps for '
      'such bodies, [docs/benchmarks.md](docs/benchmarks.md)), and '
      '`save_dots` layer by layer '
      '(`layer_by_layer`: the dots\' outputs of every layer for the whole '
      'batch). On one device the plain stack keeps all of those outputs '
      'too; partitioned, recomputing is what fits a chip. See '
      '[docs/memory.md](docs/memory.md).')
  p.Define(
      'store_body_intermediates', False,
      'True is `remat_policy=\'save_all\'` (the older name).')
  p.Define(
      'backward_schedule', 'reverse',
      'How the backward pass runs (`gpipe.pipeline.one_f_one_b`). '
      '`\'reverse\'`: a loop in reverse order over the buffer the forward '
      'loop kept for every iteration (T stage inputs per stage, about R x '
      'the batch per chip). `\'1f1b\'`: the forward loop keeps nothing per '
      'iteration; the gradient is one loop in forward order in which each '
      'stage runs the forward of one microbatch again and the backward of '
      'another, each stage keeping a ring of 2h(RS - 1) + 1 stage inputs (h: '
      'the schedule\'s hop, 2 with delayed sends) whatever '
      'M is, for one forward pass more (5/4 of the FLOPs of a body whose '
      'backward is twice its forward, under the same `remat_policy`; '
      '`\'1f1b\'` with `\'save_dots\'` has about the FLOPs of `\'reverse\'` '
      'with `\'recompute\'`); `remat_policy` says what a ring entry keeps of '
      'the body. See [docs/memory.md](docs/memory.md).')
  p.Define(
      'delayed_sends', False,
      'Hand each stage\'s output on one iteration after it is made '
      '(`gpipe.pipeline.rotation.DelayedHandoff`), so that the stage dim\'s '
      'collective-permute runs beside the next iteration\'s compute instead '
      'of between two iterations\' calls; each microbatch then takes two '
      'iterations a stage: 2(S - 1) bubble iterations instead of S - 1, '
      'circular segments of 2S microbatches, one more buffer in flight. '
      'Pays where the permute is long beside a call (see '
      '[docs/planning.md](docs/planning.md)); the outputs and gradients are '
      'the same. `python -m gpipe.schedule --num_stages 4 --num_microbatches 8 '
      '--delayed_sends` draws it.')
  p.Define(
      'stream_io', False,
      'Split the microbatched inputs, the outputs and their gradients over '
      'the stages (Praxis\'s name; `gpipe.pipeline.loop_io`): each stage\'s '
      'device keeps ceil(M/S) of the M microbatches, brought to stage 0 and '
      'back from the last stage by one collective-permute per iteration, so '
      'that no chip holds the whole batch; the `[B, ...]` outputs come back '
      'split over the stage devices on the batch dim. Per-example kwargs '
      'stay whole.')
  p.Define(
      'ring_split_mesh_dim', None,
      'With `backward_schedule=\'1f1b\'` and `pipeline_stage_mesh_dim`: '
      'also split each entry of the 1f1b rings (the stored stage inputs and '
      'checkpoints) over this other axis of `device_mesh`, one over which '
      'they are whole (a model axis), on the entry\'s largest dim that '
      'divides: the rings take 1/n of the memory on each of its n devices, '
      'for one all-gather of an entry over the axis when the backward wave '
      'reads it (`gpipe.pipeline.one_f_one_b.rings.SplitRingLayout`). None: '
      'entries whole.')


def _DefineOneDevice(p):
  """How a run on one device computes the pipeline's schedule."""
  p.Define(
      'compile_loops', 'auto',
      'In graph mode (a tf.Session, Lingvo\'s trainer), run each of the '
      'pipeline\'s loops as one XLA computation (`gpipe.loops.compiled_loops`;'
      ' `\'auto\'`: when every op of the loop has an XLA kernel, none is '
      'placed on a device of its own, draws stateful random numbers or '
      'computes in a 16-bit float, else the loop runs op by op; '
      '`\'never\'`: always op by op). A Session runs a loop op by op at a '
      'few microseconds per op and iteration: compiled, a training step is '
      'faster, most of all a small body\'s (see '
      '[docs/benchmarks.md](docs/benchmarks.md)), for an XLA compilation '
      'when the Session first runs it; results equal '
      'the op-by-op loop\'s up to float32 rounding. layer_by_layer\'s loops '
      'run op by op. Inside a tf.function (compiled with it or not) and on a '
      'TPU this does nothing.')
  p.Define(
      'vectorize_stages', 'auto',
      'On one device, run the S stages of an iteration as one computation '
      'vectorized over the stage dim (`gpipe.pipeline.vectorized_stages`; '
      '`\'auto\'`: falls back to one stage after another, once, with a log '
      'line saying why, for a body that cannot be vectorized; `\'always\'`: '
      'an error instead; `\'never\'`). Partitioned, each device runs its own '
      'stage either way.')
  p.Define(
      'skip_bubbles', None,
      'On one device, run the first and last iterations (about S / 2 at '
      'each end, filling and draining the pipeline) on the half of the '
      'stages that holds their useful work '
      '(`gpipe.schedule.Schedule.Phases`), so about half the bubbles '
      'are not computed: faster steps where M is close to S and the body is '
      'compute-bound, under XLA, slower for small bodies in graph mode, and '
      'longer to trace and compile (three loops instead of one). None (the '
      'default): on under XLA '
      '(`tf.function(jit_compile=True)`) for a body of at least a million '
      'FLOPs a microbatch (2 x positions x one layer\'s weights: '
      '`gpipe.pipeline.loop_choices.SkipsBubbles`), where it saves time, '
      'else off. Partitioned, each device runs its own stage and '
      'this does nothing. See '
      '[BENCHMARKS.md](BENCHMARKS.md).')
  p.Define(
      'layer_by_layer', None,
      'On one device, loop over the S x R layers instead of the pipeline '
      'schedule, each layer running on all M microbatches as one vectorized '
      'computation (`gpipe.pipeline.layer_by_layer`): no bubbles at all and '
      'one loop of S x R iterations instead of the pipeline\'s T (M + S - 1 '
      'or, circular, more), the fastest one-device run (against Lingvo\'s '
      'layer: [BENCHMARKS.md](BENCHMARKS.md)). '
      'Every call is still one body call on one microbatch with its own step '
      'seed, so results equal the pipeline\'s up to float rounding; the '
      'body\'s internal activations are the whole batch\'s at once (the '
      'pipeline\'s: S microbatches\'). Per-stage states (a decoder\'s caches) '
      'work as in the pipeline (in graph mode; under XLA decoding calls run '
      'the pipeline loop, faster there). Runs the pipeline loop instead, '
      'saying why in one log line, for non-trainable variables, a body that '
      'cannot be vectorized, `vectorize_stages=\'never\'`, stage-parallel '
      'bodies and partitioned runs. None (the default): the program\'s '
      'choice, False (the schedule a pod runs, which a test on one device '
      'checks) unless the program trains on one device: '
      '`gpipe.lingvo_trainer --run_locally=...` runs these layers layer by '
      'layer (`--nolayer_by_layer`: the schedule), as does '
      '`gpipe.pipeline.layer_by_layer.SetProgramDefault(True)`.')
