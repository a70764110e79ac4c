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
    assert a["digests"] == b["digests"]  # the runs themselves did the same arithmetic
    assert a["committed"] == b["committed"] == ["step-2", "step-4"], (a["committed"], b["committed"])
    for name in b["committed"]:
        assert same_checkpoints(os.path.join(blocking, name), os.path.join(overlap, name)) == [], name


def test_torchtitan_overlap_needs_an_async_mode():
    from ckptkit.adapters.torchtitan import CkptkitCheckpointManager
    from ckptkit.errors import OptionsError

    with pytest.raises(OptionsError, match="needs async_mode='async' or 'async_process'"):
        CkptkitCheckpointManager.Config(enable=True, folder="x", snapshot="overlap")
