"""Draws a pipeline schedule as a picture: stages x iterations.

    iteration ->   0    1    2    3    4    5
    stage 0      [0]  [1]  [2]  [3]  ///  ///
    stage 1      ///  [0]  [1]  [2]  [3]  ///      (/// = bubble)

Each cell says which microbatch (and, when circular, which repeat) the stage
works on at that iteration; cells are coloured by microbatch, bubbles are
grey and hatched. With a gpipe.schedule.ZeroBubble, its backward wave is
drawn below: each cell's upper half the stage's input gradient (B), its
lower half the deferred weight gradient (W). Everything comes from the
schedule objects passed in, the same arithmetic the layer runs (this module
does not import them: gpipe.schedule's command imports this one).
"""

import io
import os


def CellLabels(schedule):
  """[S][T] labels: 'm' (linear) or 'm/r' (circular), None on bubbles."""
  table = schedule.Table()
  labels = []
  for stage in range(schedule.num_stages):
    line = []
    for iteration in range(schedule.num_iterations):
      entry = table[iteration][stage]
      if entry is None:
        line.append(None)
      elif schedule.circular:
        line.append(f'{entry[0]}/{entry[1]}')
      else:
        line.append(str(entry[0]))
    labels.append(line)
  return labels


def OutPathProblem(path):
  """Why a diagram asked for at `path` would not be what its name says, or
  ''. Draw writes PNG only: a suffix other than .png (in any case) is
  refused; a path without a suffix gets the PNG as it is."""
  suffix = os.path.splitext(os.fspath(path))[1]
  if suffix and suffix.lower() != '.png':
    return (f'the diagram is written as PNG only, not {suffix}: give a path '
            'ending in .png.')
  return ''


def PngBytes(schedule):
  """The schedule diagram as PNG bytes (e.g. for an image summary)."""
  buffer = io.BytesIO()
  Draw(schedule, buffer)
  return buffer.getvalue()


def ImageSummary(schedule, tag='pipeline_schedule'):
  """The diagram as a TensorBoard image summary (a tf.compat.v1.Summary)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  png = PngBytes(schedule)
  height, width = _PngSize(png)
  image = tf.compat.v1.Summary.Image(height=height, width=width, colorspace=4,
                                     encoded_image_string=png)
  return tf.compat.v1.Summary(
      value=[tf.compat.v1.Summary.Value(tag=tag, image=image)])


def _PngSize(png):
  """(height, width) from a PNG's header chunk."""
  return (int.from_bytes(png[20:24], 'big'), int.from_bytes(png[16:20], 'big'))


def Draw(schedule, path, zero_bubble=None):
  """Writes the schedule diagram to `path` (PNG; or a binary file object);
  returns CellLabels. With `zero_bubble` (a gpipe.schedule.ZeroBubble of
  the schedule), its backward wave is drawn below (ZeroBubbleAxes)."""
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  fig, _ = Figure(schedule, zero_bubble)
  fig.savefig(path, dpi=100, format='png')  # exactly `path`, any suffix
  pyplot.close(fig)
  return CellLabels(schedule)


def Figure(schedule, zero_bubble=None):
  """The diagram as a matplotlib (figure, axes of the forward schedule);
  the caller closes it. With `zero_bubble`, a second axes below it."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top

  labels = CellLabels(schedule)
  table = schedule.Table()
  s_count, t_count = schedule.num_stages, schedule.num_iterations
  width = min(max(4.0, 0.45 * t_count + 1.5), 60.0)
  height = 0.5 * s_count + 1.5
  if zero_bubble is None:
    fig, ax = pyplot.subplots(figsize=(width, height), dpi=100)
  else:
    fig, (ax, zb_ax) = pyplot.subplots(2, 1, figsize=(width, 2 * height),
                                       dpi=100)
    ZeroBubbleAxes(zb_ax, schedule, zero_bubble)
  colors = pyplot.get_cmap('tab20')
  for stage in range(s_count):
    for iteration in range(t_count):
      entry = table[iteration][stage]
      y = _RowY(stage, s_count)
      if entry is None:
        ax.add_patch(
            pyplot.Rectangle((iteration, y), 1, 1, facecolor='0.9',
                             edgecolor='0.6', hatch='///', linewidth=0.5))
        continue
      ax.add_patch(
          pyplot.Rectangle((iteration, y), 1, 1,
                           facecolor=colors(entry[0] % 20), edgecolor='white',
                           linewidth=1.0))
      ax.text(iteration + 0.5, y + 0.5, labels[stage][iteration],
              ha='center', va='center', fontsize=8)
  _StageAxes(ax, s_count, t_count, 'iteration')
  cell_kind = 'microbatch/repeat' if schedule.circular else 'microbatch'
  ax.set_title(
      f'S={s_count} stages, M={schedule.num_microbatches} microbatches, '
      f'R={schedule.circular_repeat}: {t_count} iterations\n'
      f'{schedule.bubble_fraction:.0%} bubbles (hatched); cells: {cell_kind}',
      fontsize=9)
  fig.tight_layout()
  return fig, ax


def ZeroBubbleLabels(schedule, zero_bubble):
  """[S][T] (B label, W label) of zero bubble's backward wave: 'm' or
  'm/r' of the call whose input gradient (B), then whose deferred weight
  gradient (W), the stage computes at backward iteration k; None where a
  task idles, '-' for W where k has no slot."""
  backward = zero_bubble.one_f_one_b.BackwardRows()
  slots = zero_bubble.SlotRows()

  def Label(work):
    if not work.valid:
      return None
    if schedule.circular:
      return f'{work.microbatch}/{work.repeat}'
    return str(work.microbatch)

  def WLabel(k, s):
    if slots[k] is None:
      return '-'
    w = slots[k][s]
    return Label(backward[w.made_at][s]) if w.valid else None

  return [[(Label(row[s]), WLabel(k, s)) for k, row in enumerate(backward)]
          for s in range(schedule.num_stages)]


def ZeroBubbleAxes(ax, schedule, zero_bubble):
  """Draws zero bubble's backward wave on `ax`: per stage and backward
  iteration, B in the cell's upper half and W in its lower half, coloured
  by microbatch; an idle task grey and hatched, no W slot left white."""
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  colors = pyplot.get_cmap('tab20')
  labels = ZeroBubbleLabels(schedule, zero_bubble)
  s_count, t_count = schedule.num_stages, schedule.num_iterations
  for stage, line in enumerate(labels):
    y = _RowY(stage, s_count)
    for k, halves in enumerate(line):
      for half, label in zip((0.5, 0.0), halves):
        if label == '-':
          continue
        if label is None:
          patch = dict(facecolor='0.9', edgecolor='0.6', hatch='///',
                       linewidth=0.5)
        else:
          patch = dict(facecolor=colors(int(label.split('/')[0]) % 20),
                       edgecolor='white', linewidth=1.0)
        ax.add_patch(pyplot.Rectangle((k, y + half), 1, 0.5, **patch))
        if label is not None:
          ax.text(k + 0.5, y + half + 0.25, label, ha='center',
                  va='center', fontsize=7)
  _StageAxes(ax, s_count, t_count, 'backward iteration k')
  ax.set_title('zero_bubble: B above, deferred W below (white: no W slot)',
               fontsize=9)


def _RowY(stage, s_count):
  """Where stage's row starts on the y axis: stage 0 at the top."""
  return s_count - 1 - stage


def _StageAxes(ax, s_count, t_count, xlabel):
  """Limits and ticks of a stages x iterations grid: a column a label
  0..t_count - 1, a row 'stage s' (stage 0 at the top)."""
  ax.set_xlim(0, t_count)
  ax.set_ylim(0, s_count)
  ax.set_xticks([i + 0.5 for i in range(t_count)])
  ax.set_xticklabels([str(i) for i in range(t_count)], fontsize=7)
  ax.set_yticks([s_count - 1 - s + 0.5 for s in range(s_count)])
  ax.set_yticklabels([f'stage {s}' for s in range(s_count)])
  ax.set_xlabel(xlabel)
