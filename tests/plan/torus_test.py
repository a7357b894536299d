"""The links a collective along each mesh axis drives, by hand (no compile).

gpipe.plan.torus lays a mesh on a slice's dimensions, its last axis
fastest: two links for each closed dimension an axis spans whole, one for
one that does not close or that it shares. The figures below are counted
by hand from that rule.
"""

import dataclasses

import pytest

from gpipe.plan import collectives
from gpipe.plan import roofline
from gpipe.plan import torus
from gpipe.xla import hlo_text


@pytest.mark.parametrize('mesh, slice_dims, closed, links', [
    ((1, 256, 1), (16, 16), None, (1, 4, 1)),  # FSDP over a whole pod
    ((1, 16, 16), (16, 16), None, (1, 2, 2)),  # FSDP 16 x tensor 16
    ((16, 16), (16, 16), (True, False), (2, 1)),  # the fast dim: no wrap
    ((2, 4, 2), (4, 4), (False, False), (1, 2, 1)),  # data over parts of 2
    ((1, 8, 2), (16, 1), (True, True), (1, 1, 1)),  # sharing one dim
    ((4, 64, 1), (16, 16), None, (1, 3, 1)),  # a whole dim and a part
    ((1, 1, 1), (1, 1), None, (1, 1, 1)),
])
def test_links_per_axis_by_hand(mesh, slice_dims, closed, links):
  assert torus.LinksPerAxis(mesh, slice_dims, closed) == links


def test_a_mesh_off_the_slice_is_refused():
  with pytest.raises(ValueError, match=(
      r"mesh 1x16x1 has 16 devices, the slice 16x16 256: give a mesh of "
      r"the slice's chips")):
    torus.LinksPerAxis((1, 16, 1))
  with pytest.raises(ValueError, match=(
      r"a mesh axis of 2 chips does not lie along the slice's dimensions")):
    torus.LinksPerAxis((1, 3, 2), (2, 3), (False, False))


def test_a_collective_sends_over_the_links_of_its_axes():
  """An all-gather of f32[8] over 4 devices sends 24 bytes: at 1 B/s one
  link takes 24 s; along the data axis of a chip with 4 links there, 6 s;
  along the model axis (1 link) 24 s again; over both (a group of all 4),
  its faster axis's 4: 6 s. No hop, HBM free."""
  chip = roofline.Chip('toy', 1.0, 1.0, float('inf'), ici_bandwidth=2.0,
                       ici_ports=1)
  wide = roofline.Chip('toy', 1.0, 1.0, float('inf'), ici_bandwidth=2.0,
                       ici_ports=1, links_per_axis=(1, 4, 1))
  mesh = (1, 2, 2)

  def Gather(groups):
    return hlo_text.Collective('all-gather', 'f32[8]', 'c', -1,
                               groups=groups)

  data, model, both = ((0, 2), (1, 3)), ((0, 1), (2, 3)), ((0, 1, 2, 3),)
  seconds = lambda c, on: collectives.Seconds(c, 4, on, 0.0, mesh)
  assert seconds(Gather(((0, 1, 2, 3),)), chip) == pytest.approx(24.0)
  assert seconds(Gather(both), wide) == pytest.approx(6.0)
  # Groups of 2: each chip sends 1/2 of 32 bytes.
  assert seconds(Gather(data), chip) == pytest.approx(16.0)
  assert seconds(Gather(data), wide) == pytest.approx(4.0)
  assert seconds(Gather(model), wide) == pytest.approx(16.0)
  assert wide.Links(()) == 1 and chip.Links((1,)) == 1


def test_a_permute_sends_over_one_link():
  """A rotation sends its 32 bytes to one neighbour: 32 s at 1 B/s, with
  4 links along its axis or 1."""
  wide = roofline.Chip('toy', 1.0, 1.0, float('inf'), ici_bandwidth=2.0,
                       ici_ports=1, links_per_axis=(4,))
  permute = hlo_text.Collective('collective-permute', 'f32[8]', 'c', -1,
                                groups=((0, 1), (1, 0)))
  assert collectives.Seconds(permute, 2, wide, 0.0, (2,)) == (
      pytest.approx(32.0))


def test_a_slice_gives_each_mesh_its_links():
  """v5e: a dimension closes at 16 only; v5p at whole cubes. A chip on a
  slice gets the links of the mesh it is given; links said stay."""
  assert torus.Closed('v5e', (4, 8)) == (False, False)
  assert torus.Closed('v5e', (16, 16)) == (True, True)
  assert torus.Closed('v5p', (4, 4, 2)) == (True, True, False)
  v5e = roofline.CHIPS['v5e']
  assert torus.OnSlice(v5e, (1, 4, 8)) is v5e
  on_pod = dataclasses.replace(v5e, slice_dims=(16, 16))
  assert torus.OnSlice(on_pod, (1, 256, 1)).links_per_axis == (1, 4, 1)
  assert torus.OnSlice(on_pod, (16, 8, 2)).links_per_axis == (2, 1, 1)
  small = dataclasses.replace(v5e, slice_dims=(4, 8))
  assert torus.OnSlice(small, (1, 4, 8)).links_per_axis == (1, 1, 1)
  said = dataclasses.replace(on_pod, links_per_axis=(1, 1, 1))
  assert torus.OnSlice(said, (1, 256, 1)) is said
