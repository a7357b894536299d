"""The report's line breaking: figures stay with their units, words whole."""

from gpipe.plan import text_lines


def test_a_percent_sign_stays_beside_its_figure():
  words = ['MFU 12.5 %;'] * 40
  lines = text_lines.Wrap(' '.join(words))
  assert len(lines) > 1
  assert all(len(line) <= text_lines.WIDTH for line in lines)
  assert not any(line.startswith('%') for line in lines), lines
  assert ' '.join(lines) == ' '.join(words)


def test_items_that_fit_stay_whole_and_a_long_remark_breaks_between_words():
  short = [f'{i} all-reduce over data (1.00 KiB)' for i in range(8)]
  lines = text_lines.Listed('outside the loops: ', short)
  for item in short:
    assert any(item in line for line in lines), (item, lines)
  remark = ' '.join(['assumes a pipeline'] * 12)
  long_item = f'stage 25.5 KiB / floor 12.0 KiB = 2.13 [{remark}]'
  lines = text_lines.Listed('sent per step: ', [long_item])
  assert len(lines) > 1
  assert all(len(line) <= text_lines.WIDTH for line in lines)
  assert 'stage 25.5 KiB / floor 12.0 KiB = 2.13' in lines[0]
  words = ' '.join(line.strip() for line in lines).split()
  assert words == f'sent per step: {long_item}'.split()
