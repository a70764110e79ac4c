"""Pieces fetched ahead of a streaming writer, into a bounded set of reused buffers.

An offline write (``reshard``, imports) asks a source for one piece at a time, just before it
writes it. Fetching the next few meanwhile keeps the store busy while the writer writes and
checksums; fetching them into a :class:`~ckptkit.engine.buffers.BufferPool` keeps memory at
the pool's size whatever the checkpoint's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ckptkit.engine.buffers import BufferPool
from ckptkit.errors import SaveError


class PrefetchedPieces:
    """``count`` pieces fetched on demand, with read-ahead, into pooled buffers.

    A :class:`~ckptkit.engine.offline_writer.PieceSource`: the writer asks for
    piece ``ref`` just before writing it; at most ``read_ahead`` later pieces
    are being fetched meanwhile (a reshard plan's memory estimate counts
    them). With a ``buffers`` pool each piece is fetched into a pooled buffer
    (``layout(ref)`` gives its dtype, shape and bytes), given back when the
    writer calls :meth:`release` (written and checksummed); without one,
    ``fetch(ref, None)`` allocates.
    """

    def __init__(self, count: int, layout: Callable[[int], tuple[torch.dtype, tuple[int, ...], int]],
                 fetch: Callable[[int, torch.Tensor | None], torch.Tensor], pool: ThreadPoolExecutor,
                 read_ahead: int, buffers: BufferPool | None = None) -> None:
        self._count = count
        self._layout = layout
        self._fetch = fetch
        self._pool = pool
        self._read_ahead = read_ahead
        self._buffers = buffers
        self._futures: dict[int, Future[torch.Tensor]] = {}
        self._held: dict[int, torch.Tensor] = {}  # ref -> pooled buffer, until released
        self._closed = False
        self._lock = threading.Lock()
        self.bytes_read = 0

    def __len__(self) -> int:
        return self._count

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
        with self._lock:
            future = self._futures.pop(ref, None) or self._pool.submit(self._load, ref)
            for stale in [r for r in self._futures if r < ref]:  # never to be asked for: free their buffers
                self._futures.pop(stale).add_done_callback(lambda _f, r=stale: self.release(r))
            for nxt in range(ref + 1, min(self._count, ref + 1 + self._read_ahead)):
                if nxt not in self._futures:
                    self._futures[nxt] = self._pool.submit(self._load, nxt)
        try:
            return future.result()
        except BaseException:
            self.release(ref)
            raise

    def release(self, ref: int) -> None:
        """Piece ``ref`` is written and checksummed: its buffer goes back to the pool."""
        with self._lock:
            buf = self._held.pop(ref, None)
        if buf is not None and self._buffers is not None:
            self._buffers.release(buf)

    def close(self) -> None:
        """The rank is done (or failed): read-ahead still running frees its buffers as it finishes."""
        with self._lock:
            self._closed = True
            futures, self._futures = list(self._futures.items()), {}
        for ref, future in futures:
            future.add_done_callback(lambda _f, r=ref: self.release(r))
        for ref in list(self._held):
            if all(ref != r for r, _ in futures):
                self.release(ref)
