"""tests/covering.py: the chosen rows see every pair the full product does."""

import itertools

import pytest

from tests import covering
from tests import decoding_test
from tests import gshard_builder_test
from tests import layers_test
from tests import lingvo_parity_test
from tests import recurrent_test
from tests import training_semantics_test
from tests import training_state_test
from tests.pipeline import one_f_one_b_test
from tests.pipeline import stage_ends_test
from tests.pipeline import vectorized_stages_test


def _Features(n):
  return [lambda row, i=i: row[i] for i in range(n)]


def test_pairwise_covers_every_pair_in_fewer_rows():
  full = list(itertools.product((1, 2, 3, 4), (1, 2, 3), (False, True),
                                ('graph', 'jit')))
  rows = covering.Pairwise(full, _Features(4))
  assert not covering.Uncovered(rows, full, _Features(4))
  assert 12 <= len(rows) < len(full) // 3  # at least 4 x 3 pairs
  assert rows == [r for r in full if r in rows]  # in the product's order
  assert covering.Pairwise(full, _Features(4)) == rows  # the same each time


def test_uncovered_names_a_missing_pair():
  full = list(itertools.product((1, 2), (1, 2)))
  missing = covering.Uncovered([(1, 1), (2, 2)], full, _Features(2))
  assert missing == {(0, 1, 1, 2), (0, 2, 1, 1)}


def test_rows_that_must_stay_stay():
  full = list(itertools.product((1, 2, 3), (1, 2, 3), (1, 2)))
  rows = covering.Pairwise(full, _Features(3), must=[(3, 3, 1), (1, 1, 2)])
  assert (3, 3, 1) in rows and (1, 1, 2) in rows
  assert not covering.Uncovered(rows, full, _Features(3))


# Each sweep cut to pairs: (module, NAME), the module's _NAME the rows it
# runs, _FULL_NAME the product they stand for, _NAME_FEATURES the
# settings they pair.
_SWEEPS = [
    (layers_test, 'SWEEP'), (one_f_one_b_test, 'SWEEP'),
    (training_semantics_test, 'SWEEP'), (recurrent_test, 'SWEEP'),
    (stage_ends_test, 'SWEEP'), (lingvo_parity_test, 'GRID'),
    (training_state_test, 'STATEFUL'), (decoding_test, 'DECODING'),
    (decoding_test, 'FROM_CACHE'), (gshard_builder_test, 'CASES'),
    (vectorized_stages_test, 'AGREE'),
]


@pytest.mark.parametrize('module,name', _SWEEPS,
                         ids=[f'{m.__name__}.{n}' for m, n in _SWEEPS])
def test_the_sweeps_cover_their_products(module, name):
  """Each sweep cut to pairs still sees every pair of its product's values."""
  rows, full, features = (getattr(module, f'_{name}'),
                          getattr(module, f'_FULL_{name}'),
                          getattr(module, f'_{name}_FEATURES'))
  assert not covering.Uncovered(rows, full, features)
  assert len(rows) < len(full)
