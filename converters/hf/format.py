"""The Hugging Face format: safetensors folders as ``save_pretrained`` writes them (dense and MoE)."""

from __future__ import annotations

from typing import Any

from ckptkit_converters.common.format import FormatBase
from ckptkit_converters.hf.options import HFExportOptions


class HFFormat(FormatBase, name="hf", description="a Hugging Face safetensors folder", priority=50, options="HF",
               importer="importer:import_hf", exporter="exporter:export_hf", spreads=True):
    """A folder with ``config.json`` and ``model.safetensors`` (or its index): the model's weights,
    named as transformers names them. Detected last: it is the loosest signature of all."""

    def detect(self, url: str, storage_options: dict[str, Any] | None = None) -> bool:
        from ckptkit_converters.hf.files import is_hf_folder

        return is_hf_folder(url, storage_options)

    def check_export(self, options: HFExportOptions) -> None:
        options.hf_config()


FORMAT = HFFormat()
