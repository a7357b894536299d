"""What the layer decides for a loop before it runs it: the remat policy
and skip_bubbles where the params leave them to it, and how the loop reads
and writes (its io's kind, spec.io_kind).

    remat_policy=None   'save_dots' on one device with the reverse
                        backward, for a body of at least
                        MIN_FLOPS_PER_CALL_TO_SAVE_DOTS a call; else
                        'recompute'
    skip_bubbles=None   on one device under XLA, for a body of at least
                        MIN_FLOPS_PER_CALL_TO_SKIP_BUBBLES a call
    the io              loop_io.MadeAtStageZero with a FirstStageInput,
                        streamed_io.StreamedIo with stream_io, else
                        loop_io.WholeIo

The thresholds were measured
(docs/benchmarks.md#the-one-device-defaults-against-what-they-replace).
The LoopSpec stays data: Decide gives it back with the choices filled in.
"""

import dataclasses

import tensorflow as tf

from gpipe.loops import compiled_loops
from gpipe.pipeline import loop_io
from gpipe.pipeline import loop_spec
from gpipe.pipeline import streamed_io


def Decide(spec, theta, mb_leaves):
  """The spec with remat_policy, skip_bubbles and io_kind decided."""
  return dataclasses.replace(
      spec, remat_policy=ChosenRematPolicy(spec, theta, mb_leaves),
      skip_bubbles=SkipsBubbles(spec, theta, mb_leaves),
      io_kind=spec.io_kind or IoKind(spec))


# remat_policy=None keeps the dots' outputs (save_dots) on one device for a
# body whose call on one microbatch takes at least this many FLOPs
# (CallFlops), rather than running its dots again in the backward loop:
# above it, keeping them measured faster than recomputing; below, within
# the noise, so those bodies keep recomputing.
MIN_FLOPS_PER_CALL_TO_SAVE_DOTS = 2e6

# skip_bubbles=None turns it on under XLA for a body whose call on one
# microbatch takes at least this many FLOPs: below, what the skipped
# bubbles save is within a short step's noise, and every body's three
# loops take longer to trace and compile than one.
MIN_FLOPS_PER_CALL_TO_SKIP_BUBBLES = 1e6


def ChosenRematPolicy(spec: loop_spec.LoopSpec, theta, mb_leaves):
  """The loop's remat policy: the one the params ask for; None: save_dots
  on one device, with the reverse schedule, for a body of at least
  MIN_FLOPS_PER_CALL_TO_SAVE_DOTS, else recompute.

  On one device the plain stack the pipeline stands for keeps all of its
  dots' outputs: keeping them costs no more than running unpipelined
  would. Partitioned, a chip's memory is what recomputing saves (and what
  `gpipe.plan` plans for), and 1f1b is chosen to bound memory."""
  if spec.remat_policy is not None:
    return spec.remat_policy
  if (spec.runner.any_stage_range and spec.backward_schedule == 'reverse' and
      CallFlops(spec.schedule, theta, mb_leaves) >=
      MIN_FLOPS_PER_CALL_TO_SAVE_DOTS):
    return 'save_dots'
  return 'recompute'


def SkipsBubbles(spec: loop_spec.LoopSpec, theta, mb_leaves) -> bool:
  """Whether the reverse loop runs in phases: only where a runner computes
  a range of the stages (one device), as the skip_bubbles param says;
  None: under XLA (tf.function(jit_compile=True)) for a body of at least
  MIN_FLOPS_PER_CALL_TO_SKIP_BUBBLES. In a Session it measured no faster,
  and slower for small bodies."""
  if not spec.runner.any_stage_range:
    return False
  if spec.skip_bubbles is not None:
    return spec.skip_bubbles
  return (compiled_loops.UnderXla() and
          CallFlops(spec.schedule, theta, mb_leaves) >=
          MIN_FLOPS_PER_CALL_TO_SKIP_BUBBLES)


def CallFlops(sched, theta, mb_leaves):
  """A body call's FLOPs on one microbatch, as if each weight entered one
  multiply-add per position: 2 x positions x one layer's weights, where
  positions are all dims of a microbatch's largest input but its first
  (the examples) and its last (the features). The dots of dense layers,
  not those between activations (attention's scores); an over-estimate
  for lookups."""
  weights = sum(w.shape.num_elements() or 0 for w in tf.nest.flatten(theta)
                if w.dtype.is_floating) / sched.num_layers
  positions = max([x.shape[1:-1].num_elements() or 0 for x in mb_leaves
                   if x.shape.rank and x.shape.rank >= 2] or [1])
  return 2 * positions * weights


def IoKind(spec: loop_spec.LoopSpec):
  """The loop io's class (gpipe.pipeline.loop_io): with a FirstStageInput
  (1f1b with a LastStageLoss: no outputs) MadeAtStageZero, with stream_io
  StreamedIo, else WholeIo."""
  if spec.first_stage is not None:
    return loop_io.MadeAtStageZero
  if spec.stream_io:
    return streamed_io.StreamedIo
  return loop_io.WholeIo
