"""The README's table of Params is the one their help strings make.

gpipe/pipeline/layer_params.py says what each Param of PipelinedLayer
means; tools/readme_params.py writes the README's Configuration table from
it. These tests fail when the committed table differs from the generated
one, and check that the generator notices a row edited by hand (on a copy of
the README's text, never the file itself).
"""

import pathlib
import re

import pytest

import gpipe  # pylint: disable=unused-import
from gpipe import layers
from gpipe.pipeline import layer_params
from lingvo.core import hyperparams
from tools import readme_params

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_FIX = 'python tools/readme_params.py'


def _Readme():
  return (_ROOT / 'README.md').read_text()


def test_readme_table_matches_the_help_strings():
  problem = readme_params.Check(_Readme())
  if problem:
    pytest.fail('README.md\'s Params table is out of date; regenerate it with '
                f'`{_FIX}`.\n{problem}')


def test_table_rows_are_the_pipelines_params_in_define_order():
  own = hyperparams.Params()
  layer_params.DefineLingvos(own)
  layer_params.DefineGpipes(own)
  expected = [name for name, _ in own.IterParams()]
  expected.insert(expected.index('pipeline_stage_mesh_dim'), 'device_mesh')
  rows = readme_params.Rows()
  assert [name for name, _, _ in rows] == expected
  p = layers.PipelinedLayer.Params()
  for name, default, meaning in rows:
    assert default == p.Get(name), name
    assert meaning and '\n' not in meaning, name
  table = readme_params.Table()
  for row_start in ("| `unroll` | `'eval_only'` | ",
                    '| `device_mesh` | None | ',
                    '| `shard_stages_1d` | False | ',
                    '| `circular_repeat` | 1 | '):
    assert f'\n{row_start}' in table, row_start


def test_check_reports_a_row_edited_by_hand():
  text = _Readme()
  row = re.search(r'^\| `num_stages` \| 1 \| .*\|$', text, re.M).group(0)
  edited = text.replace(row, '| `num_stages` | 1 | Stages, set by hand. |')
  assert edited != text
  problem = readme_params.Check(edited)
  assert '-| `num_stages` | 1 | Stages, set by hand. |' in problem
  assert f'+{row}' in problem
  assert _FIX in problem
  assert readme_params.Render(edited) == text


def test_check_command_exits_1_on_a_stale_copy(tmp_path, capsys):
  page = tmp_path / 'README.md'
  page.write_text(_Readme().replace('| `stream_io` | False |',
                                    '| `stream_io` | True |'))
  assert readme_params.main(['--check', '--readme', str(page)]) == 1
  assert _FIX in capsys.readouterr().out
  assert readme_params.main(['--readme', str(page)]) == 0
  assert page.read_text() == _Readme()
  assert readme_params.main(['--check', '--readme', str(page)]) == 0


@pytest.mark.parametrize('text', [
    'no markers at all\n',
    f'{readme_params.BEGIN}\n| a | b | c |\n',
    f'{readme_params.END}\n{readme_params.BEGIN}\n',
])
def test_render_needs_both_markers_in_order(text):
  with pytest.raises(readme_params.ReadmeParamsError, match='must have'):
    readme_params.Render(text)


def test_a_listed_base_layer_param_that_is_not_one_is_an_error(monkeypatch):
  monkeypatch.setattr(layer_params, 'BASE_LAYER_PARAMS', {
      'device_mesh': ('pipeline_stage_mesh_dim', 'The mesh.'),
      'num_stages': ('unroll', 'Not a base-layer Param.')})
  with pytest.raises(readme_params.ReadmeParamsError, match='num_stages'):
    readme_params.Rows()
