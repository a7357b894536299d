"""tests/covering.py: the chosen rows see every pair the full product does."""

import itertools

from tests import covering


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


def test_the_sweeps_cover_their_products():
  """Each sweep cut to pairs still sees every pair of its product's values."""
  # pylint: disable=g-import-not-at-top,protected-access
  from tests import decoding_test
  from tests import gshard_builder_test
  from tests import layers_test
  from tests import recurrent_test
  from tests import lingvo_parity_test
  from tests import training_semantics_test
  from tests import training_state_test
  from tests.pipeline import one_f_one_b_test
  from tests.pipeline import stage_ends_test
  # pylint: enable=g-import-not-at-top
  for module, rows, full, features in (
      (layers_test, layers_test._SWEEP, layers_test._FULL_SWEEP,
       layers_test._SWEEP_FEATURES),
      (one_f_one_b_test, one_f_one_b_test._SWEEP,
       one_f_one_b_test._FULL_SWEEP, one_f_one_b_test._SWEEP_FEATURES),
      (training_semantics_test, training_semantics_test._SWEEP,
       training_semantics_test._FULL_SWEEP,
       training_semantics_test._SWEEP_FEATURES),
      (recurrent_test, recurrent_test._SWEEP, recurrent_test._FULL_SWEEP,
       recurrent_test._SWEEP_FEATURES),
      (stage_ends_test, stage_ends_test._SWEEP, stage_ends_test._FULL_SWEEP,
       stage_ends_test._SWEEP_FEATURES),
      (lingvo_parity_test, lingvo_parity_test._GRID,
       lingvo_parity_test._FULL_GRID, lingvo_parity_test._GRID_FEATURES),
      (training_state_test, training_state_test._STATEFUL,
       training_state_test._FULL_STATEFUL,
       training_state_test._STATEFUL_FEATURES),
      (decoding_test, decoding_test._DECODING, decoding_test._FULL_DECODING,
       decoding_test._DECODING_FEATURES),
      (decoding_test, decoding_test._FROM_CACHE,
       decoding_test._FULL_FROM_CACHE, decoding_test._FROM_CACHE_FEATURES),
      (gshard_builder_test, gshard_builder_test._CASES,
       gshard_builder_test._FULL_CASES, gshard_builder_test._FEATURES),
  ):
    assert not covering.Uncovered(rows, full, features), module.__name__
    assert len(rows) < len(full), module.__name__
