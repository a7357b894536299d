"""Where each iteration's extras are kept in gpipe.recurrent's stacks
(`Kept`, exported there), and where their gradients are read back
(`GradientAt`)."""

import dataclasses
from typing import Tuple

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Kept:
  """Which of num_kept kept entries each iteration's extra goes to.

  By default the extra of iteration t is entry t of a [T, ...] stack. An
  extra that only some iterations produce for keeps (the pipeline's
  outputs: one iteration per microbatch finishes it) is kept in num_kept
  entries instead, iteration t's in entry index[t], or nowhere when
  index[t] is -1: the loop then holds num_kept of it, not T, and its
  gradient is read back from the same entry.
  """
  index: Tuple[int, ...]
  num_kept: int

  def __post_init__(self):
    if any(not -1 <= k < self.num_kept for k in self.index):
      raise ValueError(f'Kept: every index must be in [-1, {self.num_kept}); '
                       f'got {list(self.index)}.')

  def At(self, t):
    """The entry iteration t (a scalar tensor) writes: num_kept for none."""
    entries = [self.num_kept if k < 0 else k for k in self.index]
    return tf.gather(tf.constant(entries, tf.int32), t)


def FlatKept(extras_spec, kept_extras):
  """Per flat extras leaf, its Kept, or None for one entry per iteration."""
  if not kept_extras:
    return [None] * len(tf.nest.flatten(extras_spec))
  unknown = set(kept_extras) - set(extras_spec)
  if unknown:
    raise ValueError(f'Recurrent kept_extras names {sorted(unknown)}, which '
                     f'the cell\'s extras ({sorted(extras_spec)}) lack.')
  marked = type(extras_spec)(
      (k, tf.nest.map_structure(lambda _, r=kept_extras.get(k): r, v))
      for k, v in extras_spec.items())
  return tf.nest.flatten(marked)


def GradientAt(d_extra, kept, t):
  """The gradient of iteration t's extra: entry t, or its Kept entry (zeros
  for an iteration whose extra was kept nowhere)."""
  if kept is None:
    return tf.gather(d_extra, t)
  entry = kept.At(t)
  found = tf.gather(d_extra, tf.minimum(entry, kept.num_kept - 1))
  return tf.where(entry < kept.num_kept, found, tf.zeros_like(found))
