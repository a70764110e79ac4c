"""The reshard planner (pure): every element stored once, each target rank stores its own local pieces."""

from __future__ import annotations

from math import prod

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptkit.layout.box import Box, Region
from ckptkit.layout.config import ParallelConfig
from ckptkit.layout.grid import GridLayout
from ckptkit.layout.manifest import DTYPES, ExplicitLayout, TensorMeta
from ckptkit.layout.rules import PartitionRule
from ckptkit.plan.merge import check_coverage
from ckptkit.plan.reshard_plan import (
    ReshardError,
    ReshardPlan,
    ReshardPlanOptions,
    check_plan,
    plan_reshard,
    split_box,
)

from .strategies import compositions


@st.composite
def targets(draw) -> tuple[ParallelConfig, int]:
    """A target config and a layer count that fits it (explicit pp_layers half the time)."""
    tp, pp, dp, vpp = draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(
        st.integers(1, 2))
    if draw(st.booleans()):
        layers = pp * vpp * draw(st.integers(1, 2))
        return ParallelConfig(tp=tp, pp=pp, dp=dp, vpp=vpp), layers
    layers = draw(st.integers(1, 7))
    return ParallelConfig(tp=tp, pp=pp, dp=dp, vpp=vpp, pp_layers=draw(compositions(layers, pp * vpp))), layers


@st.composite
def explicit_source(draw, key: str, shape: tuple[int, ...], dtype: str, rule: PartitionRule | None,
                    world: int) -> TensorMeta:
    """A source tensor stored as random axis-0 slabs by random ranks (any saving layout will do)."""
    if not shape or shape[0] == 0:
        return TensorMeta(key, dtype, shape, ExplicitLayout(((Region(Box.full(shape)), 0),)), 0, rule)
    sizes = [s for s in draw(compositions(shape[0], draw(st.integers(1, 3)))) if s]
    pieces, start = [], 0
    for s in sizes:
        box = Box((start, *(0 for _ in shape[1:])), (s, *shape[1:]))
        pieces.append((Region(box), draw(st.integers(0, world - 1))))
        start += s
    return TensorMeta(key, dtype, shape, ExplicitLayout(tuple(pieces)), 0, rule)


@st.composite
def gpt_sources(draw, tp: int, layers: int) -> dict[str, TensorMeta]:
    """A Megatron-GPT-shaped set of tensors with the adapter's rules, sized so tp can split them."""
    h = tp * draw(st.integers(1, 3))
    ffn = tp * draw(st.integers(1, 2))
    vocab = draw(st.integers(1, 23))
    mult = draw(st.integers(1, 4))
    world = draw(st.integers(1, 4))
    specs = {
        "model/emb": ((vocab, h), "bfloat16", PartitionRule(tp_axis=0, vocab_multiple=mult, stage=0)),
        "model/out": ((vocab, h), "float32", PartitionRule(tp_axis=0, vocab_multiple=mult, stage=-1)),
        "model/qkv": ((layers, 3 * h, h), "float32", PartitionRule(tp_axis=1, layer_axis=0)),
        "model/proj": ((layers, h, h), "float32", PartitionRule(tp_axis=2, layer_axis=0)),
        "model/fc1": ((layers, 2 * ffn, h), "float32", PartitionRule(tp_axis=1, layer_axis=0, fused=(ffn, ffn))),
        "model/fc2": ((layers, h, ffn), "float32", PartitionRule(tp_axis=2, layer_axis=0)),
        "model/ln": ((layers, h), "float32", PartitionRule(layer_axis=0)),
        "model/final_ln": ((h,), "float32", PartitionRule(stage=-1)),
        "extra/counts": ((draw(st.integers(0, 5)), 3), "int64", None),
        "extra/scalar": ((), "float64", None),
    }
    chosen = draw(st.sets(st.sampled_from(sorted(specs)), min_size=1))
    return {k: draw(explicit_source(k, *specs[k], world)) for k in sorted(chosen)}


def _stage_layers(config: ParallelConfig, layers: int, stage: int) -> set[int]:
    """Independent of the layout code: the layers a pipeline stage owns, from the chunk sizes."""
    sizes = config.pp_layers or (layers // (config.pp * config.vpp),) * (config.pp * config.vpp)
    owned, start = set(), 0
    for k, n in enumerate(sizes):
        if k % config.pp == stage:
            owned.update(range(start, start + n))
        start += n
    return owned


def _check_invariants(plan: ReshardPlan, tensors: dict[str, TensorMeta], layers: int) -> None:
    target = plan.target
    check_plan(plan)
    assert plan.peak_memory <= plan.max_memory
    total = 0
    for t in plan.tensors:
        meta = tensors[t.key]
        itemsize = DTYPES[meta.dtype]
        total += t.nbytes
        # every element stored exactly once
        check_coverage(t.key, t.shape, tuple((Region(p.box), p.rank) for p in t.pieces), "plan")
        for p in t.pieces:
            assert 0 <= p.rank < target.world_size
            assert p.nbytes == p.box.numel * itemsize <= max(plan.piece_limit, itemsize)
            assert sum(r.nbytes for r in p.reads) == p.nbytes
            if t.rule is not None and t.rule.layer_axis == 0:
                stage = target.coordinate(p.rank)["pp"]
                assert set(range(p.box.offsets[0], p.box.offsets[0] + p.box.sizes[0])) <= _stage_layers(
                    target, layers, stage)
        if t.layout is None:
            continue
        assert isinstance(t.layout, GridLayout) and t.layout == t.rule.evaluate(t.shape, target, layers)  # type: ignore[union-attr]
        by_rank: dict[int, list[Box]] = {}
        for p in t.pieces:
            by_rank.setdefault(p.rank, []).append(p.box)
        stored = {tuple(boxes[0].offsets) for boxes in by_rank.values()}
        for rank in range(target.world_size):
            held = t.layout.local_pieces(t.layout.mesh.coordinate(rank))  # type: ignore[union-attr]
            if held is None:
                assert rank not in by_rank
                continue
            local = [b for _, b in sorted(held[1], key=lambda x: x[0]) if b.numel]
            if rank in by_rank and not t.split:
                # a writer stores its own local pieces, in local order: it loads them as one run of its object
                assert by_rank[rank] == local
            elif rank in by_rank:
                merged = [b for b in local]
                assert sum(b.numel for b in by_rank[rank]) == sum(b.numel for b in merged)
            if local:
                # and every rank's local data is stored by exactly one replica
                assert sum(1 for boxes in by_rank.values() if boxes and _same_cell(boxes, local, t.split)) == 1
                assert tuple(local[0].offsets) in stored
    assert sum(r.bytes_written for r in plan.ranks) == total == plan.nbytes


def _same_cell(stored: list[Box], local: list[Box], split: bool) -> bool:
    if not split:
        return stored == local
    return stored[0].offsets == local[0].offsets


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_plan_stores_every_element_once_at_the_target_layout(data):
    target, layers = data.draw(targets())
    tensors = data.draw(gpt_sources(target.tp, layers))
    plan = plan_reshard(tensors, target)
    assert not plan.split
    _check_invariants(plan, tensors, layers)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.integers(64, 4096))
def test_a_small_budget_splits_regions_and_keeps_every_invariant(data, budget):
    target, layers = data.draw(targets())
    tensors = data.draw(gpt_sources(target.tp, layers))
    options = ReshardPlanOptions(max_memory=budget, source_block=0)  # tiny pieces: no checksum-block widening
    try:
        plan = plan_reshard(tensors, target, options)
    except ReshardError as exc:
        # only when even one element's read window does not fit
        assert "too small" in str(exc)
        src_max = max(r.numel * DTYPES[m.dtype] for m in tensors.values() for r, _ in m.stored_pieces())
        assert budget < 8 + 2 * src_max
        return
    _check_invariants(plan, tensors, layers)
    for t in plan.tensors:
        if t.split:
            assert t.meta().layout.__class__ is ExplicitLayout and t.meta().rule == t.rule


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=0, max_size=4), st.sampled_from([1, 2, 4, 8]), st.integers(1, 200))
def test_split_box_cuts_the_row_major_stream_into_consecutive_runs(sizes, itemsize, limit):
    limit = max(limit, itemsize)
    box = Box(tuple(range(len(sizes))), tuple(sizes))
    parts = split_box(box, itemsize, limit)
    pos = 0
    for part in parts:
        assert box.contains(part) and part.numel * itemsize <= max(limit, box.numel * itemsize if not sizes else limit)
        assert box.position(part.offsets) == pos if part.numel else True
        pos += part.numel
    assert pos == box.numel


def test_replicated_regions_are_spread_over_the_dp_replicas():
    norms = {f"n{i}": TensorMeta(f"n{i}", "float32", (256,), ExplicitLayout(((Region(Box((0,), (256,))), 0),)), 0,
                                 PartitionRule()) for i in range(8)}
    plan = plan_reshard(norms, ParallelConfig(dp=4))
    assert [r.bytes_written for r in plan.ranks] == [2048] * 4


def test_impossible_targets_name_the_tensor():
    fc1 = TensorMeta("model/fc1", "float32", (4, 12, 8), ExplicitLayout(((Region(Box.full((4, 12, 8))), 0),)), 0,
                     PartitionRule(tp_axis=1, layer_axis=0, fused=(6, 6)))
    with pytest.raises(ReshardError, match=r"'model/fc1'.*fused part of 6 does not split evenly over tp=4"):
        plan_reshard({"model/fc1": fc1}, ParallelConfig(tp=4))
    with pytest.raises(ReshardError, match=r"'model/fc1'.*4 layers do not split evenly over pp=3"):
        plan_reshard({"model/fc1": fc1}, ParallelConfig(pp=3))
    plan = plan_reshard({"model/fc1": fc1}, ParallelConfig(pp=3, pp_layers=(1, 2, 1)))
    assert [r.bytes_written for r in plan.ranks] == [1 * 96 * 4, 2 * 96 * 4, 1 * 96 * 4]


def test_strict_mode_refuses_a_tensor_without_a_rule():
    t = TensorMeta("extra/x", "float32", (3,), ExplicitLayout(((Region(Box.full((3,))), 0),)))
    with pytest.raises(ReshardError, match=r"'extra/x' has no partition rule"):
        plan_reshard({"extra/x": t}, ParallelConfig(tp=2), ReshardPlanOptions(strict=True))
    plan = plan_reshard({"extra/x": t}, ParallelConfig(tp=2))
    assert plan.unruled == ("extra/x",) and prod(plan.tensors[0].shape) == 3


def test_a_budget_too_small_for_one_element_fails_clearly():
    t = TensorMeta("w", "float64", (4, 4), ExplicitLayout(((Region(Box.full((4, 4))), 0),)), 0, PartitionRule())
    with pytest.raises(ReshardError, match="too small"):
        plan_reshard({"w": t}, ParallelConfig(), ReshardPlanOptions(max_memory=8))
