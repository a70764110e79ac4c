"""XOR parity over a group of ``g`` snapshots with distributed shares (RAID 5's placement).

Member ``i``'s snapshot (a byte string of any length) is cut into ``g - 1`` chunks of
:func:`chunk_len` bytes, zero-padded at the end; its chunk ``t`` goes to member
``(i + 1 + t) mod g`` — every other member exactly once. Member ``j``'s *share* is
the XOR of the chunks it received. Losing member ``k`` (its snapshot and its share)
leaves, for each of ``k``'s chunks, the share it went into and every other chunk in
that share: XOR them and the chunk is back. See :mod:`ckptkit.memory.topology` for
why the shares cost ``1 / (g - 1)`` of a snapshot and no less.

Everything moves and is XORed a *window* at a time (:data:`WINDOW` bytes of a chunk): a
chunk is a third of a snapshot at ``g = 4``, and a snapshot can be tens of GiB, so neither
the parity rounds nor a rebuild ever hold a chunk, let alone a snapshot (:func:`encode_rounds`,
:func:`rebuild_windows`: the orders every rank of a group walks alike). Snapshots are read
through anything with ``read_into(offset, out)`` (:class:`~ckptkit.memory.bundle.BundleBytes`).
Bytes are XORed as 64-bit words (chunks and windows are multiples of 8 bytes).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ckptkit.errors import CorruptCheckpointError

WORD = 8
WINDOW = 32 << 20
"""Bytes of a chunk moved and XORed at once: one message each way per window in the parity rounds."""


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


def windows(c: int, window: int = WINDOW) -> Iterator[tuple[int, int]]:
    """(offset, bytes) of each window of a ``c``-byte chunk."""
    if window <= 0 or window % WORD:
        raise ValueError(f"a parity window is a positive multiple of {WORD} bytes, got {window}")
    for off in range(0, c, window):
        yield off, min(window, c - off)


def xor_into(acc: memoryview | bytearray, other: memoryview | bytes | bytearray) -> None:
    """``acc ^= other``, in place (equal lengths, a multiple of 8 bytes)."""
    if len(acc) != len(other) or len(acc) % WORD:
        raise ValueError(f"XOR of {len(acc)} and {len(other)} bytes (equal multiples of {WORD} expected)")
    if len(acc):
        a = np.frombuffer(acc, dtype=np.uint64)
        np.bitwise_xor(a, np.frombuffer(other, dtype=np.uint64), out=a)


@dataclass(frozen=True)
class Round:
    """One window of the parity rounds, seen by one member: send ``n`` bytes of its snapshot at
    ``send_at`` to member ``to``; receive ``n`` bytes from member ``frm`` and XOR them into its share
    at ``off`` — or, in the ``first`` round, whose windows cover the share once, store them there:
    the share's former bytes then never matter (a recycled file's need no zeroing), and a store is
    cheaper than an XOR with zeros."""

    to: int
    frm: int
    send_at: int
    off: int
    n: int
    first: bool = False


def encode_rounds(me: int, g: int, c: int, window: int = WINDOW) -> Iterator[Round]:
    """Member ``me``'s side of the ``g - 1`` parity rounds: in round ``t`` every member sends its
    chunk ``t`` to ``holder_of(member, t)`` and receives from the member that sends to it, so every
    pair of a round runs at once and every member sends and receives one chunk per round."""
    for t in range(g - 1):
        to, frm = holder_of(me, t, g), (me - 1 - t) % g
        for off, n in windows(c, window):
            yield Round(to, frm, t * c + off, off, n, t == 0)


@dataclass(frozen=True)
class RebuildWindow:
    """One window of a lost member's rebuild: its bytes at ``at`` are share ``share``'s ``n`` bytes at
    ``off`` XOR the matching window of each member in ``members`` (at ``member_at[i]`` in member
    ``members[i]``'s snapshot)."""

    at: int
    share: int
    off: int
    n: int
    members: tuple[int, ...]
    member_at: tuple[int, ...]


def rebuild_windows(lost: int, g: int, c: int, window: int = WINDOW) -> Iterator[RebuildWindow]:
    """Rebuilding member ``lost``, window by window, in the order its snapshot's bytes come back."""
    for t in range(g - 1):
        j = holder_of(lost, t, g)
        others = tuple(i for i in range(g) if i not in (lost, j))
        for off, n in windows(c, window):
            yield RebuildWindow(t * c + off, j, off, n, others, tuple(chunk_index(i, j, g) * c + off for i in others))


def check_rebuild(lost: int, length: int, present: set[int], g: int, c: int) -> None:
    """Refuse a rebuild that cannot work: another member missing, or a length the chunks cannot hold."""
    missing = [i for i in range(g) if i != lost and i not in present]
    if missing:
        raise CorruptCheckpointError(f"cannot rebuild parity member {lost}: members {missing} are missing too")
    if length > (g - 1) * c:
        raise CorruptCheckpointError(f"parity member {lost}: {length} bytes do not fit {g - 1} chunks of {c}")
