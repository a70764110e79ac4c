"""Other checkpoint formats, as plugins: the one contract every format implements.

``ckptkit.reshard(MEGATRON_ITER_DIR, OUT, ...)`` should just work, but the core must not import
the converters (they import torch.load, DeepSpeed and Megatron names; arrows point inward). So a
format *registers* a :class:`Format` under the ``ckptkit.formats`` entry-point group
(``pyproject.toml``) and this module finds it at run time: the core defines the contract, the edge
implements it, and a user's own format plugs in the same way (docs/architecture.md, "How to add a
format").

A format is one object with:

* ``name`` (as the CLI spells it), ``description`` (``"a Megatron checkpoint"``), ``priority``
  (detection order, lower first: formats overlap — a Megatron torch_dist directory is also a valid
  DCP checkpoint — so the more specific one is asked first; the shipped formats use 10-50);
* ``import_options`` / ``export_options``: the small frozen dataclass each direction takes (None:
  the format has no such direction); every field has a default, so the CLI can build one from
  ``--opt KEY=VALUE`` and :func:`options_from` from names;
* ``relayout``: exporting a source of this format to this format rewrites its layout (Megatron at
  another tp/pp) rather than being a no-op;
* ``detect(url, storage_options)``, ``import_to(source, dest, options, run)``,
  ``export_from(source, dest, options, run)`` and ``check_export(options)`` (what an export needs,
  checked before anything is read).

:class:`RunOptions` is how any conversion runs, whatever the format: threads, a progress callback,
the byte stores' options. Results are :class:`~ckptkit.engine.offline_writer.ConvertResult`
(``ckptkit.offline.ConvertResult``).

Plugins written against the first contract (:class:`SourceFormat`: ``import_to(source, dest,
ImportOptions, storage_options)``, no export) still load, wrapped, with a DeprecationWarning.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from ckptkit.errors import CkptkitError

ENTRY_POINT_GROUP = "ckptkit.formats"
DEFAULT_PRIORITY = 100
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class RunOptions:
    """How a conversion runs, whatever its formats.

    ``threads``: ranks, shards or files written at once (None: each format's default; given, it
    overrides a ``threads`` field of the format's options). ``progress``: ``progress(done, total)``
    over bytes. ``storage_options``: both sides' byte stores (fsspec options, e.g. an S3 endpoint).
    ``process_group``: spread the export over this group's processes (a ``torchrun`` job's; call
    on every process); only formats whose ``spreads`` is true accept one of more than one process.
    """

    threads: int | None = None
    progress: Progress | None = None
    storage_options: dict[str, Any] | None = None
    process_group: Any = None

    def __post_init__(self) -> None:
        if self.threads is not None and (isinstance(self.threads, bool) or self.threads < 1):
            raise CkptkitError(f"threads must be a positive integer or None, got {self.threads!r}")


@runtime_checkable
class Format(Protocol):
    """A checkpoint format ckptkit converts from (``import_to``) and/or to (``export_from``)."""

    name: str
    description: str
    priority: int
    import_options: type | None
    export_options: type | None
    relayout: bool

    def detect(self, url: str, storage_options: dict[str, Any] | None = None) -> bool:
        """Whether ``url`` holds a checkpoint of this format (cheap: a listing, a small file)."""
        ...

    def import_to(self, source: str, dest: str, options: Any, run: RunOptions) -> Any:
        """Write ``source`` as a committed ckptkit checkpoint at ``dest``: a ``ConvertResult``."""
        ...

    def export_from(self, source: str, dest: str, options: Any, run: RunOptions) -> Any:
        """Write the ckptkit checkpoint ``source`` in this format at ``dest``: a ``ConvertResult``."""
        ...

    def check_export(self, options: Any) -> None:
        """Raise a clear error, naming the option, when ``options`` cannot run an export."""
        ...


# ---------------------------------------------------------------- the first contract (deprecated)


@dataclass(frozen=True)
class ImportOptions:
    """The first contract's import options (deprecated: each format has its own dataclass now,
    e.g. ``ckptkit_converters.megatron.MegatronImportOptions``; :func:`options_from` maps these
    fields and ``extra`` keys onto it by name).

    ``vocab_size`` / ``make_vocab_size_divisible_by``: a Megatron checkpoint's true vocabulary and
    its padding multiple. ``threads``, ``progress``: see :class:`RunOptions`. ``extra``:
    format-specific ones by name (``skip_unsafe_items`` for DCP, ``tag`` for DeepSpeed, ``tied``
    for a legacy Megatron checkpoint without ``args``).
    """

    vocab_size: int | None = None
    make_vocab_size_divisible_by: int | None = None
    threads: int | None = None
    progress: Callable[[int, int], None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def named(self) -> dict[str, Any]:
        """The facts given, by name (None fields left out; ``extra`` merged in)."""
        given = {"vocab_size": self.vocab_size, "make_vocab_size_divisible_by": self.make_vocab_size_divisible_by}
        return {**{k: v for k, v in given.items() if v is not None}, **self.extra}

    def is_default(self) -> bool:
        return self == ImportOptions()


class MissingImportOptions(CkptkitError):
    """An import needs facts the source does not record: ``missing`` names the options fields to give."""

    def __init__(self, message: str, missing: tuple[str, ...]) -> None:
        super().__init__(message)
        self.missing = missing


@runtime_checkable
class SourceFormat(Protocol):
    """The first plugin contract: a format a converter can import, nothing more (deprecated)."""

    name: str

    def detect(self, url: str, storage_options: dict[str, Any] | None = None) -> bool: ...

    def import_to(self, source: str, dest: str, options: ImportOptions,
                  storage_options: dict[str, Any] | None = None) -> Any: ...


@dataclass(frozen=True)
class _FirstContract:
    """A :class:`SourceFormat` plugin seen through :class:`Format` (import only)."""

    plugin: Any
    name: str
    description: str
    priority: int
    import_options: type | None = ImportOptions
    export_options: type | None = None
    relayout: bool = False

    def detect(self, url: str, storage_options: dict[str, Any] | None = None) -> bool:
        return bool(self.plugin.detect(url, storage_options))

    def import_to(self, source: str, dest: str, options: Any, run: RunOptions) -> Any:
        legacy = options if isinstance(options, ImportOptions) else ImportOptions()
        legacy = dataclasses.replace(legacy, threads=legacy.threads or run.threads,
                                     progress=legacy.progress or run.progress)
        return self.plugin.import_to(source, dest, legacy, run.storage_options)

    def export_from(self, source: str, dest: str, options: Any, run: RunOptions) -> Any:
        self.check_export(options)

    def check_export(self, options: Any) -> None:
        raise CkptkitError(f"{self.description} has no exporter (a plugin of the first contract imports only)")


def _as_format(plugin: Any) -> Format | None:
    if isinstance(plugin, Format):
        return plugin
    if isinstance(plugin, SourceFormat):
        warnings.warn(f"checkpoint format plugin {plugin.name!r} implements the first contract (SourceFormat); "
                      "implement ckptkit.offline.formats.Format (import_options, export_options, relayout, "
                      "import_to(source, dest, options, run), export_from, check_export) instead",
                      DeprecationWarning, stacklevel=3)
        return _FirstContract(plugin, plugin.name, description_of(plugin), priority_of(plugin))
    return None


# ---------------------------------------------------------------- finding formats


def priority_of(fmt: Any) -> int:
    p = getattr(fmt, "priority", DEFAULT_PRIORITY)
    return p if isinstance(p, int) and not isinstance(p, bool) else DEFAULT_PRIORITY


def description_of(fmt: Any) -> str:
    d = getattr(fmt, "description", None)
    return d if isinstance(d, str) and d else f"a {fmt.name} checkpoint"


def source_formats() -> list[Format]:
    """Every registered format, in detection order: by ``priority`` (lower first), then name.

    A format registered twice (an editable and a regular install side by side) counts once.
    """
    found: dict[str, Format] = {}
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.name, e.value)):
        loaded = ep.load()
        fmt = _as_format(loaded() if isinstance(loaded, type) else loaded)
        if fmt is not None and fmt.name not in found:
            found[fmt.name] = fmt
    return sorted(found.values(), key=lambda f: (priority_of(f), f.name))


def detect_format(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Format | None:
    """The registered format of the checkpoint at ``url``, or None (ckptkit's own, or unknown)."""
    for fmt in source_formats():
        if fmt.import_options is not None and fmt.detect(os.fspath(url), storage_options):
            return fmt
    return None


def format_named(name: str) -> Format:
    for fmt in source_formats():
        if fmt.name == name:
            return fmt
    names = ", ".join(f.name for f in source_formats()) or "none installed"
    raise CkptkitError(f"no checkpoint format {name!r} is registered (formats: {names})")


# ---------------------------------------------------------------- options by name


def options_from(cls: type, named: Mapping[str, Any], *, where: str = "") -> Any:
    """An instance of the options dataclass ``cls`` from the ``named`` facts that are its fields.

    Names ``cls`` does not have are left out (a Megatron fact means nothing to a DCP import); a
    value of the wrong type fails in ``cls``'s own checks, or here with the field named.
    """
    fields = {f.name for f in dataclasses.fields(cls)}
    given = {k: v for k, v in named.items() if k in fields}
    try:
        return cls(**given)
    except TypeError as exc:
        raise CkptkitError(f"{where or cls.__name__}: {exc}") from exc


def import_options_for(fmt: Format, given: Any) -> Any:
    """What ``fmt.import_to`` takes, from ``given``: an instance of its options dataclass (kept),
    None (its defaults) or a first-contract :class:`ImportOptions` (mapped by name)."""
    cls = fmt.import_options
    if cls is None or isinstance(given, cls):
        return given
    if given is None:
        return cls()
    if isinstance(given, ImportOptions):
        return options_from(cls, given.named(), where=f"importing {description_of(fmt)}")
    raise CkptkitError(f"{description_of(fmt)} imports with {cls.__name__} options, not {type(given).__name__}")


# ---------------------------------------------------------------- options from text (CLI --opt KEY=VALUE)

_TRUE = {"true", "yes", "1", "on"}
_FALSE = {"false", "no", "0", "off"}


def option_types(cls: type) -> dict[str, Any]:
    """Each field of the options dataclass ``cls`` and its type (annotations resolved)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(kind: Any, text: str, where: str) -> Any:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(kind)
        if type(None) in members and text.strip().lower() in ("none", "null"):
            return None
        errors = []
        for member in members:
            if member is type(None):
                continue
            try:
                return _coerce(member, text, where)
            except CkptkitError as exc:
                errors.append(str(exc))
        raise CkptkitError("; ".join(errors))
    if origin is typing.Literal:
        if text in typing.get_args(kind):
            return text
        raise CkptkitError(f"{where} must be one of {', '.join(map(str, typing.get_args(kind)))}, got {text!r}")
    if kind is bool:
        if text.strip().lower() in _TRUE | _FALSE:
            return text.strip().lower() in _TRUE
        raise CkptkitError(f"{where} is true or false, got {text!r}")
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            raise CkptkitError(f"{where} is {'an integer' if kind is int else 'a number'}, got {text!r}") from None
    if kind is str:
        return text
    parse = getattr(kind, "parse", None)  # ParallelConfig: "tp4pp2"
    if callable(parse):
        try:
            return parse(text)
        except (CkptkitError, ValueError) as exc:
            raise CkptkitError(f"{where}: {exc}") from None
    raise CkptkitError(f"{where} ({kind}) cannot be given as text")


def parse_options(cls: type, pairs: Mapping[str, str], *, what: str) -> dict[str, Any]:
    """``KEY=VALUE`` texts -> field values of the options dataclass ``cls``, each parsed by the
    field's type; an unknown key is an error naming ``what`` (e.g. "the hf export") and its fields."""
    types_ = option_types(cls)
    out: dict[str, Any] = {}
    for key, text in pairs.items():
        if key not in types_:
            raise CkptkitError(f"{what} has no option {key!r} (its options: {', '.join(types_) or 'none'})")
        out[key] = _coerce(types_[key], text, f"{what}: {key}")
    return out
