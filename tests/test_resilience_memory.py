"""The resilience controller over a manager with a memory tier: snapshots are taken, and used.

The controller decided alone when a persistent save was due and called the manager's ``save``; the
memory tier's snapshots are taken only by the manager's ``maybe_save``, so under the controller a
tier never held a step (reproduced: ``MemoryTier(every_steps=1)``, persistent saves every 10 steps,
a restart at step 7 resumed from scratch). The user had configured recovery from memory every few
steps and silently got recovery from the persistent checkpoint: up to a whole persistent interval
of work lost per failure, which is what the tier exists to prevent.

Real gloo worlds of 2 ranks on 2 "nodes" (each rank its own memory folder, one replica each).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import ckptkit
from ckptkit.resilience import DetectorConfig, Rollback

BATCH = 4
BAD = range(64, 72)  # samples whose batch spikes: steps 17 and 18 at batch 4


def policy() -> ckptkit.SpikePolicy:
    return ckptkit.SpikePolicy(loss=DetectorConfig(window=8, warmup=4, k=6.0), grad_norm=None,
                               rollback=Rollback(after_spikes=2, steps_before=1, skip_before=0, skip_after=1),
                               rewarm=None)


def train(run: str, mem: str | None, steps: int, every: int) -> dict:
    """Resume from ``run`` and train to ``steps``: persistent saves every ``every`` steps and, with
    ``mem``, a memory snapshot every 2 steps into this rank's folder under ``mem``."""
    rank = dist.get_rank()
    tier = None if mem is None else ckptkit.MemoryTier(every_steps=2, replicas=1, ranks_per_node=1,
                                                       root=os.path.join(mem, f"node{rank}"))
    mgr = ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=every), memory=tier)
    ctl = ckptkit.ResilienceController(mgr, policy(), batch_size=BATCH, signals=(), watchdog_seconds=None)
    row = torch.arange(3, dtype=torch.float64).reshape(1, 3) * (rank + 1)  # this rank's own bytes: a row of a sharded tensor
    state = {"w": torch.arange(3, dtype=torch.float64), "seen": [],  # w: a DP replica, the same on every rank
             "shard": ckptkit.Sharded(row, [ckptkit.box_piece("shard", (2, 3), (rank, 0), (1, 3))])}
    events: list[list] = []
    start = ctl.resume(state)
    events.append(["resumed", start, None if mgr.last_restore is None else mgr.last_restore.source])
    for step, first in ctl.batches(lambda p: p, start):
        if step > steps:
            break
        action = ctl.observe(step, loss=1e3 if first in BAD else 1.0 + 0.01 * (first % 3))
        if action.rollback:
            action.restore(state)
            events.append(["rollback", step, ctl.step, mgr.last_restore.source])
            continue
        if not action.skip_step:
            state["w"] += float(first)
            row += float(first) * (rank + 1)
            state["seen"] = [*state["seen"], first]
        ctl.maybe_save(step, state)
    ctl.close()
    return {"events": events, "w": state["w"].tolist(), "row": row.flatten().tolist(), "seen": state["seen"], "sample": ctl.sample}


def test_a_restart_resumes_from_the_newest_snapshot_the_controller_took(worlds, tmp_path):
    run, mem = str(tmp_path / "run"), str(tmp_path / "mem")
    worlds.run(2, train, run, mem, 13, 10)
    assert "step-0000010" in os.listdir(run) and "step-0000012" not in os.listdir(run)
    for node in ("node0", "node1"):  # the snapshots the tier takes every 2 steps, the newest kept
        assert any(name.endswith("12") for name in os.listdir(os.path.join(mem, node))), os.listdir(os.path.join(mem, node))
    resumed = worlds.run(2, train, run, mem, 13, 10)
    assert [r["events"][0] for r in resumed] == [["resumed", 13, "memory"]] * 2, resumed  # step 12 restored
    straight = worlds.run(2, train, str(tmp_path / "oracle"), None, 13, 1)  # saved at every step, no tier
    for got, want in zip(resumed, straight):
        assert (got["w"], got["row"], got["sample"]) == (want["w"], want["row"], want["sample"]), (got, want)


def test_a_spike_rollback_restores_a_snapshot_newer_than_the_persistent_checkpoint(worlds, tmp_path):
    run, mem = str(tmp_path / "run"), str(tmp_path / "mem")
    got = worlds.run(2, train, run, mem, 24, 10)
    oracle = worlds.run(2, train, str(tmp_path / "oracle"), None, 24, 2)  # persistent at the tier's steps
    for rank in range(2):
        rollbacks = [e for e in got[rank]["events"] if e[0] == "rollback"]
        assert rollbacks == [["rollback", 18, 16, "memory"]], got[rank]["events"]
        want = [e for e in oracle[rank]["events"] if e[0] == "rollback"]
        assert [e[:3] for e in want] == [["rollback", 18, 16]]
        assert [got[rank][k] for k in ("w", "row", "seen")] == [oracle[rank][k] for k in ("w", "row", "seen")]
        assert not set(got[rank]["seen"]) & set(BAD)
