"""The words of docs/how-it-works.md keep one meaning in gpipe's identifiers.

Each spelling below once named something else than its word means there
(or guessed at a meaning); none may come back as a name in gpipe's code:
a function, class, argument, variable or attribute.
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_PAGE = ROOT / 'docs' / 'how-it-works.md'

# spelling: (the word it misused, what to call the thing instead)
BANNED = {
    'state_slots': ('slot', "a stage's states [S, ...] are whole tensors, "
                    'not slots: stage_states'),
    'native': ('(none)', 'the inputs as the io holds them: held'),
    'ToNative': ('(none)', 'LoopInputs.Hold'),
    'ReverseNativeOutputs': ('(none)', 'ReverseHeldOutputs'),
    'data_state': ('(none)', "the state entries whose functions are "
                   'activations: activation_state'),
    'marks': ('(none)', 'a list alike an entry list: alike'),
    '_LastSlot': ('slot', 'on a split stage dim it keeps all S slots: '
                  '_KeptOfOutput'),
    '_FirstSlot': ('slot', '_KeptOfInputGradient'),
    'KeptOutputs': ('kept outputs', 'the reverse loop hands its outputs to '
                    'the io: ReverseLoopOutputs'),
    'StageTables': ('row', 'one way to the tables: iteration.Tables'),
    'InputIndexPerIteration': ('row', "the rows' first_layer and microbatch"),
    'OutputIndexPerIteration': ('row', "the rows' last_layer and microbatch"),
    'DirectCell': ('cell', 'it is never traced on its own: DirectStages'),
    'Run': ('(none)', 'say what it runs: a stage runner\'s CallStages, the '
            'stage calls\' Apply, GradientLoop.Gradients, _Loops.Forward'),
}


def _Words():
  """The glossary's words: the first column of the Words table."""
  words = _PAGE.read_text().split('\n## Words\n', 1)[1].split('\n## ', 1)[0]
  return [m.group(1).split()[0]
          for m in re.finditer(r'^\| (\w[^|]*?) \|', words, re.M)
          if m.group(1) != 'word']


def _Names(tree):
  """Every name a module defines or uses: functions, classes, arguments,
  variables and attributes."""
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                         ast.ClassDef)):
      yield node.name, node.lineno
    elif isinstance(node, ast.arg):
      yield node.arg, node.lineno
    elif isinstance(node, ast.Name):
      yield node.id, node.lineno
    elif isinstance(node, ast.Attribute):
      yield node.attr, node.lineno
    elif isinstance(node, ast.keyword) and node.arg:
      yield node.arg, node.value.lineno


def test_the_banned_spellings_name_glossary_words():
  words = set(_Words()) | {'(none)', 'kept outputs'}
  assert {'slot', 'row', 'step', 'cell', 'segment', 'block'} <= words, words
  for spelling, (word, _) in BANNED.items():
    assert word in words, spelling


@pytest.mark.parametrize('path', sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / 'gpipe').rglob('*.py')))
def test_no_identifier_uses_a_banned_spelling(path):
  tree = ast.parse((ROOT / path).read_text())
  found = [f'{path}:{line}: {name} ({BANNED[name][1]})'
           for name, line in _Names(tree) if name in BANNED]
  assert not found, '\n'.join(found)


def test_the_check_finds_a_banned_name():
  tree = ast.parse('def F(state_slots):\n  return state_slots\n')
  assert [n for n, _ in _Names(tree) if n in BANNED] == ['state_slots'] * 2
