"""Hypothesis strategies: random global tensors laid out at random over a world of ranks."""

from __future__ import annotations

import itertools
from math import prod

from hypothesis import assume
from hypothesis import strategies as st

from ckptkit.errors import LayoutError
from ckptkit.layout.box import Box, Region
from ckptkit.layout.grid import Fused, GridLayout, Mesh, On, Replicate, Shard
from ckptkit.layout.pieces import LocalBox, LocalFlat, Piece

from .simulator import LocalTensor, fill_expected


def factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(n,)]
    out = []
    for d in range(1, n + 1):
        if n % d == 0:
            out.extend((d, *rest) for rest in factorizations(n // d, parts - 1))
    return out


@st.composite
def compositions(draw, total: int, parts: int) -> tuple[int, ...]:
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *cuts, total]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


@st.composite
def grid_layouts(draw, shape: tuple[int, ...], world: int) -> GridLayout:
    mesh_ndim = draw(st.integers(1, 3))
    mesh_shape = draw(st.sampled_from(factorizations(world, mesh_ndim)))
    ranks = tuple(draw(st.permutations(range(world))))
    mesh = Mesh(tuple(f"d{i}" for i in range(mesh_ndim)), mesh_shape, ranks)
    ndim = len(shape)
    padded = None
    if ndim and draw(st.booleans()):
        axis = draw(st.integers(0, ndim - 1))
        padded_l = list(shape)
        padded_l[axis] += draw(st.integers(1, 3))
        padded = tuple(padded_l)
    full = padded or shape
    fused = None
    if ndim and draw(st.integers(0, 3)) == 0:
        axis = draw(st.integers(0, ndim - 1))
        fused = Fused(axis, draw(compositions(full[axis], draw(st.integers(1, 3)))))
    placements = []
    sharded_axes: set[int] = set()
    for k in mesh_shape:
        kind = draw(st.sampled_from(["r", "s", "s", "ss", "sizes", "on"] if ndim else ["r", "on"]))
        if kind == "r":
            placements.append(Replicate())
        elif kind == "on":
            placements.append(On(draw(st.integers(0, k - 1))))
        else:
            axis = draw(st.integers(0, ndim - 1))
            if kind == "sizes" and axis not in sharded_axes and not (fused and fused.axis == axis):
                m = draw(st.integers(1, 2))
                placements.append(Shard(axis, sizes=draw(compositions(full[axis], k * m))))
            elif kind == "ss":
                placements.append(Shard(axis, split_factor=draw(st.integers(2, 3))))
            else:
                placements.append(Shard(axis))
            sharded_axes.add(axis)
    try:
        layout = GridLayout(mesh, tuple(placements), shape, padded, fused)
        for coord in itertools.product(*(range(n) for n in mesh_shape)):
            layout.local_pieces(coord)
    except LayoutError:
        assume(False)
    return layout


def grid_world(key: str, layout: GridLayout, world: int) -> dict[int, LocalTensor]:
    out = {}
    for rank in range(world):
        coord = layout.mesh.coordinate(rank)
        assert coord is not None
        held = layout.local_pieces(coord)
        shape = held[0] if held is not None else tuple(0 for _ in layout.shape)
        if held is None:
            continue
        out[rank] = LocalTensor(shape, grid=(key, layout, coord))
    return out


@st.composite
def explicit_world(draw, key: str, shape: tuple[int, ...], world: int) -> dict[int, list[LocalTensor]]:
    """A random partition of the tensor into boxes and flat fragments, spread over ranks with replicas."""
    cuts = []
    for n in shape:
        parts = draw(st.integers(1, min(3, max(1, n))))
        sizes = draw(compositions(n, parts))
        bounds = [0]
        for s in sizes:
            bounds.append(bounds[-1] + s)
        cuts.append(bounds)
    boxes = []

    def rec(d: int, offs: list[int], sizes: list[int]) -> None:
        if d == len(shape):
            boxes.append(Box(tuple(offs), tuple(sizes)))
            return
        for a, b in zip(cuts[d], cuts[d][1:]):
            if b > a:
                rec(d + 1, [*offs, a], [*sizes, b - a])

    rec(0, [], [])
    regions: list[Region] = []
    for box in boxes:
        if box.numel > 1 and draw(st.booleans()):
            fr = draw(compositions(box.numel, draw(st.integers(1, 3))))
            a = 0
            for n in fr:
                if n:
                    regions.append(Region(box, (a, a + n)))
                a += n
        else:
            regions.append(Region(box))
    per_rank: dict[int, list[tuple[Region, tuple[int, int] | None]]] = {r: [] for r in range(world)}
    for region in regions:
        holders = draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True))
        for i, r in enumerate(holders):
            per_rank[r].append((region, (i, len(holders)) if len(holders) > 1 else None))
    out: dict[int, list[LocalTensor]] = {}
    for rank, held in per_rank.items():
        tensors: list[LocalTensor] = []
        packed: list[Piece] = []
        pos = 0
        for region, replica in held:
            if region.flat is None and draw(st.booleans()):
                pad = draw(st.integers(0, 2))
                lshape = tuple(s + pad for s in region.box.sizes)
                local = LocalBox(tuple(pad for _ in region.box.sizes))
                tensors.append(LocalTensor(lshape, pieces=(Piece(key, shape, region, local, replica),)))
            else:
                pos += draw(st.integers(0, 2))
                packed.append(Piece(key, shape, region, LocalFlat(pos), replica))
                pos += region.numel
        if packed:
            tensors.append(LocalTensor((pos + draw(st.integers(0, 2)),), pieces=tuple(packed)))
        out[rank] = tensors
    return out


@st.composite
def worlds(draw, keys: tuple[str, ...], shapes: dict[str, tuple[int, ...]], world: int) -> list[list[LocalTensor]]:
    """A world of ``world`` ranks holding every tensor in ``keys`` under random layouts."""
    ranks: list[list[LocalTensor]] = [[] for _ in range(world)]
    for key in keys:
        shape = shapes[key]
        if len(shape) and draw(st.booleans()):
            for rank, tensors in draw(explicit_world(key, shape, world)).items():
                ranks[rank].extend(tensors)
        else:
            layout = draw(grid_layouts(shape, world))
            for rank, t in grid_world(key, layout, world).items():
                ranks[rank].append(t)
    return ranks


shapes_st = st.lists(st.integers(1, 7), min_size=0, max_size=3).map(tuple)


def filled(world: list[list[LocalTensor]]) -> list[list[LocalTensor]]:
    for tensors in world:
        for t in tensors:
            t.data = fill_expected(t)
    return world


def total_elements(shape: tuple[int, ...]) -> int:
    return prod(shape)
