"""The DeepSpeed format: native ZeRO checkpoint folders (``latest`` naming a ``global_stepN`` tag)."""

from __future__ import annotations

from typing import Any

from ckptkit.offline.formats import RunOptions
from ckptkit_converters.common.format import FormatBase, is_local, local_path
from ckptkit_converters.deepspeed.options import DeepSpeedExportOptions, DeepSpeedImportOptions


class DeepSpeedFormat(FormatBase, name="deepspeed", description="a DeepSpeed checkpoint", priority=20,
                      options="DeepSpeed", spreads=True):
    """A native DeepSpeed ZeRO checkpoint (stages 1-3, dense or MoE), imported and written at any DP/EP."""

    def detect(self, url: str, storage_options: dict[str, Any] | None = None) -> bool:
        if not is_local(url):
            return False
        from ckptkit_converters.deepspeed.files import is_deepspeed_checkpoint

        return is_deepspeed_checkpoint(local_path(url))

    def run_import(self, source: str, dest: str, options: DeepSpeedImportOptions, run: RunOptions) -> Any:
        from ckptkit.engine.offline_writer import OfflineWriteOptions
        from ckptkit_converters.deepspeed import import_deepspeed

        return import_deepspeed(local_path(source), dest, tag=options.tag,
                                options=OfflineWriteOptions(threads=options.threads),
                                storage_options=run.storage_options, progress=run.progress)

    def check_export(self, options: DeepSpeedExportOptions) -> None:
        options.check()

    def run_export(self, source: str, dest: str, options: DeepSpeedExportOptions, run: RunOptions) -> Any:
        from ckptkit_converters.deepspeed import export_deepspeed

        return export_deepspeed(source, dest, dp=options.check(), zero_stage=options.zero_stage, ep=options.ep,
                                tag=options.tag, storage_options=run.storage_options, progress=run.progress,
                                process_group=run.process_group)


FORMAT = DeepSpeedFormat()
