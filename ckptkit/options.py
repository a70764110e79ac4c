"""Options for saving and loading, as small frozen dataclasses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ckptkit.errors import LayoutError


@dataclass(frozen=True)
class SaveOptions:
    """How a save writes.

    ``block_size``: bytes covered by one CRC32C; a partial read (resharding)
    reads and verifies whole blocks, so smaller blocks read less extra and
    cost slightly larger indexes.
    """

    block_size: int = 4 << 20

    def __post_init__(self) -> None:
        if self.block_size < 4096 or self.block_size % 4096:
            raise LayoutError(f"block_size {self.block_size} must be a positive multiple of 4096")


@dataclass(frozen=True)
class LoadOptions:
    """How a load reads.

    ``io_threads``: read requests in flight per rank.
    ``per_rank_on_resize``: what happens to per-rank values (RNG states,
    ``PerRank``) when the world size changed: ``"error"`` refuses,
    ``"skip"`` leaves them as they are in the caller's state.
    """

    io_threads: int = 4
    per_rank_on_resize: Literal["error", "skip"] = "error"

    def __post_init__(self) -> None:
        if self.io_threads < 1:
            raise LayoutError(f"io_threads {self.io_threads} must be >= 1")
        if self.per_rank_on_resize not in ("error", "skip"):
            raise LayoutError(f"per_rank_on_resize must be 'error' or 'skip', got {self.per_rank_on_resize!r}")
