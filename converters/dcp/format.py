"""The DCP format: ``torch.distributed.checkpoint`` directories (torchtitan, plain ``dcp.save``)."""

from __future__ import annotations

from typing import Any

from ckptkit_converters.common.format import FormatBase


class DcpFormat(FormatBase, name="dcp", description="a DCP checkpoint", priority=30, options="Dcp",
                importer="convert:import_dcp", exporter="convert:export_dcp", spreads=True):
    """A DCP directory (``.metadata`` at its root), read at any world size, local or on a store."""

    def detect(self, url: str, storage_options: dict[str, Any] | None = None) -> bool:
        from ckptkit.storage.url import open_store
        from ckptkit_converters.dcp.files import METADATA_NAME

        return open_store(url, storage_options).exists(METADATA_NAME)


FORMAT = DcpFormat()
