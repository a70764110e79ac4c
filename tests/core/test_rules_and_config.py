"""ParallelConfig grammar, stage assignment, and partition rules evaluated at any degrees."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.errors import LayoutError
from ckptkit.layout.box import Box
from ckptkit.layout.config import ParallelConfig
from ckptkit.layout.manifest import IndexRef, Manifest, TensorMeta
from ckptkit.layout.rules import PartitionRule


@pytest.mark.parametrize(
    "text,expected",
    [
        ("tp4pp2", dict(tp=4, pp=2, dp=1)),
        ("tp2pp2dp4", dict(tp=2, pp=2, dp=4)),
        ("tp8pp4ep2vpp2", dict(tp=8, pp=4, ep=2, vpp=2, dp=1)),
        ("PP2TP4", dict(tp=4, pp=2)),
        ("dp8", dict(dp=8)),
    ],
)
def test_parse(text, expected):
    cfg = ParallelConfig.parse(text) if "ep" not in text else ParallelConfig.parse(text, world_size=64)
    for k, v in expected.items():
        if k == "dp" and "ep" in text:
            assert cfg.dp == 2  # 64 / (8 * 4)
        else:
            assert getattr(cfg, k) == v


def test_parse_derives_dp_from_world_size():
    assert ParallelConfig.parse("tp4pp2", world_size=64).dp == 8
    with pytest.raises(LayoutError, match="world size 10 is not a multiple of tp\\*pp\\*cp=8"):
        ParallelConfig.parse("tp4pp2", world_size=10)


@pytest.mark.parametrize("bad", ["", "tp", "tp0", "tp4pp", "tp4 pp2", "tp4tp2", "xp4", "tp-1", "4tp", "tp4pp2x"])
def test_parse_rejects_with_a_clear_error(bad):
    with pytest.raises(LayoutError, match="parallel config|positive integer|given twice"):
        ParallelConfig.parse(bad)


def test_expert_degrees_must_fit_a_pipeline_stage():
    with pytest.raises(LayoutError, match="ep=3 x etp=1 does not divide the 4 ranks.*multiple of 3"):
        ParallelConfig(dp=4, ep=3)
    with pytest.raises(LayoutError, match="ep=4 x etp=2 does not divide the 4 ranks.*multiple of 4"):
        ParallelConfig(tp=2, dp=2, ep=4)  # Megatron's default etp = tp
    assert ParallelConfig(tp=2, dp=2, ep=4, etp=1).expert_dp == 1  # ETP independent of TP


def test_rank_order_is_megatron_default():
    cfg = ParallelConfig(tp=2, pp=2, dp=2)
    # tp fastest, then dp, then pp
    assert cfg.coordinate(0) == {"pp": 0, "dp": 0, "cp": 0, "tp": 0, "edp": 0, "ep": 0, "etp": 0}
    assert cfg.coordinate(1)["tp"] == 1
    assert cfg.coordinate(2)["dp"] == 1
    assert cfg.coordinate(4)["pp"] == 1


def test_stage_assignment_even_uneven_and_virtual():
    assert ParallelConfig(pp=2).stage_layers(8) == (4, 4)
    uneven = ParallelConfig(pp=3, pp_layers=(2, 4, 2))
    assert [uneven.layer_owner(i, 8)[0] for i in range(8)] == [0, 0, 1, 1, 1, 1, 2, 2]
    virtual = ParallelConfig(pp=2, vpp=2)
    # chunks 0..3 of 2 layers: chunk k on stage k % 2
    assert [virtual.layer_owner(i, 8)[:2] for i in range(8)] == [
        (0, 0), (0, 0), (1, 0), (1, 0), (0, 1), (0, 1), (1, 1), (1, 1)
    ]
    with pytest.raises(LayoutError, match="do not split evenly"):
        ParallelConfig(pp=3).chunk_layers(8)


def pieces_by_rank(rule: PartitionRule, shape, cfg: ParallelConfig, layers=None):
    layout = rule.evaluate(shape, cfg, layers)
    out = {}
    for rank in range(cfg.world_size):
        coord = layout.mesh.coordinate(rank)  # the dense or the expert mesh: the same ranks
        out[rank] = layout.local_pieces(coord)
    return layout, out


def test_column_parallel_glu_is_split_per_part():
    cfg = ParallelConfig(tp=2)
    rule = PartitionRule(tp_axis=0, fused=(6, 6))
    _, held = pieces_by_rank(rule, (12, 4), cfg)
    # rank t holds [gate_t; up_t]: rows [3t, 3t+3) and [6+3t, 6+3t+3)
    assert [(lo, b.offsets, b.sizes) for lo, b in held[1][1]] == [((0, 0), (3, 0), (3, 4)), ((3, 0), (9, 0), (3, 4))]
    assert held[1][0] == (6, 4)


def test_vocab_padding_is_local_only():
    cfg = ParallelConfig(tp=4)
    rule = PartitionRule(tp_axis=0, vocab_multiple=8, stage=0)
    layout, held = pieces_by_rank(rule, (50, 3), cfg)
    assert layout.padded == (64, 3)  # padded to a multiple of 8 * tp
    assert [held[r][0] for r in range(4)] == [(16, 3)] * 4
    # the last rank's local rows 2..15 are padding: not model space
    assert [(b.offsets, b.sizes) for _, b in held[3][1]] == [((48, 0), (2, 3))]


def test_layer_lives_on_its_stage_and_stacked_layers_split_by_stage():
    cfg = ParallelConfig(pp=3, tp=1, pp_layers=(1, 3, 2))
    _, held = pieces_by_rank(PartitionRule(layer=2), (4,), cfg, layers=6)
    assert [r for r, h in held.items() if h is not None] == [1]
    _, held = pieces_by_rank(PartitionRule(layer_axis=0), (6, 4), cfg, layers=6)
    assert [[(b.offsets[0], b.sizes[0]) for _, b in held[r][1]] for r in range(3)] == [[(0, 1)], [(1, 3)], [(4, 2)]]


def test_experts_live_on_their_ep_rank():
    cfg = ParallelConfig(dp=4, ep=2)
    _, held = pieces_by_rank(PartitionRule(expert=5, num_experts=8), (3,), cfg)
    holders = sorted(r for r, h in held.items() if h is not None)
    ep_of = {r: cfg.coordinate(r)["ep"] for r in holders}
    assert set(ep_of.values()) == {1} and len(holders) == 2  # replicated over edp=2


def _config(tp: int, pp: int, dp: int, ep: int, etp: int | None) -> ParallelConfig:
    """Any valid layout: dp grown to the smallest multiple the expert degrees need."""
    need = ParallelConfig.parse(f"tp{tp}ep{ep}" + (f"etp{etp}" if etp else "")).dp
    return ParallelConfig(tp=tp, pp=pp, dp=dp * need, ep=ep, etp=etp)


configs = st.builds(
    _config, st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3]), st.sampled_from([1, 2, 3]),
    st.sampled_from([1, 2, 4]), st.sampled_from([None, 1, 2]),
)
rules = st.sampled_from([
    PartitionRule(),
    PartitionRule(tp_axis=0),
    PartitionRule(tp_axis=1),
    PartitionRule(tp_axis=0, fused=(12, 12)),
    PartitionRule(tp_axis=0, vocab_multiple=5, stage=0),
    PartitionRule(tp_axis=0, vocab_multiple=3, stage=-1),
    PartitionRule(tp_axis=1, layer=5),
    PartitionRule(layer_axis=0),
    PartitionRule(tp_axis=0, dp_axis=0),
    PartitionRule(tp_axis=1, dp_axis=0),
    PartitionRule(dp_axis=1),
    PartitionRule(expert_axis=0, tp_axis=1),
    PartitionRule(expert_axis=0, tp_axis=1, dp_axis=1),
    PartitionRule(layer_axis=0, expert_axis=1),
    PartitionRule(expert=3, num_experts=4, tp_axis=0),
    PartitionRule(expert_axis=1, tp_axis=0, fused=(12, 12)),
])


@settings(max_examples=300, deadline=None)
@given(configs, rules, st.integers(0, 10))
def test_rules_cover_every_element_once_per_replica_set(cfg, rule, rotation):
    shape = (24, 12)
    try:
        layout, held = pieces_by_rank(rule, shape, cfg, layers=24 if rule.layer_axis is None else None)
    except LayoutError:
        return  # degrees that do not divide the tensor are refused, which is itself tested elsewhere
    counts = Counter()
    writes = Counter()
    for rank, h in held.items():
        if h is None:
            continue
        local_shape, pieces = h
        coord = layout.mesh.coordinate(rank)
        write = layout.is_writer(coord, rotation)
        for lo, box in pieces:
            assert Box(lo, box.sizes).within(local_shape)
            for idx in itertools.product(*(range(o, o + s) for o, s in zip(box.offsets, box.sizes))):
                counts[idx] += 1
                writes[idx] += write
    assert set(counts) == set(itertools.product(range(24), range(12)))
    assert len(set(counts.values())) == 1  # every element held by the same number of replicas
    assert set(writes.values()) == {1}  # and written exactly once
    # the rule round-trips through the manifest
    meta = TensorMeta("t", "float32", shape, layout, 0, rule)
    indexes = {r: IndexRef(r, f"index/rank-{r:05d}.json", 0, "0" * 64) for r in range(cfg.world_size)}
    m = Manifest(world_size=cfg.world_size, tensors={"t": meta}, indexes=indexes)
    back = Manifest.from_json_bytes(m.to_json_bytes(), "test").tensors["t"]
    assert back.rule == rule and back.layout == layout


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(1, 6), max_size=3).map(tuple),
       axes=st.fixed_dictionaries({}, optional={n: st.integers(-1, 3) for n in ("tp_axis", "expert_axis", "dp_axis")}),
       fused=st.one_of(st.none(), st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)))
def test_check_shape_accepts_exactly_the_rules_every_layout_can_evaluate(shape, axes, fused):
    """A rule whose axis is outside its tensor, or whose fused parts do not sum to its ``tp_axis``,
    committed with a save and failed every reshard of it later (found by a hunt, 2026-12-06): the
    merge now refuses it through ``check_shape``, which must accept exactly what ``evaluate`` takes."""
    try:
        rule = PartitionRule(**axes, fused=fused if "tp_axis" in axes else None,
                             num_experts=2 if "expert_axis" in axes else None)
    except LayoutError:
        return
    try:
        rule.check_shape(shape)
        fits = True
    except LayoutError:
        fits = False
    try:
        rule.evaluate(shape, ParallelConfig())
        evaluates = True
    except LayoutError as exc:
        evaluates = "outside a tensor" not in str(exc) and "do not sum" not in str(exc)
    assert fits == evaluates, (rule, shape)
