"""Damage done to files on disk by the tests that look for whole classes of it."""

from __future__ import annotations

import os


def flip_byte(path: str, where: float = 0.5, mask: int = 0x40) -> None:
    """XOR the byte at ``where`` (a fraction of the file's size) with ``mask``, in place."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(min(size - 1, int(size * where)))
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ mask]))
