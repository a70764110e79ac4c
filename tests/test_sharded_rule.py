"""A Sharded declaration's partition rule reaches the manifest (what ``ckptkit reshard`` evaluates)."""

from __future__ import annotations

import pytest
import torch

import ckptkit
from ckptkit.engine.metadata_io import read_manifest
from ckptkit.layout import PartitionRule, box_piece
from ckptkit.layout.box import Box, Region
from ckptkit.plan.merge import RankReport, merge_reports
from ckptkit.plan.save_plan import ExplicitReport
from ckptkit.layout.manifest import IndexRef
from ckptkit.storage.url import open_store


def test_rule_is_recorded_and_survives_the_manifest(tmp_path):
    rule = PartitionRule(tp_axis=1, layer_axis=0, fused=(6, 6))
    w = torch.arange(2 * 12 * 3, dtype=torch.float32).reshape(2, 12, 3)
    state = {"w": ckptkit.Sharded(w, [box_piece("fc1", (2, 12, 3), (0, 0, 0), (2, 12, 3))], rule=rule),
             "plain": ckptkit.Sharded(w.clone(), [box_piece("other", (2, 12, 3), (0, 0, 0), (2, 12, 3))])}
    ckptkit.save(state, tmp_path / "c")
    manifest = read_manifest(open_store(tmp_path / "c"))
    assert manifest.tensors["fc1"].rule == rule
    assert manifest.tensors["other"].rule is None
    out = torch.zeros_like(w)
    ckptkit.load({"w": ckptkit.Sharded(out, [box_piece("fc1", (2, 12, 3), (0, 0, 0), (2, 12, 3))])}, tmp_path / "c",
                 strict=False)
    assert torch.equal(out, w)


def test_ranks_disagreeing_about_a_rule_fail_the_merge():
    def report(rank: int, rule: PartitionRule | None) -> RankReport:
        box = Box((rank, 0), (1, 4))
        return RankReport(rank, IndexRef(rank, f"i{rank}", 1, "0" * 64),
                          explicit=(ExplicitReport("t", "float32", (2, 4), Region(box), rule),))

    with pytest.raises(ckptkit.LayoutError, match=r"'t' has partition rule .*tp_axis.* on rank 1 but none on rank 0"):
        merge_reports([report(0, None), report(1, PartitionRule(tp_axis=0))], world_size=2, values={}, meta={},
                      parallel=None, where="x")


def test_sharded_refuses_a_rule_of_the_wrong_type():
    with pytest.raises(ckptkit.LayoutError, match="PartitionRule"):
        ckptkit.Sharded(torch.zeros(2), [], rule={"tp_axis": 0})  # type: ignore[arg-type]
