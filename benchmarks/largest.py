"""Plans the largest registered LMs on their chips; prints and checks them.

    python -m benchmarks.largest [--meshes] [--only MODEL] > largest.md

For lm.LargestOn8x16GiB (8 chips) and lm.LargestOn32x16GiB (32 chips), each
of 16 GiB, TPU v5e roofline on the v5e slice of as many chips (2x4, 4x8:
`--slice`, so each layout's collectives drive the links its mesh has
there, gpipe.plan.torus), it runs `python -m gpipe.plan --json` on the
model's own candidate (with --meshes, on other meshes of the same chips
too, ranked by the predicted step: the targets are still checked on the
model's own mesh, and the planner's pick is said if it is another), and
the same model in the layouts a user who does not pipeline would pick on
the same chips (NO_PIPELINE: one stage, FSDP over the data axis, tensor
parallelism over the model axis), all in one table ranked by the
calibrated step, each with its ceiling, no-overlap and overlapped MFU
beside, and prints, beside GPipe's largest
Transformer on as many accelerators of 16 GB (Huang et al., 2019, Table
1): the bytes per chip, the predicted step in its parts (the model's own
compute, the bubble, the rest of the compute (a recomputed forward, the
optimizer), HBM traffic, collectives by mesh axis), and per mesh axis the
bytes a chip sends against the least it must (gpipe.plan.traffic_floor).
Then it checks the targets, and exits 1 if one fails:

    recommended, at a calibrated MFU of at least 50 % (the planner's
    prediction: gpipe.plan.calibration), peak at most 90 % of 16 GiB, weights per
    chip at most 1.1 x total / N, FLOPs per chip at most 1.1 x the
    unpartitioned step's / N, bubble at most 0.1, every set of mesh axes
    sending between 0.95 and 1.25 x its floor (less than 0.95 would be
    the planner's error: a floor is a lower bound), and at least 10.6 B
    (42 B) parameters. The model axis's floor without its recomputed
    forward is printed beside (what the recomputation costs), not
    checked.

Then the 6.7B flagships' models on a mesh (FLAGSHIPS: lm.CopyLMPod8x2OnMesh,
Adam on 8 x 32 GiB v6e; lm.CopyLMPod8x2AdafactorOnMesh on 8 x 16 GiB v5e),
each pipelined as its model is beside its no-pipeline layouts, in one
table (not checked).

Every byte and FLOP figure is XLA's for the partitioned module compiled for
CPU devices; the step, its parts and the MFU are the planner's roofline
model of a v5e chip, predicted, not measured. Each plan compiles the whole
training step from shapes alone: about 8 minutes and 8 GB of host memory
for the 8-chip model's candidate, more for the 32-chip one's.
"""

import argparse
import sys

from benchmarks import flagships

GIB = 2**30
HBM_GIB = 16
MODELS = (
    # (model, chips, GPipe's parameters on as many 16 GB accelerators,
    #  the least parameters a largest model must have, other meshes)
    ('lm.LargestOn8x16GiB', 8, 5.3e9, 10.6e9, ('2x1x4',)),
    ('lm.LargestOn32x16GiB', 32, 21.0e9, 42e9, ('16x1x2', '32x1x1')),
)
# The v5e slice of each count of chips (its ICI dimensions; none closes
# below 16: gpipe.plan.torus gives each layout's links per mesh axis).
SLICES = {8: '2x4', 32: '4x8'}
# The layouts a user who does not pipeline would pick on the same chips:
# one stage of every block, FSDP over the data axis and tensor parallelism
# over the model axis, each microbatch one row a data replica (the least
# memory) ({model: ((mesh, num_microbatches), ...)}). Not the whole batch
# at once (M=1, as MaxText's runs step: FSDP gathers every weight again for
# each microbatch): the 8-chip model's did not compile in 30 minutes here
# (2026-12-02; gpipe.plan --compile_timeout_minutes gives it more).
NO_PIPELINE = {
    'lm.LargestOn8x16GiB': (('1x4x2', 8), ('1x2x4', 16)),
    'lm.LargestOn32x16GiB': (('1x8x4', 32),),
}
# The 6.7B flagships' models (benchmarks.flagships) on a pod mesh, planned
# on 8 chips beside the layouts a user who does not pipeline would pick:
# (model, TPU, HBM GiB, ((mesh, num_microbatches), ...)); not checked.
FLAGSHIPS = (
    ('lm.CopyLMPod8x2OnMesh', 'v6e', 32, (('1x4x2', 16),)),
    ('lm.CopyLMPod8x2AdafactorOnMesh', 'v5e', 16, (('1x4x2', 8),)),
)
# Each compile's limit: the 32-chip model's no-pipeline layout's
# partitioned step took 38 minutes to build and compile here (2026-12-03), over
# gpipe.plan's default 30.
COMPILE_TIMEOUT = ['--compile_timeout_minutes', '60']
TARGETS = dict(mfu=0.5, peak=0.9, weights=1.1, flops=1.1, bubble=0.1,
               least_floor=0.95, floor=1.25)


def _Checked(plan, own_mesh):
  """The index of the candidate the targets are checked on: with
  --meshes (own_mesh given) the one on the model's own mesh, whichever
  the planner recommends; else the recommended one. None if none is."""
  if own_mesh is None:
    return plan['recommended']
  return next((i for i, c in enumerate(plan['candidates'])
               if list(c['mesh_shape']) == list(own_mesh)), None)


def _Checks(plan, checked, num_devices, least_params):
  """[(what, value, bound, ok)] for candidate `checked` (an index)."""
  if checked is None or plan['recommended'] is None:
    return [('planned and recommended', 'none', 'one', False)]
  c = plan['candidates'][checked]
  b = c['per_device_bytes']
  weights_share = b['weights'] / (plan['total_weight_bytes'] / num_devices)
  params = plan['total_weight_bytes'] / 4
  checks = [
      ('parameters (B)', params / 1e9, least_params / 1e9,
       params >= least_params),
      ('predicted MFU (calibrated)', c['predicted']['mfu_calibrated'],
       TARGETS['mfu'], c['predicted']['mfu_calibrated'] >= TARGETS['mfu']),
      ('peak / 16 GiB', b['peak'] / (HBM_GIB * GIB), TARGETS['peak'],
       b['peak'] <= TARGETS['peak'] * HBM_GIB * GIB),
      ('weights per chip / (total / N)', weights_share, TARGETS['weights'],
       weights_share <= TARGETS['weights']),
      ('FLOPs per chip / (unpartitioned / N)', c['flops_ratio'],
       TARGETS['flops'], c['flops_ratio'] <= TARGETS['flops']),
      ('bubble', c['bubble_fraction'], TARGETS['bubble'],
       c['bubble_fraction'] <= TARGETS['bubble']),
  ]
  for axes, ratio in c['collective_sent_over_floor'].items():
    checks.append((f'{axes}: sent / floor',
                   float('inf') if ratio is None else ratio,
                   f"{TARGETS['least_floor']}-{TARGETS['floor']}",
                   ratio is not None and
                   TARGETS['least_floor'] <= ratio <= TARGETS['floor']))
  return checks


def _Candidates(plans):
  """Every candidate of `plans` (the same model on the same chips),
  fastest calibrated step first, as table rows."""
  rows = ['| mesh | FSDP | M | R | remat | peak GiB | fits | step s | MFU | '
          'ceiling | no overlap | overlapped |', '|---' * 12 + '|']
  candidates = [(c, i == plan['recommended']) for plan in plans
                for i, c in enumerate(plan['candidates'])]
  percent = lambda f: f'{100 * f:.1f} %'
  for c, picked in sorted(
      candidates, key=lambda x: x[0]['predicted']['step_seconds_calibrated']):
    p = c['predicted']
    rows.append(
        f"| {'x'.join(map(str, c['mesh_shape']))} | "
        f"{','.join(map(str, c.get('fsdp_mesh_dims', []))) or '-'} | "
        f"{c['num_microbatches']} | {c['circular_repeat']} | "
        f"{c['remat_policy']} | {c['per_device_bytes']['peak'] / GIB:.2f} | "
        f"{'yes' if c['fits'] else 'NO'} | "
        f"{p['step_seconds_calibrated']:.2f}{'*' if picked else ''} | "
        f"{percent(p['mfu_calibrated'])} | {percent(p['mfu_ceiling'])} | "
        f"{percent(p['mfu'])} | {percent(p['mfu_overlapped'])} |")
  return rows


def _StepParts(c):
  """The predicted step in its parts, and the collectives by axes."""
  p = c['predicted']
  rows = ['| part | seconds |', '|---|---|']
  for what, key in (('compute', 'compute_seconds'),
                    ('of it the model', 'model_compute_seconds'),
                    ('of it the bubble', 'bubble_seconds'),
                    ('of it recomputation and other',
                     'other_compute_seconds'),
                    ('HBM traffic (overlaps compute)',
                     'memory_traffic_seconds'),
                    ('collectives (overlap nothing)', 'collective_seconds'),
                    ('step = max(compute, HBM) + collectives',
                     'step_seconds'),
                    ('of the collectives, hidden by a schedule at peak',
                     'hidden_collective_seconds'),
                    ('overlapped step, at peak', 'step_seconds_overlapped'),
                    ('matrix work at peak', 'matmul_seconds'),
                    ('compute, the matrix work at the fitted efficiency',
                     'compute_seconds_calibrated'),
                    ('of the collectives, hidden by a schedule at that '
                     'speed', 'hidden_calibrated_seconds'),
                    ('calibrated step (the prediction, checked)',
                     'step_seconds_calibrated'),
                    ('ceiling: max(compute, HBM) at peak',
                     'step_seconds_ceiling')):
    rows.append(f'| {what} | {p[key]:.3f} |')
  rows.append(f"| MFU: calibrated / ceiling / no overlap / overlapped | "
              f"{100 * p['mfu_calibrated']:.1f} % / "
              f"{100 * p['mfu_ceiling']:.1f} % / {100 * p['mfu']:.1f} % / "
              f"{100 * p['mfu_overlapped']:.1f} % |")
  return rows


def _Axes(c, link_bandwidth):
  """Per set of mesh axes: sent, its floor, the ratio, the floor without
  the recomputed forward's part and the ratio to it, the seconds over one
  link (the candidate's links per axis divide them: c['links_per_axis'])."""
  rows = ['| mesh axes | sent per step | floor | sent / floor | '
          'floor without recompute | sent / that | seconds over one link |',
          '|---|---|---|---|---|---|---|']
  floors = c['collective_floor_per_step']
  without = c.get('collective_sent_over_floor_without_recompute', {})
  shown = lambda b: '-' if b is None else f'{b / GIB:.3f} GiB'
  ratio_shown = lambda r: 'no floor' if r is None else f'{r:.2f}'
  for axes, kinds in c['collective_bytes_sent_per_step'].items():
    sent = sum(kinds.values())
    floor = floors.get(axes, {})
    rows.append(
        f'| {axes} | {sent / GIB:.3f} GiB | {shown(floor.get("bytes"))} | '
        f"{ratio_shown(c['collective_sent_over_floor'].get(axes))} | "
        f'{shown(floor.get("bytes_without_recompute"))} | '
        f'{ratio_shown(without.get(axes))} | '
        f'{sent / link_bandwidth:.3f} |')
  return rows


def _PrintChecked(plan, checked):
  """The checked candidate in its parts (and the planner's pick, if
  another)."""
  best = plan['recommended']
  if best is not None and best != checked:
    c = plan['candidates'][best]
    print(f"\nThe planner recommends mesh "
          f"{'x'.join(map(str, c['mesh_shape']))}: predicted "
          f"{c['predicted']['step_seconds_calibrated']:.2f} s, "
          f"{100 * c['predicted']['mfu_calibrated']:.1f} % MFU "
          "(calibrated), peak "
          f"{c['per_device_bytes']['peak'] / GIB:.2f} GiB. The targets "
          "below are checked on the model's own mesh.")
  if checked is None:
    return
  c = plan['candidates'][checked]
  b = c['per_device_bytes']
  print(f"\n{'Recommended' if checked == best else 'Its own mesh'}: mesh "
        f"{'x'.join(map(str, c['mesh_shape']))}, "
        f"M={c['num_microbatches']}, R={c['circular_repeat']}, "
        f"{c['remat_policy']}, {c['backward_schedule']}"
        f"{' + stream_io' if c['stream_io'] else ''}. Bytes per chip: "
        f"weights {b['weights'] / GIB:.2f} GiB, optimizer "
        f"{b['optimizer'] / GIB:.3f} GiB, temporaries "
        f"{b['temp'] / GIB:.2f} GiB (of them stored for the backward "
        f"{c['stored_activation_bytes'] / GIB:.2f} GiB), peak "
        f"{b['peak'] / GIB:.2f} GiB.\n")
  print('\n'.join(_StepParts(c)) + '\n')
  print(f"Links per mesh axis on the {SLICES[plan['num_devices']]} slice: "
        f"{'x'.join(map(str, c['links_per_axis'])) or '1 each'}.\n")
  link = plan['tpu']['ici_bandwidth'] / (2 * plan['tpu']['ici_ports'])
  print('\n'.join(_Axes(c, link)) + '\n')


def _Report(model, num_devices, gpipe_params, least_params, meshes):
  """Prints one model's section; returns whether every check holds."""
  print(f'## {model} on {num_devices} x {HBM_GIB} GiB (TPU v5e roofline)\n')
  plan, error, seconds = flagships.Plan(
      model, 'v5e', HBM_GIB, num_devices=num_devices,
      extra=['--slice', SLICES[num_devices], *COMPILE_TIMEOUT] +
      (['--mesh', ','.join(meshes)] if meshes else []))
  if plan is None:
    print(f'Not planned: {error}\n')
    return False
  params = plan['total_weight_bytes'] / 4  # float32 weights
  print(f'{params / 1e9:.1f} B parameters ({params / gpipe_params:.2f} x '
        f"GPipe's {gpipe_params / 1e9:.1f} B on {num_devices} accelerators "
        f'of 16 GB); planned in {seconds:.0f} s.\n')
  plans = [plan] + _NoPipelinePlans(model, num_devices,
                                    NO_PIPELINE.get(model, ()))
  print('\n'.join(_Candidates(plans)))
  for reason in plan['skipped']:
    print(f"\nskipped {'x'.join(map(str, reason['mesh_shape'] or []))}: "
          f"{reason['reason']}")
  checked = _Checked(plan, meshes and [int(n) for n in meshes[0].split('x')])
  _PrintChecked(plan, checked)
  print('| check | value | bound | holds |\n|---|---|---|---|')
  checks = _Checks(plan, checked, num_devices, least_params)
  for what, value, bound, ok in checks:
    shown = value if isinstance(value, str) else f'{value:.3f}'
    print(f"| {what} | {shown} | {bound} | {'yes' if ok else 'NO'} |")
  print()
  return all(ok for *_, ok in checks)


def _FlagshipReport(model, tpu, hbm_gib, layouts):
  """Prints a flagship's section: its own pipelined candidate beside
  `layouts` without a pipeline, one table."""
  print(f'## {model} on 8 x {hbm_gib} GiB (TPU {tpu} roofline, '
        f'{SLICES[8]} slice)\n')
  plan, error, seconds = flagships.Plan(
      model, tpu, hbm_gib, extra=['--slice', SLICES[8], *COMPILE_TIMEOUT])
  if plan is None:
    print(f'Not planned: {error}\n')
    return
  print(f"{plan['total_weight_bytes'] / 4 / 1e9:.1f} B parameters; its own "
        f'candidate planned in {seconds:.0f} s.\n')
  plans = [plan] + _NoPipelinePlans(model, 8, layouts, tpu, hbm_gib)
  print('\n'.join(_Candidates(plans)) + '\n')


def _NoPipelinePlans(model, num_devices, layouts, tpu='v5e',
                     hbm_gib=HBM_GIB):
  """The model planned in `layouts` ((mesh, num_microbatches), one plan
  each: their microbatches differ); a layout that cannot be planned is
  said."""
  plans = []
  for mesh, microbatches in layouts:
    plan, error, seconds = flagships.Plan(
        model, tpu, hbm_gib, num_devices=num_devices,
        extra=['--slice', SLICES[num_devices], *COMPILE_TIMEOUT,
               '--mesh', mesh, '--fsdp_mesh_dim', '1', '--num_microbatches',
               str(microbatches), '--circular_repeat', '1'])
    if plan is None:
      print(f'No pipeline on {mesh}: not planned: {error}\n')
    else:
      print(f'No pipeline on {mesh} (FSDP over axis 1, M={microbatches}): '
            f'planned in {seconds:.0f} s.')
      plans.append(plan)
  print()
  return plans


def main(argv=None):
  parser = argparse.ArgumentParser(prog='python -m benchmarks.largest',
                                   description=__doc__.split('\n\n')[0])
  parser.add_argument('--only',
                      choices=[m[0] for m in MODELS + FLAGSHIPS],
                      help='plan this model only')
  parser.add_argument('--meshes', action='store_true',
                      help='also plan each model on other meshes of its '
                      'chips (each a whole compile: several times longer)')
  args = parser.parse_args(argv)
  ok = True
  for model, num_devices, gpipe_params, least, meshes in MODELS:
    if args.only in (None, model):
      own = None
      if args.meshes:
        own_mesh = 'x'.join(map(str, _OwnMesh(model)))
        own = [own_mesh] + [m for m in meshes if m != own_mesh]
      ok &= _Report(model, num_devices, gpipe_params, least, own)
      sys.stdout.flush()
  for model, tpu, hbm_gib, layouts in FLAGSHIPS:
    if args.only in (None, model):
      _FlagshipReport(model, tpu, hbm_gib, layouts)
      sys.stdout.flush()
  return 0 if ok else 1


def _OwnMesh(model):
  """The registered model's own [stages, data, model] mesh."""
  import params.lm  # pylint: disable=g-import-not-at-top
  return params.lm.model_registry.GetClass(model).MESH.device_mesh.shape


if __name__ == '__main__':
  sys.exit(main())
