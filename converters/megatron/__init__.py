"""Megatron-core checkpoints: torch_dist directories and legacy ``model_optim_rng.pt`` folders."""

from __future__ import annotations

from ckptkit_converters.common.lazy import lazy_exports

# The package's public names, each from the module that does the job; loaded on first use, so
# importing the package (the registry does, to list formats) imports no torch.
__getattr__ = lazy_exports(__name__, {
    "import_torch_dist": "importer",
    "import_legacy": "legacy",
    "resolve_vocab": "import_shared",
    "read_torch_dist": "importer",
    "export_torch_dist": "exporter",
    "MegatronImportOptions": "options",
    "MegatronExportOptions": "options",
    "FORMAT": "format",
})
