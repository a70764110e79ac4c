"""GridLayout.overlapping (the loader's query) agrees with brute-force enumeration of every cell."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.layout.box import Box

from .strategies import grid_layouts, shapes_st


@st.composite
def layout_and_box(draw):
    shape = draw(shapes_st.filter(lambda s: len(s) > 0))
    world = draw(st.integers(1, 8))
    layout = draw(grid_layouts(shape, world))
    offs = tuple(draw(st.integers(0, n - 1)) for n in shape)
    sizes = tuple(draw(st.integers(1, n - o)) for o, n in zip(offs, shape))
    return layout, Box(offs, sizes)


def brute_force(layout, box):
    out = set()
    for coord in itertools.product(*(range(n) for n in layout.mesh.shape)):
        held = layout.local_pieces(coord)
        if held is None:
            continue
        cell = tuple((i, coord[i]) for i in layout.shard_dims)
        for _, b in held[1]:
            if not b.is_empty() and b.intersect(box) is not None:
                out.add((b.offsets, b.sizes, cell))
    return out


@settings(max_examples=400, deadline=None)
@given(layout_and_box())
def test_overlapping_matches_brute_force(case):
    layout, box = case
    got = {(b.offsets, b.sizes, tuple(sorted(cell.items()))) for b, cell in layout.overlapping(box)}
    assert got == brute_force(layout, box)
