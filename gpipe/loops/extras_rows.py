"""Where each iteration's extras go in gpipe.recurrent's stacks (`Rows`,
exported there), and where their gradients are read back (`GradientAt`)."""

import dataclasses
from typing import Tuple

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Rows:
  """Where an extra of each iteration goes: row index[t] of num_rows.

  By default the extras of iteration t are row t of a [T, ...] stack. An
  extra that only some iterations produce for keeps (the pipeline's
  outputs: one iteration per microbatch finishes it) goes to a stack of
  num_rows instead, iteration t to row index[t], or nowhere when index[t]
  is -1: the loop then holds num_rows of it, not T, and its gradient is
  read back from the same row.
  """
  index: Tuple[int, ...]
  num_rows: int

  def __post_init__(self):
    if any(not -1 <= r < self.num_rows for r in self.index):
      raise ValueError(f'Rows: every index must be in [-1, {self.num_rows}); '
                       f'got {list(self.index)}.')

  def At(self, t):
    """Row of iteration t (a scalar tensor): num_rows when not kept."""
    table = [self.num_rows if r < 0 else r for r in self.index]
    return tf.gather(tf.constant(table, tf.int32), t)


def FlatRows(extras_spec, extras_rows):
  """Per flat extras leaf, its Rows, or None for one row per iteration."""
  if not extras_rows:
    return [None] * len(tf.nest.flatten(extras_spec))
  unknown = set(extras_rows) - set(extras_spec)
  if unknown:
    raise ValueError(f'Recurrent extras_rows names {sorted(unknown)}, which '
                     f'the cell\'s extras ({sorted(extras_spec)}) lack.')
  marked = type(extras_spec)(
      (k, tf.nest.map_structure(lambda _, r=extras_rows.get(k): r, v))
      for k, v in extras_spec.items())
  return tf.nest.flatten(marked)


def GradientAt(d_extra, rows, t):
  """The gradient of iteration t's extra: row t, or its Rows row (zeros
  for an iteration whose extra was kept nowhere)."""
  if rows is None:
    return tf.gather(d_extra, t)
  row = rows.At(t)
  kept = tf.gather(d_extra, tf.minimum(row, rows.num_rows - 1))
  return tf.where(row < rows.num_rows, kept, tf.zeros_like(kept))
