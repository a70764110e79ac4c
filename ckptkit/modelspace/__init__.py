"""Model-space access to checkpoints: lazy slicing, zarr export/import, diffs.

* :func:`open` -> :class:`CheckpointView`: a read-only view of any
  checkpoint; ``view[key][128:256]`` reads only the bytes that slice needs.
* :func:`diff`: per-tensor differences of two checkpoints of any layouts,
  streamed chunk by chunk (bounded memory).
* :func:`export_zarr` / :func:`import_zarr`: a zarr v3 group written and
  read through tensorstore (imported lazily: only these two need it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptkit.modelspace.diff import DiffOptions, DiffReport, TensorDiff, ValueDiff, diff
from ckptkit.modelspace.view import (
    CheckpointView,
    SliceError,
    TensorEntry,
    TensorView,
    ViewOptions,
    open,
)

if TYPE_CHECKING:
    from ckptkit.modelspace.zarr_io import (
        ConvertResult,
        ZarrExportOptions,
        ZarrImportOptions,
        export_zarr,
        import_zarr,
        is_zarr_export,
    )

_ZARR = {"ConvertResult", "ZarrExportOptions", "ZarrImportOptions", "export_zarr", "import_zarr", "is_zarr_export"}


def __getattr__(name: str) -> Any:
    # zarr_io itself imports tensorstore only inside its functions; this keeps even
    # its module load off the path of users who only slice or diff.
    if name in _ZARR:
        from ckptkit.modelspace import zarr_io

        return getattr(zarr_io, name)
    raise AttributeError(f"module 'ckptkit.modelspace' has no attribute {name!r}")


__all__ = [
    "CheckpointView",
    "ConvertResult",
    "DiffOptions",
    "DiffReport",
    "SliceError",
    "TensorDiff",
    "TensorEntry",
    "TensorView",
    "ValueDiff",
    "ViewOptions",
    "ZarrExportOptions",
    "ZarrImportOptions",
    "diff",
    "export_zarr",
    "import_zarr",
    "is_zarr_export",
    "open",
]
