"""The page and plot of benchmarks.text_depth's runs."""

import numpy as np

from benchmarks import text_parity

SMOOTH = text_parity.SMOOTH


def Page(*, date, machine, tf_version, command, minutes, steps, last, budget,
         steps_runs, minutes_runs, speeds, recipe_runs, problems):
  """The markdown page (docs/text-depth.md)."""
  lines = [
      '# Depth on real text',
      '',
      f'Measured {date} on {machine}, 2 CPU cores, TensorFlow {tf_version}, '
      f'one CPU device, by `{command}` (about {minutes:.0f} minutes). The model: lm.TextLMSmall\'s '
      'recipe (byte-level, width 64, windows of 128 bytes of the standard '
      'library\'s source, 16 a step in 4 microbatches, Adam at 5e-3 after '
      '100 warmup steps, decaying to a tenth over the run) with its stack '
      'at each depth; every run from the same seeds, reading the same '
      'batches. Held-out: the packages email, json and asyncio. Bits per '
      'byte throughout; all figures measured.',
      '',
  ]
  lines += WHY.split('\n')
  if steps_runs:
    lines += ['![Training curves at each depth](text_depth.png)', '']
    lines += SameStepsTable(steps_runs, steps, last)
  if minutes_runs:
    lines += SameMinutesTable(minutes_runs, budget)
  if speeds:
    lines += SpeedTable(speeds)
  if recipe_runs:
    lines += RecipeTable(recipe_runs, steps)
  lines += ['## Checks', '']
  lines += (['- FAILED: ' + p for p in problems] or
            ['- All met: at the same steps 8 blocks (R = 2) below 4 and 16 '
             '(R = 4) no higher than 8, pipelined and plain; pipelined '
             'within 1 % of plain at every depth; layer by layer within '
             '1.25x the plain stack\'s step on every shipped model.'])
  return '\n'.join(lines) + '\n'


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
   the unnormalized input, x + f(LN(x)).
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


def SameStepsTable(runs, steps, last):
  by = {(r.stack, r.path): r for r in runs}
  stacks = list(dict.fromkeys(r.stack for r in runs))
  lines = [
      f'## Same steps ({steps})', '',
      f'Training: the mean of the last {last} steps. Pipelined: the '
      'schedule a pod runs (layer_by_layer off); plain: unroll=\'always\'.',
      '',
      '| stack | training, pipelined | training, plain | gap % | held-out, '
      'pipelined | held-out, plain | gap % | gzip -9 |',
      '|---|---|---|---|---|---|---|---|',
  ]
  for stack in stacks:
    a, b = by[stack, 'pipelined'], by[stack, 'plain']
    lines.append(
        f'| {stack} | {a.last_loss:.4f} | {b.last_loss:.4f} | '
        f'{_Gap(a.last_loss, b.last_loss):.3f} | {a.held_out:.4f} | '
        f'{b.held_out:.4f} | {_Gap(a.held_out, b.held_out):.3f} | '
        f'{b.gzip:.3f} |')
  return lines + ['']


def SameMinutesTable(runs, budget):
  lines = [
      f'## Same minutes ({budget:g})', '',
      'Layer by layer (what the demo trains on), each run\'s learning rate '
      'decaying over the steps its measured step time allows.', '',
      '| stack | steps | ms a step | training (last steps) | held-out | '
      'gzip -9 |',
      '|---|---|---|---|---|---|',
  ]
  for r in runs:
    lines.append(f'| {r.stack} | {r.steps} | {1e3 * r.step_seconds:.0f} | '
                 f'{r.last_loss:.4f} | {r.held_out:.4f} | {r.gzip:.3f} |')
  return lines + ['']


def SpeedTable(speeds):
  lines = [
      '## Step time of the shipped text models', '',
      'Median milliseconds of a training step through Lingvo\'s graph '
      '(gpipe.apps.trainer), the three paths timed in rotation in one '
      'process.', '',
      '| model | layer by layer | plain | schedule | layer by layer / plain '
      '| schedule / plain |',
      '|---|---|---|---|---|---|',
  ]
  for model, s in speeds.items():
    lbl, plain, sched = (s['layer by layer'], s['plain'], s['pipelined'])
    lines.append(f'| `{model}` | {1e3 * lbl:.0f} | {1e3 * plain:.0f} | '
                 f'{1e3 * sched:.0f} | {lbl / plain:.2f} | '
                 f'{sched / plain:.2f} |')
  return lines + ['']


def RecipeTable(runs, steps):
  by = {}
  for r in runs:
    by.setdefault(r.path, []).append(r)
  lines = [
      f'## The recipe, part by part ({steps} steps, plain stack)', '',
      'Each row adds one part to the row above it; the last row is the '
      'recipe. Training: the mean of the last steps.', '',
      '| recipe | 4 blocks: training | 8 blocks: training | 8 vs 4 % | '
      '4 blocks: held-out | 8 blocks: held-out |',
      '|---|---|---|---|---|---|',
  ]
  for name, (shallow, deep) in by.items():
    change = 100 * (deep.last_loss / shallow.last_loss - 1)
    lines.append(f'| {name} | {shallow.last_loss:.4f} | {deep.last_loss:.4f} '
                 f'| {change:+.1f} | {shallow.held_out:.4f} | '
                 f'{deep.held_out:.4f} |')
  return lines + ['']


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
