"""What may run beside each collective: read off the step's dependencies.

A collective can be hidden only by work that neither feeds it nor waits for
it: in its own computation (one run of a loop body, a called computation),
an instruction that is neither among its operands, transitively, nor among
its users, transitively (control dependencies count as operands). XLA may
schedule such an instruction while the collective is in flight; anything
else must finish before it starts or wait for its result.

What that work is worth is counted in matrix-unit FLOPs, read off the
instructions' shapes: a dot 2 x its result's elements x the lhs's
contracting dims, a convolution 2 x its result's elements x the kernel's
elements per output feature; a fusion or call the FLOPs of what it calls, a
while loop its body's times its known trip count (unknown: 0), a
conditional its cheapest branch. Only those: elementwise work, reductions
and HBM traffic are left out (they count for little of a step's FLOPs, and
a TPU's vector units and DMA engines are not modelled here), and so is an
instruction that itself holds a collective (a nested loop with its own:
its compute hides those first). The graph both ways (`Module.Edges`:
what each instruction follows, what follows it) is what gpipe.plan.overlap
schedules a computation on. Plain text parsing, as gpipe.xla.hlo_text.
"""

import dataclasses
import re

import numpy as np

from gpipe.xla import hlo_text
from gpipe.xla import widening

_DEF_RE = re.compile(widening.INSTRUCTION_HEAD)
_CONTROL_RE = re.compile(r'control-predecessors=\{([^}]*)\}')
_CONTRACTING_RE = re.compile(r'\blhs_contracting_dims=\{([\d,]*)\}')
_KERNEL_LABELS_RE = re.compile(r'\bdim_labels=[^_\s]*_([^-\s]*)->')


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One instruction of a computation, as its HLO line has it."""
  name: str
  type: str  # its result type, e.g. 'f32[4,8]{1,0}'
  op: str
  operands: tuple  # names of the instructions it reads (and must follow)
  line: str


def _Operands(line, start):
  """Names in the parenthesized operand list opening at `start` (just past
  its '('), and any control predecessors: what the instruction follows."""
  depth, end = 1, start
  while end < len(line) and depth:
    depth += {'(': 1, ')': -1}.get(line[end], 0)
    end += 1
  names = re.findall(r'%([\w.\-]+)', line[start:end])
  for group in _CONTROL_RE.findall(line[end:]):
    names += re.findall(r'%?([\w.\-]+)', group)
  return tuple(names)


def Instructions(lines):
  """{name: Instruction} of a computation's instruction lines."""
  found = {}
  for line in lines:
    match = _DEF_RE.match(line)
    if match:
      found[match.group('name')] = Instruction(
          match.group('name'), match.group('type'), match.group('op'),
          _Operands(line, match.end()), line)
  return found


def _Reach(start, edges):
  """Names reachable from `start` along `edges` ({name: [names]}),
  `start` itself left out."""
  seen, todo = set(), list(edges.get(start, ()))
  while todo:
    name = todo.pop()
    if name not in seen:
      seen.add(name)
      todo.extend(edges.get(name, ()))
  return seen


class Module:
  """A compiled module's computations as dependency graphs."""

  def __init__(self, text):
    computations, self.entry = hlo_text.ParseComputations(text)
    self._graphs = {name: Instructions(lines)
                    for name, lines in computations.items()}
    self._flops, self._holds, self._edges = {}, {}, {}

  def Graph(self, computation):
    """{name: Instruction} of `computation` ({} for an unknown one)."""
    return self._graphs.get(computation, {})

  def Beside(self, computation, name):
    """The instructions of `computation` that neither feed instruction
    `name` nor wait for it, transitively: what may run while it does."""
    follows, users = self.Edges(computation)
    tied = _Reach(name, follows) | _Reach(name, users) | {name}
    return set(follows) - tied

  def Edges(self, computation):
    """({name: what it follows}, {name: what follows it}) over
    `computation`'s instructions, in their order: operands and control
    predecessors, each once, names from outside it left out. Both ways
    at once, so that a walk or a scheduler never scans for users."""
    if computation not in self._edges:
      graph = self.Graph(computation)
      follows = {n: tuple(o for o in dict.fromkeys(i.operands) if o in graph)
                 for n, i in graph.items()}
      users = {n: [] for n in graph}
      for n, before in follows.items():
        for operand in before:
          users[operand].append(n)
      self._edges[computation] = follows, users
    return self._edges[computation]

  def Work(self, computation):
    """{instruction: FLOPs} of `computation`'s instructions that do
    matrix work and hold no collective: what can hide one."""
    work = {}
    for name, instruction in self.Graph(computation).items():
      if (Kind(instruction.op) not in hlo_text.COLLECTIVE_KINDS and
          not any(self.HoldsCollective(c)
                  for c in hlo_text.Callees(instruction.line))):
        flops = self.Flops(computation, instruction)
        if flops > 0:
          work[name] = flops
    return work

  def Flops(self, computation, instruction):
    """Matrix-unit FLOPs of one run of `instruction` (see the module's
    docstring), what it calls included."""
    graph = self.Graph(computation)
    if instruction.op == 'dot':
      lhs = graph[instruction.operands[0]].type
      dims = _CONTRACTING_RE.search(instruction.line).group(1)
      contracted = [hlo_text.ShapesOf(lhs)[0][int(d)]
                    for d in dims.split(',') if d]
      return 2.0 * _Elements(instruction.type) * np.prod(contracted)
    if instruction.op == 'convolution':
      kernel = hlo_text.ShapesOf(graph[instruction.operands[1]].type)[0]
      labels = _KERNEL_LABELS_RE.search(instruction.line).group(1)
      per_output = np.prod(kernel) / kernel[labels.index('o')]
      return 2.0 * _Elements(instruction.type) * per_output
    callees = [self._ComputationFlops(c)
               for c in hlo_text.Callees(instruction.line)]
    if instruction.op == 'while':
      body = hlo_text.WHILE_BODY_RE.search(instruction.line).group(1)
      trips = hlo_text.KnownTripCount(instruction.line) or 0
      return trips * self._ComputationFlops(body)
    if instruction.op == 'conditional':
      return min(callees, default=0.0)
    return float(sum(callees))

  def EntryFlops(self):
    """Matrix-unit FLOPs of one run of the whole module (its loops times
    their known trip counts)."""
    return self._ComputationFlops(self.entry) if self.entry else 0.0

  def _ComputationFlops(self, computation):
    if computation not in self._flops:
      self._flops[computation] = 0.0  # HLO calls no cycles
      self._flops[computation] = float(sum(
          self.Flops(computation, i)
          for i in self.Graph(computation).values()))
    return self._flops[computation]

  def HoldsCollective(self, computation):
    """Whether `computation`, or one it calls, runs a collective."""
    if computation not in self._holds:
      self._holds[computation] = False
      self._holds[computation] = any(
          Kind(i.op) in hlo_text.COLLECTIVE_KINDS or
          any(self.HoldsCollective(c) for c in hlo_text.Callees(i.line))
          for i in self.Graph(computation).values())
    return self._holds[computation]


def Kind(op):
  """A collective's kind from its op: 'all-reduce-start' -> 'all-reduce'."""
  for suffix in ('-start', '-done'):
    if op.endswith(suffix):
      return op[:-len(suffix)]
  return op


def _Elements(hlo_type):
  """Elements of an array type: 'f32[4,8]{1,0}' -> 32."""
  return float(np.prod(hlo_text.ShapesOf(hlo_type)[0]))
