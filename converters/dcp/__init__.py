"""torch.distributed.checkpoint directories (torchtitan, plain ``dcp.save``)."""

from __future__ import annotations

from ckptkit_converters.common.lazy import lazy_exports

# The package's public names, each from the module that does the job; loaded on first use, so
# importing the package (the registry does, to list formats) imports no torch.
__getattr__ = lazy_exports(__name__, {
    "import_dcp": "convert",
    "export_dcp": "convert",
    "DcpImportOptions": "options",
    "DcpExportOptions": "options",
    "DcpConvertResult": "convert",
    "is_dcp_checkpoint": "convert",
    "read_dcp_metadata": "convert",
    "FORMAT": "format",
})
