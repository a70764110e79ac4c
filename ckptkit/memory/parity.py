"""XOR parity over a group of ``g`` snapshots with distributed shares (RAID 5's placement).

Member ``i``'s snapshot (a byte string of any length) is cut into ``g - 1`` chunks of
:func:`chunk_len` bytes, zero-padded at the end; its chunk ``t`` goes to member
``(i + 1 + t) mod g`` — every other member exactly once. Member ``j``'s *share* is
the XOR of the chunks it received. Losing member ``k`` (its snapshot and its share)
leaves, for each of ``k``'s chunks, the share it went into and every other chunk in
that share: XOR them and the chunk is back. See :mod:`ckptkit.memory.topology` for
why the shares cost ``1 / (g - 1)`` of a snapshot and no less.

Bytes are XORed as ``int64`` words through torch (chunks are a multiple of 8 bytes).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import torch

from ckptkit.errors import CorruptCheckpointError

WORD = 8


def chunk_len(max_len: int, g: int) -> int:
    """Bytes per chunk for a group whose longest snapshot has ``max_len`` bytes."""
    if g < 2:
        raise ValueError(f"a parity group needs at least 2 members, got {g}")
    per = -(-max_len // (g - 1))
    return -(-per // WORD) * WORD


def holder_of(member: int, t: int, g: int) -> int:
    """The member holding chunk ``t`` of ``member``'s snapshot in its share."""
    return (member + 1 + t) % g


def chunk_index(member: int, holder: int, g: int) -> int:
    """Which chunk of ``member``'s snapshot ``holder``'s share contains (``holder != member``)."""
    if member == holder:
        raise ValueError("a member's share holds no chunk of its own snapshot")
    return (holder - member - 1) % g


def _chunk(blob: memoryview, t: int, c: int) -> torch.Tensor:
    out = torch.zeros(c, dtype=torch.uint8)
    part = blob[t * c:(t + 1) * c]
    if len(part):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: only read here
            out[: len(part)] = torch.frombuffer(part, dtype=torch.uint8)
    return out


def _xor_into(acc: torch.Tensor, other: torch.Tensor) -> None:
    torch.bitwise_xor(acc.view(torch.int64), other.view(torch.int64), out=acc.view(torch.int64))


def chunk_of(blob: bytes | bytearray | memoryview, member: int, holder: int, g: int, c: int) -> torch.Tensor:
    """The chunk of ``member``'s snapshot that goes into ``holder``'s share (zero-padded to ``c``)."""
    return _chunk(memoryview(blob).cast("B"), chunk_index(member, holder, g), c)


def as_chunk(data: bytes | bytearray | memoryview, c: int) -> torch.Tensor:
    """A received chunk as a tensor, checked to be exactly ``c`` bytes."""
    if len(data) != c:
        raise CorruptCheckpointError(f"a parity chunk of {len(data)} bytes, expected {c}")
    return _chunk(memoryview(data).cast("B"), 0, c)


def share_of(holder: int, chunks: Sequence[torch.Tensor], c: int) -> torch.Tensor:
    """``holder``'s share: the XOR of the chunks the other members sent it."""
    acc = torch.zeros(c, dtype=torch.uint8)
    for ch in chunks:
        if ch.numel() != c:
            raise ValueError(f"a chunk of {ch.numel()} bytes in a share of {c}-byte chunks")
        _xor_into(acc, ch)
    return acc


def encode(blobs: Sequence[bytes | bytearray | memoryview], c: int) -> list[torch.Tensor]:
    """Every member's share at once (for tests and single-process use)."""
    g = len(blobs)
    return [share_of(j, [chunk_of(blobs[i], i, j, g, c) for i in range(g) if i != j], c) for j in range(g)]


def rebuild(lost: int, length: int, others: Mapping[int, bytes | bytearray | memoryview],
            shares: Mapping[int, torch.Tensor], g: int, c: int) -> bytes:
    """Member ``lost``'s snapshot (``length`` bytes) from every other member's snapshot and share."""
    missing = [i for i in range(g) if i != lost and (i not in others or i not in shares)]
    if missing:
        raise CorruptCheckpointError(f"cannot rebuild parity member {lost}: members {missing} are missing too")
    if length > (g - 1) * c:
        raise CorruptCheckpointError(f"parity member {lost}: {length} bytes do not fit {g - 1} chunks of {c}")
    out = torch.empty((g - 1) * c, dtype=torch.uint8)
    for t in range(g - 1):
        j = holder_of(lost, t, g)
        acc = shares[j].clone()
        if acc.numel() != c:
            raise CorruptCheckpointError(f"parity share {j} has {acc.numel()} bytes, expected {c}")
        for i in range(g):
            if i not in (lost, j):
                _xor_into(acc, chunk_of(others[i], i, j, g, c))
        out[t * c:(t + 1) * c] = acc
    return bytes(out[:length].numpy().tobytes()) if length else b""
