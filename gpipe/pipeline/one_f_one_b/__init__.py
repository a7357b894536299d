"""backward_schedule='1f1b': what a stage stores bounded by the stages.

The reverse schedule's forward loop keeps each iteration's buffer for its
backward loop: T stage inputs per stage, about R x the batch per device.
With '1f1b' the forward loop keeps nothing per iteration, and the gradient
is one loop in forward order whose iteration j runs two waves (which call
each wave runs, the picture and the ring's size: gpipe.schedule.OneFOneB,
drawn by `python -m gpipe.schedule --backward_schedule 1f1b`):

    forward wave    each stage runs iteration j's forward again, from the
                    pipeline's inputs (gpipe.pipeline.iteration.Iterate),
                    and pushes its stage input [S, mb, ...] into a ring of
                    2 h (R S - 1) + 1 entries (h: the schedule's hop, 2
                    with delayed sends; OneFOneB.ring_size)
    backward wave   each stage differentiates the call whose output
                    gradient has come back one stage on (the last layer's:
                    the layer's output gradient), its input read back from
                    the ring; the input gradient goes one stage back (the
                    first layer's: the layer's input gradient)

A stage holds the ring, a forward and a gradient buffer (with stream_io:
1/S of the inputs, outputs and their gradients) whatever M is. The loss
stays outside the layer, so no output gradient exists before the whole
forward pass has run: the forward wave runs the forward a second time (one
forward more than 'reverse' with the same remat policy), and the backward
wave recomputes what its ring entry does not keep (remat_policy:
'recompute' keeps the stage input; 'save_dots' and 'save_all' also the
body's activations they name). The waves run in three loops
(OneFOneB.Phases) so that no iteration computes a wave no stage needs.
The layer's gradient is still what TensorFlow's autodiff asks of it: the
loop pair is one tf.custom_gradient, in graph mode and under XLA.

Its modules, from the top down (each imports only modules below it; a
call runs them in this order):

    pipelined          RunOneFOneB: the forward loop as one custom
                       gradient whose gradient is the gradient loop (or,
                       with a LastStageLoss, the gradient loop alone)
    forward_loop       the forward loop: T iterations, nothing kept
    gradient_loop      the gradient loop: a forward and a backward wave an
                       iteration
    cell               the stage work both loops run, traced once with
                       its gradient
    rings              the rings of stage inputs the waves write and read
    per_stage_entries  entries each stage reads or adds to on its own (the
                       per-stage states and their gradients)
"""

from gpipe.pipeline.one_f_one_b.forward_loop import FORWARD_LOOP
from gpipe.pipeline.one_f_one_b.pipelined import RunOneFOneB

__all__ = ['FORWARD_LOOP', 'RunOneFOneB']
