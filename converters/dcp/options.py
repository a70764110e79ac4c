"""What a DCP import and export take: two small frozen dataclasses (no torch imported).

Kept apart from the conversions so that a format object, the CLI and ``--opt KEY=VALUE`` can
build and check them without loading torch; every value is checked when the options are made,
before anything is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptkit.errors import LayoutError, OptionsError
from ckptkit.options import SaveOptions


@dataclass(frozen=True)
class DcpImportOptions:
    """How :func:`~ckptkit_converters.dcp.convert.import_dcp` writes: checksum ``block_size``, virtual
    ranks written at once (``threads``), chunks read ahead per rank (``read_ahead``);
    ``skip_unsafe_items``: leave out non-tensor items that do not decode safely instead of failing
    (the result lists them). Memory is about ``threads * (read_ahead + 1) * 2`` chunks (a blob and
    its tensor)."""

    block_size: int = 4 << 20
    threads: int = 2
    read_ahead: int = 2
    skip_unsafe_items: bool = False

    def __post_init__(self) -> None:
        SaveOptions(block_size=self.block_size)  # the saver's own validation of the checksum block
        if self.threads < 1:
            raise OptionsError(f"threads {self.threads} must be >= 1")
        if self.read_ahead < 0:
            raise LayoutError(f"read_ahead {self.read_ahead} must be >= 0")


@dataclass(frozen=True)
class DcpExportOptions:
    """How :func:`~ckptkit_converters.dcp.convert.export_dcp` writes: data files (writer ranks)
    written at once (``threads``), boxes read ahead per file (``read_ahead``), reads in flight per
    box (``io_threads``)."""

    threads: int = 2
    read_ahead: int = 1
    io_threads: int = 4

    def __post_init__(self) -> None:
        if self.threads < 1 or self.io_threads < 1 or self.read_ahead < 0:
            raise LayoutError("threads and io_threads must be >= 1, read_ahead >= 0")
