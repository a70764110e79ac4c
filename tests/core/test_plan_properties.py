"""Property tests of the layout core: any layout A -> any layout B, element by element."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from .simulator import LoadStats, fill_expected, fresh_copy, load, save
from .strategies import filled, shapes_st, worlds

KEYS = ("a", "b")


@st.composite
def scenario(draw):
    shapes = {k: draw(shapes_st) for k in KEYS}
    world_a = draw(st.integers(1, 4))
    world_b = draw(st.integers(1, 4))
    a = draw(worlds(KEYS, shapes, world_a))
    b = draw(worlds(KEYS, shapes, world_b))
    return filled(a), b


@settings(max_examples=300, deadline=None)
@given(scenario())
def test_every_element_lands_exactly_once_with_its_value(sc):
    a, b = sc
    stored = save(a)
    target = fresh_copy(b)
    load(stored, target)
    for tensors in target:
        for t in tensors:
            assert t.data == fill_expected(t)


@settings(max_examples=200, deadline=None)
@given(scenario())
def test_round_trip_a_b_a_is_identity(sc):
    a, b = sc
    mid = fresh_copy(b)
    load(save(a), mid)
    back = fresh_copy(a)
    load(save(mid), back)
    for orig, got in zip(a, back):
        for t0, t1 in zip(orig, got):
            assert t0.data == t1.data


@settings(max_examples=200, deadline=None)
@given(scenario())
def test_same_layout_load_reads_no_byte_twice(sc):
    a, _ = sc
    stats = LoadStats()
    target = fresh_copy(a)
    load(save(a), target, stats)
    assert stats.bytes_read_twice() == 0
    for orig, got in zip(a, target):
        for t0, t1 in zip(orig, got):
            assert t0.data == t1.data
