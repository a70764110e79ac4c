"""Read-ahead over an index sequence: the next few items fetched while the consumer works on one.

Every streaming conversion has the same shape: a consumer (an offline writer, a shard being
streamed to a store) asks for item ``i`` of a known sequence, in increasing order, and works on
it while the store is busy fetching the next few. :class:`ReadAhead` is that one mechanism, and
two promises keep memory bounded whatever the sequence's length:

* at most ``read_ahead`` fetches run ahead of the consumer at once (a fetch the consumer has
  asked for is its own, not read-ahead), so the results held for later never exceed it;
* read-ahead the consumer will never ask for (it asked for a later item: the writer skips empty
  pieces) is dropped at once: cancelled if it has not started, otherwise let finish and let go,
  so its result is freed instead of waiting for the whole conversion to end.

:class:`PrefetchedPieces` is the offline writer's piece source on top of it (``reshard``):
each piece fetched into a :class:`~ckptkit.engine.buffers.BufferPool` buffer, so memory is the
pool's size whatever the checkpoint's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from ckptkit.engine.buffers import BufferPool
from ckptkit.errors import SaveError

T = TypeVar("T")


@dataclass
class _Counted:
    """Whether a read-ahead fetch still counts against the limit: until it finishes or is asked for."""

    counted: bool = True


class ReadAhead(Generic[T]):
    """Items ``0 .. count - 1``, ``fetch(i)`` of each, fetched on ``pool`` ahead of the consumer.

    ``ahead[i]`` returns item ``i``: its read-ahead result if one was started, else ``fetch(i)`` run
    in the caller's thread (the pool's workers are read-ahead's alone). Items are asked for in
    increasing order, some possibly skipped. Asking for ``i`` starts fetches of ``i + 1 ..
    i + read_ahead`` while fewer than ``read_ahead`` read-ahead fetches run, and drops read-ahead of
    items before ``i``: those are never asked for. ``on_drop(j)`` is told once a dropped fetch of
    item ``j`` is over (finished, failed or cancelled): a caller that gave it a resource (a pooled
    buffer) takes it back then. :meth:`close` drops everything still ahead.
    """

    def __init__(self, count: int, fetch: Callable[[int], T], pool: Executor, read_ahead: int,
                 on_drop: Callable[[int], None] | None = None) -> None:
        if read_ahead < 0:
            raise ValueError(f"read_ahead must be >= 0, got {read_ahead}")
        self._count = count
        self._fetch = fetch
        self._pool = pool
        self._read_ahead = read_ahead
        self._on_drop = on_drop
        self._ahead: dict[int, tuple[Future[T], _Counted]] = {}
        self._running = 0  # read-ahead fetches started, not finished and not asked for
        self._closed = False
        # reentrant: a future that is already over (cancelled, or a fetch quicker than its submit)
        # runs the callbacks given to it at once, in this thread, which take the lock again
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return self._count

    @property
    def running(self) -> int:
        """Read-ahead fetches under way now (never more than ``read_ahead``)."""
        with self._lock:
            return self._running

    def __getitem__(self, index: int) -> T:
        with self._lock:
            if self._closed:
                raise SaveError("this read-ahead was closed: the work it fed was abandoned")
            entry = self._ahead.pop(index, None)
            if entry is not None:
                self._uncount(entry[1])
            for stale in [i for i in self._ahead if i < index]:
                self._drop(stale, self._ahead.pop(stale)[0])
            for nxt in range(index + 1, min(self._count, index + 1 + self._read_ahead)):
                if self._running >= self._read_ahead:
                    break
                if nxt not in self._ahead:
                    self._start(nxt)
        if entry is None:
            return self._fetch(index)
        return entry[0].result()

    def close(self) -> list[int]:
        """Stop: every read-ahead not asked for is dropped (``on_drop`` once each is over); returns their indices."""
        with self._lock:
            self._closed = True
            dropped, self._ahead = self._ahead, {}
            for index, (future, _) in dropped.items():
                self._drop(index, future)
        return list(dropped)

    def in_order(self) -> Iterator[T]:
        """Every item, first to last, then :meth:`close` (also when the consumer stops early)."""
        try:
            for index in range(self._count):
                yield self[index]
        finally:
            self.close()

    def _start(self, index: int) -> None:
        counted = _Counted()
        self._running += 1
        future = self._pool.submit(self._fetch, index)
        self._ahead[index] = (future, counted)
        future.add_done_callback(lambda _f: self._finished(counted))

    def _finished(self, counted: _Counted) -> None:
        with self._lock:
            self._uncount(counted)

    def _uncount(self, counted: _Counted) -> None:
        """Under the lock: a fetch stops counting against the limit, exactly once."""
        if counted.counted:
            counted.counted = False
            self._running -= 1

    def _drop(self, index: int, future: Future[T]) -> None:
        """Under the lock: let go of a fetch no one will ask for. Nothing here keeps it: its result is
        freed once it is over, and until then it counts against the limit (its done callback uncounts it)."""
        future.cancel()  # a fetch not yet started never runs (its done callback fires now)
        if self._on_drop is not None:
            on_drop = self._on_drop
            future.add_done_callback(lambda _f: on_drop(index))


class PrefetchedPieces:
    """``count`` pieces fetched on demand, with read-ahead, into pooled buffers.

    A :class:`~ckptkit.engine.offline_writer.PieceSource`: the writer asks for
    piece ``ref`` just before writing it; at most ``read_ahead`` later pieces
    are being fetched meanwhile (a reshard plan's memory estimate counts
    them). With a ``buffers`` pool each piece is fetched into a pooled buffer
    (``layout(ref)`` gives its dtype, shape and bytes), given back when the
    writer calls :meth:`release` (written and checksummed), or when the
    piece's read-ahead is dropped; without one, ``fetch(ref, None)`` allocates.
    """

    def __init__(self, count: int, layout: Callable[[int], tuple[torch.dtype, tuple[int, ...], int]],
                 fetch: Callable[[int, torch.Tensor | None], torch.Tensor], pool: Executor,
                 read_ahead: int, buffers: BufferPool | None = None) -> None:
        self._layout = layout
        self._fetch = fetch
        self._buffers = buffers
        self._held: dict[int, torch.Tensor] = {}  # ref -> pooled buffer, until released
        self._closed = False
        self._lock = threading.Lock()
        self._ahead = ReadAhead(count, self._load, pool, read_ahead, on_drop=self.release)
        self.bytes_read = 0

    def __len__(self) -> int:
        return len(self._ahead)

    def _load(self, ref: int) -> torch.Tensor:
        dtype, shape, nbytes = self._layout(ref)
        out = None
        if self._buffers is not None:
            buf = self._buffers.acquire(nbytes)
            with self._lock:
                if self._closed:
                    self._buffers.release(buf)
                    raise SaveError("the write of these pieces was abandoned")
                self._held[ref] = buf
            out = buf.view(dtype).view(shape)
        data = self._fetch(ref, out)
        with self._lock:
            self.bytes_read += nbytes
        return data

    def __getitem__(self, ref: int) -> torch.Tensor:
        try:
            return self._ahead[ref]
        except BaseException:
            self.release(ref)
            raise

    def release(self, ref: int) -> None:
        """Piece ``ref`` is written and checksummed (or its read-ahead dropped): its buffer goes back to the pool."""
        with self._lock:
            buf = self._held.pop(ref, None)
        if buf is not None and self._buffers is not None:
            self._buffers.release(buf)

    def close(self) -> None:
        """The rank is done (or failed): read-ahead still running frees its buffers as it finishes."""
        with self._lock:
            self._closed = True
        dropped = set(self._ahead.close())
        with self._lock:
            handed_out = [ref for ref in self._held if ref not in dropped]
        for ref in handed_out:
            self.release(ref)
