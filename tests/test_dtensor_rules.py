"""DTensor checkpoints carry their layout as a partition rule, so `ckptkit reshard --to` lays them
out for another mesh instead of copying every tensor whole to one rank.

Saved by 4 real gloo ranks with FSDP2 (Shard(0) over "dp") and FSDP2 x TP (a 2x2 "dp" x "tp" mesh,
_StridedShard on the data dimension), resharded offline to other degrees: every tensor comes out
as the target's grid, its bytes spread over the target ranks, bit for bit the saved values, and a
job at the target layout loads it exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.layout.config import ParallelConfig
from ckptkit.layout.grid import GridLayout, Mesh, Replicate, Shard
from ckptkit.layout.rules import PartitionRule, rule_from_grid
from tests.test_dtensor_reshard import assert_same, load_run


@pytest.fixture
def saved(dtensor_checkpoints) -> dict:
    return {layout: dtensor_checkpoints[(layout, "fp32")] for layout in ("fsdp", "fsdp_tp")}


def test_rules_read_off_dtensor_meshes():
    dp_tp = Mesh(("dp", "tp"), (2, 2), (0, 1, 2, 3))
    strided = GridLayout(dp_tp, (Shard(0, split_factor=2), Shard(0)), (8, 4))
    assert rule_from_grid(strided) == PartitionRule(tp_axis=0, dp_axis=0, chunked=True)
    rowwise = GridLayout(dp_tp, (Shard(0), Shard(1)), (8, 4))
    assert rule_from_grid(rowwise) == PartitionRule(tp_axis=1, dp_axis=0, chunked=True)
    norm = GridLayout(dp_tp, (Shard(0), Replicate()), (8,))
    assert rule_from_grid(norm) == PartitionRule(dp_axis=0, chunked=True)
    odd = GridLayout(Mesh(("pp",), (2,), (0, 1)), (Shard(0),), (8, 4))
    assert rule_from_grid(odd) is None  # a dimension of unknown meaning: no guess
    wrong_stride = GridLayout(dp_tp, (Shard(0, split_factor=3), Shard(0)), (12, 4))
    assert rule_from_grid(wrong_stride) is None


@pytest.mark.parametrize("source", ["fsdp", "fsdp_tp"])
@pytest.mark.parametrize("target", ["tp2dp2", "tp1dp4"])
def test_reshard_lays_dtensor_checkpoints_out_for_the_target(saved, tmp_path: Path, source: str, target: str):
    path, _ = saved[source]
    out = tmp_path / "out"
    config = ParallelConfig.parse(target)
    result = ckptkit.reshard(path, out, config)
    assert result.plan.unruled == ()  # every DTensor tensor had a rule
    manifest = ckptkit.open(out).manifest
    src = ckptkit.open(path)
    per_rank = {r: 0 for r in range(config.world_size)}
    for key, meta in manifest.tensors.items():
        assert isinstance(meta.layout, GridLayout) and meta.rule is not None, key
        assert torch.equal(ckptkit.open(out)[key][...], src[key][...]), key
        for region, writer in meta.stored_pieces():
            per_rank[writer] += region.numel
    assert sum(1 for n in per_rank.values() if n) == config.world_size  # spread, not whole on one rank


def test_a_resharded_dtensor_checkpoint_loads_exactly_at_its_target(worlds, saved, tmp_path: Path):
    path, ref = saved["fsdp"]
    out = str(tmp_path / "tp2dp2")
    ckptkit.reshard(path, out, ParallelConfig.parse("tp2dp2"))
    for r in worlds.run(4, load_run, "fsdp_tp", "fp32", out):
        assert_same(ref["full"], r["full"])
