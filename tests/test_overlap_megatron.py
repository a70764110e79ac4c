"""The Megatron adapter's guard for ``AsyncOptions(snapshot="overlap")``, on the tiny Megatron-core GPT.

At DP 2 with the distributed optimizer (fp32 and bf16 with fp32 main copies), a save after step 2
with the overlapped snapshot, the next iterations starting the moment it returns, must equal bit
for bit the one the same run writes with the blocking snapshot (same seeds and arithmetic: rule 1
of docs/testing.md). A router with an expert bias, which Megatron updates after backward and before
``optimizer.step()``, is refused before anything is written.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("megatron.core")

from tests import megatron_model as mm
from tests import overlap_job as job
from tests.test_overlap_adapters import same_checkpoints

pytestmark = pytest.mark.usefixtures("retire_megatron_world")


@pytest.mark.parametrize("layout", [mm.Layout(), mm.Layout(bf16=True)], ids=["fp32", "bf16"])
def test_megatron_overlapped_save_equals_the_blocking_one(worlds, tmp_path, layout):
    blocking, overlap = str(tmp_path / "blocking"), str(tmp_path / "overlap")
    worlds.run(2, job.megatron_overlap, layout, blocking, snapshot="blocking", save_step=2, steps=4)
    out = worlds.run(2, job.megatron_overlap, layout, overlap, snapshot="overlap", save_step=2, steps=4)
    assert all(r["error"] is None and r["copy_held"] for r in out), out  # the copy was in flight at the next step
    assert same_checkpoints(blocking, overlap) == []


def test_megatron_router_expert_bias_is_refused(worlds, tmp_path):
    folder = str(tmp_path / "moe")
    layout = mm.Layout(experts=2, expert_bias=True)
    out = worlds.run(2, job.megatron_overlap, layout, folder, snapshot="overlap", save_step=1, steps=2)
    assert all(r["error"] is not None and "expert bias" in r["error"] and "OptionsError" in r["error"] for r in out), out
    assert not os.path.exists(os.path.join(folder, "manifest.json"))
