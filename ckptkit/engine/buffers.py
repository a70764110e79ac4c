"""A bounded set of reusable byte buffers, for streaming work that must not churn the allocator.

Streaming a checkpoint through memory (``ckptkit reshard``) allocates and
frees a buffer for every piece and every ranged read: hundreds of
10-60 MiB blocks. glibc serves frees of that size badly for a process's
peak RSS: its dynamic mmap threshold rises to the size of the first large
block freed (up to 32 MiB), after which such blocks come from per-thread
heaps that keep their pages, so peak RSS grew to several times the data
actually live. Reusing a fixed set of buffers allocated once sidesteps the
allocator entirely: RSS is the buffers' size, whatever glibc does.

:class:`BufferPool` hands out up to ``count`` buffers of ``nbytes`` each,
allocated on first need and kept until the pool is dropped; :meth:`take`
blocks while all of them are in use (callers size ``count`` so that this
means back-pressure, never deadlock). A request larger than ``nbytes`` gets
a one-off buffer of its own (still counted against ``count``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ckptkit.errors import PoolClosedError


class BufferPool:
    """At most ``count`` byte buffers of ``nbytes`` bytes, reused; thread-safe."""

    def __init__(self, count: int, nbytes: int) -> None:
        if count < 1 or nbytes < 0:
            raise ValueError(f"a buffer pool needs count >= 1 and nbytes >= 0, got {count}, {nbytes}")
        self.count = count
        self.nbytes = nbytes
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._in_use = 0
        self._closed = False
        self._cond = threading.Condition()

    @property
    def allocated(self) -> int:
        """Buffers allocated so far (at most ``count``)."""
        with self._cond:
            return self._allocated

    def acquire(self, n: int) -> torch.Tensor:
        """A uint8 tensor of ``n`` bytes (the front of a pooled buffer); give it back with :meth:`release`."""
        with self._cond:
            while True:
                if self._closed:
                    raise PoolClosedError("the buffer pool was closed")
                if self._in_use < self.count:
                    break
                self._cond.wait()
            self._in_use += 1
            base = self._free.pop() if n <= self.nbytes and self._free else None
            if base is None and n <= self.nbytes:
                self._allocated += 1
        if base is None:
            try:
                base = torch.empty(max(n, self.nbytes), dtype=torch.uint8)
            except BaseException:
                with self._cond:
                    self._in_use -= 1
                    if n <= self.nbytes:
                        self._allocated -= 1
                    self._cond.notify()
                raise
        return base[:n]

    def release(self, buf: torch.Tensor) -> None:
        """Return a buffer :meth:`acquire` gave (any view of it is then invalid)."""
        base = buf._base if buf._base is not None else buf
        with self._cond:
            self._in_use -= 1
            if base.numel() == self.nbytes and len(self._free) < self._allocated:
                self._free.append(base)
            self._cond.notify()

    @contextmanager
    def take(self, n: int) -> Iterator[torch.Tensor]:
        buf = self.acquire(n)
        try:
            yield buf
        finally:
            self.release(buf)

    def close(self) -> None:
        """Wake every waiter with :class:`PoolClosedError` (the work they wait for was abandoned)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
