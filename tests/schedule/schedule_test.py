"""Tests for gpipe/schedule/__init__.py against an independent event simulator.

gpipe/schedule/__init__.py is loaded straight from its file under a private module name:
`import gpipe` would run gpipe/__init__.py, which imports TensorFlow, and the
schedule arithmetic must neither need nor build a graph.

The reference is `_Simulate`, which pushes microbatches through a rotating
buffer of S stages one iteration at a time, using only the rules stated in the
schedule's docstring:

  * a microbatch enters stage 0 and moves one stage per iteration;
  * after stage S - 1 it goes back to stage 0 on the next iteration for its
    next repeat, until it has run all R * S logical layers (R == 1: it leaves);
  * stage 0 reads fresh input only in the first S iterations of every R * S
    block (R == 1: every iteration), taking microbatches in order;
  * circular (R > 1): the last segment of S is padded with phantom
    microbatches, which occupy slots but do no useful work.

Nothing in the simulator uses the closed-form formulas of gpipe/schedule/__init__.py.
"""

import ast
import functools
import importlib.util
import itertools
import math
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

_SCHEDULE_PATH = (pathlib.Path(__file__).resolve().parents[2] / 'gpipe' /
                  'schedule' / '__init__.py')

_TF_LOADED_BEFORE = 'tensorflow' in sys.modules
_spec = importlib.util.spec_from_file_location('_gpipe_schedule_under_test',
                                               _SCHEDULE_PATH)
schedule = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(schedule)
_TF_LOADED_AFTER = 'tensorflow' in sys.modules

Schedule = schedule.Schedule
# The diagrams (drawn from whichever Schedule they are given); no TF either.
from gpipe.schedule import text as schedule_text  # pylint: disable=g-import-not-at-top,g-bad-import-order

_SWEEP = list(
    itertools.product(range(1, 6), range(1, 13), range(1, 4)))  # S, M, R.
_SWEEP_IDS = [f'S{s}-M{m}-R{r}' for s, m, r in _SWEEP]

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


class _SimResult:
  """What the simulator observed for one (S, M, R).

  Attributes:
    table: [T][S] of (microbatch, repeat) or None, like Schedule.Table().
    input_iteration: per real microbatch, iteration it entered stage 0.
    output_iteration: per real microbatch, iteration it left the last layer.
    input_index: per iteration, the real microbatch stage 0 read, else M.
    reads_input: per iteration, whether stage 0 took fresh input.
    useful_slots: number of (iteration, stage) slots doing real work.
    slots: {(microbatch, layer): (iteration, stage)} of the real work.
  """

  def __init__(self, table, input_iteration, output_iteration, input_index,
               reads_input, useful_slots, slots):
    self.slots = slots
    self.table = table
    self.input_iteration = input_iteration
    self.output_iteration = output_iteration
    self.input_index = input_index
    self.reads_input = reads_input
    self.useful_slots = useful_slots

  @property
  def num_iterations(self):
    return len(self.table)


@functools.lru_cache(maxsize=None)
def _Simulate(num_stages, num_microbatches, circular_repeat):
  """Runs the pipeline iteration by iteration and checks its consistency."""
  s, m, r = num_stages, num_microbatches, circular_repeat
  num_layers = s * r
  num_fed = m
  if r > 1:  # Pad the last segment of S with phantom microbatches (id >= M).
    while num_fed % s:
      num_fed += 1
  feed = list(range(num_fed))
  buffer = [None] * s  # buffer[stage] = (microbatch, layer) just processed.
  done = {}  # (microbatch, layer) -> (iteration, stage).
  table, input_index, reads_input = [], [], []
  iteration = 0
  limit = 10 * (num_fed * r + s) + 10
  while True:
    assert iteration < limit, 'simulator did not terminate'
    new = [None] * s
    for stage in range(1, s):  # Shift the buffer by one stage.
      if buffer[stage - 1] is not None:
        mb, layer = buffer[stage - 1]
        new[stage] = (mb, layer + 1)
    returning = None  # What the last stage hands back to stage 0.
    if buffer[s - 1] is not None:
      mb, layer = buffer[s - 1]
      if layer + 1 < num_layers:
        returning = (mb, layer + 1)
    fresh = iteration % (r * s) < s
    if fresh:
      # Stage 0 must never overwrite a microbatch that still needs repeats.
      assert returning is None, (
          f'collision at stage 0, iteration {iteration}: {returning}')
      if feed:
        new[0] = (feed.pop(0), 0)
    else:
      new[0] = returning
    if not feed and all(x is None for x in new):
      break
    row = []
    for stage, item in enumerate(new):
      if item is None or item[0] >= m:
        row.append(None)
        continue
      mb, layer = item
      assert layer % s == stage, (item, stage)
      assert 0 <= layer < num_layers, item
      assert item not in done, f'{item} processed twice'
      done[item] = (iteration, stage)
      row.append((mb, layer // s))
    table.append(row)
    reads_input.append(fresh)
    if fresh and new[0] is not None and new[0][0] < m:
      input_index.append(new[0][0])
    else:
      input_index.append(m)
    buffer = new
    iteration += 1

  # Every real (microbatch, layer) ran exactly once, layers in order on
  # consecutive iterations.
  assert set(done) == {(mb, l) for mb in range(m) for l in range(num_layers)}
  for mb in range(m):
    for l in range(1, num_layers):
      assert done[(mb, l)][0] == done[(mb, l - 1)][0] + 1, (mb, l)
  # No stage ever holds two things: each row has S cells, and every
  # (iteration, stage) slot was claimed at most once.
  slots = list(done.values())
  assert len(slots) == len(set(slots))
  input_iteration = [done[(mb, 0)][0] for mb in range(m)]
  assert input_iteration == sorted(input_iteration)  # Enter in order.
  output_iteration = [done[(mb, num_layers - 1)][0] for mb in range(m)]
  return _SimResult(table, input_iteration, output_iteration, input_index,
                    reads_input, len(done), dict(done))


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


# -- The module is TF free. ---------------------------------------------------


def test_loading_schedule_does_not_import_tensorflow():
  if not _TF_LOADED_BEFORE:
    assert not _TF_LOADED_AFTER
  code = (
      'import importlib.util, sys\n'
      'spec = importlib.util.spec_from_file_location(\n'
      f'    "s", {str(_SCHEDULE_PATH)!r})\n'
      'mod = importlib.util.module_from_spec(spec)\n'
      'spec.loader.exec_module(mod)\n'
      'mod.OneFOneB(mod.Schedule(3, 5, 2)).BackwardTables()\n'
      'assert "tensorflow" not in sys.modules, "tensorflow imported"\n'
      'assert "gpipe" not in sys.modules, "gpipe package imported"\n')
  result = subprocess.run([sys.executable, '-c', code],
                          capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stderr


def test_schedule_imports_only_the_standard_library_at_module_level():
  # The arithmetic must be importable (and testable) without TF or NumPy; the
  # only non-standard import is the plotting helper, loaded lazily inside the
  # command when --out is given.
  tree = ast.parse(_SCHEDULE_PATH.read_text())
  top_level = set()
  for node in tree.body:
    if isinstance(node, ast.Import):
      top_level.update(alias.name.split('.')[0] for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      top_level.add(node.module.split('.')[0])
  assert top_level, 'expected at least the dataclasses import'
  assert top_level <= set(sys.stdlib_module_names), (
      top_level - set(sys.stdlib_module_names))
  nested = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node not in tree.body:
      nested.add(node.module)
    elif isinstance(node, ast.Import) and node not in tree.body:
      nested.update(alias.name for alias in node.names)
  assert nested <= {'gpipe'}, nested


# -- The simulator itself. ----------------------------------------------------


def test_simulator_reproduces_hand_worked_examples():
  # Independent of schedule.py: parsed from the hard-coded documented diagrams.
  assert _Simulate(3, 4, 1).table == _ParseDiagram(_LINEAR_DOC_DIAGRAM)
  assert _Simulate(2, 3, 2).table == _ParseDiagram(_CIRCULAR_DOC_DIAGRAM)


# -- Sweep against the simulator. ---------------------------------------------


@pytest.mark.parametrize('s,m,r', _SWEEP, ids=_SWEEP_IDS)
def test_table_and_shape_match_simulator(s, m, r):
  sched = Schedule(s, m, r)
  sim = _Simulate(s, m, r)
  assert sched.num_iterations == sim.num_iterations
  assert sched.Table() == sim.table
  assert sched.num_stages == s
  assert sched.num_layers == s * r
  assert sched.circular == (r > 1)
  assert sim.useful_slots == m * r * s
  total_slots = sim.num_iterations * s
  assert sched.bubble_fraction == pytest.approx(
      (total_slots - sim.useful_slots) / total_slots)
  assert 0.0 <= sched.bubble_fraction < 1.0


@pytest.mark.parametrize('s,m,r', _SWEEP, ids=_SWEEP_IDS)
def test_per_slot_functions_match_simulator(s, m, r):
  sched = Schedule(s, m, r)
  sim = _Simulate(s, m, r)
  margin = 2 * s * r + 1
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
      assert sched.Offset(i, stage) == i - stage
      assert sched.MicrobatchId(i, stage) == mb, (i, stage)
      assert sched.RepeatId(i, stage) == rep, (i, stage)
      assert sched.LayerId(i, stage) == rep * s + stage, (i, stage)
      for value in (sched.MicrobatchId(i, stage), sched.RepeatId(i, stage),
                    sched.LayerId(i, stage)):
        assert type(value) is int  # pylint: disable=unidiomatic-typecheck


@pytest.mark.parametrize('s,m,r', _SWEEP, ids=_SWEEP_IDS)
def test_stage_tables_match_simulator(s, m, r):
  """The [T][S] tables the loop reads, against the simulator: on valid
  slots the cell's microbatch and repeat; on bubbles a microbatch in range;
  stage 0 reads where the simulator says, no other stage ever."""
  sched = Schedule(s, m, r)
  sim = _Simulate(s, m, r)
  tables = sched.StageTables()
  assert set(tables) == {'microbatch', 'repeat', 'seed_offset', 'valid',
                         'reads'}
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


@pytest.mark.parametrize('s,m,r', _SWEEP, ids=_SWEEP_IDS)
def test_per_microbatch_functions_match_simulator(s, m, r):
  sched = Schedule(s, m, r)
  sim = _Simulate(s, m, r)
  for mb in range(m):
    assert sched.InputIteration(mb) == sim.input_iteration[mb], mb
    assert sched.OutputIteration(mb) == sim.output_iteration[mb], mb
  assert sched.OutputIterations() == sim.output_iteration
  assert sched.InputIndexPerIteration() == sim.input_index
  for i in range(sim.num_iterations):
    assert bool(sched.StageZeroReadsInput(i)) == sim.reads_input[i], i
  # The last stage's output at OutputIteration is that microbatch's last layer.
  for mb, i in enumerate(sched.OutputIterations()):
    assert sim.table[i][s - 1] == (mb, r - 1)
  # Per iteration: the microbatch whose last layer the last stage runs, if any.
  finishes = [sim.table[i][s - 1][0]
              if sim.table[i][s - 1] and sim.table[i][s - 1][1] == r - 1
              else -1 for i in range(sim.num_iterations)]
  assert sched.OutputIndexPerIteration() == finishes


@pytest.mark.parametrize('s,m,r', _SWEEP, ids=_SWEEP_IDS)
def test_numpy_grids_match_ints(s, m, r):
  sched = Schedule(s, m, r)
  margin = 2 * s * r + 1
  it, st = _Grid(sched, margin)
  mb_grid = np.arange(-margin, m + margin)
  for dtype in (np.int64, np.int32):
    it_d, st_d = it.astype(dtype), st.astype(dtype)
    per_slot = {
        'Offset': sched.Offset(it_d, st_d),
        'MicrobatchId': sched.MicrobatchId(it_d, st_d),
        'RepeatId': sched.RepeatId(it_d, st_d),
        'LayerId': sched.LayerId(it_d, st_d),
        'IsValid': sched.IsValid(it_d, st_d),
    }
    for name, got in per_slot.items():
      assert got.shape == it.shape, name
      want = np.vectorize(lambda i, k, f=getattr(sched, name): f(int(i), int(k))
                         )(it, st)
      np.testing.assert_array_equal(got, want, err_msg=name)
    assert per_slot['IsValid'].dtype == np.bool_
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
    sim = _Simulate(s, m, r)
    valid = per_slot['IsValid']
    assert int(valid.sum()) == sim.useful_slots


@pytest.mark.parametrize('s,m,r', _SWEEP, ids=_SWEEP_IDS)
def test_layer_iteration_and_state_slots_match_the_simulator(s, m, r):
  # Per-stage decoding states live in slot (iteration, stage) of the work
  # item stage runs then: LayerIteration finds every (microbatch, layer)'s
  # slot, and StateMicrobatchPerSlot names the microbatch of every slot.
  sched = Schedule(s, m, r)
  sim = _Simulate(s, m, r)
  for (mb, layer), (iteration, stage) in sim.slots.items():
    assert sched.LayerIteration(mb, layer) == iteration, (mb, layer)
    assert layer % s == stage
  per_slot = sched.StateMicrobatchPerSlot()
  assert len(per_slot) == sim.num_iterations
  for i, row in enumerate(sim.table):
    assert len(per_slot[i]) == s
    for stage, cell in enumerate(row):
      assert per_slot[i][stage] == (0 if cell is None else cell[0]), (i, stage)


@pytest.mark.parametrize('s,m,r', [(1, 1, 1), (3, 4, 1), (2, 3, 2), (4, 9, 3),
                                   (5, 12, 2)])
def test_only_tensor_ops_are_used(s, m, r):
  """Runs every per-slot function on values that reject non-tensor ops."""
  sched = Schedule(s, m, r)
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


@pytest.mark.parametrize('s,m', list(itertools.product(range(1, 6),
                                                       range(1, 13))))
def test_linear_num_iterations_formula(s, m):
  sched = Schedule(s, m)
  assert sched.circular_repeat == 1
  assert not sched.circular
  assert sched.num_iterations == m + s - 1
  assert sched.num_padded_microbatches == m
  assert sched.bubble_fraction == pytest.approx((s - 1) / (m + s - 1))
  assert Schedule(s, m, 1) == sched


@pytest.mark.parametrize('s,m,r', [x for x in _SWEEP if x[2] > 1])
def test_circular_num_iterations_formula(s, m, r):
  sched = Schedule(s, m, r)
  assert sched.circular
  assert sched.num_padded_microbatches == math.ceil(m / s) * s
  assert sched.num_iterations == r * math.ceil(m / s) * s + s - 1


# -- Documented diagrams. -----------------------------------------------------


def test_docstring_holds_the_hard_coded_diagrams():
  blocks = _DocDiagrams()
  assert [_Words(b) for b in blocks] == [
      _Words(_LINEAR_DOC_DIAGRAM),
      _Words(_CIRCULAR_DOC_DIAGRAM)
  ]


def test_render_linear_doc_example():
  assert schedule_text.Render(Schedule(3, 4, 1)) == _LINEAR_DOC_DIAGRAM


def test_render_circular_doc_example_cells():
  rendered = schedule_text.Render(Schedule(2, 3, 2))
  assert _Words(rendered) == _Words(_CIRCULAR_DOC_DIAGRAM)
  assert _ParseDiagram(rendered) == _Simulate(2, 3, 2).table


def test_render_circular_doc_example_exact_layout():
  assert schedule_text.Render(Schedule(2, 3, 2)) == _CIRCULAR_DOC_DIAGRAM


@pytest.mark.parametrize('s,m,r', _SWEEP, ids=_SWEEP_IDS)
def test_render_cells_match_simulator(s, m, r):
  rendered = schedule_text.Render(Schedule(s, m, r))
  lines = rendered.splitlines()
  assert len(lines) == s + 1
  assert len({len(line) for line in lines}) == 1  # Columns line up.
  assert _ParseDiagram(rendered) == _Simulate(s, m, r).table


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


def test_positional_args_and_default_repeat():
  sched = Schedule(4, 6)
  assert (sched.num_stages, sched.num_microbatches,
          sched.circular_repeat) == (4, 6, 1)
  with pytest.raises(ValueError, match='num_stages'):
    Schedule(0, 6)
  with pytest.raises(ValueError, match='num_microbatches'):
    Schedule(4, 0)


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))


_PHASE_SWEEP = [(s, m, r) for s in range(1, 7) for m in (1, 2, 3, 5, 8, 13)
                for r in (1, 2, 3)]


@pytest.mark.parametrize('s,m,r', _PHASE_SWEEP)
def test_phases_tile_the_loop_and_hold_every_useful_slot(s, m, r):
  """Phases: consecutive runs covering [0, T); each computes a range of
  ceil(S/2) or S stages holding every valid slot of its iterations; at
  most three, the narrow ones first and last."""
  sched = Schedule(s, m, r)
  table = _Simulate(s, m, r).table
  phases = sched.Phases()
  assert 1 <= len(phases) <= 3
  assert phases[0].begin == 0 and phases[-1].end == sched.num_iterations
  for before, after in zip(phases, phases[1:]):
    assert before.end == after.begin
  half = -(-s // 2)
  for k, p in enumerate(phases):
    assert p.end > p.begin
    assert p.num_stages in (half, s)
    assert 0 <= p.first_stage and p.first_stage + p.num_stages <= s
    if p.num_stages < s:
      assert k in (0, len(phases) - 1)
    for i in range(p.begin, p.end):
      for stage in range(s):
        if i < len(table) and table[i][stage] is not None:
          assert p.first_stage <= stage < p.first_stage + p.num_stages, (
              i, stage, p)


def test_phases_hand_worked():
  """The docstring's S=4, M=4 and a short circular one (S=2, M=3, R=2:
  iteration 0 holds stage 0 only; 7 and 8 stage 1 or nothing)."""
  P = schedule.Phase
  assert Schedule(4, 4).Phases() == [P(0, 2, 0, 2), P(2, 5, 0, 4),
                                     P(5, 7, 2, 2)]
  assert Schedule(2, 3, 2).Phases() == [P(0, 1, 0, 1), P(1, 7, 0, 2),
                                        P(7, 9, 1, 1)]
  assert Schedule(1, 5).Phases() == [P(0, 5, 0, 1)]
  assert Schedule(3, 1).Phases() == [P(0, 2, 0, 2), P(2, 3, 1, 2)]


# -- The 1f1b gradient loop (OneFOneB) and stream_io's slots (Streams). -------

_ONE_F_ONE_B_DOC_DIAGRAM = """\
j            0   1   2   3   4   5   6   7
stage 0    0,. 1,. 2,. 3,. .,0 .,1 .,2 .,3
stage 1    .,. 0,. 1,. 2,0 3,1 .,2 .,3 .,.
stage 2    .,. .,. 0,0 1,1 2,2 3,3 .,. .,."""


def _ExpectedBackward(s, m, r):
  """{(microbatch, layer): gradient-loop iteration} from the rule the
  OneFOneB docstring states, over the simulator's forward slots: the last
  layer's backward in the iteration that runs its forward, each earlier
  layer's one iteration after the layer above it."""
  done = _Simulate(s, m, r).slots
  num_layers = s * r
  return {(mb, l): done[(mb, num_layers - 1)][0] + (num_layers - 1 - l)
          for (mb, l) in done}


@pytest.mark.parametrize('s,m,r', _PHASE_SWEEP)
def test_backward_wave_runs_every_call_once_by_the_rule(s, m, r):
  """Every real (microbatch, layer) call is differentiated exactly once, at
  the stage that ran it, at the iteration the rule gives, reading the
  input its forward wrote at the same forward iteration; its input waits
  in the ring fewer than ring_size iterations; bubbles read nothing."""
  sched = Schedule(s, m, r)
  waves = schedule.OneFOneB(sched)
  done = _Simulate(s, m, r).slots
  expected = _ExpectedBackward(s, m, r)
  tables = waves.BackwardTables()
  seen = {}
  for k in range(sched.num_iterations):
    for stage in range(s):
      if not tables['valid'][k][stage]:
        continue
      mb = tables['microbatch'][k][stage]
      layer = tables['repeat'][k][stage] * s + stage
      assert (mb, layer) not in seen, (mb, layer)
      j = k + waves.delay
      seen[(mb, layer)] = j
      forward_iteration, forward_stage = done[(mb, layer)]
      assert forward_stage == stage
      assert tables['iteration'][k][stage] == forward_iteration
      assert 0 <= j - forward_iteration < waves.ring_size
      assert tables['ring_slot'][k][stage] == (forward_iteration %
                                               waves.ring_size)
      assert tables['last_layer'][k][stage] == (layer == s * r - 1)
      assert tables['first_layer'][k][stage] == (layer == 0)
      assert tables['seed_offset'][k][stage] == sched.StepSeedOffset(layer, mb)
  assert seen == expected
  assert waves.ring_size == 2 * s * r - 1


@pytest.mark.parametrize('s,m,r', _PHASE_SWEEP)
def test_gradient_phases_hold_both_waves(s, m, r):
  """The phases tile the gradient loop; the forward wave runs exactly in
  [0, T), the backward wave in [delay, delay + T)."""
  sched = Schedule(s, m, r)
  waves = schedule.OneFOneB(sched)
  phases = waves.Phases()
  assert phases[0].begin == 0 and phases[-1].end == waves.num_iterations
  for before, after in zip(phases, phases[1:]):
    assert before.end == after.begin
  forward = {j for p in phases if p.forward for j in range(p.begin, p.end)}
  backward = {j for p in phases if p.backward for j in range(p.begin, p.end)}
  assert forward == set(range(sched.num_iterations))
  assert backward == set(range(waves.delay, waves.num_iterations))
  assert waves.num_iterations == sched.num_iterations + s * r - 1


def test_one_f_one_b_docstring_diagram():
  assert _ONE_F_ONE_B_DOC_DIAGRAM in _Unindented(schedule.OneFOneB.__doc__)
  assert (schedule_text.RenderGradientLoop(Schedule(3, 4, 1)) ==
          _ONE_F_ONE_B_DOC_DIAGRAM)


def _Unindented(text):
  """text with each line's common indent removed."""
  lines = text.splitlines()
  return '\n'.join(line.strip() and line[6:] for line in lines)


def _Rotate(column):
  """One stage towards stage 0: [c0, c1, ..., cS-1] -> [c1, ..., cS-1, c0]."""
  return column[1:] + column[:1]


@pytest.mark.parametrize('s,m,r', _PHASE_SWEEP)
def test_streams_deliver_in_order_and_end_home(s, m, r):
  """Simulated with Python lists, by the rules gpipe.streams documents:
  stage 0 reads a slot's entry at stage 0, then the slot's column rotates;
  the last stage's output goes to a slot's last entry after its column
  rotates; output gradients are read at the last stage after a rotation;
  input gradients are written at stage 0, then the column rotates. Reads
  come in microbatch order; written streams, after FixupShifts more
  rotations, hold microbatch s K + k at [s][k]."""
  sched = Schedule(s, m, r)
  streams = schedule.Streams(sched)
  k_slots = streams.num_slots
  assert streams.padded_microbatches == s * k_slots >= m > s * (k_slots - 1)
  home = [[st * k_slots + k for k in range(k_slots)] for st in range(s)]

  def Column(stream, k):
    return [stream[st][k] for st in range(s)]

  def SetColumn(stream, k, column):
    for st in range(s):
      stream[st][k] = column[st]

  def Home(stream):
    for k, shift in enumerate(streams.FixupShifts()):
      column = Column(stream, k)
      for _ in range(shift):
        column = _Rotate(column)
      SetColumn(stream, k, column)
    return [[x if x is not None and x < m else None for x in row]
            for row in stream]

  expected = [[x if x < m else None for x in row] for row in home]
  # Inputs, read at stage 0 in the forward schedule's order.
  stream = [list(row) for row in home]
  reads = []
  for k in streams.ReadSlots():
    if k >= 0:
      reads.append(stream[0][k])
      SetColumn(stream, k, _Rotate(Column(stream, k)))
  assert reads == list(range(m))
  # Outputs, written at the last stage.
  stream = [[None] * k_slots for _ in range(s)]
  for i, k in enumerate(streams.WriteSlots()):
    if k >= 0:
      column = _Rotate(Column(stream, k))
      column[-1] = sched.OutputIndexPerIteration()[i]
      SetColumn(stream, k, column)
  assert Home(stream) == expected
  # Backward wave: output gradients read at the last stage, input
  # gradients written at stage 0.
  tables = schedule.OneFOneB(sched).BackwardTables()
  d_out = [list(row) for row in home]
  d_in = [[None] * k_slots for _ in range(s)]
  read_order, write_order = [], []
  for step in range(sched.num_iterations):
    if tables['last_layer'][step][s - 1]:
      k = streams.Slot(tables['microbatch'][step][s - 1])
      SetColumn(d_out, k, _Rotate(Column(d_out, k)))
      read_order.append(d_out[s - 1][k])
    if tables['first_layer'][step][0]:
      mb = tables['microbatch'][step][0]
      write_order.append(mb)
      k = streams.Slot(mb)
      d_in[0][k] = mb
      SetColumn(d_in, k, _Rotate(Column(d_in, k)))
  assert read_order == list(range(m)) == write_order
  assert Home(d_in) == expected
