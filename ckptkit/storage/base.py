"""The byte-store interface every storage backend implements.

Small on purpose: streaming writes of large objects, small durable puts, an
atomic put-if-absent (the commit), ranged reads into caller buffers, listing
and deletion. It knows nothing of tensors. Keys are ``/``-separated strings
relative to the store's root, because roots are often remote URIs
(``s3://bucket/run``), not paths.

Durability contract: when ``write_object``/``put_bytes`` return, the bytes
survive a crash of this process and of the machine (fsync on POSIX, a
completed PUT on object stores). ``put_if_absent`` is atomic: two writers can
never both succeed, and a reader never sees a partial object.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from ckptkit.errors import TooLargeError


class ByteStore(ABC):
    """A place to put and get bytes by key (a directory, a bucket prefix)."""

    url: str

    #: ``write_object`` is done with each chunk (written it, or copied it) before it takes the next
    #: from the iterator, so a caller may reuse a chunk's buffer from then on. Stores that collect
    #: the chunks first (to send one request) leave this False.
    streams_writes: bool = False

    @abstractmethod
    def child(self, name: str) -> ByteStore:
        """The store rooted at ``name`` under this one."""

    @abstractmethod
    def write_object(self, key: str, chunks: Iterable[memoryview | bytes]) -> int:
        """Write ``chunks`` as one object, durably; return its size."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write a small object durably, replacing any previous one atomically."""

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Atomically create ``key``; False (and nothing written) if it already exists."""

    @abstractmethod
    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``[offset, offset + len(out))``; CorruptCheckpointError if short."""

    def read_into_vectored(self, key: str, offset: int, buffers: list[memoryview]) -> None:
        """Fill ``buffers`` in order from consecutive bytes starting at ``offset`` (a scatter read).

        Backends override this with one vectored request where they can.
        """
        pos = offset
        for buf in buffers:
            self.read_into(key, pos, buf)
            pos += len(buf)

    @abstractmethod
    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        """The whole object; CheckpointNotFoundError if missing.

        ``limit`` caps the object's size for callers that parse it whole (a manifest, an index):
        a larger object raises :class:`~ckptkit.errors.TooLargeError` before its bytes are read
        into memory, so a damaged or hostile store cannot exhaust it. A transient failure is a
        :class:`~ckptkit.errors.StorageError`, never short data and never "missing".
        """

    @abstractmethod
    def size(self, key: str) -> int | None:
        """Object size, or None if it does not exist (a prefix or directory is not an object)."""

    @abstractmethod
    def list_keys(self, prefix: str = "") -> list[str]:
        """Every object key under ``prefix`` (recursive), sorted."""

    @abstractmethod
    def list_children(self) -> list[str]:
        """Names directly under the root (objects and prefixes), sorted."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove one object; no error if missing."""

    @abstractmethod
    def delete_all(self) -> None:
        """Remove every object under the root (and the root itself where that means anything)."""

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def prune_empty(self) -> None:
        """Remove directories left empty under the root (and the root, if empty); nothing else.

        For stores with real directories (a filesystem). Never removes an object, so it is safe
        while another writer is adding objects here — unlike :meth:`delete_all`. Object stores
        have no directories: nothing to do."""


def too_large(what: str, size: int, limit: int) -> TooLargeError:
    """The error for an object over a reader's size limit, worded the same by every backend."""
    return TooLargeError(f"{what} is {size} bytes, over the {limit}-byte limit for reading it whole")
