"""The independent reference of gpipe.schedule's tests: an event simulator.

gpipe/schedule/__init__.py is loaded straight from its file under a private
module name (`schedule` here; its own modules one_f_one_b and work load
with it, as that package's), and so is gpipe/schedule/streams.py
(`streams`): `import gpipe` would run gpipe/__init__.py,
which imports TensorFlow, and the schedule arithmetic must neither need nor
build a graph (TF_LOADED_BEFORE and TF_LOADED_AFTER say whether TensorFlow
was loaded before and after the load).

The reference is `Simulate`, which pushes microbatches through a rotating
buffer of S stages one iteration at a time, using only the rules stated in the
schedule's docstring:

  * a microbatch enters stage 0 and moves one stage per iteration (with
    delayed sends: what a stage made waits one iteration in flight, then
    moves on: one stage per two iterations);
  * after stage S - 1 it goes back to stage 0 the same way for its
    next repeat, until it has run all R * S logical layers (R == 1: it leaves);
  * stage 0 reads fresh input only in the first h S iterations of every
    R h S block (h = 2 with delayed sends, else 1; R == 1: every
    iteration), taking microbatches in order;
  * circular (R > 1): the last segment of h S is padded with phantom
    microbatches, whose calls do no useful work (bubbles).

Nothing in the simulator uses the closed-form formulas of
gpipe/schedule/__init__.py.
"""

import functools
import importlib.util
import pathlib
import sys

SCHEDULE_PATH = (pathlib.Path(__file__).resolve().parents[2] / 'gpipe' /
                 'schedule' / '__init__.py')
STREAMS_PATH = SCHEDULE_PATH.with_name('streams.py')


def _Load(name, path, package=False):
  """The module at `path` under `name`; as a package (its own modules
  importable relative to it) with `package`."""
  spec = importlib.util.spec_from_file_location(
      name, path,
      submodule_search_locations=[str(path.parent)] if package else None)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


TF_LOADED_BEFORE = 'tensorflow' in sys.modules
schedule = _Load('_gpipe_schedule_under_test', SCHEDULE_PATH, package=True)
streams = _Load('_gpipe_schedule_streams_under_test', STREAMS_PATH)
TF_LOADED_AFTER = 'tensorflow' in sys.modules


class SimResult:
  """What the simulator observed for one (S, M, R).

  Attributes:
    table: [T][S] of (microbatch, repeat) or None, like Schedule.Table().
    input_iteration: per real microbatch, iteration it entered stage 0.
    output_iteration: per real microbatch, iteration it left the last layer.
    input_index: per iteration, the real microbatch stage 0 read, else M.
    reads_input: per iteration, whether stage 0 took fresh input.
    useful_calls: number of calls ((iteration, stage) pairs) doing real work.
    calls: {(microbatch, layer): (iteration, stage)} of the real work.
  """

  def __init__(self, table, input_iteration, output_iteration, input_index,
               reads_input, useful_calls, calls):
    self.calls = calls
    self.table = table
    self.input_iteration = input_iteration
    self.output_iteration = output_iteration
    self.input_index = input_index
    self.reads_input = reads_input
    self.useful_calls = useful_calls

  @property
  def num_iterations(self):
    return len(self.table)


@functools.lru_cache(maxsize=None)
def Simulate(num_stages, num_microbatches, circular_repeat,
             delayed_sends=False):
  """Runs the pipeline iteration by iteration and checks its consistency."""
  s, m, r = num_stages, num_microbatches, circular_repeat
  hop = 2 if delayed_sends else 1
  num_layers = s * r
  num_fed = m
  if r > 1:  # Pad the last segment of h S with phantom microbatches (>= M).
    while num_fed % (hop * s):
      num_fed += 1
  feed = list(range(num_fed))
  buffer = [None] * s  # buffer[stage] = (microbatch, layer) just processed.
  in_flight = [None] * s  # With delayed sends: what the stages made before.
  done = {}  # (microbatch, layer) -> (iteration, stage).
  table, input_index, reads_input = [], [], []
  iteration = 0
  limit = 10 * (num_fed * r + s) + 10
  while True:
    assert iteration < limit, 'simulator did not terminate'
    # What moves on now: made last iteration, or (delayed) the one before.
    moving = in_flight if delayed_sends else buffer
    new = [None] * s
    for stage in range(1, s):  # Shift by one stage.
      if moving[stage - 1] is not None:
        mb, layer = moving[stage - 1]
        new[stage] = (mb, layer + 1)
    returning = None  # What the last stage hands back to stage 0.
    if moving[s - 1] is not None:
      mb, layer = moving[s - 1]
      if layer + 1 < num_layers:
        returning = (mb, layer + 1)
    fresh = iteration % (r * hop * s) < hop * s
    if fresh:
      # Stage 0 must never overwrite a microbatch that still needs repeats.
      assert returning is None, (
          f'collision at stage 0, iteration {iteration}: {returning}')
      if feed:
        new[0] = (feed.pop(0), 0)
    else:
      new[0] = returning
    # Delayed: what the stages just made is still on its way.
    on_the_way = [x for x in (buffer if delayed_sends else [])
                  if x is not None and x[1] + 1 < num_layers]
    if not feed and not on_the_way and all(x is None for x in new):
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
    in_flight, buffer = buffer, new
    iteration += 1

  # Every real (microbatch, layer) ran exactly once, layers in order, h
  # iterations apart.
  assert set(done) == {(mb, l) for mb in range(m) for l in range(num_layers)}
  for mb in range(m):
    for l in range(1, num_layers):
      assert done[(mb, l)][0] == done[(mb, l - 1)][0] + hop, (mb, l)
  # No stage ever holds two things: each row has S entries, and every
  # call (iteration, stage) was claimed at most once.
  calls = list(done.values())
  assert len(calls) == len(set(calls))
  input_iteration = [done[(mb, 0)][0] for mb in range(m)]
  assert input_iteration == sorted(input_iteration)  # Enter in order.
  output_iteration = [done[(mb, num_layers - 1)][0] for mb in range(m)]
  return SimResult(table, input_iteration, output_iteration, input_index,
                   reads_input, len(done), dict(done))
