"""The resilience controller when ranks pass different signals: the same decisions, one saved state.

Each rank of a data-parallel job usually has its own micro-batch loss (torchtitan's and DeepSpeed's
training steps return it), and in a pipeline only the last stage has one. The controller used to
run each rank's detectors on its own values and combine only their flags: the detector windows in
``state["resilience"]`` then differed per rank, every save warned and stored the value per rank,
and a restart at another world size (after losing a node) was refused ("per-rank values
['resilience'] cannot be matched to ranks"). Now the signals are agreed (the largest any rank
saw) before detection.

Real gloo worlds of 2 and 3 ranks; the oracle is one process fed the largest value per step.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist

import ckptkit
from ckptkit.engine.metadata_io import read_manifest
from ckptkit.resilience import DetectorConfig, Rollback
from ckptkit.storage import open_store

BATCH = 4
BAD = range(60, 72)  # samples whose batch spikes on rank 1: steps 16-18 at batch 4


def policy() -> ckptkit.SpikePolicy:
    return ckptkit.SpikePolicy(loss=DetectorConfig(window=16, warmup=4, k=6.0), grad_norm=None,
                               rollback=Rollback(after_spikes=2, steps_before=3, skip_before=1, skip_after=2),
                               rewarm=None)


def loss_of(rank: int, first: int) -> float | None:
    """Rank ``rank``'s loss for the batch from sample ``first``: each rank's own noise; rank 1 spikes
    on the bad samples; rank 2 (a pipeline stage without the loss) has none."""
    if rank == 2:
        return None
    if rank == 1 and any(s in BAD for s in range(first, first + BATCH)):
        return 1e3
    return 1.0 + 0.01 * ((first * 7 + rank * 3) % 5)


def train(run: str, steps: int, losses=None) -> dict:
    """Resume from ``run`` and train to ``steps`` on this rank (the caller's world); ``losses(first)``
    overrides :func:`loss_of` (the one-process oracle feeds the largest)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    mgr = ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=5))
    ctl = ckptkit.ResilienceController(mgr, policy(), batch_size=BATCH, signals=(), watchdog_seconds=None)
    state = {"w": torch.zeros(2, dtype=torch.float64)}
    events: list[tuple] = []
    start = ctl.resume(state)
    events.append(("resumed", start))
    for step, first in ctl.batches(lambda p: p, start):
        if step > steps:
            break
        loss = losses(first) if losses is not None else loss_of(rank, first)
        action = ctl.observe(step, loss=loss)
        if action.rollback:
            action.restore(state)
            events.append(("rollback", step, ctl.step))
            continue
        if action.skip_step:
            events.append(("skip", step))
        else:
            state["w"] += float(first)
        ctl.maybe_save(step, state)
    ctl.close()
    return {"events": events, "w": state["w"].tolist(), "sample": ctl.sample, "skips": ctl.skips.to_json()}


def held_per_rank(run: str) -> list[str]:
    """The checkpoints of ``run`` that store the controller's state per rank."""
    store = open_store(run)
    return [name for name in sorted(os.listdir(run)) if name.startswith("step-")
            and "resilience" in read_manifest(store.child(name)).rank_values]


def oracle(run: str, steps: int, world: int) -> dict:
    """One process fed, at every step, the largest loss any of ``world`` ranks had."""
    def largest(first: int) -> float | None:
        given = [v for v in (loss_of(r, first) for r in range(world)) if v is not None]
        return max(given) if given else None
    return train(run, steps, largest)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_with_their_own_losses_decide_and_save_as_one(worlds, tmp_path, world):
    run = str(tmp_path / "run")
    got = worlds.run(world, train, run, 30)
    assert all(g == got[0] for g in got)  # every rank: the same decisions, data position and state
    want = oracle(str(tmp_path / "oracle"), 30, world)
    assert got[0] == want
    assert any(e[0] == "rollback" for e in want["events"])  # rank 1's spikes were seen: rolled back
    assert held_per_rank(run) == []  # one controller state per checkpoint, whatever the ranks' losses


@pytest.mark.parametrize("before,after", [(2, 1), (2, 3), (3, 2)])
def test_a_restart_at_another_world_size_resumes_where_the_job_was(worlds, tmp_path, before, after):
    """A job that lost (or gained) a node comes back from its newest checkpoint, with its data
    position, skip ranges and ladder, and goes on as the job would have at that world size."""
    run = str(tmp_path / "run")
    worlds.run(before, train, run, 22)  # through the spikes: a rollback and a skip range
    reference = str(tmp_path / "reference")
    shutil.copytree(run, reference)
    got = worlds.run(after, train, run, 35)
    assert got[0]["events"][0] == ("resumed", 21)
    assert all(g == got[0] for g in got)
    # the same continuation as one process resuming that checkpoint with the new world's largest losses
    want = oracle(reference, 35, after)
    assert got[0] == want
    assert got[0]["skips"]  # the skip range decided before the restart still holds


def nan_on_rank_1_at_step_5(run: str) -> tuple[list, bool]:
    rank = dist.get_rank()
    mgr = ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=5))
    ctl = ckptkit.ResilienceController(mgr, policy(), batch_size=BATCH, signals=(), watchdog_seconds=None)
    state = {"w": torch.zeros(2, dtype=torch.float64)}
    kinds = []
    for step, first in ctl.batches(lambda p: p, ctl.resume(state)):
        if step > 8:
            break
        action = ctl.observe(step, loss=float("nan") if (rank, step) == (1, 5) else 1.0 + rank)
        kinds.append(action.decision.kind)
        ctl.maybe_save(step, state)
    ctl.close()
    return kinds, rank == 0


def test_a_non_finite_loss_on_one_rank_is_skipped_on_all_and_logged_as_nan(worlds, tmp_path):
    from ckptkit.resilience.incidents import IncidentLog

    run = str(tmp_path / "run")
    got = worlds.run(2, nan_on_rank_1_at_step_5, run)
    assert got[0][0] == got[1][0] and got[0][0][4] == "skip_step"
    metrics = {step: loss for step, loss, _ in IncidentLog(open_store(run), writer=False).read_metrics()}
    assert metrics[5] != metrics[5] and metrics[4] == 2.0  # NaN as a rank had it; else the largest


def spike_while_the_log_refuses_writes(run: str) -> list:
    """Rank 0 (the log's writer) cannot write incident records from step 4 to step 9 (a file where
    their folder goes); the loss spikes at step 6."""
    rank = dist.get_rank()
    mgr = ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=100))
    ctl = ckptkit.ResilienceController(mgr, policy(), batch_size=BATCH, signals=(), watchdog_seconds=None)
    state = {"w": torch.zeros(2, dtype=torch.float64)}
    blocker = os.path.join(run, ".ckptkit", "incidents")
    kinds = []
    for step, first in ctl.batches(lambda p: p, ctl.resume(state)):
        if step > 12:
            break
        if rank == 0 and step == 4:
            shutil.rmtree(blocker, ignore_errors=True)
            os.makedirs(os.path.dirname(blocker), exist_ok=True)
            open(blocker, "w").close()
        if rank == 0 and step == 9:
            os.remove(blocker)
        kinds.append(ctl.observe(step, loss=1e3 if step == 6 else 1.0).decision.kind)
        ctl.maybe_save(step, state)
    ctl.close()
    return kinds


def test_an_incident_the_store_refuses_is_retried_and_never_fails_one_rank_alone(worlds, tmp_path):
    """Only rank 0 writes the incident log: its store error used to raise there alone, and the other
    ranks were left in the job's next collective (the job died, or hung where the error was caught)."""
    from ckptkit.resilience.incidents import IncidentLog

    run = str(tmp_path / "run")
    got = worlds.run(2, spike_while_the_log_refuses_writes, run)
    assert got[0] == got[1] and got[0][5] == "skip_step"
    kinds = [(i.kind, i.step) for i in IncidentLog(open_store(run), writer=False).read()]
    assert ("skip_step", 6) in kinds  # written when the store took writes again


def discard_after_one(run: str) -> str:
    mgr = ckptkit.CheckpointManager(run, asynchronous=None)
    try:
        mgr.discard_after(1)
        return "discarded"
    except ckptkit.CkptkitError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        mgr.close()


def test_a_discard_that_fails_on_rank_0_fails_on_every_rank(worlds, tmp_path):
    """``discard_after`` deletes on rank 0 and raises there if it cannot (a restart could resume from
    the checkpoint it could not remove); the other ranks used to return and train on alone. The run
    is on a file system mounted read-only after its saves: the kernel refuses the deletion."""
    import subprocess

    mnt = tmp_path / "fs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        for step in (1, 2):
            ckptkit.save({"w": torch.zeros(2)}, str(mnt / "run" / f"step-{step:07d}"))
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True, capture_output=True)
        said = worlds.run(2, discard_after_one, str(mnt / "run"))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    assert all(s.startswith("StorageError") and "failed on rank 0" in s for s in said), said
