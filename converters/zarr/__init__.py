"""zarr v3 groups written by tensorstore: one array per logical tensor, the manifest in the attributes."""

from __future__ import annotations

from ckptkit_converters.common.lazy import lazy_exports

# The package's public names, each from the module that does the job; loaded on first use, so
# importing the package (the registry does, to list formats) imports no torch.
__getattr__ = lazy_exports(__name__, {
    "import_zarr": "convert",
    "export_zarr": "convert",
    "ZarrImportOptions": "options",
    "ZarrExportOptions": "options",
    "FORMAT": "format",
})
