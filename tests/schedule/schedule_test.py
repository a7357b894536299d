"""Tests for gpipe/schedule/__init__.py against an independent event simulator.

The reference is schedule_reference.py's simulator, which pushes
microbatches through a rotating buffer of S stages one iteration at a time
by the rules the schedule's docstring states (nothing in it uses the
schedule's closed forms). Checked here: the simulator reproduces the
hand-worked examples; Schedule's table, per-call, per-stage and
per-microbatch functions against the simulator over a sweep of S, M, R
and delayed sends, on ints, NumPy grids and values that reject anything a
tensor would not do; the closed forms the docstring states; its diagrams;
parameter validation. The forward loop's phases, the 1f1b gradient loop
and stream_io's columns are in schedule_loops_test.py; that the module
loads without TensorFlow in schedule_imports_test.py.
"""

import itertools
import math
import re

import numpy as np
import pytest

# Loads gpipe/schedule/__init__.py without TensorFlow: before gpipe.
from tests.schedule import schedule_reference  # pylint: disable=g-bad-import-order
# The diagrams (drawn from whichever Schedule they are given); no TF either.
from gpipe.schedule import text as schedule_text  # pylint: disable=g-bad-import-order

schedule = schedule_reference.schedule
Schedule = schedule.Schedule
_Simulate = schedule_reference.Simulate

_SWEEP = list(itertools.product(range(1, 6), range(1, 13), range(1, 4),
                                (False, True)))  # S, M, R, delayed sends.
_SWEEP_IDS = [f'S{s}-M{m}-R{r}' + ('-delayed' if d else '')
              for s, m, r, d in _SWEEP]

# The two diagrams in gpipe/schedule/__init__.py's module docstring.
_LINEAR_DOC_DIAGRAM = """\
iteration   0  1  2  3  4  5
stage 0     0  1  2  3  .  .
stage 1     .  0  1  2  3  .
stage 2     .  .  0  1  2  3"""

_CIRCULAR_DOC_DIAGRAM = """\
iteration     0    1    2    3    4    5    6    7    8
stage 0     0/0  1/0  0/1  1/1  2/0    .  2/1    .    .
stage 1       .  0/0  1/0  0/1  1/1  2/0    .  2/1    ."""

# The delayed sends' diagram there (S=3, M=2, linear: two iterations a hop).
_DELAYED_DOC_DIAGRAM = """\
iteration   0  1  2  3  4  5
stage 0     0  1  .  .  .  .
stage 1     .  .  0  1  .  .
stage 2     .  .  .  .  0  1"""

# Worked by hand: S=2, M=3, R=2 delayed. Segments of 2 S = 4 (one here, a
# phantom fourth microbatch padding it), each microbatch back at stage 0
# four iterations after it left it.
_CIRCULAR_DELAYED_DIAGRAM = """\
iteration     0    1    2    3    4    5    6    7    8    9
stage 0     0/0  1/0  2/0    .  0/1  1/1  2/1    .    .    .
stage 1       .    .  0/0  1/0  2/0    .  0/1  1/1  2/1    ."""


class _StrictInt:
  """An int array that only supports the ops TF int32 tensors share.

  Anything outside `+ - * // %`, comparisons and `&` (in particular `bool()`,
  `int()`, `==` or indexing) raises, so this catches Python control flow on
  values that would be graph tensors.
  """

  __hash__ = None

  def __init__(self, value):
    self.value = np.asarray(value)

  @staticmethod
  def _Unwrap(other):
    if isinstance(other, _StrictInt):
      return other.value
    if isinstance(other, int) and not isinstance(other, bool):
      return other
    raise TypeError(f'unsupported operand {other!r}')

  def _Op(name, reflected=False):  # pylint: disable=no-self-argument
    op = getattr(np.ndarray, name)

    def Method(self, other):
      other = _StrictInt._Unwrap(other)
      if reflected:
        return _StrictInt(op(np.asarray(other), self.value))
      return _StrictInt(op(self.value, other))

    return Method

  __add__ = _Op('__add__')
  __radd__ = _Op('__add__', reflected=True)
  __sub__ = _Op('__sub__')
  __rsub__ = _Op('__sub__', reflected=True)
  __mul__ = _Op('__mul__')
  __rmul__ = _Op('__mul__', reflected=True)
  __floordiv__ = _Op('__floordiv__')
  __rfloordiv__ = _Op('__floordiv__', reflected=True)
  __mod__ = _Op('__mod__')
  __rmod__ = _Op('__mod__', reflected=True)
  __lt__ = _Op('__lt__')
  __le__ = _Op('__le__')
  __gt__ = _Op('__gt__')
  __ge__ = _Op('__ge__')
  __and__ = _Op('__and__')
  __rand__ = _Op('__and__', reflected=True)
  del _Op

  def __neg__(self):
    return _StrictInt(-self.value)

  def __bool__(self):
    raise TypeError('bool() of a tensor-like value')

  def __eq__(self, other):
    raise TypeError('== on a tensor-like value')

  def __ne__(self, other):
    raise TypeError('!= on a tensor-like value')

  def __index__(self):
    raise TypeError('index of a tensor-like value')


def _Grid(sched, margin):
  """Iteration x stage grids covering [-margin, T + margin) x [0, S)."""
  iterations = np.arange(-margin, sched.num_iterations + margin)
  stages = np.arange(sched.num_stages)
  return np.meshgrid(iterations, stages, indexing='ij')


def _ParseDiagram(text):
  """Parses a Render()-style diagram into a [T][S] table of cells."""
  lines = text.strip().splitlines()
  header = lines[0].split()
  assert header[0] == 'iteration'
  num_iterations = len(header) - 1
  assert [int(x) for x in header[1:]] == list(range(num_iterations))
  columns = []
  for stage, line in enumerate(lines[1:]):
    words = line.split()
    assert words[:2] == ['stage', str(stage)], line
    column = []
    for word in words[2:]:
      if word == '.':
        column.append(None)
      elif '/' in word:
        mb, rep = word.split('/')
        column.append((int(mb), int(rep)))
      else:
        column.append((int(word), 0))
    assert len(column) == num_iterations, line
    columns.append(column)
  return [list(row) for row in zip(*columns)]


def _DocDiagrams():
  """The diagram blocks following '::' in the module docstring."""
  blocks = []
  lines = schedule.__doc__.splitlines()
  for n, line in enumerate(lines):
    if not line.rstrip().endswith('::'):
      continue
    block = []
    for following in lines[n + 2:]:
      if not following.strip():
        break
      # Drop a trailing remark such as "('.' = bubble)".
      block.append(re.sub(r'\s+\(.*\)$', '', following).strip())
    blocks.append('\n'.join(block))
  return blocks


def _Words(text):
  return [line.split() for line in text.strip().splitlines()]


# -- The simulator itself. ----------------------------------------------------


def test_simulator_reproduces_hand_worked_examples():
  # Independent of schedule.py: parsed from the hard-coded documented diagrams.
  assert _Simulate(3, 4, 1).table == _ParseDiagram(_LINEAR_DOC_DIAGRAM)
  assert _Simulate(2, 3, 2).table == _ParseDiagram(_CIRCULAR_DOC_DIAGRAM)
  assert _Simulate(3, 2, 1, True).table == _ParseDiagram(_DELAYED_DOC_DIAGRAM)
  assert _Simulate(2, 3, 2, True).table == _ParseDiagram(
      _CIRCULAR_DELAYED_DIAGRAM)


# -- Sweep against the simulator. ---------------------------------------------


def _TableAndShapeMatchSimulator(s, m, r, d=False):
  sched = Schedule(s, m, r, d)
  sim = _Simulate(s, m, r, d)
  assert sched.num_iterations == sim.num_iterations
  assert sched.Table() == sim.table
  assert sched.num_stages == s
  assert sched.num_layers == s * r
  assert sched.circular == (r > 1)
  assert sim.useful_calls == m * r * s
  total_calls = sim.num_iterations * s
  assert sched.bubble_fraction == pytest.approx(
      (total_calls - sim.useful_calls) / total_calls)
  assert 0.0 <= sched.bubble_fraction < 1.0


def _PerCallFunctionsMatchSimulator(s, m, r, d=False):
  sched = Schedule(s, m, r, d)
  sim = _Simulate(s, m, r, d)
  margin = 4 * s * r + 1
  for i in range(-margin, sim.num_iterations + margin):
    for stage in range(s):
      cell = sim.table[i] if 0 <= i < sim.num_iterations else [None] * s
      cell = cell[stage]
      valid = sched.IsValid(i, stage)
      assert isinstance(valid, bool)
      assert valid == (cell is not None), (i, stage)
      # In range on bubbles too: the layer indexes repeats with it unclamped.
      assert 0 <= sched.RepeatId(i, stage) < r, (i, stage)
      if cell is None:
        continue
      mb, rep = cell
      assert sched.Offset(i, stage) == i - (2 if d else 1) * stage
      assert sched.MicrobatchId(i, stage) == mb, (i, stage)
      assert sched.RepeatId(i, stage) == rep, (i, stage)
      assert sched.LayerId(i, stage) == rep * s + stage, (i, stage)
      for value in (sched.MicrobatchId(i, stage), sched.RepeatId(i, stage),
                    sched.LayerId(i, stage)):
        assert type(value) is int  # pylint: disable=unidiomatic-typecheck


def _FieldTablesMatchSimulator(s, m, r, d=False):
  """The [T][S] tables the loop reads, against the simulator: on valid
  calls the cell's microbatch and repeat; on bubbles a microbatch in range;
  stage 0 reads where the simulator says, no other stage ever."""
  sched = Schedule(s, m, r, d)
  sim = _Simulate(s, m, r, d)
  tables = schedule.FieldTables(sched.Rows())
  assert {name: dtype for name, (dtype, _) in tables.items()} == {
      'microbatch': 'int32', 'repeat': 'int32', 'seed_offset': 'int64',
      'valid': 'bool', 'reads': 'bool', 'first_layer': 'bool',
      'last_layer': 'bool'}
  tables = {name: table for name, (_, table) in tables.items()}
  for name, table in tables.items():
    assert len(table) == sim.num_iterations and all(
        len(row) == s for row in table), name
  for i in range(sim.num_iterations):
    for stage in range(s):
      cell = sim.table[i][stage]
      mb = tables['microbatch'][i][stage]
      assert 0 <= mb < m, (i, stage)
      assert tables['valid'][i][stage] == (cell is not None), (i, stage)
      assert tables['reads'][i][stage] == (stage == 0 and
                                           sim.reads_input[i]), (i, stage)
      if cell is None:
        continue
      assert (mb, tables['repeat'][i][stage]) == cell, (i, stage)
      layer = cell[1] * s + stage
      assert tables['seed_offset'][i][stage] == (
          (layer * m + mb) * schedule.STEP_SEEDS_PER_CALL), (i, stage)


def _PerMicrobatchFunctionsMatchSimulator(s, m, r, d=False):
  sched = Schedule(s, m, r, d)
  sim = _Simulate(s, m, r, d)
  for mb in range(m):
    assert sched.InputIteration(mb) == sim.input_iteration[mb], mb
    assert sched.OutputIteration(mb) == sim.output_iteration[mb], mb
  assert sched.OutputIterations() == sim.output_iteration
  # Per iteration, the microbatch stage 0 takes in (M: none), from the rows.
  rows = sched.Rows()
  assert [row[0].microbatch if row[0].first_layer else m
          for row in rows] == sim.input_index
  for i in range(sim.num_iterations):
    assert bool(sched.StageZeroReadsInput(i)) == sim.reads_input[i], i
  # The last stage's output at OutputIteration is that microbatch's last layer.
  for mb, i in enumerate(sched.OutputIterations()):
    assert sim.table[i][s - 1] == (mb, r - 1)
  # Per iteration: the microbatch whose last layer the last stage runs, if any.
  finishes = [sim.table[i][s - 1][0]
              if sim.table[i][s - 1] and sim.table[i][s - 1][1] == r - 1
              else -1 for i in range(sim.num_iterations)]
  assert [row[-1].microbatch if row[-1].last_layer else -1
          for row in rows] == finishes
  # first_layer and last_layer are the calls of layers 0 and L - 1 alone.
  for i, row in enumerate(rows):
    for stage, work in enumerate(row):
      cell = sim.table[i][stage]
      layer = None if cell is None else cell[1] * s + stage
      assert work.first_layer == (layer == 0), (i, stage)
      assert work.last_layer == (layer == r * s - 1), (i, stage)


def _NumpyGridsMatchInts(s, m, r, d=False):
  sched = Schedule(s, m, r, d)
  margin = 4 * s * r + 1
  it, st = _Grid(sched, margin)
  mb_grid = np.arange(-margin, m + margin)
  for dtype in (np.int64, np.int32):
    it_d, st_d = it.astype(dtype), st.astype(dtype)
    per_call = {
        'Offset': sched.Offset(it_d, st_d),
        'MicrobatchId': sched.MicrobatchId(it_d, st_d),
        'RepeatId': sched.RepeatId(it_d, st_d),
        'LayerId': sched.LayerId(it_d, st_d),
        'IsValid': sched.IsValid(it_d, st_d),
    }
    for name, got in per_call.items():
      assert got.shape == it.shape, name
      want = np.vectorize(lambda i, k, f=getattr(sched, name): f(int(i), int(k))
                         )(it, st)
      np.testing.assert_array_equal(got, want, err_msg=name)
    assert per_call['IsValid'].dtype == np.bool_
    got = sched.StageZeroReadsInput(it_d[:, 0])
    want = [sched.StageZeroReadsInput(int(i)) for i in it[:, 0]]
    np.testing.assert_array_equal(got, want)
    mbs = mb_grid.astype(dtype)
    np.testing.assert_array_equal(
        sched.InputIteration(mbs), [sched.InputIteration(int(x)) for x in mbs])
    np.testing.assert_array_equal(
        sched.OutputIteration(mbs),
        [sched.OutputIteration(int(x)) for x in mbs])
    # Valid cells of the grid agree with the simulator.
    sim = _Simulate(s, m, r, d)
    valid = per_call['IsValid']
    assert int(valid.sum()) == sim.useful_calls


def _LayerIterationAndStateCallsMatchTheSimulator(s, m, r, d=False):
  # Per-stage decoding states live in the entry of the call (iteration,
  # stage) that runs them: LayerIteration finds every (microbatch, layer)'s
  # call, and StateMicrobatchPerCall names the microbatch of every call.
  sched = Schedule(s, m, r, d)
  sim = _Simulate(s, m, r, d)
  for (mb, layer), (iteration, stage) in sim.calls.items():
    assert sched.LayerIteration(mb, layer) == iteration, (mb, layer)
    assert layer % s == stage
  per_call = sched.StateMicrobatchPerCall()
  assert len(per_call) == sim.num_iterations
  for i, row in enumerate(sim.table):
    assert len(per_call[i]) == s
    for stage, cell in enumerate(row):
      assert per_call[i][stage] == (0 if cell is None else cell[0]), (i, stage)


@pytest.mark.parametrize('s,m,r,d', [(1, 1, 1, False), (3, 4, 1, False),
                                     (2, 3, 2, False), (4, 9, 3, False),
                                     (5, 12, 2, False), (3, 4, 1, True),
                                     (3, 7, 2, True)])
def test_only_tensor_ops_are_used(s, m, r, d):
  """Runs every per-call function on values that reject non-tensor ops."""
  sched = Schedule(s, m, r, d)
  it, st = _Grid(sched, margin=3)
  i, k = _StrictInt(it), _StrictInt(st)
  for name in ('Offset', 'MicrobatchId', 'RepeatId', 'LayerId', 'IsValid'):
    got = getattr(sched, name)(i, k)
    np.testing.assert_array_equal(got.value, getattr(sched, name)(it, st),
                                  err_msg=name)
  np.testing.assert_array_equal(
      sched.StageZeroReadsInput(_StrictInt(it[:, 0])).value,
      sched.StageZeroReadsInput(it[:, 0]))
  mbs = np.arange(m)
  np.testing.assert_array_equal(
      sched.InputIteration(_StrictInt(mbs)).value, sched.InputIteration(mbs))
  np.testing.assert_array_equal(
      sched.OutputIteration(_StrictInt(mbs)).value, sched.OutputIteration(mbs))


# -- Closed forms stated in the docstring. ------------------------------------


def _LinearNumIterationsFormula(s, m, d=False):
  sched = Schedule(s, m, delayed_sends=d)
  h = 2 if d else 1
  assert sched.circular_repeat == 1
  assert not sched.circular
  assert sched.num_iterations == m + h * (s - 1)
  assert sched.num_padded_microbatches == m
  assert sched.bubble_fraction == pytest.approx(1 - m / (m + h * (s - 1)))
  assert Schedule(s, m, 1, d) == sched


def _CircularNumIterationsFormula(s, m, r, d=False):
  sched = Schedule(s, m, r, d)
  h = 2 if d else 1
  assert sched.circular
  assert sched.num_padded_microbatches == math.ceil(m / (h * s)) * h * s
  assert sched.num_iterations == (r * math.ceil(m / (h * s)) * h * s +
                                  h * (s - 1))


# -- Documented diagrams. -----------------------------------------------------


def test_docstring_holds_the_hard_coded_diagrams():
  blocks = _DocDiagrams()
  assert [_Words(b) for b in blocks] == [
      _Words(_LINEAR_DOC_DIAGRAM),
      _Words(_CIRCULAR_DOC_DIAGRAM),
      _Words(_DELAYED_DOC_DIAGRAM),
  ]


def test_render_linear_doc_example():
  assert schedule_text.Render(Schedule(3, 4, 1)) == _LINEAR_DOC_DIAGRAM


def test_render_circular_doc_example_cells():
  rendered = schedule_text.Render(Schedule(2, 3, 2))
  assert _Words(rendered) == _Words(_CIRCULAR_DOC_DIAGRAM)
  assert _ParseDiagram(rendered) == _Simulate(2, 3, 2).table


def test_render_delayed_examples():
  assert schedule_text.Render(Schedule(3, 2, 1, True)) == _DELAYED_DOC_DIAGRAM
  assert schedule_text.Render(Schedule(2, 3, 2, True)) == (
      _CIRCULAR_DELAYED_DIAGRAM)


def test_render_circular_doc_example_exact_layout():
  assert schedule_text.Render(Schedule(2, 3, 2)) == _CIRCULAR_DOC_DIAGRAM


def _RenderCellsMatchSimulator(s, m, r, d=False):
  rendered = schedule_text.Render(Schedule(s, m, r, d))
  lines = rendered.splitlines()
  assert len(lines) == s + 1
  assert len({len(line) for line in lines}) == 1  # Columns line up.
  assert _ParseDiagram(rendered) == _Simulate(s, m, r, d).table


@pytest.mark.parametrize('s,m,r,d', _SWEEP, ids=_SWEEP_IDS)
def test_schedule_matches_the_simulator(s, m, r, d):
  """Every check of the sweep against the simulator, and the closed form
  of T the docstring states, on one (S, M, R): one test per row, not one
  per row and check (the checks are microseconds; a test item is not)."""
  _TableAndShapeMatchSimulator(s, m, r, d)
  _PerCallFunctionsMatchSimulator(s, m, r, d)
  _FieldTablesMatchSimulator(s, m, r, d)
  _PerMicrobatchFunctionsMatchSimulator(s, m, r, d)
  _NumpyGridsMatchInts(s, m, r, d)
  _LayerIterationAndStateCallsMatchTheSimulator(s, m, r, d)
  _RenderCellsMatchSimulator(s, m, r, d)
  if r == 1:
    _LinearNumIterationsFormula(s, m, d)
  else:
    _CircularNumIterationsFormula(s, m, r, d)


# -- Parameter validation. ----------------------------------------------------

_GOOD = {'num_stages': 2, 'num_microbatches': 3, 'circular_repeat': 2}


@pytest.mark.parametrize('name', sorted(_GOOD))
@pytest.mark.parametrize('bad', [0, -1, 1.5, True, False, None, '2', 2.0],
                         ids=repr)
def test_invalid_params_raise_value_error_naming_param(name, bad):
  kwargs = dict(_GOOD, **{name: bad})
  with pytest.raises(ValueError, match=name) as info:
    Schedule(**kwargs)
  assert repr(bad) in str(info.value)


@pytest.mark.parametrize('bad', [0, 1, None, 'True'], ids=repr)
def test_delayed_sends_must_be_a_bool(bad):
  with pytest.raises(ValueError, match='delayed_sends') as info:
    Schedule(2, 3, 2, bad)
  assert repr(bad) in str(info.value)


def test_positional_args_and_default_repeat():
  sched = Schedule(4, 6)
  assert (sched.num_stages, sched.num_microbatches, sched.circular_repeat,
          sched.delayed_sends, sched.hop) == (4, 6, 1, False, 1)
  assert Schedule(4, 6, 1, True).hop == 2
  with pytest.raises(ValueError, match='num_stages'):
    Schedule(0, 6)
  with pytest.raises(ValueError, match='num_microbatches'):
    Schedule(4, 0)


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
