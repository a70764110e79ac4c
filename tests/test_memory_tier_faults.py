"""The memory tier under damaged entries and failing node-folder writes (2026-12-06).

Each defect class here once failed one rank alone: a share header or a copy's manifest holding
``Infinity``, a 10**40 integer or nesting deeper than Python recurses crashed that rank's inventory
before the restore's first agreement; a failed commit of a received copy, or a failed write of a
parity rebuild, left that rank's walk of transfers early. Its peers then waited for it until the
tier's timeout. Here every such fault must end the restore promptly (well under the timeout) on
every rank, with the next source's bytes, bit-exact. A node folder sized for two steps must keep
taking snapshots after a restart (the budget once counted the kept step twice).

Faults in writes are injected by making one real call (``os.makedirs``, ``os.pwrite``, ...) on the
receiving rank raise at its k-th use: no tmpfs (and no root) needed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import time

import pytest
import torch
import torch.distributed as dist

import ckptkit
from ckptkit.layout.manifest import seal, unseal
from ckptkit.memory.node_folder import NodeFolder

TIMEOUT = 12  # the tier's group timeout: every restore here must end well within it
PROMPT = TIMEOUT / 2
N = 4096  # floats per rank: 16 KiB, four 4 KiB parity windows per chunk


def _state(rank: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    world = dist.get_world_size() if dist.is_initialized() else 1
    piece = ckptkit.box_piece("w", (N * world,), (N * rank,), (N,))
    return {"w": ckptkit.Sharded(torch.randn(N, generator=g), [piece]), "b": torch.full((8,), float(seed))}


def _manager(base: str, **kw) -> ckptkit.CheckpointManager:
    tier = ckptkit.MemoryTier(every_steps=1, root=os.path.join(base, f"node{dist.get_rank()}"), ranks_per_node=1,
                              timeout_seconds=TIMEOUT, **kw)
    return ckptkit.CheckpointManager(os.path.join(base, "run"), save=ckptkit.SavePolicy(every_steps=2), memory=tier)


def train(base: str, **kw) -> None:
    """Steps 1-3: step 2 persistent, step 3 the newest in memory."""
    mgr = _manager(base, **kw)
    for s in (1, 2, 3):
        mgr.maybe_save(s, _state(dist.get_rank(), s))
    mgr.close()


class _Fault:
    """``owner.name`` raising ``error`` at its ``k``-th call that ``when`` accepts (a real call otherwise)."""

    def __init__(self, owner: object, name: str, k: int, error: BaseException, when=lambda *a, **kw: True) -> None:
        self.owner, self.name, self.k, self.error, self.when, self.calls = owner, name, k, error, when, 0

    @contextlib.contextmanager
    def armed(self):
        real = getattr(self.owner, self.name)

        def faulty(*a, **kw):
            if self.when(*a, **kw):
                self.calls += 1
                if self.calls == self.k:
                    raise self.error
            return real(*a, **kw)

        setattr(self.owner, self.name, faulty)
        try:
            yield
        finally:
            setattr(self.owner, self.name, real)


def _faults(point: str, folder: str) -> _Fault:
    """The write points of a received copy and of a parity rebuild in ``folder``."""
    from ckptkit.memory import bundle
    from ckptkit.storage.local import LocalStore

    enospc = OSError(errno.ENOSPC, "No space left on device (injected)")
    return {
        "step folder": _Fault(os, "makedirs", 1, enospc, lambda path, *a, **k: str(path).startswith(folder)),
        "new file": _Fault(bundle, "open_new_file", 1, RuntimeError("injected: file not made"),
                           lambda path, *a, **k: path.startswith(folder)),
        "data write": _Fault(os, "pwrite", 2, RuntimeError("injected: write failed")),
        "sync": _Fault(os, "fsync", 1, enospc),
        "manifest": _Fault(LocalStore, "write_object", 1, enospc,
                           lambda self, key, *a, **k: key == "manifest.json" and self.root.startswith(folder)),
    }[point]


def restore(base: str, fault_at: str | None = None, faulty_rank: int = 0, **kw) -> tuple:
    """Restore into a fresh state (with ``fault_at`` injected on ``faulty_rank``): the step, the
    source, whether the bytes are that step's, and the seconds it took."""
    rank = dist.get_rank()
    st = _state(rank, 99)
    fault = _faults(fault_at, os.path.join(base, f"node{rank}")) if fault_at and rank == faulty_rank else None
    mgr = _manager(base, **kw)
    t0 = time.monotonic()
    with fault.armed() if fault is not None else contextlib.nullcontext():
        step = mgr.restore_latest(st)
    seconds = time.monotonic() - t0
    mgr.close()
    want = _state(rank, step)
    exact = torch.equal(st["w"].local, want["w"].local) and torch.equal(st["b"], want["b"])
    return step, mgr.last_restore.source, exact, seconds, None if fault is None else fault.calls


def _fresh(pristine: str, to: str) -> str:
    shutil.copytree(pristine, to, symlinks=True)
    return to


# --------------------------------------------------------------- malformed share headers and manifests
_HEADER = {"version": 3, "step": 3, "members": [0, 1], "index": 1, "chunk": 8, "lengths": [8, 8],
           "digests": ["a", "b"], "share_digest": "c", "run": "r"}


def _header(**change) -> bytes:
    return json.dumps({**_HEADER, **change}).encode()


MALFORMED_HEADERS = {
    "step Infinity": _header().replace(b'"step": 3', b'"step": Infinity'),
    "chunk NaN": _header().replace(b'"chunk": 8', b'"chunk": NaN'),
    "length 1e999": _header().replace(b'"lengths": [8, 8]', b'"lengths": [8, 1e999]'),
    "huge index": _header(index=10**40),
    "huge member": _header(members=[0, 10**30]),
    "float step": _header(step=3.0),
    "bool index": _header(index=True),
    "string member": _header(members=[0, "1"]),
    "digest not a string": _header(digests=["a", 7]),
    "run not a string": _header(run=[1]),
    "members an object": _header(members={"0": 0}),
    "deep nesting": b"[" * 200_000,
    "deep in a field": _header().replace(b'"run": "r"', b'"run": ' + b"[" * 5000 + b"]" * 5000),
    "truncated": _header()[:40],
    "binary junk": bytes(range(256)) * 4,
    "not an object": b"[3, 1]",
    "duplicate key": _header()[:-1] + b', "step": 4}',
    "empty": b"",
}


def test_malformed_share_headers_are_refused_by_name(tmp_path):
    """Every kind of damage to a share header is a CorruptCheckpointError naming the file, never
    another exception (OverflowError, RecursionError) that a rank's inventory lets through."""
    folder = NodeFolder(str(tmp_path))
    os.makedirs(folder.step_path(3))
    path = os.path.join(folder.step_path(3), "share-00001.json")
    with open(path, "wb") as f:
        f.write(_header())
    assert folder.share_header(3, 1).members == (0, 1)  # the undamaged one parses
    for what, data in MALFORMED_HEADERS.items():
        with open(path, "wb") as f:
            f.write(data)
        with pytest.raises(ckptkit.CorruptCheckpointError, match="share-00001.json") as got:
            folder.share_header(3, 1)
        assert type(got.value) is ckptkit.CorruptCheckpointError, what


def _manifest_with(path: str, user_rank: bytes | None = None, raw: bytes | None = None) -> None:
    """Rewrite a copy's manifest: its recorded rank replaced by ``user_rank`` (re-sealed, so only the
    value is wrong), or the whole file by ``raw``."""
    if raw is None:
        with open(path, "rb") as f:
            body, _ = unseal(f.read(), path)
        assert b'"rank":0,' in body
        raw = seal(body.replace(b'"rank":0,', b'"rank":' + user_rank + b",", 1))
    with open(path, "wb") as f:
        f.write(raw)


MALFORMED_RANKS = [b'{"__float__":"inf"}', b'{"__float__":"nan"}', b"1" + b"0" * 40, b'"0"', b"true",
                   b"[" * 150 + b"]" * 150, b"-1"]


def test_malformed_copy_manifests_fall_back_to_storage(tmp_path, caplog):
    """One process: a copy's manifest recording a non-finite, huge, mistyped or deeply nested rank,
    or cut short, or junk, is left out with a warning naming it, and the persistent step restores."""
    pristine = str(tmp_path / "pristine")

    def manager(base):
        return ckptkit.CheckpointManager(os.path.join(base, "run"), save=ckptkit.SavePolicy(every_steps=2),
                                         memory=ckptkit.MemoryTier(every_steps=1, replicas=0,
                                                                   root=os.path.join(base, "mem")))

    with manager(pristine) as mgr:
        for s in (1, 2, 3):
            mgr.maybe_save(s, {"w": torch.full((64,), float(s))})
    where = os.path.join("mem", "step-0000000003", "rank-00000", "manifest.json")
    with open(os.path.join(pristine, where), "rb") as f:
        good = f.read()
    caplog.set_level(logging.WARNING, logger="ckptkit")
    for i, damage in enumerate(MALFORMED_RANKS + [good[: len(good) // 2], b"\x00\xff" * 300]):
        base = _fresh(pristine, str(tmp_path / f"v{i}"))
        if damage in MALFORMED_RANKS:
            _manifest_with(os.path.join(base, where), damage)
        else:
            _manifest_with(os.path.join(base, where), raw=damage)
        caplog.clear()
        st = {"w": torch.zeros(64)}
        with manager(base) as mgr:
            assert mgr.restore_latest(st) == 2, damage[:40]
            assert mgr.last_restore.source == "persistent"
        assert torch.equal(st["w"], torch.full((64,), 2.0))
        assert "rank-00000" in caplog.text and "unreadable" in caplog.text, damage[:40]


def test_malformed_entries_on_one_rank_fall_back_without_a_hang(worlds, tmp_path, caplog):
    """Two ranks on two nodes. A damaged manifest of rank 0's own copy: rank 0's copy comes from its
    peer instead. A damaged share header on node 1 while node 0 lost rank 0's copy: no rebuild, the
    persistent step. Never a rank alone out of the restore (before: rank 1 crashed in its inventory
    and rank 0 waited in the all-gather until the timeout)."""
    copies, shares = str(tmp_path / "copies"), str(tmp_path / "shares")
    worlds.run(2, train, copies, replicas=1)
    worlds.run(2, train, shares, parity=2)
    for i, damage in enumerate([b'{"__float__":"inf"}', b"1" + b"0" * 40, b"[" * 150 + b"]" * 150]):
        base = _fresh(copies, str(tmp_path / f"c{i}"))
        _manifest_with(os.path.join(base, "node0", "step-0000000003", "rank-00000", "manifest.json"), damage)
        res = worlds.run(2, restore, base, replicas=1, timeout=3 * TIMEOUT)
        assert [r[:3] for r in res] == [(3, "peer", True), (3, "memory", True)], damage
        assert max(r[3] for r in res) < PROMPT
    for i, what in enumerate(["step Infinity", "huge index", "deep nesting", "binary junk", "bool index"]):
        base = _fresh(shares, str(tmp_path / f"s{i}"))
        shutil.rmtree(os.path.join(base, "node0", "step-0000000003", "rank-00000"))
        header = os.path.join(base, "node1", "step-0000000003", "share-00001.json")
        with open(header, "wb") as f:
            f.write(MALFORMED_HEADERS[what])
        res = worlds.run(2, restore, base, parity=2, timeout=3 * TIMEOUT)
        assert [r[:3] for r in res] == [(2, "persistent", True)] * 2, what
        assert max(r[3] for r in res) < PROMPT


# ------------------------------------------------------------------ failing writes of a received copy
RECEIVE_POINTS = ["step folder", "new file", "data write", "sync", "manifest"]


def test_a_failed_write_of_a_received_copy_never_stalls_later_moves(worlds, tmp_path):
    """Three nodes, replicas=1, rank 0's and rank 2's own copies lost: rank 0 receives its copy from
    rank 1, then sends rank 2's. Each write point of rank 0's receive fails in turn: the step is
    given up on every rank promptly and the persistent step restores, bit-exact (before, a failed
    commit left rank 0's walk before its send, and rank 2 waited the whole timeout)."""
    pristine = str(tmp_path / "pristine")
    worlds.run(3, train, pristine, replicas=1)
    for point in RECEIVE_POINTS:
        base = _fresh(pristine, str(tmp_path / point.replace(" ", "-")))
        shutil.rmtree(os.path.join(base, "node0", "step-0000000003", "rank-00000"))
        shutil.rmtree(os.path.join(base, "node2", "step-0000000003", "rank-00002"))
        res = worlds.run(3, restore, base, point, replicas=1, timeout=3 * TIMEOUT)
        assert res[0][4] >= 1, f"{point}: the fault was never reached"
        assert [r[:3] for r in res] == [(2, "persistent", True)] * 3, point
        assert max(r[3] for r in res) < PROMPT, (point, [r[3] for r in res])
    # the same walk without a fault: both copies arrive, step 3 from peers
    base = _fresh(pristine, str(tmp_path / "none"))
    shutil.rmtree(os.path.join(base, "node0", "step-0000000003", "rank-00000"))
    shutil.rmtree(os.path.join(base, "node2", "step-0000000003", "rank-00002"))
    res = worlds.run(3, restore, base, replicas=1, timeout=3 * TIMEOUT)
    assert [r[:3] for r in res] == [(3, "peer", True), (3, "memory", True), (3, "peer", True)]


# ------------------------------------------------------------------------- failing writes of a rebuild
def _windowed(fn, *args, **kw):
    from ckptkit.memory import parity

    before, parity.WINDOW = parity.WINDOW, 4096
    try:
        return fn(*args, **kw)
    finally:
        parity.WINDOW = before


def test_a_failed_write_of_a_parity_rebuild_never_stalls_the_walk(worlds, tmp_path):
    """Two nodes, parity=2, node 1 lost: rank 1 is rebuilt from rank 0's copy and share in 4 KiB
    windows. Each write point of the rebuilt copy fails in turn (with an OSError or an error of any
    other type): the walk completes on both ranks, and the persistent step restores promptly,
    bit-exact, with no half-rebuilt folder left (before, a raw OSError from making the step folder
    left rank 1's walk, and rank 0 waited in its sends until the timeout)."""
    pristine = str(tmp_path / "pristine")
    worlds.run(2, _windowed, train, pristine, parity=2)
    for point in RECEIVE_POINTS:
        base = _fresh(pristine, str(tmp_path / point.replace(" ", "-")))
        shutil.rmtree(os.path.join(base, "node1"))
        res = worlds.run(2, _windowed, restore, base, point, faulty_rank=1, parity=2, timeout=3 * TIMEOUT)
        assert res[1][4] >= 1, f"{point}: the fault was never reached"
        assert [r[:3] for r in res] == [(2, "persistent", True)] * 2, point
        assert max(r[3] for r in res) < PROMPT, (point, [r[3] for r in res])
        assert not os.path.exists(os.path.join(base, "node1", "step-0000000003", "rank-00001")), point
    base = _fresh(pristine, str(tmp_path / "none"))
    shutil.rmtree(os.path.join(base, "node1"))
    res = worlds.run(2, _windowed, restore, base, parity=2, timeout=3 * TIMEOUT)
    assert [r[:3] for r in res] == [(3, "memory", True), (3, "parity", True)]


# ------------------------------------------------------------------------------- budget after restart
def test_snapshots_go_on_after_a_restart_in_a_folder_sized_for_two_steps(tmp_path, monkeypatch):
    """A memory folder with room for two steps (a file system of 2.5 states, emulated by its free
    space) keeps taking snapshots after a restart, which finds the newest step still there (before,
    that step was counted against the free space as well as in the two steps: every snapshot after
    the restart failed the budget). A folder too small says so in units that show the figures."""
    mem, state_bytes = str(tmp_path / "mem"), 256 * 1024 * 4
    capacity = [int(2.5 * state_bytes)]

    def usage(path):
        used = sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(mem) for f in fs)
        return shutil._ntuple_diskusage(capacity[0], used, max(0, capacity[0] - used))

    monkeypatch.setattr("ckptkit.memory.tier.shutil.disk_usage", usage)

    def manager():
        return ckptkit.CheckpointManager(str(tmp_path / "run"), save=ckptkit.SavePolicy(every_steps=100),
                                         memory=ckptkit.MemoryTier(every_steps=1, replicas=0, root=mem))

    def state(s):
        return {"w": torch.full((256 * 1024,), float(s))}

    with manager() as mgr:
        for s in range(1, 4):
            mgr.maybe_save(s, state(s))
    x = state(0)
    with manager() as mgr:  # the restart
        assert mgr.restore_latest(x) == 3 and mgr.last_restore.source == "memory"
        for s in range(4, 7):
            mgr.maybe_save(s, state(s))
            mgr.wait()
    x = state(0)
    with manager() as mgr:
        assert mgr.restore_latest(x) == 6
    assert torch.equal(x["w"], state(6)["w"])
    capacity[0] = 3 * state_bytes // 2  # room for one step beside the kept one: not for two
    shown = r"needs 2\.00 MiB .*less 1\.0\d MiB.*1\.00 MiB of state\) but .* is \d+\.\d\d KiB"
    with pytest.raises(ckptkit.SaveError, match=shown):
        with manager() as mgr:
            mgr.maybe_save(7, state(7))
