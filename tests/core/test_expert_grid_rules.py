"""Rules read off expert-parallel DTensor grids (torchtitan's GroupedExperts), in the pure core.

A rule is only worth recording if, evaluated at another degree, it gives every rank exactly the
pieces the framework gives it there. The grids below are the layouts torchtitan 0.3's parallelize
builds (checked against real DTensors in tests/test_torchtitan_moe.py); here every degree
combination is tried, and layouts a rule would misdescribe must get no rule at all.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.layout.config import ParallelConfig
from ckptkit.layout.grid import GridLayout, Mesh, Replicate, Shard
from ckptkit.layout.rules import PartitionRule, rule_from_grid


def torchtitan_expert_grid(shape: tuple[int, ...], dp: int, tp: int, ep: int, tp_axis: int | None) -> GridLayout:
    """What torchtitan makes of a GroupedExperts weight: EP on (``efsdp``, ``ep``), else (``fsdp``, ``tp``)."""
    if ep > 1:
        efsdp = dp * tp // ep
        return GridLayout(Mesh.arange(("efsdp", "ep"), (efsdp, ep)), (Shard(0, split_factor=ep), Shard(0)), shape)
    tp_place = Shard(tp_axis) if tp_axis is not None else Replicate()
    return GridLayout(Mesh.arange(("fsdp", "tp"), (dp, tp)), (Shard(0), tp_place), shape)


def pieces_by_rank(grid: GridLayout) -> dict[int, list]:
    out = {}
    for rank in grid.mesh.ranks:
        held = grid.local_pieces(grid.mesh.coordinate(rank))
        out[rank] = sorted(b for _, b in held[1]) if held else []
    return out


degrees = st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2, 4, 8])).filter(
    lambda d: (d[0] * d[1]) % d[2] == 0)


@settings(max_examples=300, deadline=None)
@given(degrees, degrees, st.sampled_from([(8, 6, 4), (16, 4, 6), (8, 3, 8)]), st.sampled_from([None, 1, 2]))
def test_a_rule_read_at_one_degree_predicts_torchtitans_layout_at_another(saved, target, shape, tp_axis):
    dp, tp, ep = saved
    rule = rule_from_grid(torchtitan_expert_grid(shape, dp, tp, ep, tp_axis if ep == 1 else None), expert_axis=0)
    assert rule is not None and rule.expert_axis == 0 and rule.dp_axis == 0
    dp2, tp2, ep2 = target
    if rule.tp_axis is None and tp2 > 1 and ep2 == 1:
        return  # a rule read where experts were not TP-sharded cannot know the TP axis it would have
    want_tp = rule.tp_axis if ep2 == 1 else None
    config = ParallelConfig(dp=dp2, tp=tp2, ep=ep2, etp=1 if ep2 > 1 else tp2)
    predicted = rule.evaluate(shape, config)
    actual = torchtitan_expert_grid(shape, dp2, tp2, ep2, want_tp)
    assert pieces_by_rank(predicted) == pieces_by_rank(actual)


def test_without_the_mark_an_ep1_expert_weight_reads_as_dense():
    grid = torchtitan_expert_grid((8, 6, 4), 4, 1, 1, None)
    assert rule_from_grid(grid) == PartitionRule(dp_axis=0, chunked=True)
    assert rule_from_grid(grid, expert_axis=0) == PartitionRule(dp_axis=0, expert_axis=0, chunked=True)
    ep_grid = torchtitan_expert_grid((8, 6, 4), 4, 1, 2, None)
    assert rule_from_grid(ep_grid) == rule_from_grid(ep_grid, expert_axis=0)  # the ep dimension says it


def test_layouts_a_rule_would_misdescribe_get_no_rule():
    mesh = Mesh.arange(("efsdp", "ep"), (2, 2))
    # FSDP splitting first and EP inside (no _StridedShard): not what rule.evaluate would lay out
    assert rule_from_grid(GridLayout(mesh, (Shard(0), Shard(0)), (8, 4))) is None
    # a strided split that is not the EP size
    assert rule_from_grid(GridLayout(Mesh.arange(("efsdp", "ep"), (2, 4)), (Shard(0, split_factor=2), Shard(0)),
                                     (16, 4))) is None
    # EP along another axis than the declared expert axis
    assert rule_from_grid(GridLayout(mesh, (Replicate(), Shard(1)), (4, 8)), expert_axis=0) is None
    # EP sharding with a split factor, and two EP dimensions
    assert rule_from_grid(GridLayout(mesh, (Replicate(), Shard(0, split_factor=2)), (8, 4))) is None
    two = Mesh.arange(("ep", "expert"), (2, 2))
    assert rule_from_grid(GridLayout(two, (Shard(0), Shard(1)), (8, 8))) is None
    # the dense case keeps its old answers: FSDP inside TP needs the TP size as split factor, outside
    dp_tp = Mesh.arange(("dp", "tp"), (2, 2))
    assert rule_from_grid(GridLayout(dp_tp, (Shard(0), Shard(0)), (8, 4))) is None
    assert rule_from_grid(GridLayout(Mesh.arange(("tp", "dp"), (2, 2)), (Shard(0), Shard(0, split_factor=2)),
                                     (8, 4))) is None
