"""The expert convention in the pure core: the ep/etp grammar, the expert mesh, expert rules, and
coverage errors that name the expert (docs/moe.md)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.errors import CoverageError, LayoutError
from ckptkit.layout.box import Box, Region
from ckptkit.layout.config import ParallelConfig
from ckptkit.layout.coverage import check_coverage, incomplete_indices, named_axes
from ckptkit.layout.rules import PartitionRule


@pytest.mark.parametrize("text,expected", [
    ("tp2pp2ep4etp1dp2", dict(tp=2, pp=2, ep=4, expert_tp=1, dp=2, expert_dp=1, world_size=8)),
    ("tp2pp2ep4", dict(tp=2, pp=2, ep=4, expert_tp=2, dp=4, expert_dp=1, world_size=16)),  # smallest dp that fits
    ("tp2ep4etp1", dict(dp=2, expert_dp=1, world_size=4)),
    ("ep8", dict(dp=8, expert_dp=1)),
    ("tp4ep2etp2dp2", dict(expert_dp=2)),
    ("tp2etp2", dict(etp=None, expert_tp=2)),  # etp = tp is the default, spelled once
])
def test_parse_expert_degrees(text, expected):
    cfg = ParallelConfig.parse(text)
    for k, v in expected.items():
        assert getattr(cfg, k) == v, k
    assert ParallelConfig.parse(str(cfg)) == cfg


def test_parse_expert_degrees_against_a_world_size():
    assert ParallelConfig.parse("tp2pp2ep4etp1", world_size=16).dp == 4
    with pytest.raises(LayoutError, match="ep=4 x etp=2 does not divide the 4 ranks"):
        ParallelConfig.parse("tp2pp2ep4", world_size=8)


configs = st.builds(
    lambda tp, pp, dp, ep, etp: ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp,
                                               dp=dp * ParallelConfig.parse(f"tp{tp}ep{ep}etp{etp}").dp),
    st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1, 2, 4]),
)


@settings(max_examples=200, deadline=None)
@given(configs)
def test_every_rank_is_in_both_meshes_once(cfg):
    dense, expert = cfg.mesh(), cfg.expert_mesh()
    assert sorted(dense.ranks) == sorted(expert.ranks) == list(range(cfg.world_size))
    for rank in range(cfg.world_size):
        c = cfg.coordinate(rank)
        assert c["pp"] == expert.coordinate(rank)[0]  # both meshes agree on the pipeline stage
        assert 0 <= c["ep"] < cfg.ep and 0 <= c["etp"] < cfg.expert_tp and 0 <= c["edp"] < cfg.expert_dp


@settings(max_examples=200, deadline=None)
@given(configs, st.sampled_from([(8, 2, 24, 16), (16, 2, 8, 4)]), st.booleans())
def test_stacked_experts_split_over_ep_and_etp(cfg, shape, fused):
    """[layers, experts, rows, cols] with the expert axis over EP and rows over ETP: each rank holds
    num_experts / ep whole experts (a 1/etp slice of each), replicated edp times."""
    layers, experts, rows, cols = shape
    rule = PartitionRule(layer_axis=0, expert_axis=1, tp_axis=2, fused=(rows // 2, rows // 2) if fused else None)
    try:
        layout = rule.evaluate((layers, experts, rows, cols), cfg)
    except LayoutError:
        return  # degrees that do not divide (tested by the cover test of test_rules_and_config)
    held_by: dict[tuple[int, int], int] = {}
    for rank in range(cfg.world_size):
        coord = layout.mesh.coordinate(rank)
        pieces = layout.local_pieces(coord)
        assert pieces is not None
        local_shape, boxes = pieces
        assert local_shape[1] == experts // cfg.ep and local_shape[2] == rows // cfg.expert_tp
        expert_ids = {e for _, b in boxes for e in range(b.offsets[1], b.offsets[1] + b.sizes[1])}
        assert len(expert_ids) == experts // cfg.ep
        ep_rank = cfg.coordinate(rank)["ep"]
        assert expert_ids == set(range(ep_rank * experts // cfg.ep, (ep_rank + 1) * experts // cfg.ep))
        for _, b in boxes:
            for idx in itertools.product(*(range(o, o + s) for o, s in zip(b.offsets, b.sizes))):
                held_by[idx] = held_by.get(idx, 0) + 1
    assert len(held_by) == layers * experts * rows * cols
    assert set(held_by.values()) == {cfg.expert_dp}


def test_expert_rules_refuse_what_cannot_split():
    with pytest.raises(LayoutError, match="6 experts do not split evenly over ep=4"):
        PartitionRule(expert_axis=0).evaluate((6, 4), ParallelConfig(dp=4, ep=4))
    with pytest.raises(LayoutError, match="fused expert part of 3 does not split evenly over etp=2"):
        PartitionRule(expert_axis=0, tp_axis=1, fused=(3, 3)).evaluate((4, 6, 2), ParallelConfig(tp=2, dp=2, ep=2))
    # the dense tp does not constrain an expert tensor: etp=1 at tp=2
    PartitionRule(expert_axis=0, tp_axis=1, fused=(3, 3)).evaluate((4, 6, 2), ParallelConfig(tp=2, dp=2, ep=4, etp=1))


def _pieces(shape, skip=None):
    """One box piece per (layer, expert) of a [layers, experts, n] tensor, minus ``skip``."""
    out = []
    for layer, expert in itertools.product(range(shape[0]), range(shape[1])):
        if (layer, expert) != skip:
            out.append((Region(Box((layer, expert, 0), (1, 1, shape[2]))), expert % 2))
    return tuple(out)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 8), st.integers(1, 5), st.data())
def test_a_missing_expert_is_named(layers, experts, n, data):
    shape = (layers, experts, n)
    skip = (data.draw(st.integers(0, layers - 1)), data.draw(st.integers(0, experts - 1)))
    axes = named_axes(PartitionRule(layer_axis=0, expert_axis=1))
    check_coverage("w", shape, _pieces(shape), "ckpt", axes)  # complete: fine
    assert incomplete_indices(shape, _pieces(shape, skip), 1) == [skip[1]]
    with pytest.raises(CoverageError) as err:
        check_coverage("w", shape, _pieces(shape, skip), "ckpt", axes)
    message = str(err.value)
    assert f"expert {skip[1]} (of {experts})" in message and f"layer {skip[0]} (of {layers})" in message
    assert message.index("expert") < message.index("layer")  # the expert first: it is what a user looks for
