"""A Hugging Face folder read as untrusted input: safetensors headers, the shard index, the hub cache.

An HF folder is often downloaded from somewhere else, so every byte of it is checked before a
tensor is trusted:

* **safetensors headers** (:func:`parse_header`): the rules of the format exactly as the
  ``safetensors`` package enforces them (its Rust ``SafeTensors::read_metadata`` and
  ``Metadata::validate``): a header length of at most 100,000,000 bytes that ends inside the file,
  a UTF-8 JSON object, every integer (shape entry, data offset) a plain non-negative JSON integer
  that fits 64 bits (not ``2.5``, ``true``, ``"4"`` or ``-0``), a known dtype, ``end - begin`` equal
  to ``prod(shape) * itemsize`` (products checked for 64-bit overflow as the package does), and,
  sorted by offsets, the tensors tile the data exactly: each begins where the previous one ends
  (no overlap: two weights can never share bytes; no gap) and the last ends at the end of the
  file. Where the file is local, the ``safetensors`` package validates it too, through a
  descriptor opened on the very file read here (:func:`check_with_package`), and its view of the
  header (names, dtypes, shapes, order) must equal ours: two parsers that must agree, so neither
  can silently read a file the other refuses. Remote files (``s3://``) get the strict parser alone.
* **the index** (:func:`open_files`): ``model.safetensors.index.json``'s ``weight_map`` must name
  plain ``.safetensors`` files of the folder, and agree with what the files hold (every tensor
  listed is in the file it is listed in, every tensor of a listed file is listed there, once).
* **the hub cache** (:func:`open_source`): ``~/.cache/huggingface/hub/models--ORG--NAME/snapshots/REV``
  is a folder of symlinks into ``../../blobs/``. Such a snapshot is read through its repo folder,
  and a link is followed only when it resolves into that repo's ``blobs/`` or stays inside the
  snapshot itself; any other folder keeps the local store's rule (nothing outside the folder).

No pickle, no mmap of our own: tensors are read with ranged reads through a byte store.
"""

from __future__ import annotations

import json
import math
import operator
import os
import stat
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from ckptkit.errors import (
    CkptkitError,
    CorruptCheckpointError,
    ManifestError,
    StorageError,
    UnsafePathError,
)
from ckptkit.layout.strict_json import load_json
from ckptkit.storage.base import ByteStore
from ckptkit.storage.local import LocalStore
from ckptkit.storage.url import open_store
from ckptkit_converters.common.safetensors_out import SAFETENSORS_DTYPES

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"  # a model saved in one file, without an index
CONFIG_NAME = "config.json"
MAX_HEADER = 100_000_000  # safetensors' MAX_HEADER_SIZE: a longer header is refused by the package too
MAX_INDEX_BYTES = 64 << 20  # a 100k-tensor index is a few MiB
_USIZE = 2**64 - 1  # the package reads shapes and offsets as 64-bit usize
_MAX_DIM = 2**63 - 1  # torch's largest dimension (a zero-size tensor may declare more; refused)
DTYPES = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}  # what the export writes, the import reads
ITEMSIZE = {code: torch.empty((), dtype=d).element_size() for code, d in DTYPES.items()}
# dtypes the package knows that ckptkit does not import (named in the refusal, never misread)
_OTHER_DTYPES = ("F4", "F6_E2M3", "F6_E3M2", "F8_E8M0")
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: dtype (torch and the file's code), shape, absolute byte range."""

    dtype: torch.dtype
    code: str
    shape: tuple[int, ...]
    begin: int
    end: int


def shown(value: Any, width: int = 80) -> str:
    """A short one-line rendering of a hostile value (names, numbers) for an error message."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value).encode("utf-8", "backslashreplace").decode()
    return text if len(text) <= width else text[: width - 3] + "..."


# ---------------------------------------------------------------- the header


def parse_header(raw: bytes, size: int, where: str) -> tuple[dict[str, Entry], dict[str, str] | None]:
    """The tensors and ``__metadata__`` of a safetensors header (``raw``: bytes ``[8, 8 + len(raw))`` of a
    file of ``size`` bytes), or CorruptCheckpointError naming ``where``, the tensor(s) and the rule broken.

    Accepts exactly what the ``safetensors`` package accepts, except (refused, never misread) dtypes
    ckptkit does not import, dimensions torch cannot hold, and what every checkpoint document is refused
    for (nesting past 100 levels, a key given twice).
    """
    doc = _header_json(raw, where)
    meta = doc.pop("__metadata__", None)
    if meta is not None and (not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())):
        raise CorruptCheckpointError(f"{where}: __metadata__ must be an object of strings, got {shown(meta)}")
    base = 8 + len(raw)
    found = [(name, *_entry(name, e, where)) for name, e in doc.items()]
    found.sort(key=lambda x: (x[3], x[4]))  # by data_offsets, as the package sorts them
    out: dict[str, Entry] = {}
    pos, prev = 0, None
    for name, code, shape, begin, end in found:
        if begin != pos or end < begin:
            raise CorruptCheckpointError(f"{where}: {_offset_problem(name, begin, end, pos, prev)} (safetensors "
                                         f"requires the tensors' data_offsets to tile the data exactly, in order)")
        need = _nbytes(name, code, shape, where)
        if end - begin != need:
            raise CorruptCheckpointError(f"{where}: tensor {shown(name)} ({code} {list(shape)}) needs {need} bytes, "
                                         f"its data offsets [{begin}, {end}) hold {end - begin}")
        if base + end > size:
            raise CorruptCheckpointError(f"{where}: tensor {shown(name)} has data offsets [{begin}, {end}) past the "
                                         f"end of the file ({size - base} bytes of data)")
        out[name] = Entry(DTYPES[code], code, shape, base + begin, base + end)
        pos, prev = end, (name, begin, end)
    if base + pos != size:
        last = f"the last tensor, {shown(prev[0])}, ends at data offset {pos}" if prev else "there are no tensors"
        raise CorruptCheckpointError(f"{where}: data bytes [{pos}, {size - base}) belong to no tensor ({last}; the "
                                     f"file must end where the tensors do)")
    return out, meta


def _header_json(raw: bytes, where: str) -> dict:
    """The header as a JSON object under the limits every checkpoint document gets (depth, duplicate keys,
    NaN, lone surrogates). ``-0`` is read as the float it is to the package's JSON parser (serde_json),
    so it is refused wherever an integer is required, as the package refuses it."""
    try:
        doc = load_json(raw, f"{where}: the header")
    except ManifestError as exc:
        raise CorruptCheckpointError(str(exc)) from None
    if b"-0" in raw:  # rare: only then the integers are looked at again
        doc = json.loads(raw.decode("utf-8"), parse_int=lambda s: -0.0 if s == "-0" else int(s))
    return doc


def _entry(name: str, e: Any, where: str) -> tuple[str, tuple[int, ...], int, int]:
    what = f"{where}: tensor {shown(name)}"
    if not isinstance(e, dict):
        raise CorruptCheckpointError(f"{what}: its header entry must be an object, got {shown(e)}")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in e:
            raise CorruptCheckpointError(f"{what}: its header entry has no {field!r}")
    code = e["dtype"]
    if not isinstance(code, str) or code not in DTYPES:
        known = "a dtype ckptkit does not import" if code in _OTHER_DTYPES else "not a safetensors dtype"
        raise CorruptCheckpointError(f"{what}: dtype {shown(code)} is {known} (known: {', '.join(DTYPES)})")
    shape, offsets = e["shape"], e["data_offsets"]
    if not isinstance(shape, list) or not all(_usize(s) for s in shape):
        raise CorruptCheckpointError(f"{what}: shape must be a list of non-negative integers, got {shown(shape)}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_usize(x) for x in offsets):
        raise CorruptCheckpointError(f"{what}: data_offsets must be two non-negative integers, got {shown(offsets)}")
    if any(s > _MAX_DIM for s in shape):
        raise CorruptCheckpointError(f"{what}: a dimension of {shown(max(shape))} is beyond what torch can hold")
    return code, tuple(shape), offsets[0], offsets[1]


def _usize(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _USIZE


def _nbytes(name: str, code: str, shape: tuple[int, ...], where: str) -> int:
    """prod(shape) * itemsize, refused where the package's 64-bit fold overflows (even if a later 0 would
    make it empty)."""
    # every step of the package's fold, lazily: a hostile shape stops at its first overflow
    if any(n > _USIZE for n in accumulate(shape, operator.mul)):
        raise CorruptCheckpointError(f"{where}: tensor {shown(name)}: the element count of shape "
                                     f"{shown(list(shape))} overflows 64 bits")
    n = math.prod(shape)
    if n * ITEMSIZE[code] * 8 > _USIZE:  # the package counts bits
        raise CorruptCheckpointError(f"{where}: tensor {shown(name)}: its size in bits overflows 64 bits")
    return n * ITEMSIZE[code]


def _offset_problem(name: str, begin: int, end: int, pos: int, prev: tuple[str, int, int] | None) -> str:
    this = f"tensor {shown(name)} has data offsets [{begin}, {end})"
    if end < begin:
        return f"{this}, which run backwards"
    if begin < pos:
        assert prev is not None
        return f"{this}, overlapping tensor {shown(prev[0])}'s [{prev[1]}, {prev[2]})"
    after = f"tensor {shown(prev[0])} ends at {pos}" if prev else "the data begins at 0"
    return f"{this}, but {after}: bytes [{pos}, {begin}) belong to no tensor"


# ---------------------------------------------------------------- one file


class SafetensorsFile:
    """One ``.safetensors`` file read lazily through a byte store: the header now (checked, and checked
    again by the ``safetensors`` package where the file is local), tensors on demand."""

    def __init__(self, store: ByteStore, name: str) -> None:
        self.store, self.name = store, name
        self.where = where = f"{store.url}/{name}"
        size = store.checked_size(name)
        if size < 8:
            raise CorruptCheckpointError(f"{where}: {size} bytes, too short for a safetensors file")
        head = bytearray(8)
        store.read_into(name, 0, memoryview(head))
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER or 8 + n > size:
            raise CorruptCheckpointError(f"{where}: header of {n} bytes in a file of {size} (at most "
                                         f"{MAX_HEADER}, and inside the file)")
        buf = bytearray(n)
        store.read_into(name, 8, memoryview(buf))
        self.entries, self.metadata = parse_header(bytes(buf), size, where)
        path = local_path(store, name)
        if path is not None:
            check_with_package(path, size, self.entries, self.metadata, where)

    def read(self, key: str) -> torch.Tensor:
        e = self.entries[key]
        buf = bytearray(e.end - e.begin)
        if buf:
            self.store.read_into(self.name, e.begin, memoryview(buf))
            return torch.frombuffer(buf, dtype=e.dtype).reshape(e.shape)
        return torch.empty(e.shape, dtype=e.dtype)


def check_with_package(path: str, size: int, entries: dict[str, Entry], meta: dict[str, str] | None,
                       where: str) -> None:
    """The ``safetensors`` package's own validation of the local file at ``path`` (the real path the store
    resolved, inside the folder), and agreement between its view of the header and ours.

    The package opens ``/proc/self/fd/N`` of a descriptor opened here without following links and
    checked to be a regular file of the size read: it validates the very file the store reads.
    Without the package installed (it is an optional dependency), the strict parser stands alone, as
    for remote files: the tests hold the two to the same verdicts.
    """
    try:
        from safetensors import safe_open
    except ImportError:
        return
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        raise StorageError(f"{where}: cannot open it for validation ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise CorruptCheckpointError(f"{where}: changed while being opened (no longer the regular file of "
                                         f"{size} bytes read)")
        proc = f"/proc/self/fd/{fd}"
        try:
            with safe_open(proc if os.path.exists(proc) else path, framework="pt") as f:
                theirs = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
                order = [k for k in f.offset_keys() if entries.get(k) and entries[k].end > entries[k].begin]
                their_meta = f.metadata()
        except Exception as exc:  # noqa: BLE001 - a foreign parser's every refusal (SafetensorError, OSError ...)
            msg = " ".join(str(exc).split())[:300]
            raise CorruptCheckpointError(f"{where}: the safetensors package refuses it: {msg}") from None
    finally:
        os.close(fd)
    ours = {k: (e.code, e.shape) for k, e in entries.items()}
    mine = sorted((k for k, e in entries.items() if e.end > e.begin), key=lambda k: entries[k].begin)
    if theirs != ours or order != mine or (their_meta or None) != (meta or None):
        diff = sorted(set(theirs.items()) ^ set(ours.items()))[:2]
        what = shown(diff, 160) if diff else "tensor order or metadata"
        raise CorruptCheckpointError(f"{where}: the safetensors package reads this header differently from "
                                     f"ckptkit ({what}): refusing it")


# ---------------------------------------------------------------- where the files are


def local_path(store: ByteStore, key: str) -> str | None:
    """The real path the store reads ``key`` from (already checked to lie inside it), None if not local."""
    if isinstance(store, SnapshotStore):
        return store.real_path(key)
    if isinstance(store, LocalStore):
        return os.path.realpath(os.path.join(store.root, *key.split("/")))
    return None


def hub_snapshot(path: str) -> tuple[str, str] | None:
    """``(repo folder, revision)`` if ``path`` is a Hugging Face hub cache snapshot
    (``.../models--ORG--NAME/snapshots/REV``, beside the repo's ``blobs/``), else None."""
    real = os.path.realpath(path)
    snapshots, rev = os.path.split(real)
    repo, middle = os.path.split(snapshots)
    if middle != "snapshots" or not os.path.basename(repo).startswith("models--") or not rev:
        return None
    return (repo, rev) if os.path.isdir(os.path.join(repo, "blobs")) and os.path.isdir(real) else None


class SnapshotStore(ByteStore):
    """A Hugging Face hub cache snapshot, read-only, through a local store rooted at its repo folder.

    The cache keeps each file once, in ``models--ORG--NAME/blobs/<hash>``, and a snapshot is a folder
    of symlinks to them (``snapshots/REV/model.safetensors -> ../../blobs/<hash>``): the layout the
    cache itself writes. A link is followed when it resolves into this repo's ``blobs/`` or inside the
    snapshot; anywhere else (another repo, ``refs/``, outside the cache) is refused before it is opened.
    """

    def __init__(self, repo: str, rev: str) -> None:
        self.repo = LocalStore(repo)
        self.rev = rev
        self.url = os.path.join(repo, "snapshots", rev)
        real_repo = os.path.realpath(repo)
        self._inside = (os.path.join(real_repo, "blobs") + os.sep, os.path.join(real_repo, "snapshots", rev) + os.sep)

    def _key(self, key: str) -> str:
        parts = key.split("/")
        if key.startswith("/") or ".." in parts or "" in parts:
            raise UnsafePathError(f"key {key!r} is not a plain relative name inside the snapshot {self.url}")
        self.real_path(key)
        return f"snapshots/{self.rev}/{key}"

    def real_path(self, key: str) -> str:
        path = os.path.join(self.url, *key.split("/"))
        real = os.path.realpath(path)
        if not real.startswith(self._inside):
            raise UnsafePathError(f"{path} points to {real}: a Hugging Face cache snapshot's files may link only into "
                                  f"its own repo's blobs/ ({self._inside[0]}): refusing to read it")
        return real

    def child(self, name: str) -> ByteStore:
        raise UnsafePathError(f"{self.url}: a Hugging Face cache snapshot is read, never written")

    def write_object(self, key: str, chunks: Any) -> int:
        raise UnsafePathError(f"{self.url}: a Hugging Face cache snapshot is read, never written")

    def put_bytes(self, key: str, data: bytes) -> None:
        self.write_object(key, ())

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return bool(self.write_object(key, ()))

    def delete(self, key: str) -> None:
        self.write_object(key, ())

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        self.repo.read_into(self._key(key), offset, out)

    def read_into_vectored(self, key: str, offset: int, buffers: list[memoryview]) -> None:
        self.repo.read_into_vectored(self._key(key), offset, buffers)

    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        return self.repo.read_bytes(self._key(key), limit)

    def size(self, key: str) -> int | None:
        return self.repo.size(self._key(key))

    def checked_size(self, key: str) -> int:
        return self.repo.checked_size(self._key(key))

    def list_keys(self, prefix: str = "") -> list[str]:
        base = f"snapshots/{self.rev}/"
        return [k[len(base):] for k in self.repo.list_keys(base + prefix if prefix else base.rstrip("/"))]


def open_source(source: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> ByteStore:
    """The store an HF folder is read from: a hub cache snapshot through its repo folder, else the plain store."""
    store = open_store(source, storage_options)
    if isinstance(store, LocalStore):
        snap = hub_snapshot(store.root)
        if snap is not None:
            return SnapshotStore(*snap)
    return store


def is_hf_folder(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> bool:
    """True if ``url`` is a Hugging Face model folder: ``config.json`` beside ``model.safetensors`` or
    ``model.safetensors.index.json`` (local, ``s3://``, or a hub cache snapshot).

    What a format's detection asks of every checkpoint it is shown, so it only asks whether those
    names exist (a request or two, ``config.json`` first: most folders stop there), through the
    store the import reads with; nothing is parsed. A store's refusal (a link out of the folder)
    is raised, as the import would raise it, rather than read as "not HF".
    """
    store = open_source(url, storage_options)
    return store.exists(CONFIG_NAME) and (store.exists(INDEX_NAME) or store.exists(SINGLE_NAME))


def read_local_json(path: str | os.PathLike[str], limit: int = 16 << 20) -> dict:
    """A JSON object from a local file the user named (``--hf-config``), parsed strictly.

    The user's own path: links are followed (a hub snapshot's ``config.json`` is one), but only a
    regular file of at most ``limit`` bytes is read (a FIFO or a device is refused, never opened).
    """
    where = os.fspath(path)
    real = os.path.realpath(where)
    try:
        data = LocalStore(os.path.dirname(real)).read_bytes(os.path.basename(real), limit=limit)
        return load_json(data, where)
    except CkptkitError as exc:
        raise CkptkitError(f"{where}: not a readable JSON config ({' '.join(str(exc).split())})") from None


# ---------------------------------------------------------------- the folder


def _index(store: ByteStore) -> dict[str, str]:
    where = f"{store.url}/{INDEX_NAME}"
    try:
        doc = load_json(store.read_bytes(INDEX_NAME, limit=MAX_INDEX_BYTES), where)
    except ManifestError as exc:
        raise CorruptCheckpointError(str(exc)) from None
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CorruptCheckpointError(f"{where}: no weight_map of file names")
    for f in set(weight_map.values()):
        if "/" in f or "\\" in f or f.startswith(".") or not f.endswith(".safetensors") or \
                any(ord(c) < 32 for c in f):
            raise CorruptCheckpointError(f"{where}: {shown(f)} is not a plain .safetensors file name")
    return weight_map


def open_folder(store: ByteStore) -> tuple[dict[str, SafetensorsFile], dict[str, str] | None]:
    """Every shard an HF folder lists (``model.safetensors.index.json``, or one ``model.safetensors``), each
    checked, no tensor in two of them, and the index's ``weight_map`` (None without an index): the caller
    checks it against the shards (:func:`check_index`) once the model's own checks have named what is missing."""
    try:
        weight_map = None
        if store.exists(INDEX_NAME):
            weight_map = _index(store)
            names = sorted(set(weight_map.values()))
        elif store.exists(SINGLE_NAME):
            names = [SINGLE_NAME]
        else:
            raise CkptkitError(f"{store.url}: neither {INDEX_NAME} nor {SINGLE_NAME}")
        files = {f: SafetensorsFile(store, f) for f in names}
    except UnsafePathError as exc:
        if isinstance(store, SnapshotStore):
            raise
        raise UnsafePathError(f"{exc} (an HF folder's files must lie inside it; only a Hugging Face cache "
                              f"snapshot's may link into its repo's blobs/)") from None
    seen: dict[str, str] = {}
    for fname, f in files.items():
        for name in f.entries:
            if name in seen:
                raise CorruptCheckpointError(f"{store.url}: HF tensor {shown(name)} is in both {seen[name]} and "
                                             f"{fname}")
            seen[name] = fname
    return files, weight_map


def open_files(store: ByteStore) -> dict[str, SafetensorsFile]:
    """:func:`open_folder` with the index checked against the shards."""
    files, weight_map = open_folder(store)
    if weight_map is not None:
        check_index(weight_map, files, f"{store.url}/{INDEX_NAME}")
    return files


def check_index(weight_map: dict[str, str], files: dict[str, SafetensorsFile], where: str) -> None:
    """The index and the shards agree: a tensor listed in one file but held by another (or by none), or
    held by a listed file without being listed, means one of them is damaged."""
    seen = {name: fname for fname, f in files.items() for name in f.entries}
    for name, fname in weight_map.items():
        if name not in seen:
            raise CorruptCheckpointError(f"{where}: lists HF tensor {shown(name)} in {fname}, which does not hold it")
        if seen[name] != fname:
            raise CorruptCheckpointError(f"{where}: lists HF tensor {shown(name)} in {fname}, but {seen[name]} "
                                         f"holds it")
    extra = sorted(set(seen) - set(weight_map))
    if extra:
        raise CorruptCheckpointError(f"{where}: does not list HF tensor {shown(extra[0])}, which {seen[extra[0]]} "
                                     f"holds{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}")
