"""``ConvertOptions``: the first options bag of :func:`~ckptkit_converters.registry.convert` (deprecated).

One dataclass carried every format's fields (18 over 5 formats). Each format now has its own
small dataclasses (``MegatronExportOptions``, ``HFExportOptions``, ...) and
:func:`~ckptkit_converters.registry.convert` takes ``source_options`` / ``target_options`` /
``run``. Passing ``options=ConvertOptions(...)`` still works for one release: :func:`split` maps
its fields onto the formats' dataclasses by name, and a DeprecationWarning names the new form.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptkit.layout.config import ParallelConfig
from ckptkit.offline.formats import Format, ImportOptions, RunOptions, import_options_for, options_from

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ConvertOptions:
    """Deprecated: every direction's fields in one bag (see the module docstring for the new form).

    ``threads``, ``progress``, ``storage_options``: :class:`~ckptkit.offline.formats.RunOptions`;
    ``imports``: the first contract's import options; zarr: ``chunk_bytes``, ``shard_bytes``,
    ``portable``, ``compression``; hf: ``hf_config`` (a path), ``heads``, ``kv_heads``, ``prefix``,
    ``dtype``, ``hf_family``; deepspeed: ``dp``, ``zero_stage``, ``ep``; megatron: ``layout`` and
    ``imports.make_vocab_size_divisible_by``.
    """

    threads: int | None = None
    progress: Progress | None = None
    storage_options: dict[str, Any] | None = None
    imports: ImportOptions = field(default_factory=ImportOptions)
    chunk_bytes: int | None = None
    shard_bytes: int | None = None
    portable: bool = False
    compression: str = "none"
    hf_config: str | None = None
    heads: int | None = None
    kv_heads: int | None = None
    prefix: str | None = None
    dtype: str | None = None
    hf_family: str | None = None
    dp: int | None = None
    zero_stage: int | None = None
    ep: int | None = None
    layout: ParallelConfig | None = None

    def import_options(self) -> ImportOptions:
        """``imports`` with this conversion's ``threads`` and ``progress`` where it has none."""
        changes: dict[str, Any] = {}
        if self.imports.threads is None and self.threads is not None:
            changes["threads"] = self.threads
        if self.imports.progress is None and self.progress is not None:
            changes["progress"] = self.progress
        return dataclasses.replace(self.imports, **changes) if changes else self.imports

    def run(self) -> RunOptions:
        return RunOptions(threads=self.threads, progress=self.progress, storage_options=self.storage_options)

    def named(self) -> dict[str, Any]:
        """Every field given, by the name the formats' own dataclasses use."""
        named = {"chunk_bytes": self.chunk_bytes, "shard_bytes": self.shard_bytes, "portable": self.portable,
                 "compression": self.compression, "config": self.hf_config, "heads": self.heads,
                 "kv_heads": self.kv_heads, "prefix": self.prefix, "dtype": self.dtype, "family": self.hf_family,
                 "dp": self.dp, "zero_stage": self.zero_stage, "ep": self.ep, "layout": self.layout,
                 "make_vocab_size_divisible_by": self.imports.make_vocab_size_divisible_by, "threads": self.threads}
        return {k: v for k, v in named.items() if v is not None}

    def source_options(self, fmt: Format | None) -> Any:
        if fmt is None or fmt.import_options is None:
            return None
        return import_options_for(fmt, self.import_options())

    def target_options(self, fmt: Format) -> Any:
        cls = fmt.export_options
        return None if cls is None else options_from(cls, self.named(), where=f"the {fmt.name} export")
