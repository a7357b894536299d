"""What a stage does in one iteration (StageWork), typed, and its fields
as tables (FieldTables): the schedule's rows, in pure Python.

Imports nothing of gpipe, as the rest of gpipe.schedule.
"""

import dataclasses
from typing import Dict, List, Sequence, Tuple

__all__ = [
    'StageWork',
    'FieldTables',
]


def Field(dtype):
  """A work's field whose [T, S] tensor has dtype `dtype` (a name)."""
  return dataclasses.field(metadata={'dtype': dtype})


@dataclasses.dataclass(frozen=True)
class StageWork:
  """What one stage does in one iteration, its call (Schedule.WorkAt).

  Typed, not a dict: a misspelt field fails where the work is made, and
  each field declares its tensor's dtype once, beside it, in its metadata
  (no TensorFlow here; FieldTables hands the names on). The loops read
  their work from those [T, S] tensors, a row per iteration, rather than
  compute it in the graph (gpipe.pipeline.iteration.Tables makes them):
  which microbatch stage 0 takes in (its microbatch where first_layer),
  which one the last stage finishes (where last_layer), each stage's
  repeat and step seed, all from here.
  """
  microbatch: int = Field('int32')  # clamped into [0, M) (a bubble's: any)
  repeat: int = Field('int32')  # its circular repeat
  seed_offset: int = Field('int64')  # StepSeedOffset: grows with L M
  valid: bool = Field('bool')  # False on a bubble
  reads: bool = Field('bool')  # takes a fresh microbatch (stage 0 only)
  first_layer: bool = Field('bool')  # runs the microbatch's first layer
  last_layer: bool = Field('bool')  # its output is the microbatch's final


def FieldTables(
    rows: Sequence[Sequence[StageWork]]) -> Dict[str, Tuple[str, List[list]]]:
  """{field: (dtype name, [T][S] values)} of rows of one kind of work (T
  rows of S works): each field's table, for a tf.constant of that dtype."""
  return {f.name: (f.metadata['dtype'],
                   [[getattr(work, f.name) for work in row] for row in rows])
          for f in dataclasses.fields(rows[0][0])}
