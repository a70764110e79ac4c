"""Spare files (:mod:`ckptkit.memory.spares`): a retired snapshot's data files written over by the next.

What must hold whatever the pool holds or the folder around it does: a recycled file holds exactly
the new bytes (never a byte of what it held before, whatever the sizes); a link or a hard link in
the pool is never written through; a node folder never holds more than two steps; and a job whose
state grows and shrinks between snapshots restores bit-exact from its peers."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.memory.spares import MIN_SPARE, RecyclingStore, SparePool, open_new_file
from tests import models

MiB = 1 << 20


def _spare(pool: SparePool, tmp, name: str, size: int, fill: bytes = b"\xee") -> int:
    path = os.path.join(tmp, name)
    with open(path, "wb") as f:
        f.write(fill * size)
    return pool.keep(path, 1 << 40)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3 * MiB), min_size=1, max_size=6), st.lists(st.integers(MIN_SPARE, 3 * MiB), max_size=3))
def test_a_recycled_object_holds_exactly_the_new_bytes(tmp_path_factory, sizes, spares):
    tmp = str(tmp_path_factory.mktemp("recycle"))
    pool = SparePool(tmp, 0)
    for i, n in enumerate(spares):
        assert _spare(pool, tmp, f"old{i}", n) == n
    store = RecyclingStore(os.path.join(tmp, "rank"), pool)
    for i, n in enumerate(sizes):
        data = bytes((i * 7 + j) % 251 for j in range(min(n, 4096))) * (n // 4096 + 1)
        data = data[:n]
        key = f"data/obj{i}.bin"
        assert store.write_object(key, [memoryview(data)[: n // 2], memoryview(data)[n // 2:]]) == n
        with open(os.path.join(store.root, "data", f"obj{i}.bin"), "rb") as f:
            assert f.read() == data
        if os.path.getsize(os.path.join(store.root, "data", f"obj{i}.bin")) >= MIN_SPARE:  # back into the pool
            pool.keep(os.path.join(store.root, "data", f"obj{i}.bin"), 1 << 40)
    pool.close()


def test_small_objects_never_take_a_spare(tmp_path):
    pool = SparePool(str(tmp_path), 0)
    _spare(pool, str(tmp_path), "old", 2 * MiB)
    store = RecyclingStore(str(tmp_path / "rank"), pool)
    store.write_object("index/rank-00000.json", [b"{}"])
    store.put_bytes("manifest.json", b"{}")
    assert len(pool) == 1
    fd = open_new_file(str(tmp_path / "small.bin"), 100, pool)
    os.close(fd)
    assert len(pool) == 1


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_a_link_in_the_pool_is_never_written_through(tmp_path, kind):
    """A link (or a second name of a file elsewhere) put where a spare was: refused when kept, and
    refused again when taken (the pool folder is in shared memory that others could reach)."""
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"precious" * (MiB // 4))
    before = outside.read_bytes()
    pool = SparePool(str(tmp_path / "node"), 0)
    link = tmp_path / "node" / "link.bin"
    if kind == "symlink":
        os.symlink(outside, link)
    else:
        os.link(outside, link)
    assert pool.keep(str(link), 1 << 40) == 0  # refused at keep
    # and planted behind the pool's back, as if swapped in after it was kept
    assert _spare(pool, str(tmp_path / "node"), "good", 2 * MiB) == 2 * MiB
    (_, spare), = pool._files
    os.unlink(spare)
    if kind == "symlink":
        os.symlink(outside, spare)
    else:
        os.link(outside, spare)
    store = RecyclingStore(str(tmp_path / "rank"), pool)
    store.write_object("data/x.bin", [b"\x01" * (3 * MiB)])
    assert outside.read_bytes() == before
    assert (tmp_path / "rank" / "data" / "x.bin").read_bytes() == b"\x01" * (3 * MiB)
    assert not os.path.islink(tmp_path / "rank" / "data" / "x.bin")



def test_a_former_process_pool_is_cleared(tmp_path):
    first = SparePool(str(tmp_path), 3)
    _spare(first, str(tmp_path), "old", 2 * MiB)
    again = SparePool(str(tmp_path), 3)
    assert len(again) == 0 and os.listdir(again.dir) == []


# ------------------------------------------------------------------ a real job: 4 ranks, 2 nodes


def _folder_bytes(root: str) -> int:
    return sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(root) for f in fs)


def _step_bytes(root: str, step: int) -> int:
    return _folder_bytes(os.path.join(root, f"step-{step:010d}"))


def growing_job(run: str, base: str, reuse: bool = True) -> dict:
    """Snapshots every step while the state grows (an extra buffer appears, then doubles) and shrinks
    again; after each, this node's folder against the newest step. Returns the ratios."""
    model, optim = models.build("fsdp", torch.float32, seed=0)
    extra_sizes = {1: 0, 2: 0, 3: 600_000, 4: 600_000, 5: 600_000, 6: 1_200_000, 7: 900_000}
    ratios, reused = [], []
    pool_inodes: set[int] = set()
    node = os.path.join(base, f"node{dist.get_rank() // 2}")
    tier = ckptkit.MemoryTier(every_steps=1, replicas=1, root=node, ranks_per_node=2, timeout_seconds=60.0,
                              reuse_files=reuse)
    with ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(), memory=tier) as mgr:
        for s in range(1, 8):
            models.train(model, optim, 1, start=s)
            state = models.sharded_state(model, optim)
            n = extra_sizes[s]
            if n:
                state["extra"] = torch.full((n,), float(s * 10 + dist.get_rank()))
            mgr.maybe_save(s, state)
            mgr.wait()
            dist.barrier()
            if dist.get_rank() % 2 == 0:
                ratios.append(_folder_bytes(node) / _step_bytes(node, s))
                reused.append(len(_inodes(os.path.join(node, f"step-{s:010d}")) & pool_inodes))
                pool_inodes = _inodes(os.path.join(node, f"spares-{dist.get_rank():05d}"))
            dist.barrier()
    return {"ratios": ratios, "reused": reused}


def _inodes(root: str) -> set[int]:
    """The inodes of the files a spare could be made of, under ``root``."""
    return {os.lstat(os.path.join(d, f)).st_ino for d, _, fs in os.walk(root) for f in fs
            if os.lstat(os.path.join(d, f)).st_size >= MIN_SPARE}


def restore_with_extra(run: str, base: str, extra: int = 900_000, value: float = 70.0, parity: bool = False) -> dict:
    """Restore into a fresh model whose "extra" buffer has the last step's size (``extra``), and
    whether it came back as ``value + rank``. Replicas on 2 nodes of 2, or ``parity``=4 on 4 of 1."""
    model, optim = models.build("fsdp", torch.float32, seed=5)
    state = models.sharded_state(model, optim)
    state["extra"] = torch.zeros(extra)
    rpn, kw = (1, {"parity": 4}) if parity else (2, {"replicas": 1})
    tier = ckptkit.MemoryTier(every_steps=1, root=os.path.join(base, f"node{dist.get_rank() // rpn}"),
                              ranks_per_node=rpn, timeout_seconds=60.0, **kw)
    with ckptkit.CheckpointManager(run, memory=tier) as mgr:
        step = mgr.restore_latest(state)
        info = mgr.last_restore
    models.apply_state(model, optim, state)
    return {"step": step, "sources": info.sources, "full": models.full_state(model, optim),
            "extra_ok": bool(torch.equal(state["extra"], torch.full((extra,), float(value + dist.get_rank()))))}


def reference(step: int) -> dict:
    model, optim = models.build("fsdp", torch.float32, seed=0)
    for s in range(1, step + 1):
        models.train(model, optim, 1, start=s)
    return models.full_state(model, optim)


def test_a_growing_and_shrinking_state_recycles_within_two_steps_and_restores_bit_exact(worlds, tmp_path):
    run, base = str(tmp_path / "run"), str(tmp_path / "mem")
    res = worlds.run(4, growing_job, run, base)
    for r in (0, 2):
        # two steps at most (the newest and the spares of the one before, or its files), plus a little
        assert all(x <= 2.2 for x in res[r]["ratios"]), res[r]["ratios"]
        assert res[r]["ratios"][3] > 1.8, res[r]["ratios"]  # step 3's files kept as spares by step 4
        assert res[r]["reused"][4] >= 2, res[r]["reused"]  # step 5 written over them: its own and a received copy
    import shutil

    shutil.rmtree(os.path.join(base, "node0"))
    again = worlds.run(4, restore_with_extra, run, base)
    assert again[0]["step"] == 7 and again[0]["sources"] == ("peer", "peer", "memory", "memory")
    assert all(a["extra_ok"] for a in again)
    want = worlds.run(4, reference, 7)[0]
    assert again[0]["full"].keys() == want.keys()
    for k in want:
        assert torch.equal(again[0]["full"][k], want[k]), k


def test_reuse_files_off_keeps_one_step_between_snapshots(worlds, tmp_path):
    res = worlds.run(4, growing_job, str(tmp_path / "run"), str(tmp_path / "mem"), False)
    for r in (0, 2):
        assert all(x <= 1.05 for x in res[r]["ratios"]) and not any(res[r]["reused"]), res[r]
    assert not [n for n in os.listdir(tmp_path / "mem" / "node0") if n.startswith("spares-")]


def test_reuse_files_must_be_a_bool():
    with pytest.raises(ckptkit.OptionsError, match="reuse_files"):
        ckptkit.MemoryTier(every_steps=1, reuse_files="yes")


def test_a_spare_that_cannot_be_moved_into_place_is_not_left_behind(tmp_path):
    pool = SparePool(str(tmp_path), 0)
    _spare(pool, str(tmp_path), "old", 2 * MiB)
    assert pool.open_over(str(tmp_path / "no" / "such" / "dir" / "x.bin")) is None
    assert len(pool) == 0 and os.listdir(pool.dir) == []


def test_a_link_in_place_of_the_pool_folder_is_not_followed(tmp_path):
    """A symlink where the pool's folder goes (a hostile or damaged node folder) is removed, and the
    pool made as a folder of its own: nothing is ever moved into the place it pointed at."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "theirs").write_bytes(b"x")
    node = tmp_path / "node"
    node.mkdir()
    os.symlink(elsewhere, node / "spares-00000")
    pool = SparePool(str(node), 0)
    assert not os.path.islink(pool.dir) and os.path.isdir(pool.dir)
    _spare(pool, str(node), "old", 2 * MiB)
    assert sorted(os.listdir(elsewhere)) == ["theirs"]
    pool.close()
    assert sorted(os.listdir(elsewhere)) == ["theirs"]


def parity_job(run: str, base: str) -> dict:
    """parity=4 over 4 nodes of 1, a snapshot every step: whether each new share is written over a
    spare (the former share of this rank, or a data file), and the shares' bytes in the end."""
    model, optim = models.build("fsdp", torch.float32, seed=0)
    node = os.path.join(base, f"node{dist.get_rank()}")
    tier = ckptkit.MemoryTier(every_steps=1, parity=4, root=node, ranks_per_node=1, timeout_seconds=60.0)
    recycled, pool_inodes = [], set()
    share = f"share-{dist.get_rank():05d}.bin"
    with ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(), memory=tier) as mgr:
        for s in range(1, 6):
            models.train(model, optim, 1, start=s)
            state = models.sharded_state(model, optim)
            state["extra"] = torch.full((1_000_000 + 1000 * s,), float(s * 10 + dist.get_rank()))
            mgr.maybe_save(s, state)
            mgr.wait()
            recycled.append(os.lstat(os.path.join(node, f"step-{s:010d}", share)).st_ino in pool_inodes)
            pool_inodes = _inodes(os.path.join(node, f"spares-{dist.get_rank():05d}"))
    return {"recycled": recycled}


def test_parity_shares_are_written_over_spares_and_still_rebuild_a_lost_node_bit_exact(worlds, tmp_path):
    """A share of a retired step is kept as a spare like the data files, and the next share is written
    over one (no zeroing: the parity rounds' first round stores every byte). Step 5's shares were
    all written over former files, whose old bytes must not show: rank 1's node is rebuilt from them."""
    run, base = str(tmp_path / "run"), str(tmp_path / "mem")
    res = worlds.run(4, parity_job, run, base)
    for r in res:
        assert not r["recycled"][0] and all(r["recycled"][2:]), r["recycled"]
    import shutil

    shutil.rmtree(os.path.join(base, "node1"))
    again = worlds.run(4, restore_with_extra, run, base, 1_005_000, 50.0, True)
    assert again[0]["step"] == 5 and again[0]["sources"] == ("memory", "parity", "memory", "memory")
    assert all(a["extra_ok"] for a in again)
    want = worlds.run(4, reference, 5)[0]
    for k in want:
        assert torch.equal(again[0]["full"][k], want[k]), k
