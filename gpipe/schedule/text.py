"""The schedule as text, and the `python -m gpipe.schedule` command.

    python -m gpipe.schedule --num_stages 4 --num_microbatches 8 \\
        --circular_repeat 2 [--delayed_sends] [--skip_bubbles] \\
        [--backward_schedule 1f1b|zero_bubble] [--out schedule.png]

prints the schedule's summary and its table (gpipe.schedule has the
arithmetic; gpipe.schedule.plot draws it). Loads no TensorFlow.
"""

import argparse
import os
import sys

from gpipe import schedule as schedule_lib


def Render(schedule, phases=None):
  """A text diagram of the schedule, one line per stage ('.' a bubble;
  with `phases`, '-' a bubble the loop does not compute)."""
  table = schedule.Table()
  computed = schedule_lib.ComputedCalls(phases or [schedule_lib.Phase(
      0, schedule.num_iterations, 0, schedule.num_stages)])
  width = 5 if schedule.circular else 3
  lines = ['iteration ' + ''.join(f'{i:>{width}}' for i in
                                  range(schedule.num_iterations))]
  for s in range(schedule.num_stages):
    line = []
    for i in range(schedule.num_iterations):
      entry = table[i][s]
      if entry is None:
        text = '.' if (i, s) in computed else '-'
      elif schedule.circular:
        text = f'{entry[0]}/{entry[1]}'
      else:
        text = str(entry[0])
      line.append(f'{text:>{width}}')
    lines.append(f'stage {s:<4}' + ''.join(line))
  return '\n'.join(lines)


def RenderGradientLoop(schedule):
  """The 1f1b gradient loop (schedule_lib.OneFOneB.Rows) as text, one line
  per stage: 'f,b' is the forward wave's microbatch and the backward wave's
  ('microbatch/repeat' when circular), '.' where a wave idles (a bubble,
  or an iteration the wave does not run in)."""
  loop = schedule_lib.OneFOneB(schedule)

  def Text(work):
    if work is None or not work.valid:
      return '.'
    if schedule.circular:
      return f'{work.microbatch}/{work.repeat}'
    return str(work.microbatch)

  rows = loop.Rows()
  return _StageLines('j', [
      [f'{Text(row[s].forward)},{Text(row[s].backward)}' for row in rows]
      for s in range(schedule.num_stages)])


def _StageLines(index_name, texts):
  """texts [S][n] as lines: a header of the indices 0..n-1 under
  `index_name`, then a line a stage, each column right-aligned."""
  width = 1 + max(len(text) for line in texts for text in line)
  lines = [f'{index_name:<10}' + ''.join(
      f'{i:>{width}}' for i in range(len(texts[0])))]
  lines += [f'stage {s:<4}' + ''.join(f'{text:>{width}}' for text in line)
            for s, line in enumerate(texts)]
  return '\n'.join(lines)


def Summary(schedule):
  """Iterations, bubble fraction and useful work per stage, as text."""
  useful = schedule.num_microbatches * schedule.circular_repeat
  delayed = ', delayed sends' if schedule.delayed_sends else ''
  lines = [
      f'{schedule.num_stages} stages x {schedule.circular_repeat} '
      f'repeat(s), {schedule.num_microbatches} microbatches{delayed}: '
      f'{schedule.num_iterations} iterations, bubble fraction '
      f'{schedule.bubble_fraction:.3f}'
  ]
  for s in range(schedule.num_stages):
    lines.append(f'  stage {s}: useful work in {useful} of '
                 f'{schedule.num_iterations} iterations '
                 f'({useful / schedule.num_iterations:.0%})')
  return '\n'.join(lines)


def PhasesSummary(schedule):
  """What skip_bubbles runs on one device (Schedule.Phases), as text."""
  phases = schedule.Phases()
  calls = schedule.num_iterations * schedule.num_stages
  computed = schedule.CallsComputed(phases)
  lines = [f'skip_bubbles (one device): {len(phases)} loop(s), '
           f'{computed} of {calls} calls computed ({computed / calls:.0%})']
  for p in phases:
    last = p.first_stage + p.num_stages - 1
    lines.append(f'  iterations {p.begin}-{p.end - 1}: stages '
                 f'{p.first_stage}-{last}')
  return '\n'.join(lines)


def GradientLoopSummary(schedule):
  """What backward_schedule='1f1b' runs for the backward pass, as text."""
  loop = schedule_lib.OneFOneB(schedule)
  lines = [f"backward_schedule='1f1b': {loop.num_iterations} gradient-loop "
           f'iterations, each stage keeping a ring of {loop.ring_size} stage '
           'inputs']
  for p in loop.Phases():
    what = 'both waves' if len(p.waves) == 2 else f'{p.waves[0]} wave'
    lines.append(f'  iterations {p.begin}-{p.end - 1}: {what}')
  return '\n'.join(lines)


def RenderZeroBubble(schedule):
  """zero_bubble's backward wave (ZeroBubble.SlotRows) as text, one line
  per stage: 'b,w' is the microbatch whose input gradient (B) the stage
  computes and the one whose deferred weight gradient (W) it computes
  ('microbatch/repeat' when circular), '.' an idle task, '-' no W slot."""
  from gpipe.schedule import plot as schedule_plot  # pylint: disable=g-import-not-at-top
  labels = schedule_plot.ZeroBubbleLabels(
      schedule, schedule_lib.ZeroBubble(schedule))
  return _StageLines('k', [[f'{b or "."},{w or "."}' for b, w in line]
                          for line in labels])


def ZeroBubbleSummary(schedule):
  """What backward_schedule='zero_bubble' defers and saves, as text: its W
  slots and ring, and the weighted bubbles at F = B = W (ZeroBubble)."""
  zero_bubble = schedule_lib.ZeroBubble(schedule)
  bubbles = zero_bubble.Bubbles(schedule_lib.TaskCosts())
  slots = len(zero_bubble.SlotIterations())
  ratio = (bubbles['zero_bubble'] / bubbles['1f1b']
           if bubbles['1f1b'] else 1.0)
  return '\n'.join([
      "backward_schedule='zero_bubble': each backward split into B and a "
      'deferred W',
      f'  W slots in {slots} of {schedule.num_iterations} backward '
      f"iterations; a ring of {zero_bubble.ring_size} W's operands a stage "
      f'(at most {zero_bubble.WaitingAtMost()} waiting)',
      '  weighted bubble of the gradient loop (F = B = W): 1f1b '
      f"{bubbles['1f1b']:g}, zero_bubble {bubbles['zero_bubble']:g} "
      f"({ratio:.2f} of 1f1b's), per-stage branches "
      f"{bubbles['per-stage branches']:g}, fill bound "
      f"{bubbles['fill bound']:g}"])


# Spellings from before the commands spoke one dialect (Lingvo's).
_OLD_SPELLINGS = {'--stages': '--num_stages',
                  '--microbatches': '--num_microbatches',
                  '--circular-repeat': '--circular_repeat'}


def _Parser():
  from gpipe import quiet  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(
      prog='python -m gpipe.schedule',
      description='Print (and draw) a pipeline schedule: which microbatch '
      '(and\nrepeat) each stage works on at each loop iteration.',
      formatter_class=quiet.HelpFormatter)
  parser.add_argument('--num_stages', type=int, required=True,
                      help='pipeline stages S')
  parser.add_argument('--num_microbatches', type=int, required=True,
                      help='microbatches M')
  parser.add_argument('--circular_repeat', type=int, default=1,
                      help='R: times each microbatch passes through the '
                      'stages')
  parser.add_argument('--delayed_sends', action='store_true',
                      help="hand each stage's output on one iteration "
                      'after it is made, beside the next calls (two '
                      'iterations a stage)')
  parser.add_argument('--skip_bubbles', action='store_true',
                      help='show what a layer with skip_bubbles=True runs '
                      'on one device: the bubbles it does not compute '
                      "('-') and its loops")
  parser.add_argument('--backward_schedule',
                      choices=('reverse', '1f1b', 'zero_bubble'),
                      default='reverse',
                      help="with 1f1b, also show the gradient loop: each "
                      "stage's forward and backward wave per iteration; "
                      "with zero_bubble, also each backward iteration's "
                      "input gradient (B) and deferred weight gradient (W), "
                      "and the bubbles both schedules leave (with --out, "
                      "drawn below the schedule)")
  parser.add_argument('--out', default=None,
                      help='write the diagram to this .png path (default: '
                      'text only)')
  return parser


def _CheckOut(parser, out):
  from gpipe.schedule import plot as schedule_plot  # pylint: disable=g-import-not-at-top
  problem = schedule_plot.OutPathProblem(out)
  if problem:
    parser.error(f'--out {out}: {problem}')
  directory = os.path.dirname(os.path.abspath(out))
  if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
    parser.error(f'--out {out}: cannot write there (directory '
                 f'{directory} does not exist or is not writable).')


def main(argv=None):
  from gpipe import flag_spellings  # pylint: disable=g-import-not-at-top
  parser = _Parser()
  argv = sys.argv[1:] if argv is None else argv
  args = parser.parse_args(flag_spellings.Respell(argv, _OLD_SPELLINGS,
                                                  parser.prog))
  try:
    schedule = schedule_lib.Schedule(args.num_stages, args.num_microbatches,
                                     args.circular_repeat, args.delayed_sends)
  except ValueError as e:
    message = str(e)
    for name in ('num_stages', 'num_microbatches', 'circular_repeat'):
      message = message.replace(name, '--' + name)
    parser.error(message)
  if args.out:
    _CheckOut(parser, args.out)
  print(Summary(schedule))
  if args.skip_bubbles:
    print(PhasesSummary(schedule))
  print(Render(schedule, schedule.Phases() if args.skip_bubbles else None))
  if args.backward_schedule in ('1f1b', 'zero_bubble'):
    print(GradientLoopSummary(schedule))
    print(RenderGradientLoop(schedule))
  if args.backward_schedule == 'zero_bubble':
    print(ZeroBubbleSummary(schedule))
    print(RenderZeroBubble(schedule))
  if args.out:
    from gpipe.schedule import plot as schedule_plot  # pylint: disable=g-import-not-at-top
    schedule_plot.Draw(
        schedule, args.out,
        schedule_lib.ZeroBubble(schedule)
        if args.backward_schedule == 'zero_bubble' else None)
    print(f'wrote {os.path.abspath(args.out)}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
