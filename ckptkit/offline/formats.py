"""Other checkpoint formats, as plugins: how the offline API reads what a converter can import.

``ckptkit.reshard(MEGATRON_ITER_DIR, OUT, ...)`` should just work, but the core must not import
the converters (they import torch.load, DeepSpeed and Megatron names; arrows point inward). So a
converter *registers* a :class:`SourceFormat` under the ``ckptkit.formats`` entry-point group
(``pyproject.toml``), and this module finds them at run time: the core defines the contract,
the edge implements it, and a user's own format plugs in the same way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from ckptkit.errors import CkptkitError

ENTRY_POINT_GROUP = "ckptkit.formats"


@dataclass(frozen=True)
class ImportOptions:
    """What an import may need that the source does not record (e.g. a Megatron-LM checkpoint
    without saved ``args`` needs ``vocab_size``), by name; ``extra`` for format-specific ones."""

    vocab_size: int | None = None
    make_vocab_size_divisible_by: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class SourceFormat(Protocol):
    """A checkpoint format a converter can import into ckptkit's."""

    name: str  # as the CLI spells it: "megatron", "dcp", "deepspeed", "zarr"

    def detect(self, url: str, storage_options: dict[str, Any] | None = None) -> bool:
        """Whether ``url`` holds a checkpoint of this format (cheap: a listing, a small file)."""
        ...

    def import_to(self, source: str, dest: str, options: ImportOptions,
                  storage_options: dict[str, Any] | None = None) -> Any:
        """Write ``source`` as a committed ckptkit checkpoint at ``dest``; return a result with
        ``to_json()`` (:class:`~ckptkit.engine.offline_writer.ConvertResult`)."""
        ...


def source_formats() -> list[SourceFormat]:
    """Every registered format, in a stable order (detection tries them in this order)."""
    found = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        fmt = ep.load()
        fmt = fmt() if isinstance(fmt, type) else fmt
        if isinstance(fmt, SourceFormat):
            found.append(fmt)
    return found


def detect_format(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> SourceFormat | None:
    """The registered format of the checkpoint at ``url``, or None (ckptkit's own, or unknown)."""
    for fmt in source_formats():
        if fmt.detect(os.fspath(url), storage_options):
            return fmt
    return None


def format_named(name: str) -> SourceFormat:
    for fmt in source_formats():
        if fmt.name == name:
            return fmt
    names = ", ".join(f.name for f in source_formats()) or "none installed"
    raise CkptkitError(f"no checkpoint format {name!r} is registered (formats: {names})")
