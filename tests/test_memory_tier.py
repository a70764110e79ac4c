"""The memory tier across real gloo worlds: 4 ranks on simulated nodes (a memory folder per node).

A "lost node" is its memory folder deleted between two runs of the job (the next run is the
restarted job); tests/test_memory_tier_torchrun.py does the same with SIGKILLed ranks under
torchrun. The reference for every restore is the same training run without interruption, and
the comparison is bit for bit: FSDP2-sharded weights and Adam moments, unique bytes per rank.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist

import ckptkit
from tests import models
from tests.damage import flip_byte

STEPS = 6
PERSIST_EVERY = 4


def _tier(base: str, rpn: int, **kw) -> ckptkit.MemoryTier:
    node = dist.get_rank() // rpn
    return ckptkit.MemoryTier(every_steps=1, root=os.path.join(base, f"node{node}"), ranks_per_node=rpn, **kw)


def train(run: str, base: str, rpn: int, steps: int = STEPS, fail_protect_at: int | None = None, **kw) -> dict:
    """Train with a persistent save every 4 steps and a memory snapshot every step."""
    model, optim = models.build("fsdp", torch.float32, seed=0)
    mgr = ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=PERSIST_EVERY),
                                    memory=_tier(base, rpn, **kw))
    failed = None
    from ckptkit.memory import exchange

    swap = exchange.Link.swap  # the ranks are reused by later tests: put it back
    try:
        for step in range(1, steps + 1):
            failed = _step(mgr, model, optim, step, fail_protect_at, exchange) or failed
    finally:
        exchange.Link.swap = swap
    try:
        mgr.close()
    except ckptkit.SaveError:
        pass
    # step 4 is in both tiers: the persistent save persisted from the memory snapshot, never staging its own copy
    return {"failed": failed, "persistent_staging": mgr._saver.pool.nbytes}


def _step(mgr, model, optim, step: int, fail_protect_at: int | None, exchange) -> str | None:
    """One training step and its checkpoints; at ``fail_protect_at`` the copies to peers fail."""
    failed = None
    models.train(model, optim, 1, start=step)
    if step == fail_protect_at:  # the copies of this step never reach the peers (a kill in flight)
        mgr.wait()

        def lost(*a, **k):
            raise RuntimeError("peer lost while copying")
        exchange.Link.swap = lost
    mgr.maybe_save(step, models.sharded_state(model, optim))
    if step == fail_protect_at:
        try:
            mgr.wait()
        except ckptkit.SaveError as exc:
            failed = str(exc)
    return failed


def reference(step: int) -> dict:
    model, optim = models.build("fsdp", torch.float32, seed=0)
    for s in range(1, step + 1):
        models.train(model, optim, 1, start=s)
    return models.full_state(model, optim)


def restore(run: str, base: str, rpn: int, **kw) -> dict:
    model, optim = models.build("fsdp", torch.float32, seed=5)
    state = models.sharded_state(model, optim)
    with ckptkit.CheckpointManager(run, memory=_tier(base, rpn, **kw)) as mgr:
        step = mgr.restore_latest(state)
        info = mgr.last_restore
    models.apply_state(model, optim, state)
    return {"step": step, "source": info.source, "sources": info.sources, "full": models.full_state(model, optim)}


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def references(worlds):
    return {s: worlds.run(4, reference, s)[0] for s in (4, 5, 6)}


def _run(worlds, tmp_path, rpn: int, **kw):
    run, base = str(tmp_path / "run"), str(tmp_path / "mem")
    res = worlds.run(4, train, run, base, rpn, **kw)
    assert [r["persistent_staging"] for r in res] == [0] * 4
    return run, base


def test_lost_node_resumes_from_peer_memory_bit_exact(worlds, tmp_path, references):
    run, base = _run(worlds, tmp_path, 2, replicas=1)
    shutil.rmtree(os.path.join(base, "node1"))  # ranks 2 and 3 lose their node
    res = worlds.run(4, restore, run, base, 2, replicas=1)
    assert [r["step"] for r in res] == [STEPS] * 4  # not the persistent step 4
    assert res[0]["sources"] == ("memory", "memory", "peer", "peer")
    _equal(res[0]["full"], references[STEPS])
    # the restored node holds its own copies again: a second restore needs no peer
    again = worlds.run(4, restore, run, base, 2, replicas=1)
    assert again[0]["sources"] == ("memory",) * 4


def test_lost_node_rebuilt_from_parity_bit_exact(worlds, tmp_path, references):
    run, base = _run(worlds, tmp_path, 1, parity=4)
    shutil.rmtree(os.path.join(base, "node2"))
    res = worlds.run(4, restore, run, base, 1, parity=4)
    assert res[0]["step"] == STEPS and res[0]["sources"] == ("memory", "memory", "parity", "memory")
    _equal(res[0]["full"], references[STEPS])


def _windowed(window: int, fn, *args, **kw):
    """``fn`` with the parity code moving ``window`` bytes at a time (many windows per chunk)."""
    from ckptkit.memory import parity

    before, parity.WINDOW = parity.WINDOW, window
    try:
        return fn(*args, **kw)
    finally:
        parity.WINDOW = before


def restore_with_a_failing_input(run: str, base: str, rank: int, kind: str) -> dict:
    """A restore in which ``rank`` cannot read its ``kind`` input of the rebuild halfway through."""
    from ckptkit.memory import rebuild

    read = rebuild._Inputs.read
    calls = {"n": 0}

    def failing(self, k, of, at, out):
        calls["n"] += k == kind
        if dist.get_rank() == rank and k == kind and calls["n"] > 1:  # its second window of that kind
            raise OSError(f"injected: rank {rank} cannot read its {k}")
        return read(self, k, of, at, out)

    rebuild._Inputs.read = failing
    try:
        return restore(run, base, 1, parity=4)
    finally:
        rebuild._Inputs.read = read


@pytest.fixture(scope="module")
def windowed_parity_run(worlds, tmp_path_factory):
    """One training run whose snapshots were protected 4 KiB at a time (parity=4, 4 nodes of 1); each
    test restores a copy of it."""
    folder = tmp_path_factory.mktemp("windowed")
    worlds.run(4, _windowed, 4096, train, str(folder / "run"), str(folder / "mem"), 1, parity=4)
    return folder


def _copy_of(run_folder, tmp_path) -> tuple[str, str]:
    shutil.copytree(run_folder / "run", tmp_path / "run")
    shutil.copytree(run_folder / "mem", tmp_path / "mem")
    return str(tmp_path / "run"), str(tmp_path / "mem")


def test_a_rebuild_in_many_windows_is_bit_exact(worlds, windowed_parity_run, tmp_path, references):
    """Snapshots protected and rebuilt 4 KiB at a time: a chunk is many windows, each a message."""
    run, base = _copy_of(windowed_parity_run, tmp_path)
    shutil.rmtree(os.path.join(base, "node1"))
    res = worlds.run(4, _windowed, 4096, restore, run, base, 1, parity=4)
    assert res[0]["step"] == STEPS and res[0]["sources"] == ("memory", "parity", "memory", "memory")
    _equal(res[0]["full"], references[STEPS])


@pytest.mark.parametrize("holder,kind", [(0, "copy"), (3, "share")])
def test_an_input_that_fails_mid_rebuild_falls_back_on_every_rank(worlds, windowed_parity_run, tmp_path, references,
                                                                    holder, kind):
    """A holder that cannot read its input halfway through the rebuild says so instead of sending:
    every rank finishes the walk, the rebuilt rank fails naming the input, and the job falls back to
    the persistent checkpoint together, bit-exact (no rank is left waiting)."""
    run, base = _copy_of(windowed_parity_run, tmp_path)
    shutil.rmtree(os.path.join(base, "node2"))
    res = worlds.run(4, _windowed, 4096, restore_with_a_failing_input, run, base, holder, kind)
    assert [r["step"] for r in res] == [PERSIST_EVERY] * 4 and res[0]["sources"] == ("persistent",) * 4
    _equal(res[0]["full"], references[PERSIST_EVERY])
    # the rebuilt rank's half-written folder is gone, nothing of it is committed
    assert not os.path.exists(os.path.join(base, "node2", f"step-{STEPS:010d}", "rank-00002", "manifest.json"))


def parity_memory(run: str, base: str, mib: int) -> dict:
    """The Python memory a parity snapshot's protection and a parity rebuild of rank 1 allocate
    (tracemalloc's peak: the bytes objects and buffers the parity code makes), for a ``mib`` MiB state."""
    import tracemalloc

    from ckptkit.memory import parity, rebuild

    rank = dist.get_rank()
    walk = rebuild.walk
    before, parity.WINDOW = parity.WINDOW, 64 << 10
    try:
        state = {"w": torch.arange(mib << 18, dtype=torch.float32) * (rank + 1)}
        with ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=100), memory=_tier(base, 1, parity=4)) as mgr:
            mgr.maybe_save(1, state)
            mgr.wait()  # the staging buffer exists from here on
            tracemalloc.start()
            mgr.maybe_save(2, state)
            mgr.wait()
            protect = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(base, "node1"))
        dist.barrier()
        dest = {"w": torch.zeros(mib << 18)}
        walk, peaks = rebuild.walk, []

        def measured(*a, **k):  # the rebuild alone: verifying and loading the copies read them as any load does
            tracemalloc.start()
            try:
                return walk(*a, **k)
            finally:
                peaks.append(tracemalloc.get_traced_memory()[1])
                tracemalloc.stop()

        rebuild.walk = measured
        with ckptkit.CheckpointManager(run, memory=_tier(base, 1, parity=4)) as mgr:
            step = mgr.restore_latest(dest)
            sources = mgr.last_restore.sources
        return {"step": step, "sources": sources, "equal": torch.equal(dest["w"], state["w"]),
                "protect": protect, "rebuild": max(peaks)}
    finally:
        parity.WINDOW = before
        rebuild.walk = walk


def test_parity_protection_and_rebuild_hold_windows_not_snapshots(worlds, tmp_path):
    """An 8 MiB snapshot per rank, 64 KiB windows: neither the parity rounds nor the rebuild allocate
    anything near a chunk (2.7 MiB) or a snapshot (8 MiB); before they were streamed, the rounds
    held the whole snapshot as one byte string and the rebuilt rank the group's three snapshots."""
    res = worlds.run(4, parity_memory, str(tmp_path / "run"), str(tmp_path / "mem"), 8)
    assert [r["step"] for r in res] == [2] * 4 and res[0]["sources"] == ("memory", "parity", "memory", "memory")
    assert all(r["equal"] for r in res)
    for r in res:
        assert r["protect"] < 1 << 20 and r["rebuild"] < 1 << 20, r


def test_both_copies_gone_falls_back_to_persistent(worlds, tmp_path, references):
    run, base = _run(worlds, tmp_path, 2, replicas=1)
    shutil.rmtree(os.path.join(base, "node0"))
    shutil.rmtree(os.path.join(base, "node1"))
    res = worlds.run(4, restore, run, base, 2, replicas=1)
    assert res[0]["step"] == PERSIST_EVERY and res[0]["sources"] == ("persistent",) * 4
    _equal(res[0]["full"], references[PERSIST_EVERY])


def test_kill_while_copying_uses_the_older_complete_step(worlds, tmp_path, references):
    run, base = _run(worlds, tmp_path, 2, replicas=1, fail_protect_at=STEPS)
    shutil.rmtree(os.path.join(base, "node1"))
    res = worlds.run(4, restore, run, base, 2, replicas=1)
    assert res[0]["step"] == STEPS - 1 and res[0]["sources"] == ("memory", "memory", "peer", "peer")
    _equal(res[0]["full"], references[STEPS - 1])


def _flip(folder: str) -> str:
    files = [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names]
    data = max(files, key=os.path.getsize)
    flip_byte(data)
    return data


def test_corrupted_own_copy_is_skipped_for_the_peer_copy(worlds, tmp_path, references, caplog):
    run, base = _run(worlds, tmp_path, 2, replicas=1)
    _flip(os.path.join(base, "node0", f"step-{STEPS:010d}", "rank-00000"))
    res = worlds.run(4, restore, run, base, 2, replicas=1)
    assert res[0]["step"] == STEPS and res[0]["sources"] == ("peer", "memory", "memory", "memory")
    _equal(res[0]["full"], references[STEPS])


def test_corrupted_replica_with_its_node_lost_falls_back(worlds, tmp_path, references):
    run, base = _run(worlds, tmp_path, 2, replicas=1)
    shutil.rmtree(os.path.join(base, "node1"))
    _flip(os.path.join(base, "node0", f"step-{STEPS:010d}", "rank-00002"))  # node 0's copy of rank 2
    res = worlds.run(4, restore, run, base, 2, replicas=1)
    assert res[0]["step"] == PERSIST_EVERY and res[0]["sources"] == ("persistent",) * 4
    _equal(res[0]["full"], references[PERSIST_EVERY])


def restore_plain(run: str, base: str) -> dict:
    model, optim = models.build("fsdp", torch.float32, seed=5)
    state = models.sharded_state(model, optim)
    with ckptkit.CheckpointManager(run, memory=_tier(base, 1, replicas=1)) as mgr:
        step = mgr.restore_latest(state)
        return {"step": step, "source": mgr.last_restore.source}


def test_restart_at_another_world_size_is_persistent_only(worlds, tmp_path, caplog):
    run, base = _run(worlds, tmp_path, 2, replicas=1)
    res = worlds.run(2, restore_plain, run, base)
    assert res == [{"step": PERSIST_EVERY, "source": "persistent"}] * 2


def test_memory_snapshots_are_ckptkit_checkpoints(worlds, tmp_path):
    run, base = _run(worlds, tmp_path, 2, replicas=1)
    step = os.path.join(base, "node1", f"step-{STEPS:010d}")
    assert sorted(os.listdir(step)) == ["rank-00000", "rank-00001", "rank-00002", "rank-00003"]
    for r in os.listdir(step):
        assert ckptkit.verify(os.path.join(step, r)).ok
    # only the newest complete step is kept
    assert os.listdir(os.path.join(base, "node1")) == [f"step-{STEPS:010d}"]


def train_with_one_rank_refused(run: str, base: str, rpn: int, refused_at: int, steps: int, **kw) -> dict:
    """Train as :func:`train`, but at ``refused_at`` rank 1's state holds a tensor no save takes (its
    snapshot is refused on its training thread); every rank goes on past the errors, as a job that
    logs a failed checkpoint and keeps training does."""
    model, optim = models.build("fsdp", torch.float32, seed=0)
    mgr = ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=PERSIST_EVERY),
                                    memory=_tier(base, rpn, **kw))
    errors = {}
    for step in range(1, steps + 1):
        models.train(model, optim, 1, start=step)
        state = models.sharded_state(model, optim)
        if step == refused_at and dist.get_rank() == 1:
            state["extra"] = torch.ones(3).to_sparse()
        try:
            mgr.maybe_save(step, state)
        except ckptkit.SaveError as exc:
            errors[step] = str(exc)
    mgr.close()
    return errors


def test_a_snapshot_one_rank_cannot_take_fails_that_step_on_every_rank_and_the_next_ones_work(worlds, tmp_path):
    """Rank 1 never gets to protect its refused snapshot: its background still joins that step's agreement
    (with the failure), so the ranks' agreements stay paired step with step, the step fails on every rank
    at the next snapshot, and the snapshot after that is whole. Before, the other ranks' backgrounds
    waited on an agreement rank 1 never entered, and paired it with rank 1's next step's."""
    run, base = str(tmp_path / "run"), str(tmp_path / "mem")
    res = worlds.run(4, train_with_one_rank_refused, run, base, 2, 5, 7, replicas=1, timeout=240)
    assert "tensor 'extra' cannot be saved" in res[1][5], res[1]
    for rank, errors in enumerate(res):
        assert "the previous memory snapshot failed" in errors[6] and "step 5" in errors[6], (rank, errors)
        assert set(errors) == ({5, 6} if rank == 1 else {6}), (rank, errors)
    want = worlds.run(4, reference, 7)[0]
    got = worlds.run(4, restore, run, base, 2, replicas=1)
    for r in got:
        assert (r["step"], r["source"]) == (7, "memory"), r
        _equal(r["full"], want)
