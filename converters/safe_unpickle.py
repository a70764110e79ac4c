"""The one place where ckptkit decides what a foreign pickle may build.

Two kinds of pickle reach ckptkit, both only through :mod:`ckptkit_converters`:

* **DCP's ``.metadata``** (plain DCP, and Megatron's torch_dist on top of it), read by
  :class:`RestrictedUnpickler` / :func:`load_dcp_metadata` — an allow-list of classes;
* **``torch.save`` files** (``.pt``: Megatron's ``common.pt`` and ``model_optim_rng.pt``,
  DeepSpeed's ``*_model_states.pt`` / ``*_optim_states.pt``), read by :func:`load_pt` —
  ``torch.load(weights_only=True)`` plus a per-format table of *inert stand-ins*
  (:class:`ForeignRecord`, :class:`NamespaceRecord`, or a format's own empty classes)
  for the few foreign globals those files name. Nothing else torch may have been told to
  trust in this process counts (see :func:`load_pt`).

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
instance of it. Tensor data in ``.distcp`` files never goes through this
unpickler: it is read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

from ckptkit.errors import CheckpointNotFoundError, CkptkitError, ManifestError, UnsafeCheckpointError


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


class _TrustedSet:
    """Who holds torch's process-wide ``weights_only`` allow-list, and set to what.

    Loads that want the same stand-ins share it (DCP chunks decode concurrently on reader
    threads); a load that wants another table waits until the set is free, swaps it, and the
    last load out restores what the process had registered before.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._table: tuple[tuple[int, str], ...] | None = None
        self._users = 0
        self._saved: list[Any] = []

    @contextmanager
    def exactly(self, stand_ins: StandIns) -> Iterator[None]:
        import torch

        key = tuple((id(obj), name) for obj, name in stand_ins)
        with self._cond:
            while self._users and self._table != key:
                self._cond.wait()
            if not self._users:
                self._saved = torch.serialization.get_safe_globals()
                torch.serialization.clear_safe_globals()
                torch.serialization.add_safe_globals(list(stand_ins))
                self._table = key
            self._users += 1
        try:
            yield
        finally:
            with self._cond:
                self._users -= 1
                if not self._users:
                    torch.serialization.clear_safe_globals()
                    torch.serialization.add_safe_globals(self._saved)
                    self._table, self._saved = None, []
                    self._cond.notify_all()


_TRUSTED = _TrustedSet()


def weights_only_load(f: Any, stand_ins: StandIns = (), *, mmap: bool = False) -> Any:
    """``torch.load(f, weights_only=True)`` with exactly ``stand_ins`` beside torch's own allow-list.

    torch keeps user-allowed globals in one process-wide set, which anything in the process may
    have added to: importing ``megatron.core`` registers Megatron's *real* classes under the names
    the Megatron stand-ins take (``megatron/core/safe_globals.py``), a training script may register
    its own. Which of two entries for one name wins would depend on set order, and a class someone
    else trusted would be trusted here too. So for the load the set is *replaced* by
    ``stand_ins`` (none for a DCP blob) and restored afterwards. (torch's ``safe_globals`` context
    manager instead *adds* to the set, and on exit removes entries that another thread, or the
    process, still needs.) Errors are torch's own; :func:`load_pt` and
    :func:`converters.dcp_format.load_blob` turn them into ckptkit's.
    """
    import torch

    with _TRUSTED.exactly(stand_ins):
        return torch.load(f, map_location="cpu", weights_only=True, mmap=mmap)


def load_pt(path: str, stand_ins: StandIns, *, what: str, mmap: bool = False) -> Any:
    """One ``torch.save`` file through ``torch.load(weights_only=True)`` and exactly ``stand_ins``.

    What may be built: what ``weights_only`` itself allows (tensors and storages, containers,
    numbers, strings, ``torch.Size``, ``torch`` dtypes, ``OrderedDict``, ``_codecs.encode``),
    and for each ``(stand_in, "module.name")`` pair the stand-in in place of that global. A
    file naming any other global is refused by torch's restricted unpickler before the global
    is resolved, reported as :class:`UnsafeCheckpointError` with the file and the global
    (``what`` names the format's table in the message). ``mmap``: tensors stay in the file
    until read. A missing file is :class:`CheckpointNotFoundError`, an unreadable one
    :class:`ManifestError`.
    """
    try:
        return weights_only_load(path, stand_ins, mmap=mmap)
    except pickle.UnpicklingError as exc:
        lines = [ln for ln in str(exc).splitlines() if "GLOBAL" in ln or "Unsupported" in ln] or str(exc).splitlines()[:1]
        raise UnsafeCheckpointError(f"{path}: refused by torch.load(weights_only=True) with ckptkit's {what} "
                                    f"stand-ins (nothing was executed): {' '.join(lines)[:400]}") from None
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: missing") from None
    except CkptkitError:
        raise
    except (RuntimeError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError) as exc:
        raise ManifestError(f"{path}: not a readable torch.save file ({type(exc).__name__}: {exc})") from None
