"""The format's checksums of raw bytes: a CRC32C of every checksum block.

:func:`block_crcs` checksums bytes held whole; :class:`BlockCrcs` checksums a stream fed in pieces
of any size, a block's CRC continued across pieces (staging in waves, whose windows cut blocks;
the memory tier's digests of bytes read or received a window at a time). Both give one CRC for no
bytes at all, as every index entry of an empty piece records.
"""

from __future__ import annotations

import crc32c


def block_crcs(data: memoryview, block: int) -> tuple[int, ...]:
    if len(data) == 0:
        return (crc32c.crc32c(b""),)
    return tuple(crc32c.crc32c(data[b:b + block]) for b in range(0, len(data), block))


class BlockCrcs:
    """CRC32C of every ``block`` bytes of a stream (the last block may be short), however it is fed."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.length = 0
        self._done: list[int] = []
        self._crc = 0
        self._fill = 0

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        view = memoryview(data).cast("B")
        self.length += len(view)
        while len(view):
            take = min(len(view), self.block - self._fill)
            self._crc = crc32c.crc32c(view[:take], self._crc)
            self._fill += take
            view = view[take:]
            if self._fill == self.block:
                self._done.append(self._crc)
                self._crc, self._fill = 0, 0

    def crcs(self) -> tuple[int, ...]:
        """Every block's CRC so far, in order (one, of no bytes, for an empty stream: :func:`block_crcs`)."""
        return (*self._done, self._crc) if self._fill or not self._done else tuple(self._done)
