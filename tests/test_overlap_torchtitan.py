"""The torchtitan adapter with ``snapshot="overlap"``: torchtitan's llama3 debug model under FSDP2 at
DP 2 (tests/torchtitan_job.py), checkpointing every 2 steps through ``CkptkitCheckpointManager``
with ``async_mode="async", snapshot="overlap"``, the optimizers stepping again the moment the save of
step 2 returns, must write, checkpoint by checkpoint and bit for bit, what the same run writes with
the blocking snapshot (same seeds and arithmetic: rule 1 of
docs/testing.md). Its optimizers container and each optimizer in it are the guards, and the trainer's
``maybe_wait_for_staging()`` right before ``optimizers.step()`` waits for the copy too.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torchtitan")

from tests import overlap_job as job
from tests.test_overlap_adapters import same_checkpoints

pytestmark = pytest.mark.usefixtures("torchtitan_worlds")


def test_torchtitan_overlapped_checkpoints_equal_the_blocking_ones(worlds, tmp_path):
    blocking, overlap = str(tmp_path / "blocking"), str(tmp_path / "overlap")
    a = worlds.run(2, job.torchtitan_overlap, blocking, snapshot="blocking")[0]
    b = worlds.run(2, job.torchtitan_overlap, overlap, snapshot="overlap")[0]
    assert not a["copy_held"] and b["copy_held"]  # the overlapped copy was in flight when the step came
    assert a["digests"] == b["digests"]  # the runs themselves did the same arithmetic
    assert a["committed"] == b["committed"] == ["step-2", "step-4"], (a["committed"], b["committed"])
    for name in b["committed"]:
        assert same_checkpoints(os.path.join(blocking, name), os.path.join(overlap, name)) == [], name


def test_torchtitan_overlap_needs_an_async_mode():
    from ckptkit.adapters.torchtitan import CkptkitCheckpointManager
    from ckptkit.errors import OptionsError

    with pytest.raises(OptionsError, match="needs async_mode='async' or 'async_process'"):
        CkptkitCheckpointManager.Config(enable=True, folder="x", snapshot="overlap")


def test_torchtitan_moe_overlapped_checkpoints_equal_the_blocking_ones(worlds, tmp_path):
    """qwen3 MoE at FSDP 2 x EP 2: the load-balancing pre-hook writes ``expert_bias_E`` in the step right
    after the save, while the overlapped copy is held back (tests/overlap_job.py). The gate runs first and
    waits for the copy, so the overlapped checkpoints equal the blocking ones bit for bit. With the
    load-balancing hook moved before the gate (the control), the same run's save fails naming
    ``expert_bias_E`` and commits nothing: a race the order prevents, and the version check catches."""
    blocking, overlap, control = str(tmp_path / "blocking"), str(tmp_path / "overlap"), str(tmp_path / "control")
    a = worlds.run(2, job.torchtitan_moe_overlap, blocking, snapshot="blocking")[0]
    b = worlds.run(2, job.torchtitan_moe_overlap, overlap, snapshot="overlap")[0]
    assert a["bias_changed_at_step_3"] and b["bias_changed_at_step_3"]  # the race is there to lose
    assert not a["copy_held"] and b["copy_held"] and a["error"] is None and b["error"] is None
    assert a["digests"] == b["digests"]
    assert a["committed"] == b["committed"] == ["step-2", "step-4"], (a["committed"], b["committed"])
    for name in b["committed"]:
        assert same_checkpoints(os.path.join(blocking, name), os.path.join(overlap, name)) == [], name
    c = worlds.run(2, job.torchtitan_moe_overlap, control, snapshot="overlap", gate_first=False)[0]
    assert c["copy_held"] and c["error"] is not None and "expert_bias_E' was changed in place" in c["error"], c["error"]
    assert "step-2" not in c["committed"] and not os.path.exists(os.path.join(control, "step-2", "manifest.json"))
