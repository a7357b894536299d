"""Which all-reduces are reduce-scatters, read off the compiled module.

XLA's SPMD partitioner spells a reduce-scatter (partial sums made split)
as an all-reduce each device reads only its part of; XLA's TPU and GPU
compilers make one reduce-scatter of such a pair (ReduceScatterCreator),
XLA:CPU keeps it. Sequence-parallel blocks (params/sequence_parallel.py)
and their checks ask which all-reduces are such pairs; the planner charges
each as the reduce-scatter a TPU runs (`AsTpuRuns`), which sends half the
bytes of the all-reduce. Plain text parsing, as gpipe.xla.hlo_text.
"""

import dataclasses
import re

from gpipe.xla import hlo_text as hlo_text_lib
from gpipe.xla import widening


def ScatteredElements(hlo_text):
  """{(computation, all-reduce name): per element of its result, the shape
  every reader slices of it, or None where it is read whole}.

  XLA's SPMD partitioner spells a reduce-scatter (partial sums made split)
  as an all-reduce each device reads only its part of: a dynamic-slice of
  1/n of it at an offset made from its partition id. XLA's TPU and GPU
  compilers rewrite such a pair into one reduce-scatter
  (ReduceScatterCreator); XLA:CPU keeps it, the slice fused into its
  readers. An element counts as sliced when every read of it (through
  get-tuple-element, converts, into fusions and out of them) is a
  dynamic-slice of one shape.
  """
  computations, _ = hlo_text_lib.ParseComputations(hlo_text)
  definitions = _Definitions(computations)
  readers = {}
  for comp, defs in definitions.items():
    for name, (_, _, args, _) in defs.items():
      for i, arg in enumerate(args if name is not None else ()):
        readers.setdefault((comp, arg), []).append((name, i))

  def Sliced(comp, name, fusion=None):
    """The one shape all reads of value `name` slice, or None; through
    converts and copies (XLA:CPU reduces bfloat16 in float32), and out of
    `fusion` (comp's caller, (computation, instruction)) at comp's root."""
    shapes = set()
    if fusion and definitions[comp].get(None) is definitions[comp][name]:
      shapes.add(Sliced(*fusion))
    for user, operand in readers.get((comp, name), ()):
      _, op, _, line = definitions[comp][user]
      if op == 'dynamic-slice' and operand == 0:
        shapes.add(re.search(r'dynamic_slice_sizes=\{([\d,]*)\}', line)
                   .group(1))
      elif op in ('convert', 'copy'):
        shapes.add(Sliced(comp, user, fusion))
      elif op == 'fusion':
        callee = re.search(r'\bcalls=%?([\w.\-]+)', line).group(1)
        param = next(n for n, d in definitions[callee].items() if n and
                     re.search(rf'parameter\({operand}\)', d[3]))
        shapes.add(Sliced(callee, param, (comp, user)))
      else:
        return None
    return shapes.pop() if len(shapes) == 1 else None

  found = {}
  for comp, defs in definitions.items():
    for name, (hlo_type, op, _, _) in defs.items():
      if name is None or op != 'all-reduce':
        continue
      if not hlo_type.startswith('('):
        found[(comp, name)] = (Sliced(comp, name),)
        continue
      elements = [None] * len(hlo_text_lib.ShapesOf(hlo_type))
      for user, _ in readers.get((comp, name), ()):
        user_line = defs[user][3]
        index = re.search(r'\bindex=(\d+)', user_line)
        if defs[user][1] == 'get-tuple-element' and index:
          elements[int(index.group(1))] = Sliced(comp, user)
      found[(comp, name)] = tuple(elements)
  return {key: tuple(None if s is None else tuple(
      int(d) for d in s.split(',') if d) for s in value)
          for key, value in found.items()}


def AsTpuRuns(compiled):
  """`compiled` (a CompiledModule) with its collectives as a TPU's compiler
  runs them: each all-reduce element every device slices
  (ScatteredElements) taken out as a reduce-scatter of the slice's shape
  (the same instruction's name: one task of the step, in two parts)."""
  scattered = ScatteredElements(compiled.hlo)
  out = []
  for c in compiled.collectives:
    sliced = scattered.get((c.computation, c.name), ()) if (
        c.kind == 'all-reduce') else ()
    if not any(sliced):
      out.append(c)
      continue
    dtypes = re.findall(r'([a-z]\w*)\[[\d,]*\]', c.shape)
    widened = c.widened or (False,) * len(dtypes)
    parts = {True: ([], []), False: ([], [])}
    for dtype, shape, whole, wide in zip(
        dtypes, hlo_text_lib.ShapesOf(c.shape), sliced, widened):
      part = shape if whole is None else whole
      types, wides = parts[whole is not None]
      types.append(f"{dtype}[{','.join(map(str, part))}]")
      wides.append(wide)
    for is_sliced, (types, wides) in parts.items():
      if types:
        out.append(dataclasses.replace(
            c, kind='reduce-scatter' if is_sliced else 'all-reduce',
            shape='(' + ', '.join(types) + ')', widened=tuple(wides)))
  return dataclasses.replace(compiled, collectives=out)


def _Definitions(computations):
  """{computation: {instruction name: (type, op, [operand names], line)}}."""
  found = {}
  for comp, lines in computations.items():
    defs = found[comp] = {}
    for line in lines:
      match = widening.DEF_RE.match(line)
      if match:
        args = re.findall(r'%([\w.\-]+)', match.group('args'))
        defs[match.group('name')] = (match.group('type'), match.group('op'),
                                     args, line)
        if line.lstrip().startswith('ROOT'):
          defs[None] = defs[match.group('name')]
  return found
