"""A rank's snapshot folder as a *bundle*: the form in which it travels between nodes.

A bundle is the files of one rank folder behind a small header (magic, length, JSON list of names
and sizes), manifest last: one byte string, never built whole on the way between nodes. It
travels in two shapes:

* streamed (:class:`OutgoingBundle` / :class:`IncomingBundle`): the header, then the files in
  messages of at most 4 MiB (:mod:`ckptkit.memory.exchange`), sent straight from the sender's
  memory-mapped files, received into two reused buffers in turn and written into the receiver's
  new files (a replica copy, a peer's copy at a restore). Written, not received into maps of the new files:
  a full ``/dev/shm`` is then an error the tier reports instead of a SIGBUS that kills the rank
  (the CPU is the same: a new tmpfs page costs its allocation either way);
* windowed (:class:`BundleBytes` / :class:`BundleSink`): the byte string read at any offset from
  the mapped files, and written in order into new files, a window at a time (the parity rounds of
  a snapshot and a parity rebuild: no process ever holds a whole snapshot, or a third of one).

Either way a received header is checked before anything is written (known layout, plain relative
names, sizes that add up), and the manifest is written last, so a copy cut short is never
committed. Whether a copy is *good* is decided later by ckptkit's own checks of its digests and
CRCs, the same as for any checkpoint.
"""

from __future__ import annotations

import bisect
import errno
import itertools
import json
import mmap
import os
import stat
import struct
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from ckptkit.errors import CorruptCheckpointError, StorageError
from ckptkit.memory import digest as digests
from ckptkit.layout.manifest import MANIFEST_NAME
from ckptkit.memory.spares import SparePool, open_new_file
from ckptkit.storage.local import LocalStore

MAGIC = b"CKMT1\n"
MAX_HEADER = 1 << 20
MAX_FILES = 4096


def _manifest_last(keys: list[str]) -> list[str]:
    return sorted(keys, key=lambda k: (k == MANIFEST_NAME, k))


def encode_header(files: list[tuple[str, int]]) -> bytes:
    header = json.dumps({"files": [[k, n] for k, n in files]}).encode()
    return MAGIC + struct.pack("<Q", len(header)) + header


def parse_header(view: memoryview, where: str) -> tuple[list[tuple[str, int]], int]:
    """The (name, size) entries a bundle header lists, checked, and where the header ends."""
    if len(view) < len(MAGIC) + 8 or bytes(view[: len(MAGIC)]) != MAGIC:
        raise CorruptCheckpointError(f"{where}: not a ckptkit memory snapshot bundle")
    (hlen,) = struct.unpack("<Q", view[len(MAGIC): len(MAGIC) + 8])
    start = len(MAGIC) + 8
    if hlen > min(MAX_HEADER, len(view) - start):
        raise CorruptCheckpointError(f"{where}: bundle header of {hlen} bytes does not fit")
    try:
        files = json.loads(bytes(view[start:start + hlen]))["files"]
        entries = [(str(name), int(size)) for name, size in files]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"{where}: bundle header unreadable: {exc}") from None
    if len(entries) > MAX_FILES:
        raise CorruptCheckpointError(f"{where}: bundle lists {len(entries)} files (at most {MAX_FILES})")
    for name, size in entries:
        parts = name.split("/")
        if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in name or size < 0:
            raise CorruptCheckpointError(f"{where}: bundle names a file outside its folder: {name!r}")
    names = {n for n, _ in entries}
    if MANIFEST_NAME not in names or len(names) != len(entries):
        raise CorruptCheckpointError(f"{where}: bundle holds no {MANIFEST_NAME}, or a file twice")
    for name in names:  # "a" and "a/b" cannot both be files
        parts = name.split("/")
        if any("/".join(parts[:i]) in names for i in range(1, len(parts))):
            raise CorruptCheckpointError(f"{where}: bundle names {name!r} under another of its files")
    return entries, start + hlen


def _open_regular(path: str) -> int:
    """A file of a committed rank folder, opened to be read: refused (never waited on) when a FIFO,
    a device or a link stands there instead (a damaged or hostile node folder; the manifest's checks
    only see the files it lists)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptCheckpointError(f"{path}: a link in a memory snapshot folder, not followed") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{path}: not a regular file in a memory snapshot folder")
    return fd


def _unmap(parts: list[memoryview], maps: list[mmap.mmap]) -> None:
    """Release the views first: a map with a view still exported cannot close. One may still be
    exported by a message in flight when a transfer failed (a tensor over it, kept alive by the
    failure's traceback): that map is then unmapped when the last view of it goes, and the
    failure is reported as itself, not as this close's BufferError."""
    for part in parts:
        part.release()
    for m in maps:
        try:
            m.close()
        except BufferError:
            pass


class _Closing(AbstractContextManager):
    """``with bundle:`` closes it (releases its maps) on the way out, whatever happened."""

    def __exit__(self, *exc: object) -> None:
        self.close()  # type: ignore[attr-defined]


@dataclass
class OutgoingBundle(_Closing):
    """A committed rank folder opened for sending: its header and its files, memory-mapped."""

    header: bytes
    parts: list[memoryview]
    _maps: list[mmap.mmap] = field(default_factory=list)

    @staticmethod
    def open(store: LocalStore) -> OutgoingBundle:
        keys = store.list_keys()
        if MANIFEST_NAME not in keys:
            raise CorruptCheckpointError(f"{store.url}: not a committed snapshot (no {MANIFEST_NAME})")
        keys = _manifest_last(keys)
        out = OutgoingBundle(b"", [])
        files = []
        try:
            for key in keys:
                fd = _open_regular(os.path.join(store.root, key))
                try:
                    size = os.fstat(fd).st_size
                    if size:
                        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
                        out._maps.append(m)
                        out.parts.append(memoryview(m))
                    else:
                        out.parts.append(memoryview(b""))
                finally:
                    os.close(fd)
                files.append((key, size))
        except BaseException:
            out.close()
            raise
        out.header = encode_header(files)
        return out

    def close(self) -> None:
        _unmap(self.parts, self._maps)
        self.parts, self._maps = [], []


class IncomingBundle(_Closing):
    """A rank folder being received: every file created empty and written as its bytes arrive
    (:meth:`write`, at their offset); the manifest is held apart and written by :meth:`commit`, last.

    Written with ``pwrite``, never stored through a memory map: on a file system that runs out of
    room (a full ``/dev/shm``) a write fails with ENOSPC, raised here as a :class:`StorageError`
    that the tier agrees on and reports, while a store through a map of a file whose pages cannot
    be supplied kills the process with SIGBUS. (The CPU is no different: bench_tier_cpu's r1
    measured 47-52 ms per snapshot either way on 2026-12-05, a new tmpfs page's allocation
    costing what its page fault did.)"""

    def __init__(self, store: LocalStore, header: bytes | bytearray | memoryview,
                 spares: SparePool | None = None) -> None:
        self.store = store
        self._spares = spares
        self.entries, end = parse_header(memoryview(header).cast("B"), store.url)
        if end != len(header):
            raise CorruptCheckpointError(f"{store.url}: bundle header has trailing bytes")
        #: every file's size, in the header's order (the order their bytes travel in)
        self.sizes = [size for _, size in self.entries]
        self._written = [0] * len(self.entries)
        self._fds: list[int | None] = []
        self._manifest = bytearray()
        try:
            for name, size in self.entries:
                self._fds.append(self._create(name, size))
        except OSError as exc:
            self.close()
            raise StorageError(f"{store.url}: cannot make room for a received snapshot copy: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def _create(self, name: str, size: int) -> int | None:
        if name == MANIFEST_NAME:
            self._manifest = bytearray(size)
            return None
        path = os.path.join(self.store.root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return open_new_file(path, size, self._spares)

    def write(self, index: int, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Bytes of file ``index`` (the header's order) at ``offset``, as they arrive."""
        view = memoryview(data).cast("B")
        name, size = self.entries[index]
        if offset < 0 or offset + len(view) > size:
            raise CorruptCheckpointError(f"{self.store.url}: {len(view)} bytes at {offset} of {name!r}, which the "
                                         f"bundle header lists as {size} bytes")
        fd = self._fds[index]
        if fd is None:
            self._manifest[offset:offset + len(view)] = view
        else:
            done = 0
            while done < len(view):
                try:
                    n = os.pwrite(fd, view[done:], offset + done)
                except OSError as exc:
                    raise StorageError(f"{self.store.url}: cannot write the received copy of {name!r}: {exc}") from exc
                if n <= 0:
                    raise StorageError(f"{self.store.url}: cannot write the received copy of {name!r}: no progress")
                done += n
        self._written[index] += len(view)

    def commit(self) -> LocalStore:
        """Every file has arrived: sync them and write the manifest, which commits the copy."""
        short = [(name, size, got) for (name, size), got in zip(self.entries, self._written) if got != size]
        if short:
            name, size, got = short[0]
            raise CorruptCheckpointError(f"{self.store.url}: {got} of the {size} bytes of {name!r} arrived")
        manifest = bytes(self._manifest)
        try:
            for fd in self._fds:
                if fd is not None:
                    os.fsync(fd)
            self.close()
            self.store.write_object(MANIFEST_NAME, [manifest])
        except StorageError:
            raise
        except OSError as exc:  # the manifest's file cannot be made (a folder out of room or inodes)
            raise StorageError(f"{self.store.url}: cannot commit the received copy: {exc}") from exc
        return self.store

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            if fd is not None:
                os.close(fd)


class BundleBytes:
    """A committed bundle (its header, then its mapped files) read as the one byte string it is, at
    any offset, without making that string: what the parity rounds and a
    parity rebuild read, a window at a time, so no process ever holds a whole snapshot."""

    def __init__(self, header: bytes | bytearray | memoryview, parts: Sequence[memoryview]) -> None:
        # the parts as given (byte views of the bundle's maps): a view made from them here would
        # keep the maps exported after the bundle released its own, and they could not close
        self._pieces = [memoryview(header), *parts]
        self._starts = list(itertools.accumulate((len(p) for p in self._pieces), initial=0))
        #: the bundle's length in bytes
        self.length = self._starts[-1]

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``; past the end, zeros (a parity chunk's padding)."""
        n, pos = len(out), 0
        i = bisect.bisect_right(self._starts, offset) - 1
        while pos < n and offset + pos < self.length:
            piece, at = self._pieces[i], offset + pos - self._starts[i]
            take = min(len(piece) - at, n - pos)
            if take > 0:
                out[pos:pos + take] = piece[at:at + take]
                pos += take
            i += 1
        if pos < n:
            out[pos:] = bytes(n - pos)

    def digest(self) -> str:
        """The bundle's digest (:mod:`ckptkit.memory.digest`), read through its maps."""
        h = digests.new()
        for piece in self._pieces:
            h.update(piece)
        return h.hexdigest()


class BundleSink(_Closing):
    """A bundle of ``length`` bytes whose digest (:mod:`ckptkit.memory.digest`) is ``digest``, written
    into a rank folder as its bytes arrive, in order (a parity rebuild's output, a window at a time).

    Its header is checked as soon as it is complete, and its sizes must add up to ``length`` before
    any file is made; the copy is committed (manifest written) only when every byte has arrived and
    the digest matches, so a rebuild from a damaged input is never committed."""

    def __init__(self, open_in: Callable[[bytes], IncomingBundle], length: int, digest: str, where: str) -> None:
        self._open_in, self.length, self.digest, self.where = open_in, length, digest, where
        self._head = bytearray()
        self._need = len(MAGIC) + 8  # header bytes needed before it can be parsed
        self._sink: IncomingBundle | None = None
        self._part = self._at = 0
        self._seen = 0
        self._hash = digests.new(digest)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        self._seen += len(view)
        if self._seen > self.length:
            raise CorruptCheckpointError(f"{self.where}: more than the {self.length} bytes of the rebuilt snapshot")
        self._hash.update(view)
        while self._sink is None and len(view):
            take = min(len(view), self._need - len(self._head))
            self._head += view[:take]
            view = view[take:]
            if len(self._head) == self._need:
                self._header_step()
        while len(view):
            sink = self._sink
            assert sink is not None
            while self._part < len(sink.sizes) and self._at == sink.sizes[self._part]:
                self._part, self._at = self._part + 1, 0
            if self._part == len(sink.sizes):
                raise CorruptCheckpointError(f"{self.where}: bytes past the files the bundle header lists")
            take = min(sink.sizes[self._part] - self._at, len(view))
            sink.write(self._part, self._at, view[:take])
            self._at += take
            view = view[take:]

    def _header_step(self) -> None:
        if self._need == len(MAGIC) + 8:
            if bytes(self._head[: len(MAGIC)]) != MAGIC:
                raise CorruptCheckpointError(f"{self.where}: not a ckptkit memory snapshot bundle")
            (hlen,) = struct.unpack("<Q", self._head[len(MAGIC):])
            if hlen > MAX_HEADER or len(MAGIC) + 8 + hlen > self.length:
                raise CorruptCheckpointError(f"{self.where}: bundle header of {hlen} bytes does not fit")
            self._need += hlen
            if hlen:
                return
        entries, _ = parse_header(memoryview(self._head), self.where)
        if len(self._head) + sum(size for _, size in entries) != self.length:
            raise CorruptCheckpointError(f"{self.where}: bundle sizes do not add up to {self.length} bytes")
        self._sink = self._open_in(bytes(self._head))

    def commit(self) -> LocalStore:
        """Every byte has arrived and matches the digest: commit the copy (else raise, nothing committed)."""
        if self._sink is None or self._seen != self.length:
            raise CorruptCheckpointError(f"{self.where}: {self._seen} of {self.length} bytes of the rebuilt snapshot")
        if self._hash.hexdigest() != self.digest:
            raise CorruptCheckpointError(f"{self.where}: the parity rebuild does not match the snapshot's digest")
        sink, self._sink = self._sink, None
        return sink.commit()

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()
            self._sink = None
