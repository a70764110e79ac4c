"""Other checkpoint formats, as plugins: how the offline API reads what a converter can import.

``ckptkit.reshard(MEGATRON_ITER_DIR, OUT, ...)`` should just work, but the core must not import
the converters (they import torch.load, DeepSpeed and Megatron names; arrows point inward). So a
converter *registers* a :class:`SourceFormat` under the ``ckptkit.formats`` entry-point group
(``pyproject.toml``), and this module finds them at run time: the core defines the contract,
the edge implements it, and a user's own format plugs in the same way.

The converters shipped with ckptkit register ``megatron`` (torch_dist and legacy), ``deepspeed``,
``dcp`` and ``zarr`` (``ckptkit_converters.registry``; ``[project.entry-points."ckptkit.formats"]``
in ``pyproject.toml``). A plugin is an object (or a class, instantiated without arguments) with
the attributes of :class:`SourceFormat`; two optional ones are read when present:

* ``priority`` (int, default 100; lower is tried first): detection order. Formats overlap — a
  Megatron torch_dist directory is also a valid DCP checkpoint — so the more specific one must be
  asked first (the shipped formats use 10-40);
* ``description`` (str, e.g. ``"a Megatron checkpoint"``): how messages name the format.

An import that needs a fact the source does not record raises :class:`MissingImportOptions`
naming the :class:`ImportOptions` fields to give (the CLI maps them to its flags).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from ckptkit.errors import CkptkitError

ENTRY_POINT_GROUP = "ckptkit.formats"
DEFAULT_PRIORITY = 100


@dataclass(frozen=True)
class ImportOptions:
    """What an import may need that the source does not record, by name, and how it runs.

    ``vocab_size`` / ``make_vocab_size_divisible_by``: a Megatron checkpoint's true vocabulary and
    its padding multiple, when its saved ``args`` do not record them (given and recorded must
    agree). ``threads``: ranks (or files) written at once (None: the format's default).
    ``progress``: a ``progress(done, total)`` callback over the bytes written. ``extra``:
    format-specific ones by name (``skip_unsafe_items`` for DCP, ``tag`` for DeepSpeed, ``tied``
    for a legacy Megatron checkpoint without ``args``).
    """

    vocab_size: int | None = None
    make_vocab_size_divisible_by: int | None = None
    threads: int | None = None
    progress: Callable[[int, int], None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class MissingImportOptions(CkptkitError):
    """An import needs facts the source does not record: ``missing`` names the
    :class:`ImportOptions` fields (or ``extra`` keys) to give."""

    def __init__(self, message: str, missing: tuple[str, ...]) -> None:
        super().__init__(message)
        self.missing = missing


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


def priority_of(fmt: SourceFormat) -> int:
    p = getattr(fmt, "priority", DEFAULT_PRIORITY)
    return p if isinstance(p, int) and not isinstance(p, bool) else DEFAULT_PRIORITY


def description_of(fmt: SourceFormat) -> str:
    d = getattr(fmt, "description", None)
    return d if isinstance(d, str) and d else f"a {fmt.name} checkpoint"


def source_formats() -> list[SourceFormat]:
    """Every registered format, in detection order: by ``priority`` (lower first), then name.

    A format registered twice (an editable and a regular install side by side) counts once.
    """
    found: dict[str, SourceFormat] = {}
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.name, e.value)):
        fmt = ep.load()
        fmt = fmt() if isinstance(fmt, type) else fmt
        if isinstance(fmt, SourceFormat) and fmt.name not in found:
            found[fmt.name] = fmt
    return sorted(found.values(), key=lambda f: (priority_of(f), f.name))


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
