"""CheckpointManager across real gloo worlds: async saves under FSDP2, restore at another layout,
and ranks that stay in agreement when one of them is slow or fails."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import ckptkit
import ckptkit.engine.async_save as async_save
from tests import models


def train_and_checkpoint(run: str, executor: str) -> dict:
    model, optim = models.build("fsdp", torch.float32, seed=0)
    mgr = ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=2), keep=ckptkit.RetentionPolicy(keep_last=2), asynchronous=ckptkit.AsyncOptions(executor=executor))
    group = mgr._saver.commit_comm.group
    assert group is not None and group != dist.group.WORLD  # background commits never use the training group
    blocked = []
    for step in range(1, 7):
        models.train(model, optim, 1, start=step)
        state = models.sharded_state(model, optim)
        h = mgr.maybe_save(step, state, metrics={"loss": 1.0 / step})
        if h is not None:
            blocked.append(h.blocked_seconds)
            models.train(model, optim, 1, start=100 + step)  # mutate right away: must not leak
    mgr.close()
    return {"blocked": blocked, "committed": [r.name for r in mgr.records() if r.committed]}


def reference_state(executor: str) -> dict:
    """The same training run, without checkpoints, stopped at the last saved step."""
    model, optim = models.build("fsdp", torch.float32, seed=0)
    for step in range(1, 7):
        models.train(model, optim, 1, start=step)
        models.sharded_state(model, optim)  # as the checkpointed run does (it may touch optimizer state)
        if step % 2 == 0:
            full = models.full_state(model, optim)
            models.train(model, optim, 1, start=100 + step)
    return full


def restore(run: str, layout: str) -> dict:
    model, optim = models.build(layout, torch.float32, seed=5)
    state = models.sharded_state(model, optim)
    with ckptkit.CheckpointManager(run) as mgr:
        step = mgr.restore_latest(state)
    models.apply_state(model, optim, state)
    return {"step": step, "full": models.full_state(model, optim)}


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_async_fsdp_checkpoints_restore_at_tp(worlds, tmp_path, executor):
    run = str(tmp_path / "run")
    res = worlds.run(4, train_and_checkpoint, run, executor)
    assert res[0]["committed"] == ["step-0000004", "step-0000006"]
    ref = worlds.run(4, reference_state, executor)[0]
    out = worlds.run(2, restore, run, "tp")
    for r in out:
        assert r["step"] == 6
        assert sorted(r["full"]) == sorted(ref)
        for k in ref:
            assert torch.equal(r["full"][k], ref[k]), k


def one_slow_rank(run: str) -> list:
    rank = dist.get_rank()
    real = async_save.write_staged

    def slow(*a, **k):
        if rank == 1:
            time.sleep(1.5)
        return real(*a, **k)

    async_save.write_staged = slow
    try:
        mgr = ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=1), asynchronous=ckptkit.AsyncOptions(on_busy="skip"))
        state = {"w": torch.ones(1000) * rank}
        got = [mgr.maybe_save(1, state) is not None, mgr.maybe_save(2, state) is not None]
        mgr.close()
        return got
    finally:
        async_save.write_staged = real


def test_skip_is_decided_by_all_ranks_together(worlds, tmp_path):
    # rank 0 finishes its part at once, rank 1 is still writing: both must skip step 2
    assert worlds.run(2, one_slow_rank, str(tmp_path / "run")) == [[True, False], [True, False]]


def one_rank_runs_out_of_space(run: str) -> str:
    rank = dist.get_rank()
    real = async_save.write_staged

    def full(*a, **k):
        if rank == 1:
            raise OSError(28, "No space left on device")
        return real(*a, **k)

    async_save.write_staged = full
    try:
        mgr = ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=1))
        state = {"w": torch.ones(1000) * rank}
        mgr.maybe_save(1, state)
        try:
            mgr.maybe_save(2, state)
            return "no error"
        except ckptkit.SaveError as exc:
            return str(exc)
        finally:
            async_save.write_staged = real
            mgr.close()
    finally:
        async_save.write_staged = real


def test_a_background_failure_surfaces_on_every_rank_at_the_next_call(worlds, tmp_path):
    out = worlds.run(2, one_rank_runs_out_of_space, str(tmp_path / "run"), timeout=90)
    assert all("previous checkpoint save failed" in r and "No space left on device" in r for r in out), out
    assert not (tmp_path / "run" / "step-0000001" / "manifest.json").exists()
