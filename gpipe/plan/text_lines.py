"""The report's prose in lines of a fixed width, a figure kept with its unit.

    Wrap(paragraph)      lines of at most WIDTH, ' %' never broken off
    Listed(head, items)  head and items, broken between items where they fit
"""

import textwrap

WIDTH = 100  # the report's line width
_NO_BREAK = '\0'  # a space Wrap does not break at


def Wrap(paragraph, **kwargs):
  """The paragraph in lines of at most WIDTH, a percentage's sign kept
  beside its figure."""
  return [line.replace(_NO_BREAK, ' ') for line in textwrap.wrap(
      paragraph.replace(' %', _NO_BREAK + '%'), width=WIDTH,
      break_on_hyphens=False, **kwargs)]


def Listed(head, items, sep=', '):
  """head and the items, joined by sep, in lines of at most WIDTH
  indented by 2 (continued by 4), broken between items where they fit;
  one too long for a line breaks in its remark (_Unbroken)."""
  keep = [_Unbroken(item) for item in items]
  return Wrap(head + sep.join(keep), initial_indent='  ',
              subsequent_indent='    ')


def _Unbroken(item):
  """item with its spaces kept from breaking (_NO_BREAK); one too
  long for a line keeps only those before its remark (' [...', ' (...')."""
  cut = len(item)
  if len(item) > WIDTH - 4:
    cut = min([i for i in (item.find(' ['), item.find(' (')) if i >= 0],
              default=cut)
  return item[:cut].replace(' ', _NO_BREAK) + item[cut:]
