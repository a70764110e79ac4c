"""The Megatron format: torch_dist directories and legacy ``model_optim_rng.pt`` folders.

Detection reads a small file (``metadata.json``, ``latest_checkpointed_iteration.txt``) or a
listing; the import and export modules (which import torch) load when a conversion runs.
"""

from __future__ import annotations

from typing import Any

from ckptkit.offline.formats import RunOptions
from ckptkit_converters.common.format import FormatBase, is_local, local_path
from ckptkit_converters.megatron.options import MegatronExportOptions, MegatronImportOptions


class MegatronFormat(FormatBase, name="megatron", description="a Megatron checkpoint", priority=10,
                     options="Megatron", relayout=True, spreads=True):
    """Megatron-core ``torch_dist`` (``metadata.json`` naming torch_dist) and legacy
    (``mp_rank_*/model_optim_rng.pt``, or the save root with ``latest_checkpointed_iteration.txt``);
    exported as torch_dist at any tp/pp (a Megatron source exported again is a relayout)."""

    def detect(self, url: str, storage_options: dict[str, Any] | None = None) -> bool:
        if not is_local(url):
            return False
        from ckptkit_converters.megatron.files import is_legacy, is_torch_dist

        return is_torch_dist(local_path(url)) or is_legacy(local_path(url))

    def run_import(self, source: str, dest: str, options: MegatronImportOptions, run: RunOptions) -> Any:
        from ckptkit_converters.megatron.files import is_torch_dist
        from ckptkit_converters.megatron.importer import import_legacy, import_torch_dist

        path = local_path(source)
        common: dict[str, Any] = {
            "vocab_size": options.vocab_size, "make_vocab_size_divisible_by": options.make_vocab_size_divisible_by,
            "threads": options.threads, "weights_only": options.weights_only, "progress": run.progress,
            "storage_options": run.storage_options}
        if is_torch_dist(path):
            return import_torch_dist(path, dest, **common)
        return import_legacy(path, dest, tied=options.tied, **common)

    def check_export(self, options: MegatronExportOptions) -> None:
        options.target()

    def run_export(self, source: str, dest: str, options: MegatronExportOptions, run: RunOptions) -> Any:
        from ckptkit_converters.megatron.exporter import export_torch_dist

        target = options.target()
        return export_torch_dist(source, dest, tp=target.tp, pp=target.pp, ep=target.ep, etp=target.etp,
                                 vpp=target.vpp, pp_layers=target.pp_layers,
                                 make_vocab_size_divisible_by=options.make_vocab_size_divisible_by,
                                 weights_only=options.weights_only, progress=run.progress,
                                 optimizer=options.optimizer, process_group=run.process_group,
                                 max_memory=options.max_memory)


FORMAT = MegatronFormat()
