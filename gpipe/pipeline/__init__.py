"""The pipelined layer's data path, in the order one FProp call runs it.

gpipe.layers.PipelinedLayer is the public face; these modules are its
parts (internal: their names may change).

    layer_params       the Params and what each means
    param_checks       every bad Param or combination, refused at Instantiate
    layouts            where the body's weights live: stacked, per stage,
                       Lingvo's stage-parallel layout
    stage_vars         the body's non-trainable variables, carried through
                       the loop
    repeats            a circular stage's repeat out of its [R, ...] weights
    per_stage_states   per-stage states (decoding) and one iteration's
                       stage calls, for callers that drive their own loop
    unrolled           unroll: the S * R layers one after another
    layer_by_layer     one device: each layer on every microbatch at once
    pipeline_loop      the loop: T iterations over the rotating buffer
    one_f_one_b        backward_schedule='1f1b': its gradient in forward
                       order
    gradient_waves     that gradient's loop: a forward and a backward wave
                       an iteration
    stage_ends         FPropWithLoss: the first stage's inputs and the
                       last stage's loss, made inside that loop
    loop_io            the loop's inputs and outputs: whole, or streamed
    rotating_buffer    the [S, ...] buffer's ops, each with its gradient
    stage_slots        rows a stage reads and writes on its own (and rings)
    stage_step         one iteration's stage work, bubbles masked
    stage_runners      every stage of an iteration: vectorized, one after
                       another, or partitioned
    vectorized_stages  every stage as one computation, on one device
    stage_call         the one call site of the body
    side_outputs       aux losses and summaries, bubbles masked
    nest               nested structures of tensors

The loops themselves and their gradients are gpipe.recurrent and
gpipe.loops; where tensors are placed, gpipe.sharding; the schedule's
arithmetic, gpipe.schedule.
"""
