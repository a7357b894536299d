"""Which collectives XLA:CPU widened from bfloat16, read off the module.

XLA:CPU moves no bfloat16. After partitioning, its passes widen a bfloat16
all-reduce to float32 (all-reduce-promotion, which renames the reduction
`..._promoted`) and other bfloat16 collectives too
(float-normalization-bf16): each gets a convert of its bfloat16 operand
to float32 on the way in, and its float32 result is narrowed back to
bfloat16 on the way out. A TPU moves such a collective as bfloat16, at
half the bytes the CPU module shows.

A float32 collective fed by a convert from bfloat16 is not always one of
them: a program may itself sum bfloat16 values in float32 (a gradient
accumulated in float32, then exchanged), and then a TPU sends float32
too. What tells them apart is the way out: an element was widened only
where every use of it narrows it back to bfloat16 (a convert, or a
fusion whose parameter only feeds such converts), through bitcasts,
copies, reshapes and broadcasts. Plain text parsing, as gpipe.xla.hlo_text.
"""

import re

# An instruction's line up to its operands' opening parenthesis: its name,
# type and op (the operands may hold parentheses of their own).
INSTRUCTION_HEAD = (r'^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*'
                    r'(?P<type>.*?)\s(?P<op>[a-z][a-z0-9\-]*)\(')
DEF_RE = re.compile(INSTRUCTION_HEAD + r'(?P<args>[^)]*)\)')
# XLA:CPU's all-reduce-promotion names the widened reduction so.
_PROMOTED_RE = re.compile(r'\bto_apply=%?[\w.\-]*_promoted\b')
_CALLS_RE = re.compile(r'\bcalls=%?([\w.\-]+)')
_INDEX_RE = re.compile(r'\bindex=(\d+)')
# Ops that keep a value's dtype and its values (a broadcast copies them).
_UNCHANGED_OPS = ('bitcast', 'copy', 'reshape', 'broadcast')
_DEPTH = 8  # how many such ops are followed, either way


class Module:
  """A module's instructions by computation, with their operands and
  users: what a collective's operand was made from, and what its result
  becomes."""

  def __init__(self, computations):
    """computations: {name: [instruction lines]} (hlo_text's parse)."""
    self._defs, self._users, self._params = {}, {}, {}
    for comp, lines in computations.items():
      defs = self._defs[comp] = {}
      users = self._users[comp] = {}
      params = self._params[comp] = {}
      for line in lines:
        match = DEF_RE.match(line)
        if not match:
          continue
        name, op = match.group('name'), match.group('op')
        args = re.findall(r'%([\w.\-]+)', match.group('args'))
        defs[name] = (match.group('type'), op, args, line)
        if line.lstrip().startswith('ROOT'):
          defs[None] = defs[name]
        if op == 'parameter':
          params[int(match.group('args'))] = name
        for arg in args:
          users.setdefault(arg, []).append(name)

  def WidenedElements(self, computation, line):
    """Per element of a collective's result (its HLO line in
    `computation`): whether XLA:CPU widened it from bfloat16: its
    reduction promoted, or a float32 made by converting a bfloat16 and
    narrowed back to bfloat16 by every use."""
    match = DEF_RE.match(line)
    if not match:
      return ()
    types = re.findall(r'[a-z]\w*\[[\d,]*\]', match.group('type'))
    args = re.findall(r'%([\w.\-]+)', match.group('args'))
    if _PROMOTED_RE.search(line):
      return tuple(t.startswith('f32') for t in types)
    tuple_result = match.group('type').lstrip().startswith('(')
    return tuple(
        t.startswith('f32') and self._FromBfloat16(computation, arg) and
        self._Narrowed(computation, match.group('name'),
                       k if tuple_result else None)
        for k, (t, arg) in enumerate(zip(types, args)))

  def _FromBfloat16(self, computation, name, depth=0):
    """Whether value `name` is a bfloat16 converted to float32 (through
    unchanged ops, and fusions whose root is one)."""
    defs = self._defs.get(computation, {})
    if name not in defs or depth > _DEPTH:
      return False
    _, op, args, line = defs[name]
    if op in _UNCHANGED_OPS and args:
      return self._FromBfloat16(computation, args[0], depth + 1)
    if op == 'convert' and args:
      source = defs.get(args[0])
      return bool(source) and source[0].startswith('bf16')
    callee = _CALLS_RE.search(line) if op == 'fusion' else None
    root = callee and self._defs.get(callee.group(1), {}).get(None)
    if root:
      root_name = DEF_RE.match(root[3]).group('name')
      return self._FromBfloat16(callee.group(1), root_name, depth + 1)
    return False

  def _Narrowed(self, computation, name, index=None, depth=0):
    """Whether every use of value `name` (of its element `index`, a tuple)
    converts it to bfloat16, and it has one."""
    if depth > _DEPTH:
      return False
    defs = self._defs.get(computation, {})
    uses = 0
    for user in self._users.get(computation, {}).get(name, []):
      user_type, op, args, line = defs[user]
      if op == 'get-tuple-element':
        if index is not None and int(_INDEX_RE.search(line).group(1)) != index:
          continue  # another element's
        narrowed = self._Narrowed(computation, user, None, depth + 1)
      elif index is not None:
        narrowed = False  # the tuple used whole (a loop's carry, ...)
      elif op == 'convert':
        narrowed = user_type.lstrip().startswith('bf16')
      elif op in _UNCHANGED_OPS or op.endswith('-done'):
        narrowed = self._Narrowed(computation, user, None, depth + 1)
      elif op == 'fusion':
        narrowed = self._NarrowedInFusion(line, args, name, depth)
      else:
        narrowed = False
      if not narrowed:
        return False
      uses += 1
    return uses > 0

  def _NarrowedInFusion(self, line, args, name, depth):
    """Whether the fusion of HLO `line` narrows operand `name` (at each of
    its positions among the fusion's `args`) to bfloat16 inside."""
    callee = _CALLS_RE.search(line)
    params = self._params.get(callee.group(1), {}) if callee else {}
    positions = [k for k, arg in enumerate(args) if arg == name]
    return bool(positions) and all(
        k in params and
        self._Narrowed(callee.group(1), params[k], None, depth + 1)
        for k in positions)
