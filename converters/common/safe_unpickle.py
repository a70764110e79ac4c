"""The one place where ckptkit decides what a foreign pickle may build.

Two kinds of pickle reach ckptkit, both only through :mod:`ckptkit_converters`, and both
through one unpickler, :class:`RestrictedUnpickler`, each load with its own allow-list:

* **DCP's ``.metadata``** (plain DCP, and Megatron's torch_dist on top of it), read by
  :func:`load_dcp_metadata` — an allow-list of DCP's classes;
* **``torch.save`` archives** (``.pt``: Megatron's ``common.pt`` and ``model_optim_rng.pt``,
  DeepSpeed's ``*_model_states.pt`` / ``*_optim_states.pt`` / expert files, and every blob of a
  ``.distcp``), read by :func:`restricted_torch_load` / :func:`load_pt` — torch's archive
  reader with our unpickler inside: torch's default ``weights_only`` globals plus a per-format
  table of *inert stand-ins* (:class:`ForeignRecord`, :class:`NamespaceRecord`, or a format's
  own empty classes) for the few foreign globals those files name.

**Call-local, never process-wide.** torch keeps the globals ``weights_only`` trusts beyond its
defaults in one process-wide set (``add_safe_globals``; its ``safe_globals`` context manager
adds to and removes from that same set). ckptkit neither reads nor writes it: a class another
library or the user registered is not trusted here, and a load here never changes what another
thread's ``torch.load(weights_only=True)`` trusts — DCP blobs decode on reader threads while
the user's program may be loading its own files (see :func:`restricted_torch_load`).

Every refusal is an :class:`UnsafeCheckpointError` naming the file and the global, raised
before the global is resolved: nothing of the pickle runs.

**DCP metadata.** ``torch.distributed.checkpoint`` (DCP) writes its checkpoint metadata with
``pickle.dump``, and DCP's own reader loads it with plain ``pickle.load``: a
checkpoint downloaded from somewhere can run any code on the machine that
opens it. Unpickling runs code only through the globals a pickle names
(``GLOBAL`` / ``STACK_GLOBAL``, which ``REDUCE``, ``NEWOBJ`` and ``BUILD`` then
call or instantiate), so :class:`RestrictedUnpickler` resolves globals from an
explicit table and refuses every other one with :class:`UnsafeCheckpointError`
naming ``module.name`` and the file — before anything is called. Persistent
ids are refused too (pickle's default), and so is a ``BUILD`` aimed at a class
or function (it would set attributes on the class for the whole process).

Trusted for DCP metadata (:func:`dcp_allow_list`), and nothing else:

* ``torch.distributed.checkpoint.metadata``: ``Metadata``,
  ``TensorStorageMetadata``, ``BytesStorageMetadata``,
  ``ChunkStorageMetadata``, ``TensorProperties``, ``MetadataIndex``,
  ``StorageMeta`` and the enum ``_MEM_FORMAT_ENCODING`` — plain dataclasses
  and an enum whose constructors and ``__setstate__`` only store fields;
* ``torch.distributed.checkpoint.filesystem._StorageInfo`` (a dataclass);
* ``torch.Size`` (a tuple of ints), and the ``torch`` attributes that are
  ``torch.dtype``, ``torch.layout`` or ``torch.memory_format`` *objects*
  (constants, not callables);
* ``torch.serialization._get_layout``, as torch pickles ``torch.layout``: it is
  replaced here by a lookup that returns a layout by its name and refuses any
  other name;
* ``collections.OrderedDict``;
* ``pathlib`` paths (``StorageMeta.checkpoint_id``), mapped to the *pure* path
  classes, which do no I/O.

No ``builtins`` global is admitted (protocol 3+ pickles of DCP metadata need
none: containers, strings, numbers and bytes are opcodes). Everything the
unpickler returns is validated field by field afterwards
(:mod:`converters.dcp_format`); admitting a class only lets a pickle build an
instance of it. Blobs in ``.distcp`` files are ``torch.save`` archives, read like any
``.pt`` (torch's defaults only, no stand-ins).
"""

from __future__ import annotations

import _compat_pickle
import collections
import io
import os
import pathlib
import pickle
import stat
import struct
import threading
import types
import zipfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from ckptkit.errors import (
    CheckpointNotFoundError,
    CkptkitError,
    CorruptCheckpointError,
    ManifestError,
    UnsafeCheckpointError,
)


_DCP_WHAT = ("a DCP .metadata needs (the file may be malicious or written by an unsupported DCP extension)")

# A resolver returns the object a (module, name) global stands for, or None to refuse it.
Resolver = Callable[[str, str], Any]


class RestrictedUnpickler(pickle._Unpickler):
    """An unpickler whose globals come only from ``allow`` (see the module docstring).

    The pure-Python unpickler, not the C one, because more opcodes need a guard than
    ``find_class`` alone gives (the same ones torch's own ``weights_only`` unpickler guards):

    * ``REDUCE``, ``NEWOBJ``, ``NEWOBJ_EX``, ``OBJ`` and ``INST`` call or instantiate only an
      object this unpickler resolved from its allow-list, never something else that reached the
      stack;
    * ``BUILD`` on an admitted *class* (or function) rather than on an instance would set
      attributes on the class itself — a pickle could redefine ``Metadata.__reduce_ex__`` for
      the rest of the process. It is refused;
    * ``APPEND(S)``, ``SETITEM(S)`` and ``ADDITEMS`` only fill lists, dicts and sets (not call
      ``append`` / ``__setitem__`` / ``add`` of whatever object is there).

    Everything an instance needs (the allow-list, where it reads from) is its own: nothing here
    touches process-wide state, so any number of loads with different tables may run at once
    on different threads, next to anyone else's ``torch.load``. (About 3x slower than the C
    unpickler: ~6 s for 17 MiB of DCP metadata describing 128k chunks; as fast as torch's
    ``weights_only`` unpickler, which is pure Python too.)
    """

    dispatch: ClassVar[dict[int, Callable[..., Any]]] = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: Any, allow: Mapping[tuple[str, str], Any], where: str,
                 resolvers: tuple[Resolver, ...] = (), *, what: str = _DCP_WHAT, **kwargs: Any) -> None:
        super().__init__(file, **kwargs)
        self._allow = allow
        self._resolvers = resolvers
        self._where = where
        self._what = what
        self._callable_ids = {id(v) for v in allow.values()}

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3 and (module, name) in _compat_pickle.NAME_MAPPING:  # what pickle itself maps
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif self.proto < 3 and module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        found = self._allow.get((module, name))
        if found is None:
            for resolve in self._resolvers:
                found = resolve(module, name)
                if found is not None:
                    break
        if found is None:
            raise UnsafeCheckpointError(self._refusal(f"{module}.{name}"))
        return found

    def _refusal(self, name: str) -> str:
        return f"{self._where}: refusing to unpickle global {name}: it is not among the classes {self._what}; nothing was executed"

    def _check_callable(self, obj: Any, how: str) -> None:
        if id(obj) not in self._callable_ids:
            shown = getattr(obj, "__qualname__", type(obj).__name__)
            raise UnsafeCheckpointError(f"{self._where}: refusing to {how} {shown!r}: only the allow-listed globals "
                                        "may be called or instantiated; nothing was executed")

    def _target(self, kind: type, opcode: str, target: Any) -> Any:
        if not isinstance(target, kind):
            raise UnsafeCheckpointError(f"{self._where}: refusing a pickle {opcode} on a {type(target).__name__} "
                                        f"(only a {kind.__name__} may be filled that way)")
        return target

    def _load_reduce_guarded(self) -> None:
        self._check_callable(self.stack[-2], "call")
        pickle._Unpickler.load_reduce(self)

    def _load_newobj_guarded(self) -> None:
        self._check_callable(self.stack[-2], "instantiate")
        pickle._Unpickler.load_newobj(self)

    def _load_newobj_ex_guarded(self) -> None:
        self._check_callable(self.stack[-3], "instantiate")
        pickle._Unpickler.load_newobj_ex(self)

    def _instantiate(self, klass: Any, args: Any) -> None:  # OBJ and INST
        self._check_callable(klass, "instantiate")
        super()._instantiate(klass, args)

    def _load_build_guarded(self) -> None:
        target = self.stack[-2]
        if isinstance(target, type) or callable(target):
            raise UnsafeCheckpointError(
                f"{self._where}: refusing to set attributes on {getattr(target, '__qualname__', target)!r} "
                "(a pickle BUILD aimed at a class or function, not at an instance)"
            )
        pickle._Unpickler.load_build(self)

    def _load_append_guarded(self) -> None:
        value = self.stack.pop()
        self._target(list, "APPEND", self.stack[-1]).append(value)

    def _load_appends_guarded(self) -> None:
        items = self.pop_mark()
        self._target(list, "APPENDS", self.stack[-1]).extend(items)

    def _load_setitem_guarded(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._target(dict, "SETITEM", self.stack[-1])[key] = value

    def _load_setitems_guarded(self) -> None:
        items = self.pop_mark()
        target = self._target(dict, "SETITEMS", self.stack[-1])
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def _load_additems_guarded(self) -> None:
        items = self.pop_mark()
        self._target(set, "ADDITEMS", self.stack[-1]).update(items)

    dispatch[pickle.REDUCE[0]] = _load_reduce_guarded
    dispatch[pickle.NEWOBJ[0]] = _load_newobj_guarded
    dispatch[pickle.NEWOBJ_EX[0]] = _load_newobj_ex_guarded
    dispatch[pickle.BUILD[0]] = _load_build_guarded
    dispatch[pickle.APPEND[0]] = _load_append_guarded
    dispatch[pickle.APPENDS[0]] = _load_appends_guarded
    dispatch[pickle.SETITEM[0]] = _load_setitem_guarded
    dispatch[pickle.SETITEMS[0]] = _load_setitems_guarded
    dispatch[pickle.ADDITEMS[0]] = _load_additems_guarded


_MALFORMED = (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError,
              RuntimeError, RecursionError, MemoryError, OverflowError, struct.error)
"""What the pure-Python unpickler raises for a malformed or truncated pickle."""


def restricted_loads(data: bytes, allow: Mapping[tuple[str, str], Any], where: str,
                     resolvers: tuple[Resolver, ...] = ()) -> Any:
    """Unpickle ``data`` admitting only the globals in ``allow`` (or found by ``resolvers``).

    A refused global raises :class:`UnsafeCheckpointError`; a malformed or
    truncated pickle raises :class:`~ckptkit.errors.ManifestError`. ``where``
    (the file) starts every message.
    """
    try:
        return RestrictedUnpickler(io.BytesIO(data), allow, where, resolvers).load()
    except UnsafeCheckpointError as exc:
        if str(exc).startswith(where):
            raise
        raise UnsafeCheckpointError(f"{where}: {exc}") from None
    except CkptkitError:
        raise
    except _MALFORMED as exc:
        raise ManifestError(f"{where}: not a readable pickle of DCP metadata ({type(exc).__name__}: {exc})") from None


# ---------------------------------------------------------------- the DCP allow-list


def _torch_constant(module: str, name: str) -> Any:
    """``torch.<name>`` when it is a dtype, layout or memory-format object (constants, never callables)."""
    if module != "torch" or name.startswith("_"):
        return None
    import torch

    value = getattr(torch, name, None)
    if type(value) in (torch.dtype, torch.layout, torch.memory_format):
        return value
    return None


def _layout_by_name(name: object) -> Any:
    """Stands in for ``torch.serialization._get_layout``: a ``torch.layout`` by its name, nothing else."""
    import torch

    if isinstance(name, str) and name.startswith("torch."):
        value = getattr(torch, name[len("torch."):], None)
        if type(value) is torch.layout:
            return value
    raise UnsafeCheckpointError(f"DCP metadata names an unknown torch layout {name!r}")


def _dcp_allow_list() -> dict[tuple[str, str], Any]:
    import torch
    from torch.distributed.checkpoint import filesystem, metadata

    meta = "torch.distributed.checkpoint.metadata"
    allow: dict[tuple[str, str], Any] = {
        (meta, name): getattr(metadata, name)
        for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                     "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    }
    allow[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allow[("torch", "Size")] = torch.Size
    allow[("torch.serialization", "_get_layout")] = _layout_by_name
    allow[("collections", "OrderedDict")] = collections.OrderedDict
    for mod in ("pathlib", "pathlib._local"):  # pathlib moved its classes in Python 3.13
        for name, pure in (("PosixPath", pathlib.PurePosixPath), ("PurePosixPath", pathlib.PurePosixPath),
                           ("WindowsPath", pathlib.PureWindowsPath), ("PureWindowsPath", pathlib.PureWindowsPath)):
            allow[(mod, name)] = pure
    return allow


_DCP_ALLOW: dict[tuple[str, str], Any] | None = None


def dcp_allow_list() -> Mapping[tuple[str, str], Any]:
    """The globals a DCP ``.metadata`` may name (built on first use: it imports torch)."""
    global _DCP_ALLOW
    if _DCP_ALLOW is None:
        _DCP_ALLOW = _dcp_allow_list()
    return _DCP_ALLOW


def load_dcp_metadata(data: bytes, where: str, extra: Mapping[tuple[str, str], Any] | None = None) -> Any:
    """Unpickle a DCP ``.metadata`` through the allow-list (validate the result before use).

    ``extra`` admits a few more globals for a DCP writer that pickles more than
    plain DCP does (Megatron's torch_dist: :mod:`converters.megatron_format`).
    """
    allow = dcp_allow_list() if not extra else {**dcp_allow_list(), **extra}
    return restricted_loads(data, allow, where, (_torch_constant,))


# ---------------------------------------------------------------- torch.save files (.pt)


class ForeignRecord:
    """Inert stand-in for a foreign class or function while unpickling a ``.pt`` file.

    Built with any arguments (kept in ``args``) and given any state (kept in
    ``state``, or merged into ``__dict__`` when it is a dict with string keys):
    it runs no foreign code and is only read as data afterwards.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict) and all(isinstance(k, str) for k in state):
            self.__dict__.update(state)
        else:
            self.state = state


class NamespaceRecord:
    """Inert stand-in for ``argparse.Namespace`` / ``types.SimpleNamespace``: holds the namespace's
    attributes (``rec.num_layers``; :func:`namespace_fields` for all of them) and nothing else.

    A pickled Namespace is ``NEWOBJ`` of the class and ``BUILD`` with its ``__dict__``; here the
    class is this one, which has no ``__init__`` logic, no properties and no methods an attribute
    could shadow, and keeps only string-keyed state (anything else is dropped, not stored).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__.update({k: v for k, v in kwargs.items() if isinstance(k, str)})

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) form
            state = state[0]
        if isinstance(state, dict):
            self.__dict__.update({k: v for k, v in state.items() if isinstance(k, str)})

    def __repr__(self) -> str:
        return f"NamespaceRecord({', '.join(sorted(vars(self)))})"


def namespace_fields(obj: Any) -> dict[str, Any]:
    """The attributes of a :class:`NamespaceRecord` (or any record), {} for anything else."""
    fields = getattr(obj, "__dict__", None) if isinstance(obj, (NamespaceRecord, ForeignRecord)) else None
    return dict(fields) if isinstance(fields, dict) else {}


StandIns = Sequence[tuple[Any, str]]
"""``(stand-in, "module.name")`` pairs, as ``torch.serialization.add_safe_globals`` takes them."""


def _torch_defaults() -> dict[tuple[str, str], Any]:
    """What ``torch.load(weights_only=True)`` admits by default — torch's own table, never the globals
    anyone registered with ``torch.serialization.add_safe_globals`` (those live in another set)."""
    from torch._weights_only_unpickler import _get_allowed_globals

    return {tuple(full.rsplit(".", 1)): obj for full, obj in _get_allowed_globals().items()}  # type: ignore[misc]


_TABLES: dict[tuple[tuple[int, str], ...], dict[tuple[str, str], Any]] = {}
_TABLES_LOCK = threading.Lock()


def _pt_table(stand_ins: StandIns) -> dict[tuple[str, str], Any]:
    """torch's default ``weights_only`` globals plus ``stand_ins``, built once per table (never mutated)."""
    key = tuple((id(obj), name) for obj, name in stand_ins)
    with _TABLES_LOCK:
        table = _TABLES.get(key)
        if table is None:
            table = _torch_defaults()
            for obj, name in stand_ins:
                table[tuple(name.rsplit(".", 1))] = obj  # type: ignore[index]
            _TABLES[key] = table
        return table


def _pickle_module(table: Mapping[tuple[str, str], Any], where: str, what: str) -> Any:
    """A ``pickle_module`` for ``torch.load`` whose ``Unpickler`` is a :class:`RestrictedUnpickler` over
    ``table``: built for this one call, so the allow-list travels with the call and nothing else."""

    class _Unpickler(RestrictedUnpickler):
        def __init__(self, file: Any, **kwargs: Any) -> None:
            super().__init__(file, table, where, what=what, **kwargs)

    def load(file: Any, **kwargs: Any) -> Any:
        return _Unpickler(file, **kwargs).load()

    return types.SimpleNamespace(__name__=__name__, Unpickler=_Unpickler, load=load,
                                 UnpicklingError=pickle.UnpicklingError)


_ZIP_MAGIC = b"PK\x03\x04"


def _open_regular(path: str | os.PathLike[str], where: str) -> Any:
    """``path`` opened for reading if it is a regular file: a FIFO, device or socket in its place fails at
    once (opened non-blocking, then ``fstat``), rather than hanging or streaming forever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{where} is not a regular file (a FIFO, device, socket or directory)")
    return os.fdopen(fd, "rb")


def _check_archive(f: Any, where: str) -> None:
    """Only a ``torch.save`` zip archive (torch >= 1.6, what DeepSpeed, Megatron and DCP write) goes on
    to ``torch.load``: torch would hand a TorchScript archive to ``torch.jit.load`` and read a legacy
    file (a tar that is *extracted*, or the pre-1.6 stream format) by other code paths, none of which
    :func:`restricted_torch_load` means to open. ``f`` is a path or a seekable file (rewound after)."""
    opened = _open_regular(f, where) if isinstance(f, (str, os.PathLike)) else f
    start = opened.tell()
    try:
        if opened.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
            raise CorruptCheckpointError(
                f"{where}: not a readable torch.save archive (no zip signature at its start): damaged, or a legacy "
                "(torch < 1.6) tar or stream-format file, which is not opened (re-save it with a recent torch)")
        opened.seek(start)
        try:
            names = zipfile.ZipFile(opened).namelist()
        except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, OSError) as exc:
            raise CorruptCheckpointError(f"{where}: not a readable torch.save archive ({type(exc).__name__}: {exc})"
                                         ) from None
        if any(n.rsplit("/", 1)[-1] == "constants.pkl" for n in names):
            raise UnsafeCheckpointError(f"{where}: a TorchScript archive (it holds constants.pkl), not a torch.save "
                                        "file; TorchScript is never loaded")
    finally:
        if opened is f:
            opened.seek(start)
        else:
            opened.close()


def restricted_torch_load(f: Any, stand_ins: StandIns = (), *, where: str | None = None,
                          what: str = "torch.load(weights_only=True) admits by default (tensors and plain containers)",
                          mmap: bool = False) -> Any:
    """``torch.load`` of one ``torch.save`` archive whose pickle may name exactly torch's default
    ``weights_only`` globals and ``stand_ins``, and nothing else.

    The allow-list travels with the call: ``torch.load(pickle_module=...)`` gets a module built
    for this call whose ``Unpickler`` is a :class:`RestrictedUnpickler` over that table (torch then
    runs its own archive reader, storages and tensor rebuilding around it; ``weights_only=False``
    only because torch refuses an explicit ``pickle_module`` otherwise — the restriction is ours
    and stricter). Why not ``weights_only=True``: torch keeps the globals it trusts beyond its
    defaults in **one process-wide set** (``add_safe_globals``, ``clear_safe_globals``, and the
    ``safe_globals`` context manager, which adds to that set and removes on exit — process-global
    too). Using it for our stand-ins means either trusting whatever else the process registered
    (importing ``megatron.core`` registers Megatron's real classes under the names our stand-ins
    take; a user's script registers its own) or replacing the set for the duration of the load,
    which makes another thread's ``torch.load(weights_only=True)`` — ours or the user's — lose its
    registrations in that window. Here nothing process-wide is read or written.

    ``where`` names the file in errors (default: ``f``). Refusals are
    :class:`UnsafeCheckpointError`, raised before the refused global is resolved.
    """
    import torch

    where = where if where is not None else os.fspath(f) if isinstance(f, (str, os.PathLike)) else "<buffer>"
    _check_archive(f, where)
    try:
        return torch.load(f, map_location="cpu", pickle_module=_pickle_module(_pt_table(stand_ins), where, what),
                          weights_only=False, mmap=mmap)
    except RuntimeError as exc:
        if "explicit pickle_module" in str(exc):  # TORCH_FORCE_WEIGHTS_ONLY_LOAD=1 in the environment
            raise UnsafeCheckpointError(
                f"{where}: not opened: TORCH_FORCE_WEIGHTS_ONLY_LOAD is set, and it makes torch.load refuse "
                "ckptkit's own allow-list unpickler (stricter than weights_only); unset it for the import") from None
        raise


def load_pt(path: str, stand_ins: StandIns, *, what: str, mmap: bool = False) -> Any:
    """One ``torch.save`` file through :func:`restricted_torch_load` with exactly ``stand_ins``.

    What may be built: what ``weights_only`` itself allows by default (tensors and storages,
    containers, numbers, strings, ``torch.Size``, ``torch`` dtypes, ``OrderedDict``,
    ``_codecs.encode``), and for each ``(stand_in, "module.name")`` pair the stand-in in place of
    that global. A file naming any other global is refused before the global is resolved,
    reported as :class:`UnsafeCheckpointError` with the file and the global (``what`` names the
    format in the message). ``mmap``: tensors stay in the file until read. A missing file is
    :class:`CheckpointNotFoundError`, an unreadable one :class:`ManifestError`.
    """
    try:
        return restricted_torch_load(path, stand_ins, where=path, mmap=mmap,
                                     what=f"ckptkit trusts in a {what} .pt (torch's weights_only defaults and inert stand-ins)")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: missing") from None
    except CkptkitError:
        raise
    except OSError as exc:
        raise ManifestError(f"{path}: cannot be read ({type(exc).__name__}: {exc})") from None
    except _MALFORMED as exc:
        raise ManifestError(f"{path}: not a readable torch.save file ({type(exc).__name__}: {exc})") from None
