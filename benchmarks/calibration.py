"""Fits the planner's one calibration figure on a published run; predicts three.

    python -m benchmarks.calibration [--chips own|fewer] [--only 16B,32B]
        > calibration.md

Plans MaxText's four published TPU v5e runs (params/published_runs.py:
16B, 32B, 64B, 128B, each with its per-chip batch, sequence, remat and
FSDP x tensor layout) as `lm.MaxText<run>OnV5e<chips>`, on their own
v5e-256 (`--chips own`) or on fewer chips with the per-chip step kept
(`--chips fewer`, the default: params.published_runs.FEWER_CHIPS; 128B
there at 16 of its 64 layers, FEWER_LAYERS: all of them are out of this
host's memory to compile). Then it
fits the matrix units' efficiency (gpipe.plan.calibration.Fit) so that the
16B run's calibrated step gives its published 61.10 % MFU, and with that
one figure predicts the other three's MFU, printed beside what was
published, with the error. Exits 1 if a prediction misses its published
MFU by more than 10 % of it.

Beside it, the bracket's other end: the same fit and predictions with
every collective hidden (`MFU, all hidden`: the step is its compute). The
planner's schedule hides less than a TPU's latency-hiding scheduler may
(it gives each mesh axis one link); where the published MFU lies between
the two predictions, what the planner misses is the collectives' share.

Each row also gives what the prediction rests on, at the fitted
efficiency: the matrix work, the rest of the compute, HBM traffic and the
collectives (those a schedule of the step leaves, and all of them), and
the MFU MaxText's own formula counts for the planned step
(published_runs.CountedFlops) beside the planner's (3 x the forward
pass's FLOPs XLA counts). Every byte and FLOP is XLA:CPU's for the
partitioned module; the steps are the planner's model, the published
figures measured on TPUs.
"""

import argparse
import dataclasses
import sys
import time

GIB = 2**30


def _Report(name, chips, compile_timeout):
  """The CandidateReport of the registered run `name` planned on `chips`
  (its model's own candidate), and the wall seconds it took;
  `compile_timeout`: the seconds each of its compiles may take."""
  # pylint: disable=g-import-not-at-top
  from gpipe.plan import candidate as candidate_lib
  from gpipe.plan import roofline
  from gpipe.plan import targets
  from gpipe.plan import torus
  import params.lm
  # pylint: enable=g-import-not-at-top
  target = targets.ModelTarget(name)
  stack = target.stack_params
  # The links its mesh had on the run's own pod, whatever the chips planned.
  chip = dataclasses.replace(
      roofline.CHIPS['v5e'], links_per_axis=torus.LinksPerAxis(
          params.lm.model_registry.GetClass(name).PublishedMeshShape()))
  start = time.time()
  plan = candidate_lib.MakePlan(
      target, [targets.Candidate(stack.num_microbatches, 1,
                                 stack.remat_policy)], chips,
      chip, chip.hbm_bytes,
      log=lambda m: print(m, file=sys.stderr, flush=True),
      compile_timeout=compile_timeout)
  return plan.reports[0], time.time() - start


def _AllHiddenMfu(prediction, efficiency):
  """The calibrated MFU of a step's roofline.Prediction at `efficiency`
  with every collective hidden: the bracket's other end (the planner's
  schedule hides less). No schedule is run: nothing is left to hide."""
  return dataclasses.replace(
      prediction, matmul_efficiency=efficiency,
      hidden_calibrated_seconds=prediction.collective_seconds).mfu_calibrated


def _Row(run, name, report, efficiency, seconds, hidden_efficiency):
  """One Markdown row: the run, its planned figures at `efficiency`, and
  its MFU with every collective hidden at `hidden_efficiency`."""
  # pylint: disable=g-import-not-at-top
  import params.lm
  from params import published_runs
  # pylint: enable=g-import-not-at-top
  published = published_runs.RUNS[run]
  p = report.Predicted(efficiency)
  n = report.compiled.num_devices
  tokens = published.per_device_batch * published_runs.SEQ_LEN * n
  counted = published_runs.CountedFlops(
      params.lm.model_registry.GetClass(name).Dims(), tokens)
  counted_mfu = counted / (n * p.peak_flops * p.step_seconds_calibrated)
  error = p.mfu_calibrated / published.mfu - 1
  all_hidden = _AllHiddenMfu(p, hidden_efficiency)
  return (f'| {run} | {name} | {published.mfu:.2%} | '
          f'{p.mfu_calibrated:.2%} | {error:+.1%} | {all_hidden:.2%} | '
          f'{all_hidden / published.mfu - 1:+.1%} | {counted_mfu:.2%} | '
          f'{p.mfu_ceiling:.2%} | {p.step_seconds_calibrated:.2f} | '
          f'{p.matmul_seconds / efficiency:.2f} | '
          f'{p.compute_seconds - p.matmul_seconds:.3f} | '
          f'{p.memory_seconds:.2f} | '
          f'{p.collective_seconds - p.hidden_calibrated_seconds:.3f} of '
          f'{p.collective_seconds:.2f} | '
          f'{report.per_device_bytes["peak"] / GIB:.1f} | {seconds:.0f} |'
          ), abs(error)


def _Fitted(run, mfu_at, published_mfu):
  """The efficiency at which mfu_at(efficiency) of run `run` is its
  published MFU, or 1.0 where that is out of reach (said: the rows then
  show the step at peak, no fit)."""
  # pylint: disable=g-import-not-at-top
  from gpipe.plan import calibration
  # pylint: enable=g-import-not-at-top
  try:
    return calibration.Fit(mfu_at, published_mfu)
  except ValueError as e:
    print(f'Not fitted on {run}: {e}\n')
    return 1.0


def main(argv=None):
  parser = argparse.ArgumentParser(prog='python -m benchmarks.calibration')
  parser.add_argument('--chips', choices=('own', 'fewer'), default='fewer')
  parser.add_argument('--only', default='16B,32B,64B,128B',
                      help='runs to plan (the first is the fitted one, '
                      'unless --efficiency is given)')
  parser.add_argument('--efficiency', type=float, default=None,
                      help='predict at this efficiency instead of fitting '
                      'one (a previous run\'s)')
  parser.add_argument('--all_hidden_efficiency', type=float, default=None,
                      help='with --efficiency: the previous run\'s fit with '
                      'every collective hidden')
  parser.add_argument('--compile_timeout_minutes', type=float, default=30,
                      help='minutes each compile of a run may take')
  args = parser.parse_args(argv)
  # pylint: disable=g-import-not-at-top
  import gpipe  # pylint: disable=unused-import
  from gpipe.lingvo_support import flags_and_seeds
  flags_and_seeds.EnsureFlagsParsed()
  import params.lm  # pylint: disable=unused-import
  from params import published_runs
  # pylint: enable=g-import-not-at-top
  efficiency, worst = args.efficiency, 0.0
  hidden_efficiency = args.all_hidden_efficiency or args.efficiency
  header = ('| run | planned as | MFU published | MFU predicted | error | '
            'MFU, all hidden | error | MFU as MaxText counts | ceiling | '
            'step (s) | matrix work (s) | other compute (s) | HBM (s) | '
            'collectives left of all (s) | peak (GiB) | plan (s) |\n|' +
            '---|' * 16)
  for k, run in enumerate(args.only.split(',')):
    if args.chips == 'own':
      chips = published_runs.RUNS[run].chips
      name = 'lm.' + published_runs.RunName(run, chips)
    else:
      chips = published_runs.FEWER_CHIPS[run]
      name = 'lm.' + published_runs.FewerChipsName(run)
    report, seconds = _Report(name, chips,
                              60 * args.compile_timeout_minutes)
    fitted_here = efficiency is None
    if fitted_here:
      published_mfu = published_runs.RUNS[run].mfu
      efficiency = _Fitted(run, lambda e: report.Predicted(e).mfu_calibrated,
                           published_mfu)
      at_peak = report.Predicted(1.0)
      hidden_efficiency = _Fitted(
          run, lambda e: _AllHiddenMfu(at_peak, e), published_mfu)
      print(f'Matrix units\' efficiency from {run}: '
            f'{efficiency:.4f} of peak (the planner\'s step: the collectives '
            f'a schedule leaves); {hidden_efficiency:.4f} with every '
            'collective hidden.\n')
    if k == 0:
      print(header)
    row, error = _Row(run, name, report, efficiency, seconds,
                      hidden_efficiency)
    print(row, flush=True)
    if not fitted_here:
      worst = max(worst, error)
  print(f'\nLargest error of a prediction: {worst:.1%} (target: 10 %).')
  return 0 if worst <= 0.10 else 1


if __name__ == '__main__':
  sys.exit(main())
