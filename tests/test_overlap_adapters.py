"""The framework adapters' guards for ``AsyncOptions(snapshot="overlap")``, on a real DeepSpeed engine.

A ZeRO 1/2/3 engine at DP 2 saves at step 2 with the overlapped snapshot and trains on at once (no
wait for ``staged``): the checkpoint must equal, tensor by tensor and bit for bit, the one the same
run writes with the blocking snapshot (same seeds, same arithmetic: rule 1 of docs/testing.md). If
the adapter's guard (the base torch optimizer inside ZeRO's) did not hold step 3 back until the
copy, step 3's update would leak into it or the save would fail its version check. A change of the
fp32 master partition outside the optimizer's step is caught and commits nothing.

The Megatron and torchtitan guards are not run here (their jobs are the slow framework modules');
docs/overlap.md says what each covers.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("deepspeed")

import torch

import ckptkit
from tests import overlap_job as job


def same_checkpoints(a: str, b: str) -> list[str]:
    """Keys whose stored tensors differ in any bit, plus value differences (the engine record)."""
    va, vb = ckptkit.open(a), ckptkit.open(b)
    assert va.keys() == vb.keys()
    bad = []
    for k in va.keys():
        x, y = va[k].read(), vb[k].read()
        if x.dtype != y.dtype or not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            bad.append(k)
    if va.values != vb.values:
        bad.append("values")
    return bad


@pytest.mark.parametrize("stage,dtype", [(1, "bf16"), (2, "fp32"), (3, "bf16")])
def test_deepspeed_overlapped_save_equals_the_blocking_one(worlds, tmp_path, stage, dtype):
    blocking, overlap = str(tmp_path / "blocking"), str(tmp_path / "overlap")
    worlds.run(2, job.deepspeed_overlap, stage, dtype, blocking, snapshot="blocking", save_step=2, steps=4)
    out = worlds.run(2, job.deepspeed_overlap, stage, dtype, overlap, snapshot="overlap", save_step=2, steps=4)
    assert all(r["error"] is None and r["copy_held"] for r in out), out  # the copy was in flight at the next step
    assert same_checkpoints(f"{blocking}/ckptkit", f"{overlap}/ckptkit") == []


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_moe_overlapped_save_equals_the_blocking_one(worlds, tmp_path, stage):
    """DeepSpeed-MoE (tests/deepspeed_moe_job.py) at EP 2 on 2 ranks: expert parameters in their own
    optimizer groups, stepped by the same base optimizer that the gate hooks."""
    blocking, overlap = str(tmp_path / "blocking"), str(tmp_path / "overlap")
    worlds.run(2, job.deepspeed_overlap, stage, "fp32", blocking, snapshot="blocking", save_step=2, steps=4, moe_ep=2)
    out = worlds.run(2, job.deepspeed_overlap, stage, "fp32", overlap, snapshot="overlap", save_step=2, steps=4,
                     moe_ep=2)
    assert all(r["error"] is None and r["copy_held"] for r in out), out
    assert same_checkpoints(f"{blocking}/ckptkit", f"{overlap}/ckptkit") == []


def test_deepspeed_a_master_changed_outside_the_step_fails_the_save(worlds, tmp_path):
    folder = str(tmp_path / "bad")
    out = worlds.run(2, job.deepspeed_overlap, 2, "bf16", folder, snapshot="overlap", save_step=2, steps=3,
                     bypass=True)
    assert all(r["error"] is not None for r in out)
    assert any("SnapshotRaceError" in r["error"] and "optimizer/fp32/" in r["error"] for r in out), out
    assert not os.path.exists(f"{folder}/ckptkit/manifest.json")
