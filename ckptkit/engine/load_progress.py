"""How far a load is, per rank: what the load watchdog judges and what ``on_progress`` shows.

A load that hangs is indistinguishable from a slow one unless something counts: a
:class:`ProgressRecord` per rank notes every storage read that finishes (through
:class:`ProgressStore`, which wraps the load's store), every piece placed in the caller's state,
every byte received from a peer, and every phase that ends. Time spent waiting for other ranks
inside a collective (:class:`WatchedComm` marks it) is not the rank's own idleness: a rank that
waits for a slow peer is never the stalled one.

Reads are counted in chunks of at most :data:`PROGRESS_CHUNK` bytes, so a long read of a large
object shows progress as it goes instead of once at its end (a 4 GiB same-layout read at 20 MB/s
would otherwise look idle for 200 s).

Once the watchdog has stopped a load, the record is *aborted*: the load's own thread, which may be
stuck in a read, is abandoned, and if that read ever returns, its next step raises here instead of
writing further into the caller's state or entering a collective the other ranks have left.

Standard library only: the record is plain data, readable without torch.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ckptkit.errors import CkptkitError

PROGRESS_CHUNK = 64 << 20
"""Largest single read the load issues to its store: each finished chunk is progress."""


class LoadAbandoned(CkptkitError):
    """Raised in a load's abandoned thread (the watchdog stopped the load) at its next step."""


@dataclass(frozen=True)
class LoadProgress:
    """One rank's progress in a load, as of ``seconds`` after it began.

    ``bytes_read``: data bytes this rank read from storage; ``bytes_received``: bytes other ranks
    read once and sent to it; ``pieces_placed``: stored pieces copied into the caller's state;
    ``phase``: what the load is doing (``metadata``, ``planning``, ``reading``, ``exchange``,
    ``agreement``, ``values``, ``done``); ``reading``: the object of the oldest storage read in
    flight (None when none is); ``last_object``: the object of the last read that began;
    ``waiting``: inside a collective, waiting for other ranks; ``idle_seconds``: since this rank
    last made progress (the watchdog's clock; it does not run while waiting).
    """

    rank: int
    phase: str
    bytes_read: int
    bytes_received: int
    pieces_placed: int
    reading: str | None
    last_object: str | None
    waiting: bool
    seconds: float
    idle_seconds: float

    @property
    def object(self) -> str | None:
        """The object this rank is reading, else the one it read last."""
        return self.reading or self.last_object

    def describe(self) -> str:
        """One line for a log or an error: where the rank is and how far it got."""
        where = f"reading {self.reading}" if self.reading else (
            f"after reading {self.last_object}" if self.last_object else "before reading anything")
        return (f"{where} (phase {self.phase}; {self.bytes_read / 2**20:.1f} MiB read, "
                f"{self.bytes_received / 2**20:.1f} MiB received, {self.pieces_placed} piece(s) placed)")


class ProgressRecord:
    """One rank's progress in one load; thread-safe (reads run on pool threads, the watchdog
    reads it from the caller's thread)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._start = self._last = time.monotonic()
        self._phase = "metadata"
        self._bytes = self._received = self._pieces = 0
        self._in_flight: dict[int, tuple[float, str]] = {}
        self._tokens = itertools.count()
        self._last_object: str | None = None
        self._waiting = 0
        self._aborted: str | None = None
        self._end: float | None = None  # once finished, snapshots stand still

    # ------------------------------------------------------------ the load's side
    def _step(self) -> None:
        """Progress was made (the lock is held)."""
        if self._aborted is not None:
            raise LoadAbandoned(self._aborted)
        self._last = time.monotonic()

    def check(self) -> None:
        """Raise in an abandoned load (before it writes or communicates again)."""
        if self._aborted is not None:
            raise LoadAbandoned(self._aborted)

    def phase(self, name: str) -> None:
        with self._lock:
            self._step()
            self._phase = name

    def begin_read(self, obj: str) -> int:
        with self._lock:
            if self._aborted is not None:
                raise LoadAbandoned(self._aborted)
            token = next(self._tokens)
            self._in_flight[token] = (time.monotonic(), obj)
            self._last_object = obj
            return token

    def end_read(self, token: int, nbytes: int = 0) -> None:
        with self._lock:
            self._in_flight.pop(token, None)
            self._bytes += nbytes
            self._step()

    def placed(self, pieces: int) -> None:
        with self._lock:
            self._pieces += pieces
            self._step()

    def received(self, nbytes: int) -> None:
        with self._lock:
            self._received += nbytes
            self._step()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Inside: waiting for other ranks (a collective, a transfer). Leaving it is progress."""
        with self._lock:
            self._step()
            self._waiting += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiting -= 1
                self._last = time.monotonic()

    # ------------------------------------------------------------ the watchdog's side
    def snapshot(self) -> LoadProgress:
        with self._lock:
            now = self._end if self._end is not None else time.monotonic()
            oldest = min(self._in_flight.values(), default=None)
            return LoadProgress(
                rank=self.rank, phase=self._phase, bytes_read=self._bytes, bytes_received=self._received,
                pieces_placed=self._pieces, reading=oldest[1] if oldest else None, last_object=self._last_object,
                waiting=self._waiting > 0, seconds=now - self._start,
                idle_seconds=0.0 if self._waiting else now - self._last)

    def abort(self, why: str) -> None:
        """The load was stopped: its thread raises :class:`LoadAbandoned` at its next step."""
        with self._lock:
            if self._aborted is None:
                self._aborted = why

    def finish(self) -> None:
        with self._lock:
            self._phase = "done"
            self._last = self._end = time.monotonic()


class ProgressStore:
    """A load's store, noting every read in its :class:`ProgressRecord` and cutting data reads
    into chunks of at most ``chunk`` bytes (each finished chunk is progress). Everything else is
    the wrapped store's; its fallback tier is watched the same way."""

    def __init__(self, inner: Any, record: ProgressRecord, chunk: int | None = None) -> None:
        self._inner = inner
        self._record = record
        self._chunk = PROGRESS_CHUNK if chunk is None else chunk

    @property
    def fallback(self) -> ProgressStore | None:
        inner = self._inner.fallback
        return None if inner is None else ProgressStore(inner, self._record, self._chunk)

    def _noted(self, key: str, fn: Any, *args: Any, nbytes: int = 0) -> Any:
        token = self._record.begin_read(key)
        done = 0
        try:
            out = fn(*args)
            done = nbytes
        finally:
            self._record.end_read(token, done)  # a failed read is progress too: the load goes on to report it
        return out

    def read_into(self, key: str, offset: int, out: Any) -> None:
        self.read_into_vectored(key, offset, [out])

    def read_into_vectored(self, key: str, offset: int, buffers: Iterable[Any]) -> None:
        pos = offset
        for group in chunked([memoryview(b).cast("B") for b in buffers], self._chunk):
            n = sum(len(v) for v in group)
            if len(group) == 1:
                self._noted(key, self._inner.read_into, key, pos, group[0], nbytes=n)
            else:
                self._noted(key, self._inner.read_into_vectored, key, pos, group, nbytes=n)
            pos += n

    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        return self._noted(key, self._inner.read_bytes, key, limit)

    def size(self, key: str) -> int | None:
        return self._noted(key, self._inner.size, key)

    def list_children(self) -> list[str]:
        return self._noted("(listing)", self._inner.list_children)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def chunked(views: list[memoryview], limit: int) -> Iterator[list[memoryview]]:
    """Consecutive groups of ``views`` of at most ``limit`` bytes each (a view longer than that is
    cut), in order; empty views are dropped."""
    group: list[memoryview] = []
    size = 0
    for view in views:
        while len(view):
            take = min(len(view), limit - size)
            group.append(view[:take])
            size += take
            view = view[take:]
            if size == limit:
                yield group
                group, size = [], 0
    if group:
        yield group


class WatchedComm:
    """A load's communicator: every collective counts as waiting for other ranks, and an
    abandoned load never enters another one. Anything else (``group``, ``group_rank`` ...) is the
    wrapped communicator's."""

    def __init__(self, inner: Any, record: ProgressRecord) -> None:
        self._inner = inner
        self._record = record

    def _collective(self, name: str, *args: Any) -> Any:
        self._record.check()
        with self._record.waiting():
            return getattr(self._inner, name)(*args)

    def all_gather(self, obj: Any) -> list[Any]:
        return self._collective("all_gather", obj)

    def all_gather_json(self, obj: Any) -> list[Any]:
        return self._collective("all_gather_json", obj)

    def gather(self, obj: Any) -> list[Any] | None:
        return self._collective("gather", obj)

    def broadcast(self, obj: Any) -> Any:
        return self._collective("broadcast", obj)

    def broadcast_json(self, obj: Any) -> Any:
        return self._collective("broadcast_json", obj)

    def any_flags(self, flags: list[bool]) -> list[bool]:
        return self._collective("any_flags", flags)

    def all_min(self, values: list[int]) -> list[int]:
        return self._collective("all_min", values)

    def all_max(self, values: list[float]) -> list[float]:
        return self._collective("all_max", values)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
