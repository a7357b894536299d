"""The pipelined layer's data path, from the top down.

gpipe.layers.PipelinedLayer is the public face; these modules are its
parts (internal: their names may change). Each module imports only
modules below it; one FProp call walks them in this order
(docs/how-it-works.md, "The route").

    layer_params       the Params and what each means
    param_checks       every bad Param or combination, refused at Instantiate
    layouts            where the body's weights live: stacked, per stage,
                       Lingvo's stage-parallel layout
    unrolled           unroll: the S * R layers one after another
    layer_loop         the same layers as one loop over the layer index
                       (the FLOP count's: one layer's compile)
    per_stage_states   per-stage states (decoding) and one iteration's
                       stage calls, for callers that drive their own loop
    loop_choices       what the layer decides before a loop runs: the
                       defaults the params leave to it, the io's kind
    layer_by_layer     one device: each layer on every microbatch at once
    pipeline_loop      the pod's schedule: T iterations over the rotating
                       buffer, its gradient in reverse
    one_f_one_b        backward_schedule='1f1b': the same iteration, its
                       gradient in forward order (a subpackage: its loops,
                       their cell, rings and per-stage entries)
    iteration          one iteration, read top to bottom (Iterate): read,
                       stage inputs, every stage's call with bubbles
                       masked, rotate, write
    streamed_io        stream_io: inputs and outputs split over the stages
    loop_io            the loop's inputs and outputs: the interface, whole
                       or made at stage 0
    loop_spec          what a loop is given (LoopSpec) and gives back
                       (LoopResult): data
    stage_ends         FPropWithLoss: the first stage's inputs and the
                       last stage's loss, made inside the 1f1b loop
    vectorized_stages  every stage as one computation, on one device
    stage_runners      every stage of an iteration: vectorized, one after
                       another, or partitioned (the StageRunner interface)
    stage_call         the one call site of the body
    non_trainable_vars the body's non-trainable variables, carried through
                       the loop
    repeats            a circular stage's repeat out of its [R, ...] weights
                       (TakeFromRS, TakeFromSR: named by their axis order)
    rotation           RotateStages: each stage hands its work to the next
    side_outputs       aux losses and summaries, bubbles masked

The loops themselves and their gradients are gpipe.recurrent and
gpipe.loops; where tensors are placed, gpipe.sharding; the schedule's
arithmetic, gpipe.schedule.
"""
