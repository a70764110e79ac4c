"""Digests of the memory tier's raw bytes: a snapshot's bundle and a parity share.

A parity rebuild is committed only if the rebuilt bytes match the snapshot's digest, and a share
is used only if its bytes match the digest its header records. Those digests are computed on every
snapshot with parity, on host cores that training shares, so their cost is part of the step time.
With SHA-256 of the bundle and the share, a parity snapshot's protection took 83.9 ms of CPU over
4 ranks of 8 MiB; with these digests, 66.9 ms (0.80x; 0.76x at 64 MiB per rank;
benchmarks/bench_tier_cpu.py, 2026-12-05).

So the digest is what ckptkit's format already trusts for raw bytes: a CRC32C of every 4 MiB block
(hardware CRC, ~11 GB/s here, against ~0.9 GB/s for SHA-256), the blocks' CRCs and the length then
folded into one SHA-256, so a digest stays one short string however large the snapshot (inventories
carry one per member to every rank). Any change to a block is caught with the same certainty as a
damaged data block of a checkpoint; like the format's own checksums, it guards against damage, not
against someone who can write the node's memory folder. Digests say which they are: ``crc32c-4m:``
and 64 hex digits; a bare 64-hex-digit digest is SHA-256 of the bytes, as share headers of version 1
recorded it, and is still checked as such.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Protocol

import crc32c

BLOCK = 4 << 20
PREFIX = "crc32c-4m:"


class Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


class BlockCrc:
    """CRC32C of every :data:`BLOCK` bytes (the last block may be short), however the bytes are fed."""

    def __init__(self) -> None:
        self._crcs = bytearray()
        self._crc = 0
        self._fill = 0
        self._length = 0

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        view = memoryview(data).cast("B")
        self._length += len(view)
        while len(view):
            take = min(len(view), BLOCK - self._fill)
            self._crc = crc32c.crc32c(view[:take], self._crc)
            self._fill += take
            view = view[take:]
            if self._fill == BLOCK:
                self._crcs += struct.pack("<I", self._crc)
                self._crc, self._fill = 0, 0

    def hexdigest(self) -> str:
        crcs = self._crcs + (struct.pack("<I", self._crc) if self._fill else b"")
        return PREFIX + hashlib.sha256(struct.pack("<Q", self._length) + crcs).hexdigest()


def new(expected: str | None = None) -> Hasher:
    """A hasher of the kind ``expected`` names (a SHA-256 one for a bare hex digest); the block-CRC
    one when nothing is expected (what new digests are)."""
    if expected is None or expected.startswith(PREFIX):
        return BlockCrc()
    return hashlib.sha256()


def of(data: bytes | bytearray | memoryview) -> str:
    """The digest of ``data``, as new digests are made."""
    h = new()
    h.update(data)
    return h.hexdigest()
