"""DeepSpeed ZeRO checkpoints (stages 1-3, dense and MoE), and the fp32 consolidation."""

from __future__ import annotations

from ckptkit_converters.common.lazy import lazy_exports

# The package's public names, each from the module that does the job; loaded on first use, so
# importing the package (the registry does, to list formats) imports no torch.
__getattr__ = lazy_exports(__name__, {
    "import_deepspeed": "importer",
    "export_deepspeed": "exporter",
    "consolidated_fp32_state_dict": "fp32",
    "export_fp32": "fp32",
    "flat_layouts": "flat_layout",
    "FlatLayout": "flat_layout",
    "read_meta": "record",
    "DeepSpeedImportOptions": "options",
    "DeepSpeedExportOptions": "options",
    "FORMAT": "format",
})
