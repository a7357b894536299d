"""The schedule command and diagram agree with what the layer really runs.

The layer is run with a body that logs, in a non-trainable variable of its
own, the microbatch id of every call it does real work in (bubbles leave
state untouched). Each stage's (and repeat's) log, in iteration order, must
be exactly the sequence of cells the diagram draws in that stage's row.
"""

import pathlib
import subprocess
import sys

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import layers
from gpipe import schedule as schedule_lib
from gpipe.schedule import plot as schedule_plot
from gpipe.schedule import text as schedule_text
from lingvo.core import base_layer
from lingvo.core import py_utils


class RecorderBody(base_layer.BaseLayer):
  """Identity that logs the microbatch id (per-example `tag`) it runs on."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 2, 'Feature dim.')
    p.Define('capacity', 16, 'Longest log.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateVariable(
        'w', py_utils.WeightParams([p.dim], py_utils.WeightInit.Constant(1.0)))
    self.CreateVariable(
        'log',
        py_utils.WeightParams([p.capacity], py_utils.WeightInit.Constant(-1.0)),
        trainable=False)
    self.CreateVariable(
        'cursor',
        py_utils.WeightParams([], py_utils.WeightInit.Constant(0), tf.int32),
        trainable=False)

  def FProp(self, theta, x, tag):
    hit = tf.equal(tf.range(self.params.capacity), theta.cursor)
    tf.compat.v1.assign(self.vars.log, tf.where(hit, tag[0], theta.log))
    tf.compat.v1.assign_add(self.vars.cursor, 1)
    return x * theta.w


def _RecordedLogs(s_count, m_count, r_count):
  """Runs the layer once; returns its log variable [S, (R,) capacity]."""
  batch = 2 * m_count
  with tf.Graph().as_default():
    layer = layers.PipelinedLayer.Params().Set(
        name='pipe', num_stages=s_count, num_microbatches=m_count,
        circular_repeat=r_count, unroll='never',
        single_stage_body=RecorderBody.Params()).Instantiate()
    # Microbatch m holds examples m, m + M, ... (gpipe.microbatch).
    tag = tf.constant(np.arange(batch) % m_count, tf.float32)
    out = layer.FProp(layer.theta, tf.ones([batch, 2]), tag=tag)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      sess.run(out)
      return sess.run(layer.vars.body.log)


@pytest.mark.parametrize('s_count,m_count,r_count',
                         [(1, 3, 1), (4, 4, 1), (3, 4, 2), (2, 5, 3),
                          (3, 2, 2)])
def test_diagram_cells_are_what_the_layer_runs(tmp_path, s_count, m_count,
                                               r_count):
  sched = schedule_lib.Schedule(s_count, m_count, r_count)
  labels = schedule_plot.Draw(sched, tmp_path / 'schedule.png')
  logs = _RecordedLogs(s_count, m_count, r_count)
  for stage in range(s_count):
    for repeat in range(r_count):
      drawn = []
      for label in labels[stage]:
        if label is None:
          continue
        parts = [int(v) for v in label.split('/')]
        if (parts[1] if r_count > 1 else 0) == repeat:
          drawn.append(parts[0])
      log = logs[stage][repeat] if r_count > 1 else logs[stage]
      recorded = [int(v) for v in log if v >= 0]
      assert recorded == drawn, (stage, repeat, recorded, drawn)
      assert sorted(drawn) == list(range(m_count))
  # What the picture shows, read from its pixels and its texts' places, is
  # what the labels say: each cell in the row and column labelled with its
  # stage and iteration, coloured by its microbatch, bubbles grey.
  assert _CellsInThePicture(sched) == labels


def _CellsInThePicture(sched):
  """[S][T]: 'm' or 'm/r' for the cell drawn where the row labelled stage s
  and the column labelled iteration t cross (its colour must be microbatch
  m's and its text the label), None where a bubble is drawn."""
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  fig, ax = schedule_plot.Figure(sched)
  try:
    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(int)
    height = pixels.shape[0]

    def Centres(tick_labels, axis, prefix):
      """{index: display coordinate} of the tick labels 'prefix<index>'."""
      centres = {}
      for label in tick_labels:
        box = label.get_window_extent()
        centre = (box.x0 + box.x1) / 2 if axis == 'x' else (box.y0 +
                                                               box.y1) / 2
        centres[int(label.get_text()[len(prefix):])] = centre
      return centres

    columns = Centres(ax.get_xticklabels(), 'x', '')
    rows = Centres(ax.get_yticklabels(), 'y', 'stage ')
    assert sorted(columns) == list(range(sched.num_iterations))
    assert sorted(rows) == list(range(sched.num_stages))
    box = ax.get_window_extent()
    cell_w = box.width / sched.num_iterations
    cell_h = box.height / sched.num_stages
    texts = {}
    for text in ax.texts:
      t_box = text.get_window_extent()
      x, y = (t_box.x0 + t_box.x1) / 2, (t_box.y0 + t_box.y1) / 2
      column = min(columns, key=lambda c: abs(columns[c] - x))
      row = min(rows, key=lambda r: abs(rows[r] - y))
      assert (row, column) not in texts
      texts[row, column] = text.get_text()
    palette = np.round(
        np.asarray(pyplot.get_cmap('tab20').colors) * 255).astype(int)
    cells = []
    for stage in range(sched.num_stages):
      row = []
      for t in range(sched.num_iterations):
        # A patch near the cell's top-left corner, clear of its text.
        x = int(columns[t] - 0.3 * cell_w)
        y = int(height - (rows[stage] + 0.3 * cell_h))
        patch = pixels[y - 2:y + 3, x - 2:x + 3].reshape(-1, 3)
        matches = [m for m in range(sched.num_microbatches)
                   if np.abs(patch - palette[m]).max() <= 2]
        if matches:
          [m] = matches
          label = texts.pop((stage, t))
          assert int(label.split('/')[0]) == m, (stage, t, label)
          row.append(label)
        else:
          # Grey (hatched): every pixel's channels equal.
          assert np.ptp(patch, axis=1).max() <= 2, (stage, t, patch)
          assert (stage, t) not in texts, (stage, t)
          row.append(None)
      cells.append(row)
    assert not texts, texts
    return cells
  finally:
    pyplot.close(fig)


def test_schedule_command_prints_and_draws(tmp_path, capsys):
  out_png = tmp_path / 'schedule.png'
  assert schedule_text.main([
      '--num_stages', '4', '--num_microbatches', '8', '--circular_repeat', '2',
      '--out', str(out_png)
  ]) == 0
  text = capsys.readouterr().out
  sched = schedule_lib.Schedule(4, 8, 2)
  assert f'{sched.num_iterations} iterations' in text
  assert f'bubble fraction {sched.bubble_fraction:.3f}' in text
  assert 'stage 3: useful work in 16 of 19 iterations' in text
  assert schedule_text.Render(sched) in text
  assert out_png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  assert f'wrote {out_png}' in text
  from matplotlib import image  # pylint: disable=g-import-not-at-top
  height, width = image.imread(out_png).shape[:2]
  assert width > height > 0


def test_schedule_command_writes_exactly_the_path_given(tmp_path, capsys):
  out = tmp_path / 'schedule'  # no suffix: still a PNG, at this path
  assert schedule_text.main(['--num_stages', '2', '--num_microbatches', '3',
                            '--out', str(out)]) == 0
  assert f'wrote {out}\n' in capsys.readouterr().out
  assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_schedule_command_needs_neither_tensorflow_nor_lingvo():
  code = ('import sys\n'
          'from gpipe.schedule import text\n'
          "text.main(['--num_stages', '4', '--num_microbatches', '8'])\n"
          "heavy = [m for m in ('tensorflow', 'lingvo', 'jax') "
          'if m in sys.modules]\n'
          'assert not heavy, heavy\n')
  result = subprocess.run([sys.executable, '-c', code], capture_output=True,
                          text=True, timeout=60, check=False,
                          cwd=pathlib.Path(__file__).resolve().parents[2])
  assert result.returncode == 0, result.stderr
  assert 'bubble fraction' in result.stdout


@pytest.mark.parametrize('argv,message', [
    (['--num_stages', '0', '--num_microbatches', '4'],
     '--num_stages must be an integer'),
    (['--num_stages', '2', '--num_microbatches', '-1'],
     '--num_microbatches must be an integer'),
    (['--num_stages', '2', '--num_microbatches', '4', '--circular_repeat', '0'],
     '--circular_repeat must be an integer'),
    (['--num_stages', '2', '--num_microbatches', '4', '--out', '/proc/x/s.png'],
     '--out /proc/x/s.png: cannot write there'),
])
def test_schedule_command_rejects_bad_configs(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    schedule_text.main(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_old_flag_spellings_still_work_with_a_note(capsys):
  """The flags are spelled like the layer's params; the spellings from
  before still run, each with a one-line note."""
  assert schedule_text.main(['--stages', '2', '--microbatches=3',
                            '--circular-repeat', '2']) == 0
  captured = capsys.readouterr()
  assert schedule_text.Render(schedule_lib.Schedule(2, 3, 2)) in captured.out
  assert captured.err.splitlines() == [
      f'python -m gpipe.schedule: note: {old} is now spelled {new}; the old '
      'spelling works until gpipe 0.2.0.'
      for old, new in (('--stages', '--num_stages'),
                       ('--microbatches', '--num_microbatches'),
                       ('--circular-repeat', '--circular_repeat'))]


def test_old_flag_spellings_are_gone_by_their_end_version():
  """The spellings end in the version the CHANGELOG names: a release at it
  must remove them (gpipe.flag_spellings and its callers)."""
  import gpipe  # pylint: disable=g-import-not-at-top
  from gpipe import flag_spellings  # pylint: disable=g-import-not-at-top
  version = lambda v: tuple(int(x) for x in v.split('.'))
  assert version(gpipe.__version__) < version(flag_spellings.REMOVED_IN)
  changelog = (pathlib.Path(__file__).parents[2] / 'CHANGELOG.md').read_text()
  assert f'removed in {flag_spellings.REMOVED_IN}' in changelog


def test_demo_reads_its_old_flag_spellings(capsys):
  from gpipe import demo  # pylint: disable=g-import-not-at-top
  argv = ['--skip-check', '--skip-decode', '--steps', '1']
  _, args = demo._Args(argv)  # pylint: disable=protected-access
  assert args.skip_check and args.skip_decode
  assert capsys.readouterr().err.count('note: --skip-') == 2


@pytest.mark.parametrize('name', ['s.txt', 's.svg', 's.png.pdf'])
def test_out_refuses_a_suffix_it_would_not_write(tmp_path, capsys, name):
  out = tmp_path / name
  with pytest.raises(SystemExit) as exit_info:
    schedule_text.main(['--num_stages', '2', '--num_microbatches', '4', '--out',
                       str(out)])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  suffix = out.suffix
  assert (f'--out {out}: the diagram is written as PNG only, not {suffix}: '
          'give a path ending in .png.') in err
  assert not out.exists()


def test_demo_refuses_the_suffix_before_any_work(tmp_path, capsys):
  from gpipe import demo  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit) as exit_info:
    demo.main(['--out', str(tmp_path / 'schedule.svg'), '--logdir',
               str(tmp_path / 'run')])
  assert exit_info.value.code == 2
  assert 'written as PNG only, not .svg' in capsys.readouterr().err
  assert not (tmp_path / 'run').exists()


def test_upper_case_png_is_a_png(tmp_path, capsys):
  out = tmp_path / 'S.PNG'
  assert schedule_text.main(['--num_stages', '2', '--num_microbatches', '3',
                            '--out', str(out)]) == 0
  assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  assert f'wrote {out}' in capsys.readouterr().out


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))


def test_skip_bubbles_shows_the_loops_and_the_bubbles_left_out(capsys):
  """--skip_bubbles: the phases and, in the diagram, '-' exactly where no
  loop computes (the docstring's S=4, M=4 example of Schedule.Phases)."""
  assert schedule_text.main(['--num_stages', '4', '--num_microbatches', '4',
                            '--skip_bubbles']) == 0
  text = capsys.readouterr().out
  assert ('skip_bubbles (one device): 3 loop(s), 20 of 28 calls computed '
          '(71%)\n  iterations 0-1: stages 0-1\n  iterations 2-4: stages '
          '0-3\n  iterations 5-6: stages 2-3\n') in text
  assert ('stage 0     0  1  2  3  .  -  -\n'
          'stage 1     .  0  1  2  3  -  -\n'
          'stage 2     -  -  0  1  2  3  .\n'
          'stage 3     -  -  .  0  1  2  3') in text


def test_without_skip_bubbles_every_bubble_is_computed(capsys):
  assert schedule_text.main(['--num_stages', '4', '--num_microbatches',
                            '4']) == 0
  text = capsys.readouterr().out
  assert 'skip_bubbles' not in text and '-' not in text.split('iteration ')[-1]


def test_zero_bubble_shows_each_stages_b_and_deferred_w(capsys):
  """--backward_schedule zero_bubble: the 1f1b gradient loop, then the W
  slots and the bubbles (the S=3, M=4 example of gpipe.schedule.zero_bubble's
  docstring, stage 0 first)."""
  assert schedule_text.main(['--num_stages', '3', '--num_microbatches', '4',
                            '--backward_schedule', 'zero_bubble']) == 0
  text = capsys.readouterr().out
  assert "backward_schedule='1f1b': 8 gradient-loop iterations" in text
  assert ('  W slots in 4 of 6 backward iterations; a ring of 3 W\'s '
          'operands a stage (at most 2 waiting)\n'
          '  weighted bubble of the gradient loop (F = B = W): 1f1b 6, '
          "zero_bubble 4 (0.67 of 1f1b's), per-stage branches 4, fill "
          'bound 2\n') in text
  assert ('stage 0    .,- .,- 0,0 1,1 2,2 3,3\n'
          'stage 1    .,- 0,- 1,0 2,1 3,2 .,3\n'
          'stage 2    0,- 1,- 2,0 3,1 .,2 .,3') in text


def test_zero_bubble_is_drawn_as_it_is_printed():
  """Read from the pixels of the picture's second axes: each B half (upper)
  and W half (lower) coloured by the microbatch the printed table (the
  S=3, M=4 example above) gives, grey where a task idles, white where no W
  slot is."""
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  sched = schedule_lib.Schedule(3, 4, 1)
  printed = {0: '.,- .,- 0,0 1,1 2,2 3,3', 1: '.,- 0,- 1,0 2,1 3,2 .,3',
             2: '0,- 1,- 2,0 3,1 .,2 .,3'}
  fig, _ = schedule_plot.Figure(sched, schedule_lib.ZeroBubble(sched))
  try:
    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(int)
    ax = fig.axes[1]
    box = ax.get_window_extent()
    cell_w, cell_h = box.width / 6, box.height / 3
    palette = np.round(
        np.asarray(pyplot.get_cmap('tab20').colors) * 255).astype(int)

    def Seen(stage, k, upper):
      """What the half at (stage, k) shows: 'm', '.' (grey) or '-'."""
      x = int(box.x0 + (k + 0.15) * cell_w)
      row_bottom = box.y0 + (2 - stage) * cell_h
      y = int(pixels.shape[0] - (row_bottom + (0.9 if upper else 0.4) *
                                 cell_h))
      patch = pixels[y - 2:y + 3, x - 2:x + 3].reshape(-1, 3)
      matches = [m for m in range(4) if np.abs(patch - palette[m]).max() <= 2]
      if matches:
        return str(matches[0])
      if (patch >= 253).all():
        return '-'
      assert np.ptp(patch, axis=1).max() <= 2, (stage, k, upper, patch)
      return '.'

    for stage, line in printed.items():
      for k, cell in enumerate(line.split()):
        b, w = cell.split(',')
        assert Seen(stage, k, True) == b, (stage, k, 'B')
        assert Seen(stage, k, False) == w, (stage, k, 'W')
  finally:
    pyplot.close(fig)
