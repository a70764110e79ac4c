"""What a memory-tier restore checks, and what it hands back, under random damage (4 gloo ranks).

Since 2026-12-05 a restore checks only the copies and shares its plan uses (own copies first; a
peer's copy or the parity inputs only for the ranks whose own copy is gone or fails), re-planning
without each one that fails. Random patterns of damaged and lost copies, replicas and shares:

* the restored step and every rank's source are what a brute force over the *undamaged* copies
  says (own memory, else a peer's copy, else a parity rebuild, else the persistent checkpoint);
* every restored byte is the saved one;
* the copies checked are exactly the ones the plans needed on the way (``replicas=1``): an own
  copy is checked by its rank's load, and a replica is never read when its rank's own copy loads;
* a restore that fails on some ranks after others loaded their copies, with nothing older to fall
  back on, raises on every rank (it never says "nothing restored" over a half-loaded state).
"""

from __future__ import annotations

import glob
import os
import random
import shutil

import pytest
import torch
import torch.distributed as dist

import ckptkit
from tests.damage import flip_byte

MEM_STEP, PERSISTENT_STEP = 2, 1


def _state(seed: int, n: int = 3000) -> dict:
    """This rank's own keys and bytes (``n + 41 * rank`` floats and 700 doubles), from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    r = dist.get_rank()
    return {f"w@{r}": torch.randn(n + 41 * r, generator=g), f"m@{r}": torch.randn(700, generator=g).double()}


def _tier(base: str, kind: str, every_steps: int = 1) -> ckptkit.MemoryTier:
    """``replicas=1`` on 2 nodes of 2 (``kind`` "r1") or ``parity=4`` on 4 nodes of 1 ("p4")."""
    rpn = 2 if kind == "r1" else 1
    kw = {"replicas": 1} if kind == "r1" else {"parity": 4}
    return ckptkit.MemoryTier(every_steps=every_steps, root=os.path.join(base, f"node{dist.get_rank() // rpn}"),
                              ranks_per_node=rpn, timeout_seconds=60.0, **kw)


def save_both(run: str, base: str, kind: str, seed: int, persistent: bool) -> dict:
    """A persistent checkpoint of step 1 (unless not ``persistent``), a memory snapshot of step 2."""
    saved = {PERSISTENT_STEP: _state(seed + 1), MEM_STEP: _state(seed + 2)}
    with ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(), memory=_tier(base, kind)) as mgr:
        if persistent:
            mgr.save(PERSISTENT_STEP, saved[PERSISTENT_STEP])
            mgr.wait()
        mgr.maybe_save(MEM_STEP, saved[MEM_STEP])
        mgr.wait()
    return saved


def restore_logged(run: str, base: str, kind: str, seed: int) -> dict:
    """Restore into fresh tensors, noting every copy and share the restore checked."""
    from ckptkit.memory import node_folder, restore

    checked: list[tuple[str, int]] = []
    real_verified, real_check_share = restore.verified, node_folder.NodeFolder.check_share

    def verified(store):
        checked.append(("copy", int(store.root.rstrip("/").rsplit("rank-", 1)[1])))
        return real_verified(store)

    def check_share(self, step, holder):
        checked.append(("share", holder))
        return real_check_share(self, step, holder)

    restore.verified, node_folder.NodeFolder.check_share = verified, check_share
    initial = _state(seed + 3)
    dest = {k: v.clone() for k, v in initial.items()}
    got = raised = sources = None
    try:
        with ckptkit.CheckpointManager(run, memory=_tier(base, kind)) as mgr:
            try:
                got = mgr.restore_latest(dest)
                sources = mgr.last_restore.sources if mgr.last_restore is not None else None
            except ckptkit.CkptkitError as exc:
                raised = f"{type(exc).__name__}: {exc}"
    finally:
        restore.verified, node_folder.NodeFolder.check_share = real_verified, real_check_share
    node = os.path.basename(_tier(base, kind).root)
    return {"got": got, "sources": sources, "raised": raised, "dest": dest, "initial": initial,
            "checked": [(node, what, r) for what, r in checked]}


def _flip_largest(folder: str, pattern: str = "**/*") -> None:
    files = [p for p in glob.glob(os.path.join(folder, pattern), recursive=True) if os.path.isfile(p)]
    flip_byte(max(files, key=os.path.getsize), 1 / 3, 0x11)


def _step_dir(base: str, node: int) -> str:
    return os.path.join(base, f"node{node}", f"step-{MEM_STEP:010d}")


def _expected_r1(lost: set[int], bad: set[tuple[str, int]]) -> tuple[tuple[str, ...] | None, set]:
    """(sources, copies checked before loading) a restore must give with ``replicas=1`` on 2 nodes of
    2 ranks. An own copy is checked by its rank's load, not before; a replica is checked by its
    holder when the plan needs it: at once for a rank whose node is lost, and after the loads for
    a rank whose own copy failed its load (if the first plan got as far as loading)."""
    own_ok = {r: r // 2 not in lost and ("own", r) not in bad for r in range(4)}
    rep_ok = {r: (1 - r // 2) not in lost and ("rep", r) not in bad for r in range(4)}
    first = {r for r in range(4) if r // 2 in lost and (1 - r // 2) not in lost}  # peers from the start
    checked = {(f"node{1 - r // 2}", "copy", r) for r in first}
    if all(rep_ok[r] for r in first) and all(own_ok[r] or rep_ok[r] or r // 2 not in lost for r in range(4)):
        checked |= {(f"node{1 - r // 2}", "copy", r) for r in range(4) if r // 2 not in lost and not own_ok[r]
                    and (1 - r // 2) not in lost}
    if all(own_ok[r] or rep_ok[r] for r in range(4)):
        return tuple("memory" if own_ok[r] else "peer" for r in range(4)), checked
    return None, checked


def _check_restored(res: list[dict], saved: list[dict], sources) -> None:
    step = MEM_STEP if sources is not None else PERSISTENT_STEP
    assert [r["got"] for r in res] == [step] * 4, [(r["got"], r["raised"]) for r in res]
    assert res[0]["sources"] == (sources or ("persistent",) * 4), res[0]["sources"]
    for rank, r in enumerate(res):
        for k, v in r["dest"].items():
            assert torch.equal(v, saved[rank][step][k]), (rank, k)


@pytest.mark.parametrize("seed", range(8))
def test_random_damage_to_replicas_restores_what_the_undamaged_copies_allow(worlds, tmp_path, seed):
    rng = random.Random(seed)
    run, base = str(tmp_path / "run"), str(tmp_path / "mem")
    saved = worlds.run(4, save_both, run, base, "r1", seed, True)
    lost = {rng.randrange(2)} if rng.random() < 0.4 else set()
    bad = {(what, r) for what in ("own", "rep") for r in range(4) if rng.random() < 0.3}
    if seed == 0:
        lost, bad = set(), set()  # nothing wrong: only the own copies are read
    for what, r in bad:
        node = r // 2 if what == "own" else 1 - r // 2
        _flip_largest(os.path.join(_step_dir(base, node), f"rank-{r:05d}"))
    for node in lost:
        shutil.rmtree(os.path.join(base, f"node{node}"))
    res = worlds.run(4, restore_logged, run, base, "r1", seed)
    sources, checked = _expected_r1(lost, bad)
    _check_restored(res, saved, sources)
    assert {c for r in res for c in r["checked"]} == checked, (lost, sorted(bad))
    if seed == 0:  # nothing wrong: each rank's load of its own copy is the only check
        assert not any(x["checked"] for x in res)


@pytest.mark.parametrize("seed", range(8))
def test_random_damage_to_parity_restores_what_the_undamaged_copies_and_shares_allow(worlds, tmp_path, seed):
    rng = random.Random(100 + seed)
    run, base = str(tmp_path / "run"), str(tmp_path / "mem")
    saved = worlds.run(4, save_both, run, base, "p4", seed, True)
    lost = {rng.randrange(4)} if rng.random() < 0.5 else set()
    bad_own = {r for r in range(4) if rng.random() < 0.12}
    bad_share = {r for r in range(4) if rng.random() < 0.12}
    if seed == 0:
        lost, bad_own, bad_share = set(), set(), set()
    for r in bad_own:
        _flip_largest(os.path.join(_step_dir(base, r), f"rank-{r:05d}"))
    for r in bad_share:
        _flip_largest(_step_dir(base, r), f"share-{r:05d}.bin")
    for node in lost:
        shutil.rmtree(os.path.join(base, f"node{node}"))
    res = worlds.run(4, restore_logged, run, base, "p4", seed)
    missing = {r for r in range(4) if r in lost or r in bad_own}
    if not missing:
        sources = ("memory",) * 4
    elif len(missing) == 1 and not ({r for r in range(4) if r not in missing} & (bad_share | lost)):
        sources = tuple("parity" if r in missing else "memory" for r in range(4))
    else:
        sources = None
    _check_restored(res, saved, sources)
    shares_checked = {r for x in res for _, what, r in x["checked"] if what == "share"}
    if not missing:
        assert not shares_checked  # every own copy good: no share is read
    if len(missing) == 1:  # a rebuild reads the other members' shares, never the lost member's own
        assert shares_checked <= {r for r in range(4) if r not in missing}


def restore_into_full_folder(run: str, base: str) -> dict:
    return restore_logged(run, base, "r1", 0)


def test_a_memory_restore_that_fails_after_some_ranks_loaded_never_says_nothing_was_restored(worlds, tmp_path):
    """Node 1 comes back with a memory folder too small for its ranks' copies (a real 8 KiB tmpfs):
    ranks 0-1 load their own copies, ranks 2-3 get nothing. With no persistent checkpoint to fall
    back on, every rank raises; none returns None over ranks 0-1's loaded state."""
    from tests.small_fs import small_tmpfs

    run, base = str(tmp_path / "run"), str(tmp_path / "mem")
    worlds.run(4, save_both, run, base, "r1", 0, False)
    shutil.rmtree(os.path.join(base, "node1"))
    with small_tmpfs(os.path.join(base, "node1"), "8k"):
        res = worlds.run(4, restore_into_full_folder, run, base)
    assert all(r["got"] is None and r["raised"] for r in res), [(r["got"], r["raised"]) for r in res]
    assert all("partly overwritten" in r["raised"] for r in res), res[0]["raised"]
    for r in res[2:]:  # what ranks 2-3 hold is still their initial state, as the error implies nothing else
        assert all(torch.equal(v, r["initial"][k]) for k, v in r["dest"].items())


def test_a_lost_members_own_damaged_share_does_not_stop_its_rebuild(worlds, tmp_path):
    """Rank 1's copy and its own share are both damaged: the rebuild needs the other members' shares
    only, so rank 1 comes back through parity, bit-exact, and share 1 is never read."""
    run, base = str(tmp_path / "run"), str(tmp_path / "mem")
    saved = worlds.run(4, save_both, run, base, "p4", 11, True)
    _flip_largest(os.path.join(_step_dir(base, 1), "rank-00001"))
    _flip_largest(_step_dir(base, 1), "share-00001.bin")
    res = worlds.run(4, restore_logged, run, base, "p4", 11)
    _check_restored(res, saved, ("memory", "parity", "memory", "memory"))
    assert {r for x in res for _, what, r in x["checked"] if what == "share"} == {0, 2, 3}


def _hostile(path: str, kind: str, rng: random.Random, others: list[str]) -> None:
    """Damage one file of a node folder: a flipped byte, a cut, gone, a FIFO or a link in its place."""
    size = os.path.getsize(path)
    if kind == "flip" and size:
        flip_byte(path, rng.random(), 1 << rng.randrange(8))
    elif kind == "cut":
        os.truncate(path, rng.randrange(size) if size else 0)
    elif kind == "gone":
        os.unlink(path)
    elif kind == "fifo":
        os.unlink(path)
        os.mkfifo(path)
    elif kind == "link":  # another file of the tier, of the same name where there is one (another rank's)
        target = rng.choice([o for o in others if o != path] or [path + ".nowhere"])
        os.unlink(path)
        os.symlink(target, path)


@pytest.mark.parametrize("kind,seed", [(k, s) for k in ("r1", "p4") for s in range(6)])
def test_hostile_node_folders_give_back_the_saved_bytes_or_fall_back_never_other_bytes(worlds, tmp_path, kind, seed):
    """1-3 random files of the node folders (data, index, manifest of any copy; a share or its
    header) flipped, cut, removed, or replaced by a FIFO or a link: the restore finishes (no hang),
    and gives back either the memory step or the persistent one, bit-exact on every rank."""
    rng = random.Random(1000 * (kind == "p4") + seed)
    run, base = str(tmp_path / "run"), str(tmp_path / "mem")
    saved = worlds.run(4, save_both, run, base, kind, seed, True)
    files = sorted(p for p in glob.glob(os.path.join(base, "node*", f"step-{MEM_STEP:010d}", "**", "*"), recursive=True)
                   if os.path.isfile(p))
    for path in rng.sample(files, rng.randint(1, 3)):
        _hostile(path, rng.choice(("flip", "cut", "gone", "fifo", "link")), rng, files)
    res = worlds.run(4, restore_logged, run, base, kind, seed, timeout=120)
    assert all(r["raised"] is None for r in res), [r["raised"] for r in res]
    step = res[0]["got"]
    assert step in (MEM_STEP, PERSISTENT_STEP) and [r["got"] for r in res] == [step] * 4
    for rank, r in enumerate(res):
        for k, v in r["dest"].items():
            assert torch.equal(v, saved[rank][step][k]), (rank, k, step, res[0]["sources"])


def test_without_a_persistent_step_a_damaged_own_copy_is_found_before_loading(worlds, tmp_path):
    """No persistent checkpoint yet (early in a run): own copies are checked before any load, so a
    rank whose own copy and replica are both damaged leaves every state untouched and the restore
    says "nothing to restore" (None: a fresh start), not "partly overwritten"."""
    run, base = str(tmp_path / "run"), str(tmp_path / "mem")
    worlds.run(4, save_both, run, base, "r1", 3, False)
    _flip_largest(os.path.join(_step_dir(base, 0), "rank-00000"))  # rank 0's own copy
    _flip_largest(os.path.join(_step_dir(base, 1), "rank-00000"))  # and its replica on node 1
    res = worlds.run(4, restore_logged, run, base, "r1", 3)
    assert [(r["got"], r["raised"]) for r in res] == [(None, None)] * 4
    for r in res:
        assert all(torch.equal(v, r["initial"][k]) for k, v in r["dest"].items())
    assert ("node0", "copy", 0) in {c for r in res for c in r["checked"]}  # checked, not loaded
