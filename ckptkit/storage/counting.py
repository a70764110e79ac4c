"""A store that counts the data bytes read through it: how read-once loads are measured.

Wraps any :class:`~ckptkit.storage.base.ByteStore` and counts what the read engine fetches
through its two data entry points (``read_into`` and ``read_into_vectored``); everything else is
the wrapped store's. Used by the read-once tests and benchmark to count bytes *at the store*.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any


class CountingStore:
    """``inner`` with a thread-safe count of the bytes read through it (:attr:`nbytes`)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.nbytes = 0

    def _count(self, n: int) -> None:
        with self._lock:
            self.nbytes += n

    def read_into(self, key: str, offset: int, out: Any) -> None:
        self._count(len(memoryview(out).cast("B")))
        self._inner.read_into(key, offset, out)

    def read_into_vectored(self, key: str, offset: int, buffers: Iterable[Any]) -> None:
        buffers = list(buffers)
        self._count(sum(len(memoryview(b).cast("B")) for b in buffers))
        self._inner.read_into_vectored(key, offset, buffers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
