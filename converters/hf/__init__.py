"""Hugging Face safetensors folders (dense and MoE families): import, export, the key tables."""

from __future__ import annotations

from ckptkit_converters.common.lazy import lazy_exports

# The package's public names, each from the module that does the job; loaded on first use, so
# importing the package (the registry does, to list formats) imports no torch.
__getattr__ = lazy_exports(__name__, {
    "import_hf": "importer",
    "read_hf": "importer",
    "export_hf": "exporter",
    "HFExportResult": "exporter",
    "HFImportOptions": "options",
    "HFExportOptions": "options",
    "HFConfig": "mapping",
    "FORMAT": "format",
})
