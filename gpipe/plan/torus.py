"""How many ICI links a chip's collective along each mesh axis drives at once.

A TPU v5e or v6e chip has four ICI ports, one to each neighbour on a 2-D
torus (a v5p six, on a 3-D one). A ring along a dimension that closes (its
wraparound link: on v5e and v6e only a whole dimension of 16 chips, a
pod's; on v5p a multiple of 4, whole cubes) sends half its
bytes each way at once: two links, one direction each. A dimension that
does not close folds its ring back on itself, and the ring moves at one
link's speed. A collective whose group spans several dimensions runs a
ring in each at once, so its links add up:

    mesh [1, 256, 1] on a 16 x 16 pod   data spans both closed dims: 4
    mesh [1, 16, 16] on a 16 x 16 pod   data 2 (one closed dim), model 2
    mesh [2, 4, 2] on a 4 x 4 slice     1, 2, 1: none closes; data spans
                                        parts of both
    mesh [1, 8, 2] on a 16 x 1 line     data shares the dim with model: 1

(The figures are the ring arithmetic of the jax-ml book "How to Scale
Your Model", its TPU and sharding chapters.) The mesh lies on the slice in
order, its last axis fastest, as a row-major device numbering puts it; an
axis that takes only part of a dimension gets one link: its ring does not
close. `LinksPerAxis` is what `roofline.Chip.links_per_axis` holds and
`gpipe.plan.collectives.Seconds` divides a collective's bytes by.
"""

import dataclasses
import math

# A pod of TPU v5e or v6e: a 16 x 16 torus, every dimension closed.
POD_DIMS = (16, 16)
# Which of a slice's dimensions close, by TPU generation: on v5e and v6e a
# whole 16 (the pod's); on v5p a multiple of 4 (whole cubes, closed by the
# optical switches).
_CLOSES = {'v5e': lambda n: n == 16, 'v6e': lambda n: n == 16,
           'v5p': lambda n: n % 4 == 0}


def Closed(tpu, slice_dims):
  """Per dimension of a `tpu` slice of `slice_dims`, whether it closes."""
  closes = _CLOSES.get(tpu, lambda n: False)
  return tuple(closes(n) for n in slice_dims)


def OnSlice(chip, mesh_shape):
  """`chip` (a roofline.Chip) with the links of `mesh_shape` laid on its
  slice (`chip.slice_dims`); as it is without a slice, or where its links
  are given."""
  if not chip.slice_dims or chip.links_per_axis:
    return chip
  return dataclasses.replace(chip, links_per_axis=LinksPerAxis(
      mesh_shape, chip.slice_dims, Closed(chip.name, chip.slice_dims)))


def LinksPerAxis(mesh_shape, slice_dims=POD_DIMS, closed=None):
  """Per axis of `mesh_shape`, the links (one direction each) a chip's
  collective along it drives at once, the mesh laid on a slice of
  `slice_dims` (`closed`: whether each dimension has its wraparound link;
  default every one of a pod's).

  Raises:
    ValueError: the mesh does not have the slice's chips, or an axis of
      it does not lie along the slice's dimensions in order.
  """
  closed = tuple(closed if closed is not None else [True] * len(slice_dims))
  if math.prod(mesh_shape) != math.prod(slice_dims):
    raise ValueError(
        f'mesh {"x".join(map(str, mesh_shape))} has '
        f'{math.prod(mesh_shape)} devices, the slice '
        f'{"x".join(map(str, slice_dims))} {math.prod(slice_dims)}: give a '
        'mesh of the slice\'s chips.')
  # What is left of each dimension, fastest first: (chips, closed).
  dims = [(n, c) for n, c in zip(slice_dims, closed) if n > 1][::-1]
  return tuple(reversed([_AxisLinks(size, dims)
                         for size in reversed(mesh_shape)]))


def _AxisLinks(size, dims):
  """The links of one mesh axis of `size`, taking it off the front of
  `dims` (changed in place): two for each closed dimension it spans
  whole, one for one that does not close or that it takes a part of (the
  rest of that dimension then does not close either)."""
  links, left = 0, size
  while left > 1:
    chips, closed = dims[0]
    if left % chips == 0:
      links += 2 if closed else 1
      dims.pop(0)
      left //= chips
    elif chips % left == 0:
      dims[0] = (chips // left, False)
      links += 1
      left = 1
    else:
      raise ValueError(
          f'a mesh axis of {size} chips does not lie along the slice\'s '
          'dimensions in order: give --links_per_axis yourself.')
  return max(links, 1)
