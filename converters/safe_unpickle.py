"""An allow-list unpickler for the one pickle a DCP checkpoint has: its ``.metadata``.

``torch.distributed.checkpoint`` (DCP) writes its checkpoint metadata with
``pickle.dump``, and DCP's own reader loads it with plain ``pickle.load``: a
checkpoint downloaded from somewhere can run any code on the machine that
opens it. Unpickling runs code only through the globals a pickle names
(``GLOBAL`` / ``STACK_GLOBAL``, which ``REDUCE``, ``NEWOBJ`` and ``BUILD`` then
call or instantiate), so :class:`RestrictedUnpickler` resolves globals from an
explicit table and refuses every other one with :class:`UnsafeCheckpointError`
naming ``module.name`` and the file — before anything is called. Persistent
ids are refused too (pickle's default), and so is a ``BUILD`` aimed at a class
or function (it would set attributes on the class for the whole process).

Trusted for DCP metadata (:data:`DCP_METADATA`), and nothing else:

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
instance of it. Tensor data in ``.distcp`` files never goes through this
module: it is read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from ckptkit.errors import CkptkitError, UnsafeCheckpointError, ManifestError


# A resolver returns the object a (module, name) global stands for, or None to refuse it.
Resolver = Callable[[str, str], Any]


class RestrictedUnpickler(pickle._Unpickler):
    """An unpickler whose globals come only from ``allow`` (see the module docstring).

    The pure-Python unpickler, not the C one, because one more opcode needs a
    guard: ``BUILD`` on an admitted *class* (or function) rather than on an
    instance would set attributes on the class itself — a pickle could
    redefine ``Metadata.__reduce_ex__`` for the rest of the process. It is
    refused. (About 3x slower than the C unpickler: ~6 s for 17 MiB of
    metadata describing 128k chunks.)
    """

    dispatch: ClassVar[dict[int, Callable[..., Any]]] = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, allow: Mapping[tuple[str, str], Any], where: str,
                 resolvers: tuple[Resolver, ...] = ()) -> None:
        super().__init__(io.BytesIO(data))
        self._allow = allow
        self._resolvers = resolvers
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        found = self._allow.get((module, name))
        if found is None:
            for resolve in self._resolvers:
                found = resolve(module, name)
                if found is not None:
                    break
        if found is None:
            raise UnsafeCheckpointError(
                f"{self._where}: refusing to unpickle global {module}.{name}: it is not among the classes a "
                "DCP .metadata needs (the file may be malicious or written by an unsupported DCP extension); "
                "nothing was executed"
            )
        return found

    def _load_build_guarded(self) -> None:
        target = self.stack[-2]
        if isinstance(target, type) or callable(target):
            raise UnsafeCheckpointError(
                f"{self._where}: refusing to set attributes on {getattr(target, '__qualname__', target)!r} "
                "(a pickle BUILD aimed at a class or function, not at an instance)"
            )
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build_guarded


def restricted_loads(data: bytes, allow: Mapping[tuple[str, str], Any], where: str,
                     resolvers: tuple[Resolver, ...] = ()) -> Any:
    """Unpickle ``data`` admitting only the globals in ``allow`` (or found by ``resolvers``).

    A refused global raises :class:`UnsafeCheckpointError`; a malformed or
    truncated pickle raises :class:`~ckptkit.errors.ManifestError`. ``where``
    (the file) starts every message.
    """
    try:
        return RestrictedUnpickler(data, allow, where, resolvers).load()
    except UnsafeCheckpointError as exc:
        if str(exc).startswith(where):
            raise
        raise UnsafeCheckpointError(f"{where}: {exc}") from None
    except CkptkitError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError,
            RuntimeError, RecursionError, MemoryError) as exc:
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
