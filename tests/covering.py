"""Pairwise covering designs: a sweep's rows that see every pair of values.

A sweep over several settings (stages, microbatches, repeats, layout,
schedule, mode) as a full product builds a layer per combination; most
bugs show with two of the settings at particular values, so a subset of
the product in which every pair of values that occurs together in the
product occurs together at least once checks what the product does, for
a fraction of the builds. Keep the full product where three or more
settings must meet (say so in a comment where the sweep is).

    rows = covering.Pairwise(full_product, features)

`features` are functions of a row (e.g. lambda row: row[0] for S, or
lambda row: 'M=S' if row[1] == row[0] else ... for a relation between two
of them): a pair is two features' values in one row. The rows are chosen
greedily, in a fixed order (the same on every xdist worker), each the
candidate that covers the most pairs not yet covered, the first such in
`rows`' order; they come back in `rows`' order.
"""

import itertools


def MicrobatchKind(num_stages, num_microbatches):
  """What a sweep's M is to its S, as a feature: one, fewer than S, S,
  S + 1 (one more than the stages) or many."""
  s, m = num_stages, num_microbatches
  return ('1' if m == 1 else '<S' if m < s else '=S' if m == s else
          'S+1' if m == s + 1 else 'many')


def MicrobatchKindOfRow(row):
  """MicrobatchKind of a sweep's row that starts (S, M, ...)."""
  return MicrobatchKind(row[0], row[1])


def Pairs(row, features):
  """The (feature i, value, feature j, value) pairs one row covers."""
  values = [f(row) for f in features]
  return {(i, values[i], j, values[j])
          for i, j in itertools.combinations(range(len(features)), 2)}


def Pairwise(rows, features, must=()):
  """A subset of `rows` covering every pair any row covers; `must` rows
  (in `rows`) are kept whatever they cover."""
  rows = list(rows)
  chosen = [r for r in rows if r in must]
  missing = set().union(*(Pairs(r, features) for r in rows))
  for r in chosen:
    missing -= Pairs(r, features)
  while missing:
    best = max(rows, key=lambda r: len(Pairs(r, features) & missing))
    chosen.append(best)
    missing -= Pairs(best, features)
  return [r for r in rows if r in chosen]


def Uncovered(rows, full, features):
  """The pairs of `full` that no row of `rows` covers (for the tests)."""
  seen = set().union(*(Pairs(r, features) for r in rows))
  return set().union(*(Pairs(r, features) for r in full)) - seen
