"""The load watchdog (LoadOptions(stall_seconds=...)): a rank whose storage read never returns fails
the load on every rank, naming that rank and the object, in a bounded time; a rank too frozen to say
so itself is named by the ranks that watch it; a load that is slow but keeps moving is never stopped.

The stalls are real: a store whose reads block on an event one rank never sets, a rank that stops
itself with SIGSTOP in the middle of a read, over real 4-process gloo worlds. A world that lost a rank
(or holds collectives a stalled rank never joined) is closed afterwards, so the next test starts a
fresh one.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ckptkit
from ckptkit.engine import load_progress
from ckptkit.engine.collective import LocalComm, resolve_comm
from ckptkit.engine.load_progress import ProgressRecord, ProgressStore, chunked
from ckptkit.engine.loader import load_state
from ckptkit.engine.state import flatten_state
from ckptkit.errors import OptionsError
from ckptkit.storage.url import open_store
from tests import test_read_once as dp

STALL = 2.0  # seconds, in the multi-process tests: a watchdog poll every 0.25 s


# ------------------------------------------------------------------ options


def test_stall_seconds_defaults_and_validation():
    opts = ckptkit.LoadOptions()
    assert opts.stall_seconds == 600.0 and opts.on_progress is None
    assert (opts.io_threads, opts.per_rank_on_resize, opts.read_once) == (4, "error", True)  # unchanged
    assert ckptkit.LoadOptions(stall_seconds=None).stall_seconds is None
    assert ckptkit.LoadOptions(stall_seconds=3).stall_seconds == 3
    assert ckptkit.LoadOptions(stall_seconds=0.5, on_progress=print).on_progress is print
    for bad in (0, -1, -0.5, math.nan, math.inf, True, "10"):
        with pytest.raises(OptionsError, match="stall_seconds"):
            ckptkit.LoadOptions(stall_seconds=bad)
    with pytest.raises(OptionsError, match="on_progress"):
        ckptkit.LoadOptions(on_progress=3)
    with pytest.raises(OptionsError):
        ckptkit.LoadOptions(io_threads=0)  # the existing checks still hold
    stalled = ckptkit.LoadStalledError
    assert issubclass(stalled, ckptkit.CkptkitError) and issubclass(stalled, TimeoutError)


# ------------------------------------------------------------------ progress counting


def test_reads_are_counted_in_chunks():
    views = [memoryview(bytearray(n)) for n in (5, 0, 12, 3)]
    groups = list(chunked(views, 8))
    assert [sum(len(v) for v in g) for g in groups] == [8, 8, 4]
    assert all(len(g) for g in groups)


def test_a_progress_store_reads_the_same_bytes_chunk_by_chunk(tmp_path):
    store = open_store(str(tmp_path))
    payload = bytes(range(256)) * 40  # 10 KiB
    store.put_bytes("obj", payload)
    record = ProgressRecord(0)
    watched = ProgressStore(store, record, chunk=1000)
    a, b = bytearray(3000), bytearray(7000)
    watched.read_into_vectored("obj", 100, [memoryview(a), memoryview(b)])
    assert bytes(a) + bytes(b) == payload[100:10100]
    snap = record.snapshot()
    assert snap.bytes_read == 10000 and snap.reading is None and snap.last_object == "obj"


def test_the_load_thread_runs_in_the_callers_grad_and_inference_mode():
    """The load runs on a worker thread: in-place copies into inference tensors need the caller's
    inference mode there too (and, on a GPU, its device and stream; see caller_context)."""
    from ckptkit.engine.watchdog import caller_context

    seen = {}

    def look(enter):
        with enter():
            seen["inference"], seen["grad"] = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    with torch.inference_mode():
        enter = caller_context()
    t = threading.Thread(target=look, args=(enter,))
    t.start()
    t.join()
    assert seen == {"inference": True, "grad": False}
    with torch.no_grad():
        enter = caller_context()
    t = threading.Thread(target=look, args=(enter,))
    t.start()
    t.join()
    assert seen == {"inference": False, "grad": False}


def test_a_load_into_inference_tensors_still_works(tmp_path):
    path = str(tmp_path / "ckpt")
    ckptkit.save({"w": torch.arange(64.0).view(8, 8)}, path)
    with torch.inference_mode():
        local = torch.zeros(4, 8)  # rows 2..5 of w: read through a scratch buffer, then copied in
        state = {"p": ckptkit.Sharded(local, [ckptkit.box_piece("w", (8, 8), (2, 0), (4, 8))])}
        ckptkit.load(state, path, strict=False)
    assert torch.equal(local, torch.arange(16.0, 48.0).view(4, 8))


# ------------------------------------------------------------------ stores for the tests


class DataReadHook:
    """A store that calls :meth:`before` ahead of every data read; everything else is the inner store's."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def before(self, key: str) -> None:
        raise NotImplementedError

    def read_into(self, key: str, offset: int, out: Any) -> None:
        self.before(key)
        self._inner.read_into(key, offset, out)

    def read_into_vectored(self, key: str, offset: int, buffers: Any) -> None:
        self.before(key)
        self._inner.read_into_vectored(key, offset, buffers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class Stalling(DataReadHook):
    """A store whose data reads block until ``release`` is set: a read that never returns."""

    def __init__(self, inner: Any, release: threading.Event) -> None:
        super().__init__(inner)
        self._release = release
        self.blocked: list[str] = []  # the objects of the reads now blocked (several threads may read)

    def before(self, key: str) -> None:
        if key.startswith("data/"):
            self.blocked.append(key)
            self._release.wait(120)


class Slow:
    """A store that answers every call after ``per_call`` seconds, plus ``per_64k`` seconds per 64 KiB
    of data: slow, but every answer comes."""

    def __init__(self, inner: Any, per_call: float = 0.0, per_64k: float = 0.0) -> None:
        self._inner, self._per_call, self._per_64k = inner, per_call, per_64k

    def _wait(self, nbytes: int = 0) -> None:
        time.sleep(self._per_call + self._per_64k * nbytes / 65536)

    def read_into(self, key: str, offset: int, out: Any) -> None:
        self._wait(len(memoryview(out).cast("B")))
        self._inner.read_into(key, offset, out)

    def read_into_vectored(self, key: str, offset: int, buffers: Any) -> None:
        buffers = list(buffers)
        self._wait(sum(len(memoryview(b).cast("B")) for b in buffers))
        self._inner.read_into_vectored(key, offset, buffers)

    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        self._wait()
        return self._inner.read_bytes(key, limit)

    def size(self, key: str) -> int | None:
        self._wait()
        return self._inner.size(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _error(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "text": str(exc), "rank": getattr(exc, "rank", None),
            "object": getattr(exc, "object", None)}


# ------------------------------------------------------------------ one process


def _single(tmp_path) -> tuple[str, dict]:
    path = str(tmp_path / "ckpt")
    state = {"w": torch.randn(512, 512), "step": 3}  # 1 MiB of weights
    ckptkit.save(state, path)
    return path, state


def test_one_process_stalled_read_fails_naming_rank_and_object(tmp_path):
    path, _ = _single(tmp_path)
    release = threading.Event()
    store = Stalling(open_store(path), release)
    t0 = time.monotonic()
    try:
        with pytest.raises(ckptkit.LoadStalledError) as info:
            load_state(flatten_state({"w": torch.zeros(512, 512), "step": 0}), store, LocalComm(),
                       options=ckptkit.LoadOptions(stall_seconds=0.5))
    finally:
        release.set()
    assert time.monotonic() - t0 < 30  # a missed stall waits for ever (the release comes after); not a speed bound
    err = info.value
    assert err.rank == 0 and store.blocked == [err.object] and err.object.startswith("data/")
    assert "rank 0 made no progress" in str(err) and err.object in str(err) and path in str(err)


def test_one_process_slow_but_steady_load_is_not_stopped(tmp_path, monkeypatch):
    """A read of 1 MiB at 0.15 s per 64 KiB takes 2.4 s, more than twice the stall budget: counted in 64 KiB
    chunks, each chunk is progress and the load completes; counted as one read (the chunk larger than the
    tensor), the same read is one silence of 2.4 s and the watchdog stops it."""
    path, state = _single(tmp_path)
    seen: list[ckptkit.LoadProgress] = []
    monkeypatch.setattr(load_progress, "PROGRESS_CHUNK", 64 << 10)
    target = {"w": torch.zeros(512, 512), "step": 0}
    t0 = time.monotonic()
    result = load_state(flatten_state(target), Slow(open_store(path), per_64k=0.15), LocalComm(),
                        options=ckptkit.LoadOptions(stall_seconds=1.0, on_progress=seen.append))
    assert time.monotonic() - t0 > 2.0
    assert torch.equal(target["w"], state["w"]) and target["step"] == 3
    assert result.progress is not None and result.progress.bytes_read == 1 << 20 and result.progress.pieces_placed == 1
    assert result.progress.phase == "done"
    assert len(seen) >= 4 and seen[-1] == result.progress
    assert any(0 < p.bytes_read < 1 << 20 for p in seen)  # progress was visible mid-read
    monkeypatch.setattr(load_progress, "PROGRESS_CHUNK", 64 << 20)
    with pytest.raises(ckptkit.LoadStalledError, match="made no progress"):
        load_state(flatten_state(target), Slow(open_store(path), per_64k=0.15), LocalComm(),
                   options=ckptkit.LoadOptions(stall_seconds=1.0))


# ------------------------------------------------------------------ 4 gloo ranks


def load_slowly(path: str, stall: float) -> dict:
    """Every store call on every rank answers after 0.4 s: no silence reaches ``stall``."""
    state = dp._state(False)
    t0 = time.monotonic()
    result = load_state(flatten_state(state), Slow(open_store(path), per_call=0.4), resolve_comm(),
                        options=ckptkit.LoadOptions(stall_seconds=stall))
    want = dp._state(True)
    same = torch.equal(state["model"]["w"], want["model"]["w"]) and \
        torch.equal(state["optim"]["m"].local, want["optim"]["m"].local)
    return {"seconds": time.monotonic() - t0, "same": same, "pieces": result.progress.pieces_placed,
            "read": result.progress.bytes_read, "received": result.progress.bytes_received}


def test_dp4_slow_but_steady_load_is_not_stopped(worlds, tmp_path):
    path = str(tmp_path / "ckpt")
    worlds.run(4, dp.save, path)
    res = worlds.run(4, load_slowly, path, 1.5, timeout=60)
    assert all(r["same"] for r in res)
    assert max(r["seconds"] for r in res) > 2.25  # the load outlasted the stall budget by half, and nothing stopped it
    assert all(r["pieces"] >= 3 for r in res)  # w, b and this rank's moments
    assert sum(r["read"] for r in res) < sum(r["read"] + r["received"] for r in res)  # read once, shared


def load_with_a_stalled_reader(path: str, stalled: int, read_once: bool, stall: float) -> dict:
    """Rank ``stalled``'s data reads never return (until this function releases them on its way out)."""
    release = threading.Event()
    store = Stalling(open_store(path), release) if dist.get_rank() == stalled else open_store(path)
    t0 = time.monotonic()
    try:
        load_state(flatten_state(dp._state(False)), store, resolve_comm(),
                   options=ckptkit.LoadOptions(read_once=read_once, stall_seconds=stall))
        out: dict = {"type": None}
    except ckptkit.CkptkitError as exc:
        out = _error(exc)
    out["seconds"] = time.monotonic() - t0
    out["blocked"] = getattr(store, "blocked", None)
    release.set()  # the abandoned read returns; the load's thread stops at its next step
    return out


@pytest.mark.parametrize("read_once", [True, False], ids=["read-once", "each-rank-reads"])
def test_dp4_a_stalled_reader_fails_every_rank_naming_it(worlds, tmp_path, read_once):
    path = str(tmp_path / "ckpt")
    worlds.run(4, dp.save, path)
    try:
        res = worlds.run(4, load_with_a_stalled_reader, path, 2, read_once, STALL, timeout=60)
    finally:
        worlds.get(4).close(grace=0.5)  # ranks 0, 1, 3 left collectives rank 2 never joined
    blocked = res[2]["blocked"]
    assert blocked and all(key.startswith("data/") for key in blocked)
    for rank, r in enumerate(res):
        assert r["type"] == "LoadStalledError", (rank, r)
        assert r["rank"] == 2 and r["object"] in blocked, (rank, r)  # the oldest of rank 2's reads in flight
        assert "rank 2 made no progress" in r["text"] and r["object"] in r["text"] and path in r["text"], r["text"]
        assert "stopped on every rank" in r["text"]
        assert r["seconds"] < STALL + 5, (rank, r["seconds"])


class Freezing(DataReadHook):
    """A store whose first data read stops the whole process (SIGSTOP) after ``after`` seconds: a rank too
    frozen to report its own stall, its watchdog thread included."""

    def __init__(self, inner: Any, after: float) -> None:
        super().__init__(inner)
        self._after = after

    def before(self, key: str) -> None:
        if key.startswith("data/"):
            time.sleep(self._after)  # long enough for a heartbeat that shows the read in flight
            os.kill(os.getpid(), signal.SIGSTOP)


def load_with_a_frozen_rank(path: str, frozen: int, stall: float) -> dict:
    store = Freezing(open_store(path), stall / 2) if dist.get_rank() == frozen else open_store(path)
    t0 = time.monotonic()
    try:
        load_state(flatten_state(dp._state(False)), store, resolve_comm(),
                   options=ckptkit.LoadOptions(read_once=True, stall_seconds=stall))
        out: dict = {"type": None}
    except ckptkit.CkptkitError as exc:
        out = _error(exc)
    out["seconds"] = time.monotonic() - t0
    return out


def test_dp4_a_frozen_rank_is_named_by_the_ranks_that_watch_it(worlds, tmp_path):
    """Rank 3 stops (SIGSTOP) in the middle of a read: it can say nothing, and gloo sees no broken
    connection. Its ring neighbours see its heartbeat stop and post the verdict; every live rank raises
    it, naming rank 3 and the object of its last report. (Rank 0 hosts the world's TCPStore, so it is
    not the one frozen here; under torchrun the store is the agent's.)"""
    path = str(tmp_path / "ckpt")
    worlds.run(4, dp.save, path)
    world = worlds.get(4)
    try:
        for conn in world.conns:
            conn.send((load_with_a_frozen_rank, (path, 3, STALL), {}))
        res = {}
        for rank in (0, 1, 2):
            assert world.conns[rank].poll(60), f"rank {rank} is still waiting for the frozen rank"
            status, value = world.conns[rank].recv()
            assert status == "ok", value
            res[rank] = value
    finally:
        world.close(grace=0.5)  # kills the stopped rank too
    for rank, r in res.items():
        assert r["type"] == "LoadStalledError", (rank, r)
        assert r["rank"] == 3 and r["object"] is not None and r["object"].startswith("data/"), (rank, r)
        assert "rank 3 stopped reporting progress" in r["text"] and "frozen or dead" in r["text"], r["text"]
        assert r["seconds"] < 1.5 * STALL + 5, (rank, r["seconds"])


def test_a_stalled_manifest_read_is_named_too(tmp_path):
    """Before any collective and any data: the manifest read that never returns is the object named."""
    path, _ = _single(tmp_path)
    release = threading.Event()

    class StalledManifest(Stalling):
        def read_bytes(self, key: str, limit: int | None = None) -> bytes:
            self.blocked.append(key)
            self._release.wait(120)
            return self._inner.read_bytes(key, limit)

    store = StalledManifest(open_store(path), release)
    try:
        with pytest.raises(ckptkit.LoadStalledError) as info:
            load_state(flatten_state({"w": torch.zeros(512, 512), "step": 0}), store, LocalComm(),
                       options=ckptkit.LoadOptions(stall_seconds=0.5))
    finally:
        release.set()
    assert info.value.object == "manifest.json" == store.blocked[0] and "phase metadata" in str(info.value)
