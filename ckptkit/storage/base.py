"""The byte-store contract every storage backend implements, and every caller may rely on.

A byte store is a place to put and get bytes by key (a directory, a bucket prefix). It knows
nothing of tensors or of the checkpoint layout. The commit protocol (DESIGN.md section 3) is built
on exactly the guarantees written here, and ``tests/store_conformance.py`` checks each of them for
every backend through a raw backdoor (the filesystem, boto3), never through the store's own reads.

Keys
    ``/``-separated strings relative to the store's root (roots are often URIs such as
    ``s3://bucket/run``, not paths). Keys from checkpoint metadata are checked by the layout
    (``check_object_key``: no ``..``, no absolute paths) before they reach a store. A local store
    also refuses reads that resolve outside its root (symlinks included), and writes or deletes of
    a key with a ``..`` part or a leading ``/`` (UnsafePathError). An object store has no paths:
    a key is just a name.

Errors (all from :mod:`ckptkit.errors`; a backend never lets a raw ``OSError`` or client error out)
    ============================  ===============================================================
    absent                        ``read_bytes``: CheckpointNotFoundError. ``read_into*`` and
                                  ``checked_size``: CorruptCheckpointError ("missing"): an object
                                  the index lists is gone. ``size``: None. A prefix (directory) is
                                  not an object: absent for all of these.
    short                         ``read_into*`` past the end: CorruptCheckpointError ("truncated").
                                  Only the store's own answer says so (a stat, S3's 416 or
                                  Content-Range), never a body cut off in transit.
    not an object                 a FIFO, socket, device or dangling link where an object should
                                  be: CorruptCheckpointError, at once (no read blocks on it).
    too large                     ``read_bytes(limit=)``: TooLargeError (a CorruptCheckpointError)
                                  before the body is read into memory.
    unsafe path                   a key that resolves outside the root (local symlinks, ``..``):
                                  UnsafePathError, before anything is opened.
    unreadable / failed write     permission, disk full, network after retries: StorageError —
                                  never "absent" or "short", which would make a restore silently
                                  skip a good checkpoint.
    the caller's own failure      an exception raised by ``write_object``'s chunk iterator
                                  propagates unchanged.
    ============================  ===============================================================

Abstract methods (what each backend must guarantee)
    ``child(name)``
        The store rooted at ``name`` under this one; ``child(n).url == join_url(url, n)``, its keys
        are relative to the new root, and it shares the parent's configuration.
    ``write_object(key, chunks)``
        One object from the chunks, in order; returns its size. Durable when it returns (fsync of
        the file and its directory; a completed PUT). Not atomic: after a failure ``key`` may hold
        nothing or a partial object (objects are trusted only once a committed manifest names
        them). See :attr:`ByteStore.streams_writes` for when a chunk's buffer may be reused.
    ``put_bytes(key, data)``
        A small object, durable, replacing any previous one atomically: a concurrent reader sees
        the old bytes or the new, never a mix or a partial object.
    ``put_if_absent(key, data)``
        The commit. Atomic: of any number of concurrent callers (threads, processes, nodes) at
        most one gets True, and an existing object is never replaced. True means ``key`` now holds
        ``data`` durably because of this call — or, on object stores, because this call's own
        earlier attempt succeeded and its answer was lost (the stored bytes are compared: callers
        make their bytes unique per writer, as the manifest does by naming its attempt).
    ``read_into(key, offset, out)``
        Fill ``out`` with bytes ``[offset, offset + len(out))`` exactly, touching nothing else of
        the buffer's memory. Zero bytes asked is a no-op (nothing is checked).
    ``read_bytes(key, limit=None)``
        The whole object; ``limit`` is the largest size accepted (TooLargeError above it).
    ``size(key)``
        The object's size, None if there is none (a prefix or a directory is not an object).
    ``list_keys(prefix="")``
        Every object key equal to ``prefix`` or under ``prefix/`` (recursive, on ``/`` boundaries:
        ``"a"`` never lists ``"ab/x"``), relative to the root, sorted; [] if none. Every page of a
        paginated listing is read.
    ``delete(key)``
        Remove one object; no error if it is missing; never removes anything else.

Declared capabilities (concrete here, overridden where a backend can do better)
    ``read_into_vectored``, ``list_children``, ``delete_all``, ``exists``, ``checked_size``,
    ``is_dir``, ``prune_empty``, :attr:`~ByteStore.fallback`, :attr:`~ByteStore.streams_writes`.
    Callers use them directly: no capability is probed with ``getattr``/``hasattr``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from ckptkit.errors import CorruptCheckpointError, TooLargeError


class ByteStore(ABC):
    """A place to put and get bytes by key; see the module docstring for the contract."""

    url: str

    #: The streaming-writes contract. True: ``write_object`` is done with each chunk (has written
    #: or copied it) before it takes the next one from the iterator — and with the last one before
    #: it asks the iterator for more — so the caller may reuse or free a chunk's buffer as soon as
    #: its next ``next()`` is called (the save engine releases pinned staging buffers that way).
    #: False: the store may hold references to every chunk until ``write_object`` returns (it
    #: sends them as one request), so each buffer must stay unchanged until then.
    streams_writes: bool = False

    # ------------------------------------------------------------ abstract
    @abstractmethod
    def child(self, name: str) -> ByteStore:
        """The store rooted at ``name`` under this one (``url`` joined with ``name``)."""

    @abstractmethod
    def write_object(self, key: str, chunks: Iterable[memoryview | bytes]) -> int:
        """Write ``chunks`` as one object, durably; return its size. Not atomic (see the module)."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write a small object durably, replacing any previous one atomically."""

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Atomically create ``key``; False (and nothing written) if it already exists."""

    @abstractmethod
    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``[offset, offset + len(out))``; CorruptCheckpointError if short or missing."""

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
        """Every object key equal to ``prefix`` or under ``prefix/`` (recursive), sorted."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove one object; no error if missing."""

    # ------------------------------------------------ declared capabilities
    def read_into_vectored(self, key: str, offset: int, buffers: list[memoryview]) -> None:
        """Fill ``buffers`` in order from consecutive bytes starting at ``offset`` (a scatter read).

        Same errors as :meth:`read_into` for the whole span. Backends override this with one
        vectored request where they can.
        """
        pos = offset
        for buf in buffers:
            self.read_into(key, pos, buf)
            pos += len(memoryview(buf).cast("B"))

    def list_children(self) -> list[str]:
        """Names directly under the root, objects and prefixes alike, sorted and unique; [] if none.

        This default derives them from a full listing; backends list one level instead.
        """
        return sorted({k.split("/", 1)[0] for k in self.list_keys()})

    def delete_all(self) -> None:
        """Remove every object under the root (and the root itself where that means anything).

        Only this store's objects: never a sibling whose name merely starts the same (``a`` vs
        ``ab``). Not safe while another writer adds objects here (see :meth:`prune_empty`).
        """
        for key in self.list_keys():
            self.delete(key)
        self.prune_empty()

    def exists(self, key: str) -> bool:
        """Whether an object is at ``key`` (``size(key) is not None``)."""
        return self.size(key) is not None

    def checked_size(self, key: str) -> int:
        """The size of the object at ``key``, for a reader about to read it by other means.

        The same refusals as a ranged read here: CorruptCheckpointError ("missing") if there is
        none, and whatever the backend refuses before reading (a local store: UnsafePathError for
        a key outside the root, CorruptCheckpointError for a FIFO or device). The tensorstore
        engine calls this before its file driver touches a path.
        """
        n = self.size(key)
        if n is None:
            raise CorruptCheckpointError(f"object {self.url}/{key} is missing")
        return n

    def is_dir(self) -> bool:
        """Whether the root exists as a container, even an empty one.

        A filesystem: a directory is there. An object store has no directories: at least one
        object lies under the prefix. Tells "an empty run directory" from "no such location".
        """
        return bool(self.list_children())

    def prune_empty(self) -> None:
        """Remove directories left empty under the root (and the root, if empty); nothing else.

        For stores with real directories (a filesystem). Never removes an object, so it is safe
        while another writer is adding objects here — unlike :meth:`delete_all`. Object stores
        have no directories: nothing to do."""

    @property
    def fallback(self) -> ByteStore | None:
        """Where a reader retries bytes that failed their checksums through this store; None if nowhere.

        A store does not verify checksums itself (the index holds them): a tiered store may
        return a damaged local copy, and the reader then reads the same range from this store.
        """
        return None


def too_large(what: str, size: int, limit: int) -> TooLargeError:
    """The error for an object over a reader's size limit, worded the same by every backend."""
    return TooLargeError(f"{what} is {size} bytes, over the {limit}-byte limit for reading it whole")
