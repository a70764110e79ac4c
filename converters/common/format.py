"""What every format's package implements: one :class:`FormatBase` subclass, one object.

The contract is the core's :class:`ckptkit.offline.formats.Format`; this base class does the parts
that are the same for every format, so a format's own class says only what differs: its name,
how it is detected, which options dataclass each direction takes, and the two calls that run.

* the options dataclasses are named by import path (``"pkg.options:Cls"``) and loaded on first
  use, so listing formats (the registry, ``ckptkit --help``) imports no torch;
* ``import_to`` / ``export_from`` accept an instance of the direction's dataclass, None (its
  defaults), or — for imports — the first contract's ``ImportOptions`` (mapped by name); a
  :class:`~ckptkit.offline.formats.RunOptions` ``threads`` overrides the options' own ``threads``;
* a direction the format does not have is a clear error naming the format.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, ClassVar

from ckptkit.errors import CkptkitError
from ckptkit.offline.formats import RunOptions, import_options_for


def load_class(path: str | None) -> type | None:
    """``"package.module:Class"`` -> the class (None stays None)."""
    if path is None:
        return None
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def is_local(url: str) -> bool:
    """Megatron and DeepSpeed write with ``torch.save`` to local paths only."""
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    return url.removeprefix("file://")


def with_threads(options: Any, run: RunOptions) -> Any:
    """``options`` with ``run.threads`` in its ``threads`` field, when both exist."""
    if run.threads is None or "threads" not in {f.name for f in dataclasses.fields(options)}:
        return options
    return dataclasses.replace(options, threads=run.threads)


class FormatBase:
    """One checkpoint format, declared in its class statement::

        class DcpFormat(FormatBase, name="dcp", description="a DCP checkpoint", priority=30,
                        options="Dcp", importer="convert:import_dcp", exporter="convert:export_dcp"):
            def detect(self, url, storage_options=None): ...

    ``options="Dcp"``: the package's ``options`` module holds ``DcpImportOptions`` and
    ``DcpExportOptions`` (``directions`` names the ones that exist). ``importer`` / ``exporter``:
    ``"module:function"`` in the package, called as ``function(source, dest, options=...,
    storage_options=..., progress=...)`` (and ``process_group=...`` when ``spreads=True``); a
    format whose functions take other arguments overrides
    :meth:`run_import` / :meth:`run_export` instead.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    priority: ClassVar[int]
    relayout: ClassVar[bool] = False
    #: the export can be spread over a job's processes (``RunOptions(process_group=...)``)
    spreads: ClassVar[bool] = False
    import_options_at: ClassVar[str | None] = None
    export_options_at: ClassVar[str | None] = None
    importer_at: ClassVar[str | None] = None
    exporter_at: ClassVar[str | None] = None

    def __init_subclass__(cls, *, name: str | None = None, description: str | None = None,
                          priority: int | None = None, options: str | None = None,
                          directions: tuple[str, ...] = ("import", "export"), relayout: bool = False,
                          importer: str | None = None, exporter: str | None = None, spreads: bool = False,
                          **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        package = cls.__module__.rpartition(".")[0]
        if name is not None:
            cls.name, cls.description, cls.relayout = name, description or f"a {name} checkpoint", relayout
            cls.spreads = spreads
        if priority is not None:
            cls.priority = priority
        if options is not None:
            cls.import_options_at = f"{package}.options:{options}ImportOptions" if "import" in directions else None
            cls.export_options_at = f"{package}.options:{options}ExportOptions" if "export" in directions else None
        if importer is not None:
            cls.importer_at = f"{package}.{importer}"
        if exporter is not None:
            cls.exporter_at = f"{package}.{exporter}"

    @property
    def import_options(self) -> type | None:
        return load_class(self.import_options_at)

    @property
    def export_options(self) -> type | None:
        return load_class(self.export_options_at)

    def __repr__(self) -> str:
        return f"<format {self.name}>"

    # -------------------------------------------------------- the contract

    def detect(self, url: str, storage_options: dict[str, Any] | None = None) -> bool:
        raise NotImplementedError

    def import_to(self, source: str, dest: str, options: Any = None, run: RunOptions = RunOptions()) -> Any:
        if self.import_options is None:
            raise CkptkitError(f"ckptkit cannot import {self.description} (the {self.name} format only exports)")
        opts = with_threads(import_options_for(self, options), run)  # type: ignore[arg-type]
        return self.run_import(source, dest, opts, run)

    def export_from(self, source: str, dest: str, options: Any = None, run: RunOptions = RunOptions()) -> Any:
        opts = with_threads(self.export_options_of(options), run)
        self.check_export(opts)
        return self.run_export(source, dest, opts, run)

    def check_export(self, options: Any) -> None:
        """Override to refuse, naming the option, an export that cannot run (before anything is read)."""

    # -------------------------------------------------------- what a format supplies

    def run_import(self, source: str, dest: str, options: Any, run: RunOptions) -> Any:
        return _call(self.importer_at, source, dest, options, run)

    def run_export(self, source: str, dest: str, options: Any, run: RunOptions) -> Any:
        extra = {"process_group": run.process_group} if self.spreads else {}
        return _call(self.exporter_at, source, dest, options, run, **extra)

    def export_options_of(self, given: Any) -> Any:
        cls = self.export_options
        if cls is None:
            raise CkptkitError(f"ckptkit cannot write {self.description} (the {self.name} format only imports)")
        if given is None:
            return cls()
        if not isinstance(given, cls):
            raise CkptkitError(f"the {self.name} export takes {cls.__name__} options, not {type(given).__name__}")
        return given


def _call(path: str | None, source: str, dest: str, options: Any, run: RunOptions, **extra: Any) -> Any:
    """The conversion function at ``path`` (``"package.module:function"``), called the common way
    (an export that spreads also takes ``process_group``)."""
    if path is None:
        raise NotImplementedError("a format without importer=/exporter= overrides run_import/run_export")
    module, _, name = path.partition(":")
    function = getattr(importlib.import_module(module), name)
    return function(source, dest, options=options, storage_options=run.storage_options, progress=run.progress, **extra)
