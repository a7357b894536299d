"""Plausible bugs, each put into a fresh copy of the checkout: the suite must
catch every one.

Each entry below is one bug of a kind that has slipped through test suites
(an off-by-one in a stage or microbatch index, two orders swapped, a
dropped gradient term, a wrong repeat, a wrong fit), written as an exact
replacement in one file, with the tests that should catch it. For each, the
checkout's files (tracked and new, as `git ls-files` lists them) are copied
to a temporary directory, the replacement is made there, and those tests
run in the copy; the bug is caught when they fail. The tests are first run
unchanged (in a copy too): a test that fails anyway catches nothing.

    .venv/bin/python tools/mutants.py            # every bug (about 10 min)
    .venv/bin/python tools/mutants.py --list     # what is in the set
    .venv/bin/python tools/mutants.py --only plan-fit-on-temp,decode-stage-0
    .venv/bin/python tools/mutants.py --quick    # survivors: whole suite

With --quick, a bug its named tests miss is run against the whole suite
(`tests/`, stopping at the first failure; the unchanged suite is run once
first, if any bug needs it): caught there, its entry should name the test
that caught it.

Exits 1 if a bug got through, or if a replacement no longer matches the
code (update the entry with the code). When a feature lands, add the bugs
its tests are there to catch; when a bug gets through, add it here with
the test that now catches it.
"""

import argparse
import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Bug:
  name: str
  why: str  # the plausible mistake, in a few words
  path: str
  old: str
  new: str
  tests: tuple  # pytest arguments: files, node ids, -k expressions


BUGS = (
    # -- The planner's fit and pick. ----------------------------------------
    Bug('plan-fit-on-temp', 'fits compares the temporaries, not the peak',
        'gpipe/plan/candidate.py',
        'return self.compiled.peak_bytes <= self.hbm_bytes',
        "return self.compiled.memory['temp_size_in_bytes'] <= self.hbm_bytes",
        ('tests/plan/plan_test.py', '-k', 'fits or recommend')),
    Bug('plan-pick-ignores-fit', 'the recommendation ignores fits',
        'gpipe/plan/report.py',
        'i for i, r in enumerate(self.reports) if r.fits and not r.Problems()',
        'i for i, r in enumerate(self.reports) if not r.Problems()',
        ('tests/plan/plan_test.py', '-k', 'fits or recommend')),
    Bug('plan-pick-slowest', 'max for min', 'gpipe/plan/report.py',
        'return min(ok, key=lambda i: self.reports[i].prediction.step_seconds)',
        'return max(ok, key=lambda i: self.reports[i].prediction.step_seconds)',
        ('tests/plan/plan_test.py', '-k', 'fits or recommend')),
    Bug('plan-clip-dropped', "the planned update ignores the gradient clip",
        'gpipe/model_step/train_step.py',
        'scale = _ClipScale(grads, self.clip_norm) if self.clip_norm > 0 '
        'else None',
        'scale = None',
        ('tests/plan/plan_step_test.py', '-k', 'planned_update')),
    # -- What a step sends, against its floors. -----------------------------
    Bug('plan-nested-loop-once',
        'a collective in a nested loop counted once per outer iteration',
        'gpipe/plan/collectives.py',
        '    runs = Runs(c) * (1 if c.loop < 0 else',
        '    runs = 1 * (1 if c.loop < 0 else',
        ('tests/plan/collectives_test.py', '-k', 'nested')),
    Bug('widened-without-narrowing',
        'every float32 collective fed by a bfloat16 convert halved',
        'gpipe/xla/widening.py',
        "        self._Narrowed(computation, match.group('name'),\n"
        '                       k if tuple_result else None)',
        '        k >= 0',
        ('tests/xla/hlo_text_test.py', '-k', 'narrows')),
    Bug('widened-where-a-fusion-narrows-some-uses',
        "halved where a fusion narrows one of the operand's positions, not "
        'each', 'gpipe/xla/widening.py',
        'return bool(positions) and all(',
        'return bool(positions) and any(',
        ('tests/xla/widening_test.py',)),
    Bug('widened-where-a-fusion-parameter-has-mixed-uses',
        "a fusion's bfloat16 result taken for its parameters' narrowing (a "
        'parameter also read in float32 inside)', 'gpipe/xla/widening.py',
        'self._Narrowed(callee.group(1), params[k], None, depth + 1)',
        "self._defs[callee.group(1)][None][0].lstrip().startswith('bf16')",
        ('tests/xla/widening_test.py',)),
    Bug('floor-table-gradient-over-its-gather',
        "a table's gradient floor on the axes it is gathered over",
        'gpipe/plan/traffic_floor.py',
        '  sums, axes = _Devices(summed, mesh_shape, names)',
        '  sums, axes = _Devices(gathered, mesh_shape, names)',
        ('tests/plan/collectives_test.py', '-k', 'gradient_is_summed')),
    Bug('stage-ends-parts-strided',
        "the ends' gradient exchanged in strided parts, not each device's "
        'block',
        'gpipe/pipeline/stage_ends.py',
        '                         [num_stages, last // num_stages])\n'
        '      parts = placement.SplitStages(parts, len(shape))',
        '                         [last // num_stages, num_stages])\n'
        '      parts = placement.SplitStages(parts, len(shape) + 1)',
        ('tests/pipeline/stage_ends_test.py', '-k', 'exchange')),
    # -- What the compute beside a collective hides. ------------------------
    Bug('overlap-hidden-by-what-feeds-it',
        "a collective hidden by the compute that feeds it (its operands' "
        'side of the graph not read)',
        'gpipe/xla/dependencies.py',
        '    tied = _Reach(name, operands) | _Reach(name, users) | {name}',
        '    tied = _Reach(name, users) | {name}',
        ('tests/plan/overlap_test.py', 'tests/xla/dependencies_test.py')),
    Bug('overlap-work-shared-twice',
        'two collectives each hidden in full behind the same dot',
        'gpipe/plan/overlap.py',
        "    Edge(('work', key), 'sink', t)",
        "    Edge(('work', key), 'sink', t * len(key))",
        ('tests/plan/overlap_test.py',)),
    # -- Decoding from per-stage states. ------------------------------------
    Bug('decode-stage-0', "every stage gets stage 0's state",
        'gpipe/microbatch.py',
        'index = np.asarray([[(m, s) for s, m in enumerate(per_stage)]',
        'index = np.asarray([[(m, 0) for s, m in enumerate(per_stage)]',
        ('tests/decoding_test.py', '-k', 'own_cache or padding_follows')),
    Bug('decode-states-split-contiguous',
        'states split into contiguous rows, the inputs strided',
        'gpipe/microbatch.py',
        '  perm = [1, 0] + list(range(2, x.shape.rank))\n'
        '  mb = ToMicrobatches(tf.transpose(x, perm), num_microbatches)\n'
        '  return tf.transpose(mb, [0, 2, 1] + list(range(3, mb.shape.rank)))',
        '  s, b, *rest = x.shape.as_list()\n'
        '  mb = tf.reshape(x, [s, num_microbatches, b // num_microbatches] +\n'
        '                  rest)\n'
        '  return tf.transpose(mb, [1, 0] + list(range(2, mb.shape.rank)))',
        ('tests/decoding_test.py', '-k', 'own_cache or padding_follows')),
    # -- What TensorBoard and the schedule picture show. --------------------
    Bug('picture-rows-flipped',
        "stage 0's cells drawn in the last stage's row",
        'gpipe/schedule/plot.py', 'y = s_count - 1 - stage', 'y = stage',
        ('tests/schedule/schedule_cli_test.py', '-k', 'diagram')),
    Bug('picture-colour-off-by-one', 'cells coloured by the next microbatch',
        'gpipe/schedule/plot.py', 'facecolor=colors(entry[0] % 20)',
        'facecolor=colors((entry[0] + 1) % 20)',
        ('tests/schedule/schedule_cli_test.py', '-k', 'diagram')),
    Bug('summary-stages-reversed', "stage i's summary under stage S-1-i",
        'gpipe/pipeline/side_outputs.py',
        "py_utils.AddTpuSummaryTensor(f'{name}/stage_{stage}', mean[stage],",
        "py_utils.AddTpuSummaryTensor(f'{name}/stage_{stage}',\n"
        '                                   mean[num_stages - 1 - stage],',
        ('tests/apps/tensorboard_test.py',)),
    Bug('tensorboard-step-before-update',
        'scalars labelled with the step before the update',
        'gpipe/apps/trainer.py', 'events.Write(done, metrics, result.seconds)',
        'events.Write(step, metrics, result.seconds)',
        ('tests/apps/tensorboard_test.py',)),
    # -- Side outputs against the plain stack. ------------------------------
    Bug('aux-mean-and-sum-swapped', "'mean' sums, 'sum' averages",
        'gpipe/pipeline/side_outputs.py', "  if accumulation == 'mean':",
        "  if accumulation == 'sum':",
        ('tests/training_semantics_test.py', '-k',
         'aux_losses_and_summaries_equal and S1-M3')),
    Bug('1f1b-drops-aux-gradient', "the aux loss's gradient dropped (1f1b)",
        'gpipe/pipeline/one_f_one_b/gradient_loop.py',
        'aux=tf.fill([num_stages], consts.d_aux),',
        'aux=tf.zeros([num_stages]),',
        ('tests/training_semantics_test.py', 'tests/training_state_test.py',
         '-k', '1f1b and graph')),
    # -- Schedule and layout. -----------------------------------------------
    Bug('circular-wrong-repeat', 'a circular stage runs the next repeat',
        'gpipe/schedule/__init__.py',
        'return (t // self.segment) % self.circular_repeat',
        'return (t // self.segment + 1) % self.circular_repeat',
        ('tests/training_semantics_test.py', '-k',
         'aux_losses_and_summaries_equal and R2 and graph')),
    Bug('inputs-split-contiguous',
        'the inputs split into contiguous rows, the outputs strided',
        'gpipe/microbatch.py',
        '  reshaped = tf.reshape(x, [batch // num_microbatches, '
        'num_microbatches] + rest)\n'
        '  return tf.transpose(reshaped, [1, 0] + '
        'list(range(2, x.shape.rank + 1)))',
        '  return tf.reshape(x, [num_microbatches, batch // num_microbatches]'
        ' + rest)',
        ('tests/training_semantics_test.py', '-k',
         'aux_losses_and_summaries_equal and S3-M2 and graph')),
    Bug('skip-bubbles-computes-all', 'the fill and drain run every stage',
        'gpipe/pipeline/pipeline_loop.py',
        '      spec, iteration.StageRange.Of(phase, spec.schedule.num_stages),',
        '      spec, iteration.StageRange.All(spec.schedule.num_stages),',
        ('tests/pipeline/skip_bubbles_test.py', '-k', 'fill_and_drain')),
    Bug('skip-bubbles-first-stages-weights',
        "a phase's loop takes the first stages' weights, not its own",
        'gpipe/pipeline/pipeline_loop.py',
        'loop_theta = NestedMap(weights=stages.Narrow(loop_theta.weights),',
        'loop_theta = NestedMap(weights=nest.MapTensors(\n'
        '      lambda w: w[:stages.count], loop_theta.weights),',
        ('tests/pipeline/skip_bubbles_test.py', '-k',
         'equals_the_reference and S4')),
    Bug('skip-bubbles-default-never',
        'skip_bubbles=None never skips bubbles',
        'gpipe/pipeline/loop_choices.py',
        '  return (compiled_loops.UnderXla() and',
        '  return (False and compiled_loops.UnderXla() and',
        ('tests/pipeline/skip_bubbles_test.py', '-k', 'none_skips')),
    Bug('remat-default-saves-partitioned',
        'remat_policy=None keeps the dots partitioned too',
        'gpipe/pipeline/loop_choices.py',
        "  if (spec.runner.any_stage_range and spec.backward_schedule == "
        "'reverse' and",
        "  if (spec.backward_schedule == 'reverse' and",
        ('tests/pipeline/remat_default_test.py',)),
    Bug('remat-default-never-saves',
        'remat_policy=None never keeps the dots',
        'gpipe/pipeline/loop_choices.py',
        "    return 'save_dots'\n  return 'recompute'",
        "    return 'recompute'\n  return 'recompute'",
        ('tests/pipeline/remat_default_test.py',)),
    Bug('remat-default-stores-in-eval',
        'remat_policy=None stores the dots in eval too',
        'gpipe/pipeline/param_checks.py',
        '  if asked is None and do_eval:',
        '  if asked is None and do_eval and False:',
        ('tests/pipeline/remat_default_test.py',)),
    # -- One iteration, one path. -------------------------------------------
    Bug('buffer-step-rotates-backwards',
        'the buffer handed to the stage before, not the stage after',
        'gpipe/pipeline/rotation.py',
        'RotateStages(x, self._shift, self._place.splits_stage_dim)',
        'RotateStages(x, -self._shift, self._place.splits_stage_dim)',
        ('tests/pipeline/pipeline_loop_test.py', '-k', 'in_order')),
    Bug('iteration-never-reads-fresh',
        'stage 0 keeps the rotated buffer where it should read a microbatch',
        'gpipe/pipeline/iteration.py',
        'io.StageInputs(row.reads,',
        'io.StageInputs(tf.zeros_like(row.reads),',
        ('tests/pipeline/pipeline_loop_test.py', '-k', 'in_order')),
    Bug('scoring-cell-scores-repeat-0',
        'the last stage scores its first repeat, not its last',
        'gpipe/pipeline/one_f_one_b/cell.py',
        'tf.equal(row.repeat, sched.circular_repeat - 1)',
        'tf.equal(row.repeat, 0)',
        ('tests/pipeline/stage_ends_test.py', '-k', 'sweep_graph')),
    Bug('loop-choices-ignore-stream-io',
        'stream_io=True runs the whole-batch io',
        'gpipe/pipeline/loop_choices.py',
        '  if spec.stream_io:\n    return streamed_io.StreamedIo',
        '  if False:\n    return streamed_io.StreamedIo',
        ('tests/pipeline/pipeline_memory_test.py', '-k', 'stream_io')),
    Bug('layer-runs-the-other-backward',
        "backward_schedule='1f1b' runs the reverse loop, and the reverse 1f1b",
        'gpipe/layers.py',
        "run = (one_f_one_b.RunOneFOneB if spec.backward_schedule == '1f1b'",
        "run = (one_f_one_b.RunOneFOneB if spec.backward_schedule == 'reverse'",
        ('tests/pipeline/pipeline_memory_test.py',)),
    Bug('made-after-not-zero',
        "a gradient accumulator's zeros start at 0.001",
        'gpipe/loops/made_after.py',
        'return tf.cast(0.0 * tf.reduce_sum(tf.cast(t, tf.float32)), dtype)',
        'return tf.cast(1e-3 + 0.0 * tf.reduce_sum(tf.cast(t, tf.float32)),'
        ' dtype)',
        ('tests/pipeline/one_f_one_b_test.py', '-k', 'sweep_graph')),
    # -- Weight gradients summed after the loop. -----------------------------
    Bug('deferred-dots-row-off-by-one',
        "a deferred weight gradient's operands written a row early",
        'gpipe/loops/deferred_dots.py',
        '[tensor_lists.SetEntry(l, t, x) for l, x in zip(lists, operands)]',
        '[tensor_lists.SetEntry(l, tf.maximum(t - 1, 0), x)\n'
        '             for l, x in zip(lists, operands)]',
        ('tests/loops/deferred_dots_test.py',
         'tests/pipeline/skip_bubbles_test.py', '-k',
         'unrolled_loop or deferred_weight_gradients_equal')),
    Bug('deferred-dots-weight-operand',
        'an operand the same every iteration kept per iteration',
        'gpipe/loops/deferred_dots.py',
        'if not (a.name in per_iteration and b.name in per_iteration):',
        'if not (a.name in per_iteration or b.name in per_iteration):',
        ('tests/loops/deferred_dots_test.py',)),
    # -- Sequence-parallel blocks. -------------------------------------------
    Bug('seqpar-scatter-sums-whole',
        "a row-parallel matmul's partial sums all-reduced whole, then sliced",
        'params/sequence_parallel.py',
        '    return SplitSequence(x, device_mesh), Grad\n\n  return Scatter(x)',
        '    return _Whole(x, device_mesh), Grad\n\n  return Scatter(x)',
        ('tests/sequence_parallel_test.py', '-k', 'gather_and_scatter')),
    Bug('seqpar-split-on-features',
        'the residual stream split and gathered along its features',
        'params/sequence_parallel.py',
        '_TIME = 1  # of the blocks\' activations [batch, time, dim]',
        '_TIME = 2  # of the blocks\' activations [batch, time, dim]',
        ('tests/sequence_parallel_test.py', '-k', 'gather_and_scatter')),
    # -- Delayed sends. -------------------------------------------------------
    Bug('delayed-handoff-sends-at-once',
        'the outputs rotated in the iteration that makes them, hop 2 or not',
        'gpipe/pipeline/rotation.py',
        'return [self.Rotate(x) for x in in_flight] + list(outputs)',
        'return [self.Rotate(x) for x in outputs] + list(outputs)',
        ('tests/pipeline/delayed_sends_test.py', '-k', 'sweep')),
    Bug('delayed-backward-wave-at-once',
        "the 1f1b backward wave hands its gradients on at once",
        'gpipe/pipeline/one_f_one_b/gradient_loop.py',
        'self._handoff_back = rotation.HandoffFor(cell.spec.schedule, '
        'self._place,\n                                             '
        'shift=-1)',
        'self._handoff_back = rotation.ImmediateHandoff(self._place, '
        'shift=-1)',
        ('tests/pipeline/delayed_sends_test.py', '-k', 'sweep and 1f1b')),
    Bug('schedule-segment-of-s',
        'circular segments of S microbatches with delayed sends',
        'gpipe/schedule/__init__.py',
        '    return self.hop * self.num_stages\n',
        '    return self.num_stages\n',
        ('tests/schedule/schedule_test.py', '-k', 'simulator')),
    Bug('one-f-one-b-delay-hop-1',
        'the backward wave starts as if each hop took one iteration',
        'gpipe/schedule/one_f_one_b.py',
        'return self.schedule.hop * (self.schedule.num_layers - 1)',
        'return self.schedule.num_layers - 1',
        ('tests/schedule/schedule_loops_test.py',)),
    Bug('delayed-permute-waits-for-the-calls',
        'the delayed hand-off rotates what this iteration made',
        'gpipe/pipeline/rotation.py',
        '    in_flight = carried[len(carried) // 2:]\n',
        '    in_flight = carried[len(carried) // 2:]\n'
        '    in_flight = [x + 0 * o for x, o in zip(in_flight, outputs)]\n',
        ('tests/xla/partitioning_test.py', '-k', 'beside')),
    # -- Blocks on the sequence's two halves. -------------------------------
    Bug('halves-second-masked-as-first',
        "the second half's queries masked as if at the first half's "
        'positions',
        'params/sequence_halves.py',
        '  padding = 1 - tf.linalg.band_part(ones, -1, offset)',
        '  padding = 1 - tf.linalg.band_part(ones, -1, 0)',
        ('tests/sequence_halves_test.py', '-k', 'one_device')),
    Bug('halves-reductions-unordered',
        "the halves' reductions left unordered (XLA merges them into one)",
        'params/sequence_halves.py',
        '  return x * tf.cast(tf.stop_gradient(pod_blocks.OneAfter(t)), '
        'x.dtype)',
        '  return x',
        ('tests/sequence_halves_test.py', '-k', 'beside')),
    Bug('halves-recomputation-ordered',
        'the recomputation orders its dead reductions, and so computes them',
        'params/sequence_halves.py',
        '    if pod_blocks.Recomputing():',
        '    if False:  # pylint: disable=using-constant-test',
        ('tests/sequence_halves_test.py', '-k', 'beside')),
    # -- What the pages show and the commands print. -------------------------
    Bug('docs-stale-check-output', 'a command prints what no page shows',
        'gpipe/xla/partitioned_step.py',
        "lines.append('Weights gathered or transposed: ' + (",
        "lines.append('Weights gathered: ' + (",
        ('tests/docs_test.py', '-k', 'quick and README')),
    Bug('trainer-steps-show-bookkeeping',
        "a step's line keeps Lingvo's gradient norms",
        'gpipe/lingvo_trainer.py',
        "if '/' not in name and name not in _LINGVOS_OWN_METRICS]",
        'if name not in _LINGVOS_OWN_METRICS]',
        ('tests/lingvo_trainer_test.py', '-k', 'progress')),
)


def _Copy(dest):
  """The checkout's tracked and new (not ignored) files, copied to dest."""
  names = subprocess.run(
      ['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'],
      cwd=ROOT, check=True, capture_output=True).stdout.decode().split('\0')
  for name in filter(None, names):
    source = ROOT / name
    if source.is_file():
      target = dest / name
      target.parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(source, target)


def _Apply(dest, bug):
  """Makes the bug's replacement in the copy; '' or why it cannot."""
  path = dest / bug.path
  text = path.read_text()
  count = text.count(bug.old)
  if count != 1:
    return (f'{bug.path}: the text to replace occurs {count} times (once '
            'expected): update the entry with the code')
  path.write_text(text.replace(bug.old, bug.new))
  return ''


# The whole suite, for --quick's survivors: one worker (the machine's
# other core is left to whatever else runs), first failure ends it.
SUITE = ('-n', '1', 'tests')


def _RunTests(dest, tests, log):
  """Runs pytest on `tests` in the copy; its exit status."""
  env = dict(os.environ, PYTHONPATH=str(dest))
  with open(log, 'w') as out:
    return subprocess.run(
        [sys.executable, '-m', 'pytest', '-x', '-q', '-p',
         'no:cacheprovider', *tests], cwd=dest, env=env, stdout=out,
        stderr=subprocess.STDOUT).returncode


def _InCopy(bug, logs, mutate, tests=None, suffix=''):
  """Runs the bug's tests (or `tests`) in a fresh copy, with the bug if
  `mutate`; (exit status or None, problem)."""
  with tempfile.TemporaryDirectory(prefix='gpipe-bug-') as tmp:
    dest = pathlib.Path(tmp)
    _Copy(dest)
    if mutate:
      problem = _Apply(dest, bug)
      if problem:
        return None, problem
    suffix = ('bug' if mutate else 'unchanged') + suffix
    return _RunTests(dest, bug.tests if tests is None else tests,
                     logs / f'{bug.name}.{suffix}.log'), ''


def _Verdict(bug, logs, quick, suite_passes):
  """'caught', 'caught by the suite', 'GOT THROUGH', 'STALE' or 'TESTS
  FAIL UNCHANGED', and the problem; `suite_passes()` says (once) whether
  the unchanged suite passes."""
  status, problem = _InCopy(bug, logs, mutate=False)
  if status != 0:
    return 'TESTS FAIL UNCHANGED', problem
  status, problem = _InCopy(bug, logs, mutate=True)
  if problem:
    return 'STALE', problem
  if status not in (0, 5):
    return 'caught', ''
  if not quick:
    return 'GOT THROUGH', ''
  if not suite_passes():
    return 'GOT THROUGH', 'and the unchanged suite fails: see its log'
  status, _ = _InCopy(bug, logs, mutate=True, tests=SUITE, suffix='.suite')
  if status not in (0, 5):
    return 'caught by the suite', 'not by its tests: name the one that did'
  return 'GOT THROUGH', 'the whole suite too'


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--list', action='store_true',
                      help='list the bugs and the tests meant to catch them')
  parser.add_argument('--only', default='',
                      help='comma-separated bug names (default: all)')
  parser.add_argument('--quick', action='store_true',
                      help="each bug against its named tests, then, if "
                      'they miss it, against the whole suite')
  parser.add_argument('--logs', default='',
                      help='directory for each run\'s pytest output '
                      '(default: a temporary one, named at the end)')
  args = parser.parse_args(argv)
  bugs = BUGS
  if args.only:
    wanted = args.only.split(',')
    unknown = sorted(set(wanted) - {b.name for b in BUGS})
    if unknown:
      parser.error(f'--only: no bug named {", ".join(unknown)}; --list '
                   'lists them')
    bugs = [b for b in BUGS if b.name in wanted]
  if args.list:
    for b in bugs:
      print(f'{b.name:32} {b.why}\n{"":32} {b.path}; tests: '
            f'{" ".join(b.tests)}')
    return 0
  logs = pathlib.Path(args.logs or tempfile.mkdtemp(prefix='gpipe-bugs-'))
  logs.mkdir(parents=True, exist_ok=True)
  failures = []
  suite = []  # the unchanged suite's exit status, once run

  def SuitePasses():
    if not suite:
      suite.append(_InCopy(Bug('suite', '', '', '', '', SUITE), logs,
                           mutate=False)[0])
    return suite[0] == 0

  for bug in bugs:
    began = time.time()
    verdict, problem = _Verdict(bug, logs, args.quick, SuitePasses)
    if not verdict.startswith('caught'):
      failures.append(bug.name)
    print(f'{verdict:20} {bug.name:32} {time.time() - began:5.0f} s'
          f'{"  " + problem if problem else ""}', flush=True)
  print(f'{len(bugs) - len(failures)} of {len(bugs)} caught; pytest output '
        f'in {logs}')
  return 1 if failures else 0


if __name__ == '__main__':
  sys.exit(main())
