"""The page and plot of benchmarks.text_depth's runs."""

import numpy as np

from benchmarks import text_parity

SMOOTH = text_parity.SMOOTH


def Page(*, machine, tf_version, last, results, steps_runs, minutes_runs,
         recipe_runs, problems):
  """The markdown page (docs/text-depth.md) of benchmarks.text_depth's
  results (its JSON: each part's figures and when they were measured)."""
  lines = [
      '# Depth on real text',
      '',
      f'Measured on {machine}, 2 CPU cores, TensorFlow {tf_version}, one CPU '
      'device, by `python -m benchmarks.text_depth` (about '
      f'{_Minutes(results):.0f} minutes; `--parts` reruns some of it, each '
      'section says when it was measured). The model: lm.TextLMSmall\'s '
      'recipe (byte-level, width 64, windows of 128 bytes of the standard '
      'library\'s source, 16 a '
      'step in 4 microbatches, Adam at 5e-3 after 100 warmup steps, '
      'decaying to a tenth over the run) with its stack at each depth; '
      'every run from the same seeds, reading the same batches. Held-out: '
      'the packages email, json and asyncio. Bits per byte throughout; all '
      'figures measured.',
      '',
  ]
  lines += WHY.split('\n')
  when = lambda part: _When(results.get(f'{part}_measured', {}))
  if steps_runs:
    lines += ['![Training curves at each depth](text_depth.png)', '']
    lines += SameStepsTable(steps_runs, last, when('steps'))
  if minutes_runs:
    lines += SameMinutesTable(minutes_runs, when('minutes'))
  if 'speed' in results:
    lines += SpeedTable(results['speed'], when('speed'))
  if 'context' in results:
    lines += ContextTable(results['context'], when('context'))
  if recipe_runs:
    lines += RecipeTable(recipe_runs, when('recipe'))
  lines += ['## Checks', '']
  lines += (['- FAILED: ' + p for p in problems] or
            ['- All met: at the same steps 8 blocks (R = 2) below 4 and 16 '
             '(R = 4) no higher than 8, pipelined and plain; pipelined '
             'within 1 % of plain at every depth; layer by layer within '
             '1.25x the plain stack\'s step on every shipped model.'])
  return '\n'.join(lines) + '\n'


def _Minutes(results):
  return sum(v['minutes'] for k, v in results.items()
             if k.endswith('_measured'))


def _When(measured):
  if not measured:
    return ''
  return f' (measured {measured["date"]}, {measured["minutes"]:g} minutes)'


WHY = """## What held depth back

The text LM's earlier recipe learned *worse* with depth: 8 blocks stalled
near the bytes' unigram entropy (about 4.3 bits per byte after 300 steps,
pipelined and plain alike) where 4 blocks reached 3.0. Four parts of the
model were found, by training shallow and deep stacks side by side; the
recipe table at the end of this page trains each step at 4 and 8 blocks.

1. **A residual stream re-normalized at every block.** Lingvo's
   time-major `TransformerLayer` adds its attention's output to the
   *normalized* input (`TransformerAttentionLayer.add_unnormalized_input`
   is False by default: h = LN(x) + attention(LN(x))), so each block
   discards the stream's scale and what the blocks below it added: the
   stack trains like a post-LN Transformer, which at this learning rate
   does not train deep. The text LM now uses the pod LMs' batch-major
   block (`pod_blocks.PodBlockParams`), in which both sub-layers add to
   the unnormalized input, x + f(LN(x)). Alone, this lifts 8 blocks off
   the unigram entropy but leaves them no better than 4 (the recipe
   table's second row): the next part is what makes depth pay.
2. **Positions only at the input.** A learned position embedding reaches
   the first block's input only, and each position's vector is learned
   from the rows that have it: with learned positions, windows of 128
   bytes learned worse than windows of 64 at the same bytes a step.
   Rotary position embeddings (`rotary=True`) give every block's
   attention the relative position of each key.
3. **Branches that add up with depth.** Each block adds its two
   sub-layers' outputs to the stream; at Lingvo's Xavier init their sum
   grows with the number of blocks. The output projections now start
   scaled by 1 / sqrt(2 x blocks), as GPT-2 scales them
   (`PipelinedLMTask.depth_scaled_init`, computed from the stack when the
   task is built, so a user who doubles `circular_repeat` gets it too);
   `tests/text_lm_test.py` checks that 16 blocks add to the stream at
   init about what 4 add.
4. **Warmup.** 100 steps instead of 50 let the 16-block stack through
   its first steps without losing the lead its depth gives.

Also measured while looking (width 64, windows of 128, plain stack, 400
steps): a lower learning rate (3.5e-3) or no gradient clipping made 16
blocks worse; Adam's beta2 0.95 instead of 0.98 did not help.
"""


def _Section(title, intro, header, rows):
  """A page section: its title, a paragraph, a table (rows: [cells])."""
  return ([f'## {title}', '', intro, '', '| ' + ' | '.join(header) + ' |',
           '|' + '---|' * len(header)] +
          ['| ' + ' | '.join(row) + ' |' for row in rows] + [''])


def SameStepsTable(runs, last, when):
  by = {(r.stack, r.path): r for r in runs}
  rows = []
  for stack in dict.fromkeys(r.stack for r in runs):
    a, b = by[stack, 'pipelined'], by[stack, 'plain']
    rows.append([stack, f'{a.last_loss:.4f}', f'{b.last_loss:.4f}',
                 f'{_Gap(a.last_loss, b.last_loss):.3f}', f'{a.held_out:.4f}',
                 f'{b.held_out:.4f}', f'{_Gap(a.held_out, b.held_out):.3f}',
                 f'{b.gzip:.3f}'])
  return _Section(
      f'Same steps ({runs[0].steps}){when}',
      f'Training: the mean of the last {last} steps. Pipelined: the '
      'schedule a pod runs (layer_by_layer off); plain: unroll=\'always\'.',
      ['stack', 'training, pipelined', 'training, plain', 'gap %',
       'held-out, pipelined', 'held-out, plain', 'gap %', 'gzip -9'], rows)


def SameMinutesTable(runs, when):
  return _Section(
      f'Same minutes{when}',
      'Layer by layer (what the demo trains on), each run\'s learning rate '
      'decaying over the steps its measured step time allows. '
      f'{_BestInMinutes(runs)}',
      ['stack', 'steps', 'ms a step', 'training (last steps)', 'held-out',
       'gzip -9'],
      [[r.stack, f'{r.steps}', f'{1e3 * r.step_seconds:.0f}',
        f'{r.last_loss:.4f}', f'{r.held_out:.4f}', f'{r.gzip:.3f}']
       for r in runs])


def _BestInMinutes(runs):
  best = min(runs, key=lambda r: r.held_out)
  return (f'Here {best.stack} ends lowest on the held-out bytes: on one '
          'device a step costs in proportion to the depth, so a deeper '
          'stack trains fewer steps in the same minutes; a pod spreads '
          'the depth over its chips (the pipeline\'s purpose), and there '
          'what each step learns, the table above, is what carries over.')


def SpeedTable(speeds, when):
  rows = []
  for model, s in speeds.items():
    lbl, plain, sched = (s['layer by layer'], s['plain'], s['pipelined'])
    rows.append([f'`{model}`', f'{1e3 * lbl:.0f}', f'{1e3 * plain:.0f}',
                 f'{1e3 * sched:.0f}', f'{lbl / plain:.2f}',
                 f'{sched / plain:.2f}'])
  return _Section(
      f'Step time of the shipped text models{when}',
      'Median milliseconds of a training step through Lingvo\'s graph '
      '(gpipe.apps.trainer), the three paths timed in rotation in one '
      'process.',
      ['model', 'layer by layer', 'plain', 'schedule',
       'layer by layer / plain', 'schedule / plain'], rows)


def ContextTable(costs, when):
  base = costs['64']['layer by layer']
  return _Section(
      f'What a window costs{when}',
      'The demo\'s model (8 blocks of width 64) on windows of 64, 128 and '
      '256 bytes, 2048 bytes a step (32, 16 and 8 windows): median '
      'milliseconds of a training step, timed in rotation. The registered '
      'models read 128 (the demo) and 256 (lm.TextLM30Min): attention '
      'grows with the window, the rest of a block does not.',
      ['window', 'layer by layer', 'plain', 'layer by layer / 64 bytes\''],
      [[window, f'{1e3 * s["layer by layer"]:.0f}', f'{1e3 * s["plain"]:.0f}',
        f'{s["layer by layer"] / base:.2f}'] for window, s in costs.items()])


def RecipeTable(runs, when):
  by = {}
  for r in runs:
    by.setdefault(r.path, []).append(r)
  rows = []
  for name, (shallow, deep) in by.items():
    change = 100 * (deep.last_loss / shallow.last_loss - 1)
    rows.append([name, f'{shallow.last_loss:.4f}', f'{deep.last_loss:.4f}',
                 f'{change:+.1f}', f'{shallow.held_out:.4f}',
                 f'{deep.held_out:.4f}'])
  return _Section(
      f'The recipe, part by part ({runs[0].steps} steps, plain stack){when}',
      'Each row adds one part to the row above it; the last row is the '
      'recipe. Training: the mean of the last steps, as above.',
      ['recipe', '4 blocks: training', '8 blocks: training', '8 vs 4 %',
       '4 blocks: held-out', '8 blocks: held-out'], rows)


def Plot(path, steps_runs, minutes_runs):
  """Training curves, smoothed: same steps (left; plain solid, pipelined
  dashed) and same minutes against minutes (right)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
  colors = {}
  for r in steps_runs:
    color = colors.setdefault(r.stack, f'C{len(colors)}')
    x = np.arange(SMOOTH, len(r.losses) + 1)
    left.plot(x, text_parity.Smoothed(r.losses), color=color,
              ls='-' if r.path == 'plain' else '--', lw=1,
              label=r.stack if r.path == 'plain' else None)
  left.set(xlabel='step', ylabel='training bits per byte',
           title='same steps (plain solid, pipelined dashed)')
  left.legend(fontsize=8)
  for r in minutes_runs:
    x = np.arange(SMOOTH, len(r.losses) + 1) * r.step_seconds / 60
    right.plot(x, text_parity.Smoothed(r.losses),
               color=colors.get(r.stack), lw=1,
               label=f'{r.stack}: held-out {r.held_out:.3f}')
  right.set(xlabel='minutes', title='same minutes (layer by layer)')
  right.legend(fontsize=8)
  for axis in (left, right):
    axis.set_ylim(top=4.0)
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


def _Gap(a, b):
  return 100 * abs(a - b) / b
