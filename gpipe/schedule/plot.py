"""Draws a pipeline schedule as a picture: stages x iterations.

    iteration ->   0    1    2    3    4    5
    stage 0      [0]  [1]  [2]  [3]  ///  ///
    stage 1      ///  [0]  [1]  [2]  [3]  ///      (/// = bubble)

Each cell says which microbatch (and, when circular, which repeat) the stage
works on at that iteration; cells are coloured by microbatch, bubbles are
grey and hatched. Everything comes from the gpipe.schedule.Schedule passed
in, the same arithmetic the layer runs (this module does not import it:
gpipe.schedule's command imports this one).
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


def Draw(schedule, path):
  """Writes the schedule diagram to `path` (PNG; or a binary file object);
  returns CellLabels."""
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  fig, _ = Figure(schedule)
  fig.savefig(path, dpi=100, format='png')  # exactly `path`, any suffix
  pyplot.close(fig)
  return CellLabels(schedule)


def Figure(schedule):
  """The diagram as a matplotlib (figure, axes); the caller closes it."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top

  labels = CellLabels(schedule)
  table = schedule.Table()
  s_count, t_count = schedule.num_stages, schedule.num_iterations
  width = min(max(4.0, 0.45 * t_count + 1.5), 60.0)
  fig, ax = pyplot.subplots(figsize=(width, 0.5 * s_count + 1.5), dpi=100)
  colors = pyplot.get_cmap('tab20')
  for stage in range(s_count):
    for iteration in range(t_count):
      entry = table[iteration][stage]
      y = s_count - 1 - stage
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
  ax.set_xlim(0, t_count)
  ax.set_ylim(0, s_count)
  ax.set_xticks([i + 0.5 for i in range(t_count)])
  ax.set_xticklabels([str(i) for i in range(t_count)], fontsize=7)
  ax.set_yticks([s_count - 1 - s + 0.5 for s in range(s_count)])
  ax.set_yticklabels([f'stage {s}' for s in range(s_count)])
  ax.set_xlabel('iteration')
  cell_kind = 'microbatch/repeat' if schedule.circular else 'microbatch'
  ax.set_title(
      f'S={s_count} stages, M={schedule.num_microbatches} microbatches, '
      f'R={schedule.circular_repeat}: {t_count} iterations\n'
      f'{schedule.bubble_fraction:.0%} bubbles (hatched); cells: {cell_kind}',
      fontsize=9)
  fig.tight_layout()
  return fig, ax
