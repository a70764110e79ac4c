"""A rank's snapshot folder as a *bundle*: the form in which it travels between nodes.

A bundle is the files of one rank folder behind a small header (magic, length, JSON list of names
and sizes), manifest last. It exists in two shapes:

* one byte string (:func:`pack_bundle` / :func:`unpack_bundle`): what a parity group XORs, and
  what a restore sends;
* streamed (:class:`OutgoingBundle` / :class:`IncomingBundle`): the header, then each file as its
  own message, sent straight from the sender's memory-mapped files and received straight into
  the receiver's new files. A replica copy made on every snapshot then costs one copy on each
  side (the socket's) instead of four (read, join, receive, write): on a host whose cores the
  training already fills, that copy work is what a snapshot costs the step.

Either way a received header is checked before anything is written (known layout, plain relative
names, sizes that add up), and the manifest is written last, so a copy cut short is never
committed. Whether a copy is *good* is decided later by ckptkit's own checks of its digests and
CRCs, the same as for any checkpoint.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from ckptkit.errors import CorruptCheckpointError, StorageError
from ckptkit.layout.manifest import MANIFEST_NAME
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


def pack_bundle(store: LocalStore) -> bytearray:
    """A rank folder's files as one byte string (each file read once, into its place)."""
    keys = store.list_keys()
    if MANIFEST_NAME not in keys:
        raise CorruptCheckpointError(f"{store.url}: not a committed snapshot (no {MANIFEST_NAME})")
    keys = _manifest_last(keys)
    sizes = [os.path.getsize(os.path.join(store.root, k)) for k in keys]
    head = encode_header(list(zip(keys, sizes)))
    out = bytearray(len(head) + sum(sizes))
    out[: len(head)] = head
    view, pos = memoryview(out), len(head)
    for key, size in zip(keys, sizes):
        with open(os.open(os.path.join(store.root, key), os.O_RDONLY | os.O_NOFOLLOW), "rb", buffering=0) as f:
            got = f.readinto(view[pos:pos + size])
        if got != size:
            raise CorruptCheckpointError(f"{store.url}/{key}: changed size while being packed")
        pos += size
    return out


def unpack_bundle(blob: bytes | bytearray | memoryview, where: str) -> list[tuple[str, memoryview]]:
    """The files of a bundle, checked: known layout, plain relative names, sizes that add up."""
    view = memoryview(blob).cast("B")
    entries, pos = parse_header(view, where)
    out = []
    for name, size in entries:
        if pos + size > len(view):
            raise CorruptCheckpointError(f"{where}: bundle file {name!r} runs past the end")
        out.append((name, view[pos:pos + size]))
        pos += size
    if pos != len(view):
        raise CorruptCheckpointError(f"{where}: bundle sizes do not add up")
    return out


def _unmap(parts: list[memoryview], maps: list[mmap.mmap]) -> None:
    """Release the views first: a map with a view still exported cannot close."""
    for part in parts:
        part.release()
    for m in maps:
        m.close()


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
                fd = os.open(os.path.join(store.root, key), os.O_RDONLY | os.O_NOFOLLOW)
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
    """A rank folder being received: every file created at its final size and memory-mapped, so the
    bytes arrive in place; the manifest is held apart and written by :meth:`commit`, last."""

    def __init__(self, store: LocalStore, header: bytes | bytearray | memoryview) -> None:
        self.store = store
        self.entries, end = parse_header(memoryview(header).cast("B"), store.url)
        if end != len(header):
            raise CorruptCheckpointError(f"{store.url}: bundle header has trailing bytes")
        self.parts: list[memoryview] = []
        self._maps: list[mmap.mmap] = []
        self._manifest = bytearray()
        try:
            for name, size in self.entries:
                self.parts.append(self._sink(name, size))
        except OSError as exc:
            self.close()
            raise StorageError(f"{store.url}: cannot make room for a received snapshot copy: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def _sink(self, name: str, size: int) -> memoryview:
        if name == MANIFEST_NAME:
            self._manifest = bytearray(size)
            return memoryview(self._manifest)
        path = os.path.join(self.store.root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            if not size:
                return memoryview(bytearray())
            m = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._maps.append(m)
        return memoryview(m)

    def commit(self) -> LocalStore:
        """Every file has arrived: flush them and write the manifest, which commits the copy."""
        for m in self._maps:
            m.flush()
        manifest = bytes(self._manifest)
        self.close()
        self.store.write_object(MANIFEST_NAME, [manifest])
        return self.store

    def close(self) -> None:
        _unmap(self.parts, self._maps)
        self.parts, self._maps = [], []
