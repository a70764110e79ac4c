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

from ckptkit.engine.block_crc import BlockCrcs

BLOCK = 4 << 20
PREFIX = "crc32c-4m:"


class Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


class BlockCrc:
    """The block-CRC digest: the format's block CRCs of the bytes (:class:`~ckptkit.engine.block_crc.BlockCrcs`),
    with the length, folded into one SHA-256."""

    def __init__(self) -> None:
        self._crcs = BlockCrcs(BLOCK)

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        self._crcs.update(data)

    def hexdigest(self) -> str:
        crcs = self._crcs.crcs() if self._crcs.length else ()
        return PREFIX + hashlib.sha256(struct.pack("<Q", self._crcs.length) + struct.pack(f"<{len(crcs)}I", *crcs)).hexdigest()


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
