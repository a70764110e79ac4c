"""The zarr format: a zarr v3 group with one array per logical tensor, written by tensorstore."""

from __future__ import annotations

from typing import Any

from ckptkit_converters.common.format import FormatBase


class ZarrFormat(FormatBase, name="zarr", description="a zarr group", priority=40, options="Zarr",
                 importer="convert:import_zarr", exporter="convert:export_zarr", spreads=True):
    """A zarr v3 group written by ``ckptkit convert --format zarr`` (``zarr.json`` at its root)."""

    def detect(self, url: str, storage_options: dict[str, Any] | None = None) -> bool:
        from ckptkit.storage.url import open_store

        return open_store(url, storage_options).exists("zarr.json")


FORMAT = ZarrFormat()
