"""The manager as a training script drives it, where timing and other ranks meet: found by a hunt
(2026-12-06), each reproduced before its fix.

* ``gc()`` while an asynchronous save persisted deleted that save's folder: the name gc keeps was
  one field, set by the next save and cleared by the previous save's commit while the next one
  waited for it (or left naming a save that was skipped). The step still committed, and a restore
  skipped it as damaged and fell back, to nothing with ``keep_last=1``.
* ``request_save()`` seen by ranks at different steps: the agreement began on the rank that was
  asked first, alone; its all-reduce paired with another rank's from a later step, the ranks saved
  different steps into one checkpoint (one committed with a rank's index missing), and the job hung.
* A request whose save was skipped (``on_busy="skip"``) was forgotten.
* A restore racing another process's retention took the checkpoint deleted between its listing and
  its lease for damaged, and fell back to an older step, or none, with a newer one committed.
* A memory tier that failed (node memory full) made every due persistent save be skipped too, and
  ``close()`` swallowed the last snapshot's failure; ``maybe_save`` after ``close`` raised torch's words.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import ckptkit
import ckptkit.engine.async_save as async_save


@pytest.fixture
def slow_writes(monkeypatch):
    """Every background write takes 0.6 s more: a save is surely in flight when the test acts."""
    write = async_save.write_staged

    def slow(*args, **kwargs):
        out = write(*args, **kwargs)
        time.sleep(0.6)
        return out

    monkeypatch.setattr(async_save, "write_staged", slow)


@pytest.mark.parametrize("keep_last", [None, 1])
@pytest.mark.parametrize("on_busy", ["wait", "skip"])
def test_gc_never_deletes_a_save_in_flight(tmp_path, slow_writes, on_busy, keep_last):
    run = str(tmp_path / "run")
    mgr = ckptkit.CheckpointManager(run, keep=ckptkit.RetentionPolicy(keep_last=keep_last),
                                    asynchronous=ckptkit.AsyncOptions(on_busy=on_busy))
    mgr.save(5, {"w": torch.full((8,), 5.0)})
    second = mgr.save(10, {"w": torch.full((8,), 10.0)})  # waits for step 5's save, or is skipped
    inflight = os.path.join(run, "step-0000010" if second is not None else "step-0000005", "data")
    deadline = time.monotonic() + 10
    while not (os.path.isdir(inflight) and os.listdir(inflight)) and time.monotonic() < deadline:
        time.sleep(0.01)  # until its data is written (its index and commit come 0.6 s later)
    assert os.listdir(inflight) and not os.path.exists(os.path.join(os.path.dirname(inflight), "manifest.json"))
    assert mgr.gc() == []  # the save in flight (10, or 5 when 10 was skipped) is not a leftover
    mgr.close()
    newest = 10 if second is not None else 5
    state = {"w": torch.zeros(8)}
    again = ckptkit.CheckpointManager(run)
    assert again.restore_latest(state) == newest and state["w"][0] == newest and again.skipped == []


def test_gc_still_removes_what_a_failed_save_left(tmp_path, monkeypatch):
    """A save that failed is not in flight any more: its leftovers are gc's to remove."""
    run = str(tmp_path / "run")
    mgr = ckptkit.CheckpointManager(run)
    write = async_save.write_staged

    def failing(*args, **kwargs):
        write(*args, **kwargs)
        raise OSError(5, "simulated I/O error after the data was written")

    monkeypatch.setattr(async_save, "write_staged", failing)
    mgr.save(3, {"w": torch.ones(8)})
    with pytest.raises(ckptkit.SaveError):
        mgr.wait()
    monkeypatch.setattr(async_save, "write_staged", write)
    assert [os.path.basename(p) for p in mgr.gc()] in (["step-0000003"], [])
    mgr.close()


def requests_at(run: str, asked: dict, steps: int, agree: bool = True) -> list:
    """Train ``steps`` steps; rank r calls ``request_save()`` before the steps ``asked[r]`` (a signal
    reaching the ranks at different times). The steps this rank saved."""
    rank = dist.get_rank()
    mgr = ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=1000, agree_requests=agree),
                                    asynchronous=None)
    saved = []
    for step in range(1, steps + 1):
        if step in asked.get(str(rank), ()):
            mgr.request_save()
        if mgr.maybe_save(step, {"w": torch.full((4,), float(step)), "step": step}) is not None:
            saved.append(step)
    mgr.close()
    return saved


PATTERNS = {
    "one step apart": {"0": [3], "1": [4]},
    "three ranks, spread": {"0": [2], "1": [5], "2": [3]},
    "one rank only": {"2": [4]},
    "twice on one, once on another": {"0": [2, 6], "1": [6]},
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_requests_seen_at_different_steps_save_the_same_steps_on_every_rank(worlds, tmp_path, pattern):
    asked = PATTERNS[pattern]
    run = str(tmp_path / "run")
    saved = worlds.run(3, requests_at, run, asked, 8, timeout=60)
    want = sorted({s for steps in asked.values() for s in steps})
    assert saved == [want] * 3, saved  # every rank saves at every step some rank asked at
    for step in want:  # and every one holds that step, from every rank
        state = {"w": torch.zeros(4), "step": 0}
        ckptkit.load(state, os.path.join(run, f"step-{step:07d}"))
        assert state["step"] == step and state["w"][0] == step


def test_requests_are_refused_where_the_policy_does_not_agree_on_them(worlds, tmp_path):
    saved = worlds.run(2, requests_at, str(tmp_path / "run"), {"0": [3]}, 5, False, timeout=60)
    assert saved == [[], []]


def test_a_request_whose_save_was_skipped_stays_pending(tmp_path, slow_writes):
    run = str(tmp_path / "run")
    mgr = ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=10),
                                    asynchronous=ckptkit.AsyncOptions(on_busy="skip"))
    assert mgr.maybe_save(10, {"w": torch.full((4,), 10.0)}) is not None
    mgr.request_save()  # a SIGTERM while step 10 persists
    assert mgr.maybe_save(11, {"w": torch.full((4,), 11.0)}) is None  # skipped: busy
    mgr.wait()
    assert mgr.maybe_save(12, {"w": torch.full((4,), 12.0)}) is not None  # the request, honoured
    assert mgr.maybe_save(13, {"w": torch.full((4,), 13.0)}) is None  # and then done with
    mgr.close()
    assert [r.step for r in mgr.records() if r.committed] == [10, 12]


def _failing_save(kind: str, mgr, monkeypatch) -> dict:
    """Make the next save fail or be refused in the way named; the kwargs of the ``maybe_save`` that does."""
    if kind == "previous save failed":  # the disk filled during the last save; the error raises at the next
        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device")
        with monkeypatch.context() as m:
            m.setattr(async_save, "write_staged", disk_full)
            mgr.maybe_save(100, {"w": torch.zeros(4)})
            mgr._saver._wait_inflight()
        return {}
    if kind == "metric refused":
        return {"metrics": {"loss": torch.ones(2)}}
    return {"state": {"w": torch.zeros(4), "bad": object()}}  # "state refused": a value no checkpoint holds


@pytest.mark.parametrize("kind, asynchronous", [("previous save failed", True), ("metric refused", True),
                                                 ("state refused", True), ("metric refused", False),
                                                 ("state refused", False)])
def test_a_request_whose_save_raised_stays_pending(tmp_path, monkeypatch, kind, asynchronous):
    """A preemption's request reached a ``maybe_save`` that raised before its save started (the last
    save's failure, a metric or a value refused): the request was cleared first and lost, so after the
    user caught the error the emergency save never came (hunt, 2026-12-06)."""
    mgr = ckptkit.CheckpointManager(str(tmp_path / "run"), save=ckptkit.SavePolicy(every_steps=100),
                                    asynchronous=ckptkit.AsyncOptions() if asynchronous else None)
    failing = _failing_save(kind, mgr, monkeypatch)
    mgr.request_save()
    with pytest.raises(ckptkit.CkptkitError):
        mgr.maybe_save(101, failing.pop("state", {"w": torch.ones(4)}), **failing)
    assert mgr.maybe_save(102, {"w": torch.full((4,), 2.0)}) is not None  # still pending: saved here
    assert mgr.maybe_save(103, {"w": torch.full((4,), 3.0)}) is None  # and then done with
    mgr.close()
    assert [r.step for r in mgr.records() if r.committed] == [102]


def test_a_restore_racing_retention_takes_the_newer_checkpoint(tmp_path):
    run = str(tmp_path / "run")
    trainer = ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=1),
                                        keep=ckptkit.RetentionPolicy(keep_last=1), asynchronous=None)
    trainer.maybe_save(1, {"w": torch.full((4,), 1.0)})
    reader = ckptkit.CheckpointManager(run, asynchronous=None)
    lease = reader.folder.acquire_lease
    raced = []

    def acquire(name, rank):  # the trainer commits step 2 (and retention deletes step 1) right then
        if not raced:
            raced.append(name)
            trainer.maybe_save(2, {"w": torch.full((4,), 2.0)})
        return lease(name, rank)

    reader.folder.acquire_lease = acquire
    state = {"w": torch.zeros(4)}
    assert reader.restore_latest(state) == 2 and state["w"][0] == 2 and reader.skipped == []
    assert raced == ["step-0000001"]


def test_a_full_memory_folder_costs_the_memory_snapshots_only(tmp_path):
    """Node memory (a real 64 KiB tmpfs) cannot take a snapshot of 256 KiB: every snapshot fails and
    ``maybe_save`` says so, but each persistent checkpoint due (every 2 steps) is saved, and
    ``close`` reports the last snapshot's failure."""
    from tests.small_fs import small_tmpfs

    run = str(tmp_path / "run")
    with small_tmpfs(str(tmp_path / "mem"), "64k") as mem:
        tier = ckptkit.MemoryTier(every_steps=1, replicas=0, root=mem, max_host_bytes=1 << 30)
        mgr = ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=2), memory=tier)
        failed = []
        for step in range(1, 9):
            try:
                mgr.maybe_save(step, {"w": torch.full((65536,), float(step))})
            except ckptkit.SaveError:
                failed.append(step)
        mgr.maybe_save(9, {"w": torch.full((65536,), 9.0)})  # its snapshot fails in the background
        with pytest.raises(ckptkit.SaveError, match="memory snapshot of step 9"):
            mgr.close()  # and close says so
        with pytest.raises(ckptkit.SaveError, match="closed"):
            mgr.maybe_save(10, {"w": torch.zeros(65536)})
    # a step reports the failed snapshot before it (and takes none itself: the next one tries again)
    assert failed == [2, 4, 6, 8]
    assert [r.step for r in mgr.records() if r.committed] == [2, 4, 6, 8]
    state = {"w": torch.zeros(65536)}
    assert ckptkit.CheckpointManager(run).restore_latest(state) == 8 and state["w"][0] == 8


def save_fail_retry(run: str, mode: str, block_rank: int | None) -> dict:
    """Step 3 saved; step 5's save fails (a plain file where rank 0's target check or this rank's write
    expects a folder); the caller sees the failure, the fault goes, and it saves step 5 again."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    asynchronous = None if mode == "sync" else ckptkit.AsyncOptions(executor=mode)
    mgr = ckptkit.CheckpointManager(run, asynchronous=asynchronous)
    state = {"w": torch.full((4,), 5.0 + rank)}
    mgr.save(3, state)
    mgr.wait()
    blocker = os.path.join(run, "step-0000005")
    if rank == (block_rank or 0):
        open(blocker, "w").close()
    if dist.is_initialized():
        dist.barrier()
    first = "no error"
    try:
        mgr.save(5, state)
        mgr.wait()
    except ckptkit.CkptkitError as exc:
        first = type(exc).__name__
    if rank == (block_rank or 0):
        os.remove(blocker)
    if dist.is_initialized():
        dist.barrier()
    handle = mgr.save(5, state)
    mgr.close()
    return {"first": first, "retry": handle is not None and handle.succeeded(),
            "committed": os.path.exists(os.path.join(blocker, "manifest.json"))}


@pytest.mark.parametrize("mode", ["sync", "thread", "process"])
def test_a_failed_save_saved_again_commits(tmp_path, mode):
    """A save of the step saved last returns that save's handle (a final save after a periodic one), but a
    failed asynchronous save's handle was returned too: the retry saved nothing and nothing said so, and a
    restore gave the step before (found by a hunt, 2026-12-06). Now a failed save is saved again."""
    got = save_fail_retry(str(tmp_path / "run"), mode, None)
    assert got == {"first": "SaveError", "retry": True, "committed": True}, got
    assert ckptkit.CheckpointManager(str(tmp_path / "run")).restore_latest({"w": torch.zeros(4)}) == 5


def test_a_failed_save_is_saved_again_on_every_rank(worlds, tmp_path):
    """Whether the last save failed is agreed: no rank returns the old handle while another saves again."""
    outs = worlds.run(2, save_fail_retry, str(tmp_path / "run"), "thread", 0, timeout=60)
    assert outs == [{"first": "SaveError", "retry": True, "committed": True}] * 2, outs


def listing_fails_on_one_rank(run: str, failing: int) -> dict:
    """Two committed steps; then rank ``failing``'s listing of the run folder fails (an S3 connection
    dropped on that node): every question that lists must fail on every rank, naming that rank."""
    from ckptkit.errors import StorageError

    rank = dist.get_rank()
    mgr = ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=1), asynchronous=None)
    for step in (1, 2):
        mgr.maybe_save(step, {"w": torch.full((4,), float(step))})
    if rank == failing:
        def broken():
            raise StorageError(f"listing in {run}: Connection was closed before we received a valid response")
        mgr.folder.records = broken
    out = {}
    for what, ask in (("restore", lambda: mgr.restore_latest({"w": torch.zeros(4)})),
                      ("latest", mgr.latest_common_step)):
        begin = time.monotonic()
        try:
            out[what] = ("returned", ask())
        except ckptkit.CkptkitError as exc:
            out[what] = (type(exc).__name__, str(exc))
        out[f"{what} seconds"] = time.monotonic() - begin
    mgr.close()
    return out


def test_a_listing_failing_on_one_rank_fails_every_rank_naming_it(worlds, tmp_path):
    """Every rank listed the run folder before the restore's first agreement; one rank's listing failing
    raised there alone and the others waited in the agreement for the process group's timeout (found by
    a hunt on S3, 2026-12-06)."""
    failing = 1
    got = worlds.run(2, listing_fails_on_one_rank, str(tmp_path / "run"), failing, timeout=90)
    for rank in range(2):
        for what in ("restore", "latest"):
            kind, said = got[rank][what]
            assert kind == "CheckpointUnreadableError" and f"(rank {failing})" in said and "Connection" in said, said
            assert got[rank][f"{what} seconds"] < 20
