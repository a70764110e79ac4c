"""The memory tier in one process: what a snapshot holds, how a restore puts it back, how it
chooses between memory and the persistent checkpoints, and what it refuses."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 8, generator=g), "layers": [torch.randn(5, generator=g), torch.randn(3, generator=g)]},
        "a/b": torch.randn(4, generator=g),  # a key with the separator in it
        "step_count": seed,
        "names": ["x", "y", seed],
        "loader": ckptkit.PerRank({"pos": seed * 10}),
        "rng": torch.Generator().manual_seed(seed),
    }


def _manager(tmp_path, persist_every: int = 5, **kw) -> ckptkit.CheckpointManager:
    tier = ckptkit.MemoryTier(every_steps=2, replicas=0, root=str(tmp_path / "mem"), **kw)
    return ckptkit.CheckpointManager(str(tmp_path / "run"), save=ckptkit.SavePolicy(every_steps=persist_every),
                                     memory=tier)


def test_restore_puts_every_kind_of_leaf_back(tmp_path):
    with _manager(tmp_path) as mgr:
        for step in range(1, 9):
            mgr.maybe_save(step, _state(step))
    want = _state(8)
    state = _state(99)
    with _manager(tmp_path) as mgr:
        assert mgr.restore_latest(state) == 8
        assert (mgr.last_restore.step, mgr.last_restore.source) == (8, "memory")
    for key in ("w",):
        assert torch.equal(state["model"][key], want["model"][key])
    assert all(torch.equal(a, b) for a, b in zip(state["model"]["layers"], want["model"]["layers"]))
    assert torch.equal(state["a/b"], want["a/b"])
    assert state["step_count"] == 8 and state["names"] == ["x", "y", 8] and state["loader"].value == {"pos": 80}
    assert torch.equal(state["rng"].get_state(), want["rng"].get_state())


def test_snapshot_keys_are_the_users_keys(tmp_path):
    with _manager(tmp_path) as mgr:
        mgr.maybe_save(2, _state(2))
    view = ckptkit.open(str(tmp_path / "mem" / "step-0000000002" / "rank-00000"))
    assert {"model/w", "model/layers/0", "a%2Fb"} <= set(view.keys())


def test_newer_persistent_checkpoint_wins(tmp_path):
    with _manager(tmp_path) as mgr:
        for step in range(1, 5):
            mgr.maybe_save(step, _state(step))
        mgr.save(5, _state(5))  # persistent only, newer than memory's 4
    state = _state(99)
    with _manager(tmp_path) as mgr:
        assert mgr.restore_latest(state) == 5
        assert mgr.last_restore.source == "persistent"
    assert torch.equal(state["model"]["w"], _state(5)["model"]["w"])


def test_rollback_below_memory_discards_the_newer_snapshots(tmp_path):
    with _manager(tmp_path) as mgr:
        for step in range(1, 9):
            mgr.maybe_save(step, _state(step))
    state = _state(99)
    with _manager(tmp_path) as mgr:
        assert mgr.restore_latest(state, at_most=7) == 5  # memory holds only 8: the persistent 5
        assert mgr.last_restore.source == "persistent"
    assert os.listdir(tmp_path / "mem") == []  # step 8 belonged to the abandoned trajectory
    with _manager(tmp_path) as mgr:
        assert mgr.restore_latest(_state(99)) == 5


def test_changed_layout_is_persistent_only_and_said(tmp_path, caplog):
    with _manager(tmp_path) as mgr:
        for step in range(1, 7):
            mgr.maybe_save(step, _state(step))
    other = _state(99)
    other["model"]["w"] = torch.zeros(32, 16)  # same bytes, another shape
    caplog.set_level(logging.WARNING, logger="ckptkit")
    with _manager(tmp_path) as mgr:
        with pytest.raises(ckptkit.CkptkitError):
            mgr.restore_latest(other)  # the persistent step 5 does not fit either: an error, not a wrong load
    assert "another layout" in caplog.text


def test_damaged_own_copy_without_protection_falls_back_to_persistent(tmp_path, caplog):
    with _manager(tmp_path) as mgr:
        for step in range(1, 7):
            mgr.maybe_save(step, _state(step))
    folder = tmp_path / "mem" / "step-0000000006" / "rank-00000"
    data = max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 1
    data.write_bytes(bytes(raw))
    caplog.set_level(logging.WARNING, logger="ckptkit")
    state = _state(99)
    with _manager(tmp_path) as mgr:
        assert mgr.restore_latest(state) == 5
        assert mgr.last_restore.source == "persistent"
    assert "fails its checks" in caplog.text
    assert torch.equal(state["model"]["w"], _state(5)["model"]["w"])


def test_budget_is_checked_with_the_figure(tmp_path):
    with pytest.raises(ckptkit.SaveError, match="of host memory"):
        with _manager(tmp_path, max_host_bytes=1000) as mgr:
            mgr.maybe_save(2, _state(2))


def test_one_node_cannot_hold_replicas(tmp_path):
    with pytest.raises(ckptkit.CkptkitError, match="replicas=0 keeps only"):
        ckptkit.CheckpointManager(str(tmp_path / "run"), memory=ckptkit.MemoryTier(every_steps=1,
                                                                                   root=str(tmp_path / "m")))


def test_a_step_in_both_tiers_copies_the_state_once(tmp_path):
    """Persistent every 4 and memory every 2: steps 4 and 8 are in both. The persistent save persists
    from the memory tier's staged snapshot, so its own staging buffer is never allocated, and the state
    changed the moment maybe_save returns never leaks into either tier."""
    state = _state(1)
    with _manager(tmp_path, persist_every=4) as mgr:
        for step in range(1, 9):
            fresh = _state(step)
            for t, f in zip(state["model"]["layers"], fresh["model"]["layers"]):
                t.copy_(f)
            state["model"]["w"].copy_(fresh["model"]["w"])
            state["step_count"] = step
            mgr.maybe_save(step, state)
            state["model"]["w"].add_(1000.0)  # mutate at once: must not reach either checkpoint
            for t in state["model"]["layers"]:
                t.mul_(-3.0)
        mgr.wait()
        assert mgr._saver.pool.nbytes == 0  # the persistent saver never staged a copy of its own
    for step in (4, 8):
        view = ckptkit.open(str(tmp_path / "run" / f"step-{step:07d}"))
        assert torch.equal(view["model/w"][...], _state(step)["model"]["w"])
        assert torch.equal(view["model/layers/1"][...], _state(step)["model"]["layers"][1])
    restored = _state(99)
    with _manager(tmp_path, persist_every=4) as mgr:
        assert mgr.restore_latest(restored) == 8 and mgr.last_restore.source == "memory"
    assert torch.equal(restored["model"]["w"], _state(8)["model"]["w"])


def _tree(root) -> dict:
    out = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), root)] = fh.read()
    return out


def test_planted_entries_are_never_read_or_written_through(tmp_path):
    """A file in a step's place, a link in a step's or a rank's place pointing at a real snapshot
    elsewhere, a real snapshot folder moved under another step's name: none is restored from, no
    write or removal goes through a link, and the real newest step comes back."""
    import shutil

    with _manager(tmp_path) as mgr:
        for step in range(1, 7):
            mgr.maybe_save(step, _state(step))
    mem, outside = tmp_path / "mem", tmp_path / "outside"
    shutil.copytree(mem / "step-0000000006", outside / "step-0000000006")  # a real snapshot elsewhere
    (mem / "step-0000000011").write_bytes(b"x")
    os.symlink(outside / "step-0000000006", mem / "step-0000000010")
    os.makedirs(mem / "step-0000000009")
    os.symlink(outside / "step-0000000006" / "rank-00000", mem / "step-0000000009" / "rank-00000")
    shutil.copytree(mem / "step-0000000006", mem / "step-0000000008")  # moved: it records step 6
    before = _tree(outside)
    state = _state(99)
    with _manager(tmp_path) as mgr:
        assert mgr.restore_latest(state) == 6 and mgr.last_restore.source == "memory"
        assert state["step_count"] == 6
        for step in range(7, 12):  # writes at the planted steps' numbers, retirement of all of them
            mgr.maybe_save(step, _state(step))
    assert _tree(outside) == before
    assert not any(os.path.islink(mem / n) for n in os.listdir(mem))
    with _manager(tmp_path) as mgr:
        state = _state(99)
        assert mgr.restore_latest(state) == 10 and state["step_count"] == 10  # 11 is a file: never a step


def test_a_link_planted_at_the_default_memory_folder_is_refused(tmp_path):
    """The default folder's name under /dev/shm is predictable (derived from the run's URL), and
    /dev/shm is writable by every user: a link planted there would receive the snapshots."""
    from ckptkit.memory.tier import default_root

    run = str(tmp_path / "run")
    root = default_root(os.path.abspath(run))
    os.symlink(tmp_path, root)
    try:
        with pytest.raises(ckptkit.CkptkitError, match="not a directory of this user's"):
            ckptkit.CheckpointManager(run, memory=ckptkit.MemoryTier(every_steps=1, replicas=0))
    finally:
        os.unlink(root)
    assert not os.path.exists(tmp_path / "step-0000000001")


def test_a_root_given_as_a_link_is_the_folder_it_names(tmp_path):
    """``MemoryTier(root=...)`` may name its folder through a link (the user's choice): snapshots
    are kept in, and restored from, the folder the link names."""
    os.makedirs(tmp_path / "real")
    os.symlink(tmp_path / "real", tmp_path / "mem")
    with _manager(tmp_path) as mgr:
        for step in range(1, 5):
            mgr.maybe_save(step, _state(step))
    assert os.path.isdir(tmp_path / "real" / "step-0000000004")
    state = _state(99)
    with _manager(tmp_path) as mgr:
        assert mgr.restore_latest(state) == 4 and mgr.last_restore.source == "memory"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(persist=st.integers(2, 4), memory=st.integers(2, 5), steps=st.integers(4, 12), data=st.data())
def test_a_damaged_persistent_step_never_hides_a_newer_snapshot(tmp_path_factory, persist, memory, steps, data):
    """Persistent and memory intervals, a run of some steps, then random persistent steps damaged (their
    data): the restart restores the newest step that loads from either, bit-exact. The newest persistent
    step counted by its manifest alone: a damaged one hid every older-but-newer-than-the-fallback snapshot,
    the fallback went further back, and the snapshot was deleted (found by a model-based hunt, 2026-12-06)."""
    saved = [s for s in range(1, steps + 1) if s % persist == 0]
    damaged = data.draw(st.sets(st.sampled_from(saved)) if saved else st.just(set()), label="damaged")
    _damaged_run(tmp_path_factory.mktemp("tier"), persist, memory, steps, damaged)


def test_a_snapshot_as_new_as_the_persistent_step_a_fallback_reached_is_taken(tmp_path):
    """A tie after a fallback (hypothesis, 2026-12-06): persistent steps 2, 4, 6, step 6 damaged, a snapshot
    of step 4. The restore takes step 4 from memory, as it does when nothing is damaged."""
    _damaged_run(tmp_path, 2, 4, 6, {6})


def _damaged_run(root, persist: int, memory: int, steps: int, damaged: set[int]) -> None:
    from tests.damage import flip_byte

    tier = ckptkit.MemoryTier(every_steps=memory, replicas=0, root=str(root / "mem"))
    mgr = ckptkit.CheckpointManager(str(root / "run"), save=ckptkit.SavePolicy(every_steps=persist), memory=tier,
                                    asynchronous=None)
    for step in range(1, steps + 1):
        mgr.maybe_save(step, _state(step))
    mgr.close()
    saved = [s for s in range(1, steps + 1) if s % persist == 0]
    for step in damaged:
        folder = root / "run" / f"step-{step:07d}" / "data"
        for name in os.listdir(folder):
            flip_byte(str(folder / name), where=0.0)
    good = max((s for s in saved if s not in damaged), default=None)
    snapshot = steps - steps % memory if steps >= memory else None
    want = max((s for s in (good, snapshot) if s is not None), default=None)
    state = _state(999)
    mgr = ckptkit.CheckpointManager(str(root / "run"), save=ckptkit.SavePolicy(every_steps=persist),
                                    memory=ckptkit.MemoryTier(every_steps=memory, replicas=0, root=str(root / "mem")),
                                    asynchronous=None)
    try:
        got = mgr.restore_latest(state)
    except ckptkit.CorruptCheckpointError:  # every step damaged after part of the state was loaded
        assert want is None, (saved, damaged, snapshot)
        return
    finally:
        mgr.close()
    assert got == want, (saved, damaged, snapshot, mgr.last_restore)
    if want is not None:
        assert torch.equal(state["model"]["w"], _state(want)["model"]["w"]) and state["step_count"] == want
        assert mgr.last_restore.source == ("memory" if want == snapshot else "persistent")  # a tie: memory


def test_a_rewind_to_before_every_checkpoint_drops_the_abandoned_snapshots(tmp_path):
    """``restore_latest(at_most=k)`` with nothing at or before ``k`` (a fresh start): the snapshots after
    ``k`` are the abandoned trajectory's, dropped as after a rewind to a step. One of them outranked the step
    the new trajectory saved again under its number, with the old trajectory's bytes (a hunt, 2026-12-06)."""
    import shutil

    def manager() -> ckptkit.CheckpointManager:
        return ckptkit.CheckpointManager(str(tmp_path / "run"), save=ckptkit.SavePolicy(every_steps=2),
                                         memory=ckptkit.MemoryTier(every_steps=2, replicas=0, root=str(tmp_path / "mem")),
                                         asynchronous=None)

    with manager() as mgr:
        mgr.maybe_save(2, _state(2))
        assert mgr.restore_latest(_state(99), at_most=1) is None
        shutil.rmtree(tmp_path / "run" / "step-0000002")  # the abandoned trajectory's persistent step, by hand
        mgr.save(2, _state(222))
    state = _state(99)
    with manager() as mgr:
        assert mgr.restore_latest(state) == 2 and mgr.last_restore.source == "persistent"
    assert state["step_count"] == 222
