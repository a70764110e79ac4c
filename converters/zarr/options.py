"""What a zarr export and import take: two small frozen dataclasses (no torch, no tensorstore).

Kept apart from the conversions so that a format object, the CLI and ``--opt KEY=VALUE`` can
build and check them without loading torch or tensorstore; every value is checked when the
options are made, before anything is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ckptkit.errors import LayoutError
from ckptkit.options import SaveOptions


@dataclass(frozen=True)
class ZarrExportOptions:
    """How :func:`~ckptkit_converters.zarr.convert.export_zarr` lays out and writes the arrays.

    ``chunk_bytes``: largest inner (read) chunk; ``shard_bytes``: target size
    of one shard object. ``portable``: store bfloat16 and float8 arrays as
    float32 so zarr-python and numpy read every array (bf16 is widened bit by
    bit, float8 by value; the import restores the original dtype).
    ``threads``: shards read and written at once (disk and object-store
    latency hide behind each other); memory is about ``threads * 2 *
    shard_bytes`` (the shard read, and tensorstore's encoded copy).
    """

    chunk_bytes: int = 8 << 20
    shard_bytes: int = 64 << 20
    portable: bool = False
    compression: Literal["none", "zstd"] = "none"
    checksum: bool = True
    threads: int = 4
    io_threads: int = 4

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1 or self.shard_bytes < 1:
            raise LayoutError("chunk_bytes and shard_bytes must be positive")
        if self.compression not in ("none", "zstd"):
            raise LayoutError(f"compression must be 'none' or 'zstd', got {self.compression!r}")
        if self.threads < 1 or self.io_threads < 1:
            raise LayoutError("threads and io_threads must be >= 1")


@dataclass(frozen=True)
class ZarrImportOptions:
    """How :func:`~ckptkit_converters.zarr.convert.import_zarr` writes: checksum ``block_size``, ranks
    written concurrently (``threads``), pieces read ahead per rank (``read_ahead``)."""

    block_size: int = 4 << 20
    threads: int = 2
    read_ahead: int = 2

    def __post_init__(self) -> None:
        SaveOptions(block_size=self.block_size)  # the saver's own validation of the checksum block
        if self.threads < 1 or self.read_ahead < 0:
            raise LayoutError("threads must be >= 1 and read_ahead >= 0")
