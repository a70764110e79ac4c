"""Properties of ckptkit.layout.zero_partition: DeepSpeed ZeRO's flat partitioning, without torch.

The facts are cross-checked against live DeepSpeed engines in
tests/test_deepspeed.py; here the invariants every layout must keep are
checked over many random groups: every parameter element is held by exactly
one rank, fragments never overlap inside a rank's buffer, the buffer sizes
and padding follow DeepSpeed's rules.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.errors import LayoutError
from ckptkit.layout.zero_partition import (
    Zero3SubGroup,
    Zero12Group,
    param_alignment,
    round_robin_order,
    zero3_sub_groups,
)

numels = st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=12)
dps = st.integers(min_value=1, max_value=9)


def _owners(fragments_by_rank, numels):
    """element -> number of (rank, fragment) holding it, per parameter; and per-rank local overlaps."""
    seen = [[0] * n for n in numels]
    for frags in fragments_by_rank:
        used = set()
        for f in frags:
            assert 0 <= f.start < f.stop <= numels[f.param]
            local = range(f.local_start, f.local_start + f.numel)
            assert used.isdisjoint(local)
            used.update(local)
            for e in range(f.start, f.stop):
                seen[f.param][e] += 1
    return seen


@settings(max_examples=300, deadline=None)
@given(numels, dps, st.booleans(), st.sampled_from([1, 2, 4, 8]))
def test_zero12_covers_every_element_once(sizes, dp, round_robin, align):
    order = tuple(round_robin_order(len(sizes), dp)) if round_robin else None
    g = Zero12Group(tuple(sizes), dp, order, align)
    frags = [g.fragments(r) for r in range(dp)]
    assert all(c == 1 for per in _owners(frags, sizes) for c in per)
    # equal slices, aligned to 2 * dp, holding the used part
    assert g.flat_numel % (2 * dp) == 0 and g.flat_numel >= g.used_numel >= sum(sizes)
    assert g.flat_numel - g.used_numel < 2 * dp
    assert g.partition_numel * dp == g.flat_numel
    for r in range(dp):
        for f in frags[r]:
            assert f.local_start + f.numel <= g.partition_numel - g.padding(r) or f.numel == 0
    assert sum(g.padding(r) for r in range(dp)) == g.flat_numel - g.used_numel
    # parameters start on the alignment, the flattening order is kept
    offs = g.offsets
    flat = g.flat_order
    assert all(offs[i] % align == 0 for i in flat)
    assert all(offs[a] + sizes[a] <= offs[b] for a, b in zip(flat, flat[1:]))


@settings(max_examples=300, deadline=None)
@given(numels, dps)
def test_zero12_slices_are_contiguous_runs(sizes, dp):
    """Without per-parameter padding, a rank's fragments tile its slice from 0 up to the padding."""
    g = Zero12Group(tuple(sizes), dp)
    for r in range(dp):
        at = 0
        for f in g.fragments(r):
            assert f.local_start == at
            at += f.numel
        assert at == g.partition_numel - g.padding(r)


@settings(max_examples=300, deadline=None)
@given(numels, dps)
def test_zero3_covers_every_element_once(sizes, dp):
    g = Zero3SubGroup(tuple(sizes), dp)
    frags = [g.fragments(r) for r in range(dp)]
    assert all(c == 1 for per in _owners(frags, sizes) for c in per)
    for i, n in enumerate(sizes):
        p = g.partition_numels[i]
        assert p * dp >= n > (p - 1) * dp or n == 0
        held = [g.param_fragment(i, r) for r in range(dp)]
        assert sum(f.numel for f in held if f is not None) == n
    assert g.partition_numel == sum(g.partition_numels)


@settings(max_examples=300, deadline=None)
@given(numels, dps, st.integers(min_value=1, max_value=500))
def test_zero3_sub_groups_split_in_order(sizes, dp, sub_group_size):
    groups = zero3_sub_groups(sizes, dp, sub_group_size)
    assert [i for g in groups for i in g] == list(range(len(sizes)))
    assert all(groups)
    p = Zero3SubGroup(tuple(sizes), dp).partition_numels
    for g in groups[:-1]:  # every sub-group but the last reached the size, the one before its end did not
        assert sum(p[i] for i in g) >= sub_group_size > sum(p[i] for i in g[:-1])


def test_known_layouts():
    """Worked examples, checked by hand against DeepSpeed 0.19 engines (Linear(7,13), Linear(13,5))."""
    g = Zero12Group((91, 13, 65, 5), 2)
    assert (g.flat_numel, g.partition_numel, g.padding(0), g.padding(1)) == (176, 88, 0, 2)
    assert g.fragments(1)[0] == g.fragments(1)[0].__class__(0, 88, 91, 0)
    g4 = Zero12Group((91, 13, 65, 5), 4)
    assert (g4.flat_numel, g4.partition_numel, g4.padding(3)) == (176, 44, 2)
    assert Zero3SubGroup((91, 13, 65, 5), 2).partition_numels == (46, 7, 33, 3)
    assert round_robin_order(5, 2) == [0, 2, 4, 1, 3]
    assert param_alignment(2, True) == 8 and param_alignment(4, True) == 4 and param_alignment(4, False) == 1


def test_bad_input_is_refused():
    with pytest.raises(LayoutError, match="dp size"):
        Zero12Group((3,), 0)
    with pytest.raises(LayoutError, match="permutation"):
        Zero12Group((3, 4), 2, (0, 0))
    with pytest.raises(LayoutError, match="rank 2"):
        Zero3SubGroup((3, 4), 2).fragments(2)
