"""The memory tier's placement and source planning (pure): every copy on another node, and a
step is restorable exactly when the lost nodes leave a copy or a parity rebuild of every rank."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.errors import OptionsError
from ckptkit.memory.options import MemoryTier
from ckptkit.memory.topology import ParityShare, Topology, plan_sources


@st.composite
def replica_layouts(draw):
    rpn = draw(st.integers(1, 4))
    nodes = draw(st.integers(2, 6))
    replicas = draw(st.integers(0, nodes - 1))
    return Topology(rpn * nodes, rpn, replicas)


@st.composite
def parity_layouts(draw):
    rpn = draw(st.integers(1, 3))
    g = draw(st.integers(2, 5))
    blocks = draw(st.integers(1, 3))
    return Topology(rpn * g * blocks, rpn, 0, g)


def _held_after_loss(topo: Topology, lost_nodes: set[int]):
    """What every rank reports after ``lost_nodes`` lost their memory (their ranks report nothing)."""
    copies, shares = [], []
    for h in range(topo.world_size):
        if topo.node_of(h) in lost_nodes:
            copies.append(frozenset())
            shares.append(None)
            continue
        copies.append(frozenset({h, *topo.replica_sources(h)}))
        shares.append(ParityShare(topo.parity_group(h), topo.member_index(h)) if topo.parity else None)
    local = [topo.node_of(h) for h in range(topo.world_size)]
    return copies, local, shares


@settings(max_examples=200, deadline=None)
@given(replica_layouts(), st.data())
def test_replicas_sit_on_other_nodes_and_cover_any_r_lost_nodes(topo, data):
    for r in range(topo.world_size):
        holders = topo.replica_holders(r)
        assert len({topo.node_of(h) for h in holders} | {topo.node_of(r)}) == topo.replicas + 1
        for h in holders:
            assert r in topo.replica_sources(h)
    lost = set(data.draw(st.lists(st.integers(0, topo.nodes - 1), max_size=topo.nodes, unique=True)))
    copies, local, shares = _held_after_loss(topo, lost)
    plan = plan_sources(topo.world_size, copies, local, shares)
    # restorable exactly when no rank lost every node holding it
    expect = all(any(topo.node_of(h) not in lost for h in (r, *topo.replica_holders(r)))
                 for r in range(topo.world_size))
    assert (plan is not None) == expect
    if plan is not None:
        for r, src in plan.items():
            assert src.kind == ("memory" if topo.node_of(r) not in lost else "peer")
            assert r in copies[src.holder]


@settings(max_examples=200, deadline=None)
@given(parity_layouts(), st.data())
def test_parity_groups_span_distinct_nodes_and_survive_one_lost_node_per_block(topo, data):
    g = topo.parity
    for r in range(topo.world_size):
        group = topo.parity_group(r)
        assert len(group) == g and r in group
        assert len({topo.node_of(m) for m in group}) == g
    lost = set(data.draw(st.lists(st.integers(0, topo.nodes - 1), max_size=topo.nodes, unique=True)))
    copies, local, shares = _held_after_loss(topo, lost)
    plan = plan_sources(topo.world_size, copies, local, shares)
    per_block = [sum(1 for n in lost if n // g == b) for b in range(topo.nodes // g)]
    assert (plan is not None) == all(k <= 1 for k in per_block)
    if plan is not None:
        for r, src in plan.items():
            assert src.kind == ("parity" if topo.node_of(r) in lost else "memory")


def test_damaged_share_makes_the_rebuild_impossible():
    topo = Topology(4, 1, 0, 4)
    copies, local, shares = _held_after_loss(topo, {2})
    assert plan_sources(4, copies, local, shares) is not None
    shares[0] = None  # member 0's share failed its digest
    assert plan_sources(4, copies, local, shares) is None


@pytest.mark.parametrize("kw, message", [
    (dict(world_size=6, ranks_per_node=4), "whole nodes"),
    (dict(world_size=4, ranks_per_node=2, replicas=2), "at least 3 nodes"),
    (dict(world_size=6, ranks_per_node=1, replicas=0, parity=4), "not a multiple of 4"),
    (dict(world_size=4, ranks_per_node=1, replicas=1, parity=2), "not both"),
])
def test_impossible_topologies_are_refused_by_name(kw, message):
    with pytest.raises(OptionsError, match=message):
        Topology(**kw)


def test_options():
    assert MemoryTier(every_steps=5).copies == 1
    assert MemoryTier(every_steps=5, parity=4).copies == 0
    assert MemoryTier(every_steps=5, parity=4).host_factor() == pytest.approx(1 + 1 / 3)
    assert MemoryTier(every_steps=5, replicas=2).host_factor() == 3
    for bad in (dict(every_steps=0), dict(every_steps=1, replicas=1, parity=4), dict(every_steps=1, parity=1),
                dict(every_steps=1, ranks_per_node=0), dict(every_steps=1, timeout_seconds=0)):
        with pytest.raises(OptionsError):
            MemoryTier(**bad)


def test_overhead_is_the_least_one_lost_node_allows():
    # the survivors of any one lost node must hold g snapshots' worth: (g-1) + (g-1) * p >= g
    for g in range(2, 9):
        p = Topology(g, 1, 0, g).overhead()
        assert (g - 1) + (g - 1) * p >= g - 1e-12
        assert list(itertools.islice(iter([p]), 1)) == [1 / (g - 1)]
