"""The pure grid layout agrees with DTensor's own sharding, element for element.

For random shapes, meshes and placements (Shard with uneven torch.chunk sizes,
nested shards, _StridedShard, Replicate), each mesh coordinate's local tensor
is computed the way torch distributes a tensor — applying each placement's
split left to right — and compared with what GridLayout says that coordinate
holds.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from ckptkit.layout.grid import GridLayout, Mesh
from ckptkit.layout.grid import Replicate as GReplicate
from ckptkit.layout.grid import Shard as GShard


def torch_local(full: torch.Tensor, mesh_shape, placements, coord) -> torch.Tensor:
    local = full
    for p, k, c in zip(placements, mesh_shape, coord):
        if isinstance(p, Replicate):
            continue
        shards, _ = p._split_tensor(local, k, with_padding=False, contiguous=True)
        shards = list(shards) + [local.narrow(p.dim, 0, 0)] * (k - len(shards))
        local = shards[c]
    return local


def grid_local(layout: GridLayout, full: torch.Tensor, coord) -> torch.Tensor:
    shape, pieces = layout.local_pieces(coord)
    out = torch.full(shape, -1, dtype=full.dtype)
    for lo, box in pieces:
        src = full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
        out[tuple(slice(o, o + s) for o, s in zip(lo, box.sizes))] = src
    return out


@st.composite
def cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    tp, gp = [], []
    for _ in mesh_shape:
        kind = draw(st.sampled_from(["r", "s", "ss"]))
        dim = draw(st.integers(0, ndim - 1))
        if kind == "r":
            tp.append(Replicate())
            gp.append(GReplicate())
        elif kind == "s":
            tp.append(Shard(dim))
            gp.append(GShard(dim))
        else:
            sf = draw(st.integers(2, 4))
            tp.append(_StridedShard(dim, split_factor=sf))
            gp.append(GShard(dim, split_factor=sf))
    return shape, mesh_shape, tp, gp


@settings(max_examples=400, deadline=None)
@given(cases())
def test_grid_local_pieces_equal_dtensor_local_shards(case):
    shape, mesh_shape, tp, gp = case
    full = torch.arange(1, 1 + torch.Size(shape).numel()).reshape(shape)
    n = 1
    for k in mesh_shape:
        n *= k
    layout = GridLayout(Mesh.arange(tuple(f"d{i}" for i in range(len(mesh_shape))), mesh_shape), tuple(gp), shape)
    for coord in itertools.product(*(range(k) for k in mesh_shape)):
        expected = torch_local(full, mesh_shape, tp, coord)
        got = grid_local(layout, full, coord)
        assert got.shape == expected.shape, (coord, got.shape, expected.shape)
        assert torch.equal(got, expected), coord


def test_fsdp2_tp_example_from_torch_docs():
    # mesh (dp=2, tp=2), placements (_StridedShard(0, sf=2), Shard(0)) on 8 rows: rank (dp, tp) gets row block 2*tp + dp
    layout = GridLayout(Mesh.arange(("dp", "tp"), (2, 2)), (GShard(0, split_factor=2), GShard(0)), (8, 8))
    for dp, tp in itertools.product(range(2), range(2)):
        _, pieces = layout.local_pieces((dp, tp))
        assert [(b.offsets, b.sizes) for _, b in pieces] == [((2 * (2 * tp + dp), 0), (2, 8))]
