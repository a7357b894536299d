"""Will it fit? Per-chip memory, FLOPs and collectives of your training step.

    python -m gpipe.plan --model lm.CopyLMPod8x2 --num_devices 8 \\
        --num_microbatches 16,32 --circular_repeat 1,2 \\
        [--remat_policy recompute,save_all] [--json]
    python -m gpipe.plan --params my_module.PipelineParams \\
        --input_shape 64,1024 --num_devices 4

For each candidate (num_microbatches, circular_repeat, remat_policy) the
planner lowers the whole training step (forward, loss, backward, the
optimizer update with its slots) from shapes alone, so no weight is ever
allocated; XLA's SPMD partitioner splits it for N virtual CPU devices and
XLA compiles it without running it. Per step:

    params --build in a scratch graph (targets)--> TrainStep (model_step,
      the task's optimizer) --TensorSpecs--> HLO --partition for N devices,
      compile (candidate)--> what XLA says --roofline--> predicted step
      time --> Plan (report): table, JSON, recommendation

Measured by XLA (the compiled module): bytes per device of weights and
optimizer slots (each parameter's per-device shape), temporaries (buffer
assignment: activations and workspace) and the peak; FLOPs and bytes
accessed per device (cost analysis, loops counted per iteration) against
the same step compiled unpartitioned for one device; every collective and
its bytes. From the schedule (gpipe.schedule): iterations and bubble
fraction. Predicted (a model, not a measurement): the step time on a TPU
generation, and so the recommendation: the fitting candidate, split as
intended, with the lowest predicted step time.

Varying circular_repeat keeps the model's depth: a stage body with a
`--depth_param` (default `num_blocks`, e.g. params.lm.StageBlocks) gets
depth * R0 / R blocks; a body without one plans only its own R.

The parts, from the top down (each imports only parts below it):
  cli         the command line (`python -m gpipe.plan`)
  flags       the flags, read before TensorFlow loads
  plot        --plot: each candidate's bytes per chip, drawn
  candidate   one candidate lowered, partitioned and compiled; its report
  report      every candidate's report, the table, JSON, recommendation
  text_lines  the report's prose in lines of a fixed width
  targets     what to plan: a registered Lingvo model, or PipelinedLayer
              Params on inputs of given shapes; candidates (M, R, policy)
  model_flops the model's work MFU counts (its forward pass compiled alone)
  step_time   what a candidate's predicted step rests on, from its module
  loops       what the compiled module's while loops compute and hold
  overlap     what the compute beside each collective hides, list
              scheduled: the overlapped step
  collectives what a chip sends over each mesh axis in a step
  traffic_floor  the least each mesh axis must carry, from the model's
              shapes
  roofline    the TPU generations and the step-time model
  torus       the links a collective along each mesh axis drives, from
              where the mesh lies on the slice (--slice)
  calibration the matrix units' efficiency, fitted on a measured run

The step itself (where a model keeps its stack, the whole training step as
a function of tensors, its optimizer) is gpipe.model_step's: the
partitioning check runs the same step (gpipe.xla.check_model).

Importing this package loads no TensorFlow: its names (MakePlan,
LayerTarget, Candidate, ...) load their module when first used.
"""

import importlib

_EXPORTS = {
    'PlanError': 'targets',
    'Candidate': 'targets',
    'ModelTarget': 'targets',
    'LayerTarget': 'targets',
    'CandidateReport': 'candidate',
    'PlanCandidate': 'candidate',
    'MakePlan': 'candidate',
    'Plan': 'report',
    'main': 'cli',
}


def __getattr__(name):
  if name in _EXPORTS:
    module = importlib.import_module(f'{__name__}.{_EXPORTS[name]}')
    return getattr(module, name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
