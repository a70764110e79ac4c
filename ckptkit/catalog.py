"""Inspecting checkpoints without loading them: list, describe, verify.

Operators need to answer "which of these checkpoints are complete?", "what
is in this one?" and "are its bytes intact?" on a login node, without a
process group, GPUs or the model code that wrote it. Everything here works
from the on-disk metadata (versioned JSON, never pickle) and raw bytes, and
imports no torch itself, so a hostile checkpoint cannot run code and nothing
here depends on how the state was built.

Results are frozen dataclasses with a ``to_json()`` so the CLI, scripts and
dashboards all see the same facts.
"""

from __future__ import annotations

import fnmatch
import re
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import crc32c

from ckptkit.options import Progress
from ckptkit.engine.metadata_io import read_index, read_indexes, read_manifest
from ckptkit.errors import (
    CheckpointNotFoundError,
    CkptkitError,
    CoverageError,
    ManifestError,
    StorageError,
    UncommittedCheckpointError,
)
from ckptkit.layout.grid import GridLayout, Mesh, On, Placement, Replicate
from ckptkit.layout.manifest import DTYPES, MANIFEST_NAME, ExplicitLayout, Index, IndexEntry, Manifest, TensorMeta
from ckptkit.layout.values import decode_value
from ckptkit.retention import Record, RetentionPolicy, decide
from ckptkit.storage.base import ByteStore
from ckptkit.storage.url import open_store

# Bytes per element, from the manifest schema: sizing a tensor never needs torch.
ITEMSIZE = DTYPES
# Largest single read of verify: memory stays bounded however large a piece is.
READ_CHUNK = 64 << 20
_STEP_NAME = re.compile(r"(?:^|[-_.])step[-_]?(\d+)$")

Work = tuple[int, int, IndexEntry]  # (rank, checksum block size, piece): one read job of verify


# ---------------------------------------------------------------- listing

@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory of a run, committed or not.

    ``reason`` says why an uncommitted one is not a checkpoint (a crashed or
    running save, an unreadable manifest), so a reader knows whether to wait,
    delete it, or look closer.
    """

    name: str
    url: str
    step: int | None
    committed: bool
    total_bytes: int
    world_size: int | None
    created: str | None
    reason: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    keep: tuple[str, ...] = ()  # why retention keeps it: latest, last, milestone, best

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def list_checkpoints(url: str) -> list[CheckpointInfo]:
    """The checkpoints directly under run directory ``url`` (or ``url`` itself if it is one).

    Sorted by step (unnumbered last), then name. Raises
    CheckpointNotFoundError if ``url`` does not exist.
    """
    store = open_store(url)
    children = store.list_children()
    if MANIFEST_NAME in children or "index" in children or "data" in children:
        return [_info(store, store.url.rstrip("/").rsplit("/", 1)[-1])]
    is_dir = getattr(store, "is_dir", None)  # an empty run directory is not an error; a missing one is
    if not children and not (callable(is_dir) and is_dir()):
        raise CheckpointNotFoundError(f"no checkpoint or run directory at {store.url}")
    infos, policies = [], {}
    for name in children:
        if name.startswith("."):
            continue  # .leases and other hidden entries
        try:
            if store.size(name) is not None:
                continue  # a plain file next to the checkpoints (notes, a "latest" pointer)
            info, policy = _info_and_policy(store.child(name), name)
        except CkptkitError as exc:  # one hostile entry must not hide the other checkpoints
            match = _STEP_NAME.search(name)
            info = CheckpointInfo(name, f"{store.url.rstrip('/')}/{name}", int(match.group(1)) if match else None,
                                  False, 0, None, None, f"unreadable: {exc}")
            policy = None
        infos.append(info)
        policies[name] = policy
    infos.sort(key=lambda i: (i.step is None, i.step or 0, i.name))
    return _with_retention(infos, policies)


def _with_retention(infos: list[CheckpointInfo], policies: dict[str, Any]) -> list[CheckpointInfo]:
    """Mark why each committed checkpoint is kept, by the policy the newest one was saved under."""
    committed = [i for i in infos if i.committed and i.step is not None]
    if not committed:
        return infos
    newest = max(committed, key=lambda i: i.step or 0)
    decision = decide([Record(i.name, i.step or 0, True, i.metrics) for i in committed],
                      RetentionPolicy.from_json(policies.get(newest.name)))
    return [
        replace(i, keep=tuple(r for r in decision.keep.get(i.name, ()) if r != "all")) if i.committed else i
        for i in infos
    ]


def _info(store: ByteStore, name: str) -> CheckpointInfo:
    return _info_and_policy(store, name)[0]


def _info_and_policy(store: ByteStore, name: str) -> tuple[CheckpointInfo, Any]:
    """A checkpoint's summary and the retention policy it was saved under (None if unknown)."""
    match = _STEP_NAME.search(name)
    step = int(match.group(1)) if match else None
    try:
        manifest = read_manifest(store)
    except CkptkitError as exc:
        keys = store.list_keys()
        if not keys:
            reason = "empty directory"
        elif not any(k.startswith(("index/", "data/")) for k in keys):
            reason = f"not a checkpoint (no {MANIFEST_NAME}, index/ or data/)"
        elif isinstance(exc, UncommittedCheckpointError):
            reason = f"no {MANIFEST_NAME}: the save did not finish (or is still running)"
        else:
            reason = f"{MANIFEST_NAME} is unreadable: {exc}"
        total = sum(store.size(k) or 0 for k in keys)
        return CheckpointInfo(name, store.url, step, False, total, None, None, reason), None
    meta = manifest.meta
    user: Any = meta.get("user")
    user_step: Any = user.get("step") if isinstance(user, dict) else None
    if step is None and isinstance(user_step, int) and not isinstance(user_step, bool):
        step = user_step
    # on-disk size, comparable with an uncommitted directory's: objects + indexes + manifest
    recorded = meta.get("stored_bytes")
    if isinstance(recorded, int):
        total = recorded + (store.size(MANIFEST_NAME) or 0)
    else:
        total = sum(store.size(k) or 0 for k in store.list_keys())
    metrics = user.get("metrics") if isinstance(user, dict) else None
    info = CheckpointInfo(
        name, store.url, step, True, total, manifest.world_size, _created(meta),
        metrics=metrics if isinstance(metrics, dict) else {},
    )
    return info, user.get("retention") if isinstance(user, dict) else None


def _created(meta: dict[str, Any]) -> str | None:
    created = meta.get("created")
    return created if isinstance(created, str) else None


# ---------------------------------------------------------------- describe

@dataclass(frozen=True)
class MeshInfo:
    """A device mesh tensors were saved on: the layout of the job that wrote them."""

    name: str
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class TensorInfo:
    """One logical tensor; ``nbytes`` is its logical size, ``stored_pieces`` counts its index entries."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    nbytes: int
    layout_kind: str
    layout: str
    mesh: str | None
    stored_pieces: int


@dataclass(frozen=True)
class RankInfo:
    """What one rank wrote, from its index: how the save's I/O was spread."""

    rank: int
    index: str
    pieces: int
    nbytes: int
    value_keys: tuple[str, ...]


@dataclass(frozen=True)
class CheckpointDescription:
    """What a checkpoint holds and how it was laid out, from metadata alone (``meta`` is the raw JSON)."""

    url: str
    world_size: int
    version: int
    parallel: str | None
    created: str | None
    total_bytes: int
    meshes: tuple[MeshInfo, ...]
    tensors: tuple[TensorInfo, ...]
    ranks: tuple[RankInfo, ...]
    values: tuple[str, ...]
    per_rank_keys: tuple[str, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    def select(self, pattern: str) -> CheckpointDescription:
        """Only the tensors whose key matches the shell-style ``pattern``."""
        return replace(self, tensors=tuple(t for t in self.tensors if fnmatch.fnmatchcase(t.key, pattern)))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def describe(url: str) -> CheckpointDescription:
    """Everything the metadata says about the checkpoint at ``url``; reads no data object.

    Raises the usual CkptkitError subclasses if the manifest or an index is
    missing or fails its integrity check (``verify`` reports those instead).
    """
    store = open_store(url)
    manifest = read_manifest(store)
    indexes = read_indexes(store, manifest, set(manifest.indexes))
    stored = Counter(e.tensor for idx in indexes.values() for e in idx.entries)
    meshes: dict[Mesh, MeshInfo] = {}  # named m0, m1, ... in manifest order, as the manifest file does
    tensors = []
    for key, t in manifest.tensors.items():
        mesh = None
        if isinstance(t.layout, GridLayout):
            m = t.layout.mesh
            mesh = meshes.setdefault(m, MeshInfo(f"m{len(meshes)}", m.dims, m.shape, m.ranks)).name
        kind = "grid" if isinstance(t.layout, GridLayout) else "explicit"
        nbytes = t.numel * ITEMSIZE[t.dtype]
        tensors.append(TensorInfo(key, t.dtype, t.shape, t.numel, nbytes, kind, layout_summary(t), mesh, stored[key]))
    ranks = tuple(
        RankInfo(r, manifest.indexes[r].key, len(idx.entries), sum(e.nbytes for e in idx.entries), tuple(sorted(idx.values)))
        for r, idx in sorted(indexes.items())
    )
    meta = manifest.meta
    total = meta.get("tensor_bytes")
    total = total if isinstance(total, int) else sum(r.nbytes for r in ranks)
    return CheckpointDescription(
        store.url, manifest.world_size, manifest.version, manifest.parallel, _created(meta), total,
        tuple(meshes.values()), tuple(tensors), ranks, tuple(sorted(manifest.values)), manifest.per_rank_keys, meta,
    )


def layout_summary(t: TensorMeta) -> str:
    """A short human reading of a layout: ``grid mesh (dp=4) [Shard(0)]``, ``explicit: 12 pieces``."""
    if isinstance(t.layout, ExplicitLayout):
        writers = {w for _, w in t.layout.pieces}
        n = len(t.layout.pieces)
        return f"explicit: {n} piece{'s' * (n != 1)} from {len(writers)} rank{'s' * (len(writers) != 1)}"
    g = t.layout
    dims = ", ".join(f"{d}={n}" for d, n in zip(g.mesh.dims, g.mesh.shape))
    out = f"grid mesh ({dims}) [{', '.join(_placement(p) for p in g.placements)}]"
    if g.padded is not None:
        out += f" padded to {list(g.padded)}"
    if g.fused is not None:
        out += f" fused axis {g.fused.axis} {list(g.fused.parts)}"
    return out


def _placement(p: Placement) -> str:
    if isinstance(p, Replicate):
        return "Replicate"
    if isinstance(p, On):
        return f"On({p.index})"
    extra = f", split={p.split_factor}" if p.split_factor != 1 else ""
    extra += f", sizes={list(p.sizes)}" if p.sizes is not None else ""
    return f"Shard({p.axis}{extra})"


# ---------------------------------------------------------------- verify

@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint; ``message`` names the file, tensor and rank involved."""

    kind: str
    message: str
    file: str | None = None
    tensor: str | None = None
    rank: int | None = None


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of :func:`verify`. ``found`` is False when there is nothing to examine at the URL
    (no such directory, or one that cannot be read at all): a usage error rather than damage."""

    url: str
    found: bool
    problems: tuple[Problem, ...]
    tensors: int = 0
    pieces: int = 0
    objects: int = 0
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return self.found and not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, **asdict(self)}


def verify(url: str, progress: Progress | None = None, *, threads: int = 4) -> VerifyReport:
    """Check a checkpoint end to end: metadata digests, coverage, object sizes, every block checksum.

    Never raises for a problem found in the checkpoint (a missing or
    uncommitted one included): every problem goes into the report, so one
    damaged object does not hide another. Only a URL that cannot be opened at
    all (an unsupported protocol) raises. ``progress(done, total)`` follows
    the stored bytes checked; each of ``threads`` readers holds at most
    READ_CHUNK bytes, so memory stays bounded on any checkpoint size.
    """
    store = open_store(url)
    try:
        manifest = read_manifest(store)
    except UncommittedCheckpointError as exc:
        return VerifyReport(store.url, True, (Problem("uncommitted", str(exc), MANIFEST_NAME),))
    except CheckpointNotFoundError as exc:  # nothing there
        return VerifyReport(store.url, False, (Problem("missing", str(exc)),))
    except StorageError as exc:  # could not be read at all (network, permissions): not evidence of damage
        return VerifyReport(store.url, False, (Problem("read", str(exc), MANIFEST_NAME),))
    except CkptkitError as exc:
        return VerifyReport(store.url, True, (Problem("manifest", str(exc), MANIFEST_NAME),))
    problems: list[Problem] = []
    indexes: dict[int, Index] = {}
    pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ckptkit-verify")
    try:
        ranks = sorted(manifest.indexes)
        for rank, got in zip(ranks, pool.map(lambda r: _try_index(store, manifest, r), ranks)):
            if isinstance(got, Index):
                indexes[rank] = got
            else:
                problems.append(Problem("index", str(got), manifest.indexes[rank].key, rank=rank))
        problems += _check_layout(store.url, manifest, indexes)
        problems += _check_values(store.url, manifest, indexes)
        work, object_problems, nobjects = _check_objects(store, indexes)
        problems += object_problems
        total, done, lock = sum(e.nbytes for _, _, e in work), [0], threading.Lock()

        def tick(n: int) -> None:
            with lock:
                done[0] += n
                if progress is not None:
                    progress(done[0], total)

        for found in pool.map(lambda item: _check_entry(store, item, tick), work):
            problems += found
    finally:  # on an interrupt, drop the queued reads rather than finish them
        pool.shutdown(cancel_futures=True)
    pieces = sum(len(i.entries) for i in indexes.values())
    return VerifyReport(store.url, True, tuple(problems), len(manifest.tensors), pieces, nobjects, done[0])


def _try_index(store: ByteStore, manifest: Manifest, rank: int) -> Index | CkptkitError:
    try:
        return read_index(store, manifest, rank)
    except CkptkitError as exc:
        return exc


def _check_layout(url: str, manifest: Manifest, indexes: dict[int, Index]) -> list[Problem]:
    """Every tensor covered exactly once, by the pieces its layout names, in its writers' indexes."""
    out: list[Problem] = []
    stored: dict[int, set[tuple[str, tuple[Any, ...]]]] = {}  # rank -> (tensor, region key) it holds
    elements: dict[str, int] = {}
    for rank, idx in sorted(indexes.items()):
        ikey, unknown = manifest.indexes[rank].key, set()
        stored[rank] = set()
        for e in idx.entries:
            t = manifest.tensors.get(e.tensor)
            if t is None:
                if e.tensor not in unknown:
                    unknown.add(e.tensor)
                    out.append(Problem("unknown-tensor", f"{url}/{ikey}: holds pieces of tensor {e.tensor!r}, "
                                       "which the manifest does not list", ikey, e.tensor, rank))
                continue
            stored[rank].add((e.tensor, e.region.key()))
            elements[e.tensor] = elements.get(e.tensor, 0) + e.region.numel
            want = e.region.numel * ITEMSIZE[t.dtype]  # the manifest parser admits only these dtypes
            if not e.region.box.within(t.shape) or e.nbytes != want:
                out.append(Problem("piece", f"{url}/{ikey}: piece {e.region.to_json()} of tensor {e.tensor!r} has "
                                   f"{e.nbytes} bytes; expected {want} inside shape {list(t.shape)} ({t.dtype})",
                                   ikey, e.tensor, rank))
    for key, t in manifest.tensors.items():
        try:
            expected = t.stored_pieces()  # an explicit layout is checked for coverage as it is parsed
        except (CoverageError, ManifestError) as exc:
            out.append(Problem("coverage" if isinstance(exc, CoverageError) else "manifest", str(exc), MANIFEST_NAME, key))
            continue
        blind: set[int] = set()  # writers whose index is unreadable: already reported, checked once
        for region, writer in expected:
            ref = manifest.indexes.get(writer)
            if ref is None:
                out.append(Problem("coverage", f"{url}: tensor {key!r}: piece {region.to_json()} is written by rank "
                                   f"{writer}, but the manifest lists no index for that rank", MANIFEST_NAME, key, writer))
            elif writer not in indexes:
                if writer not in blind:
                    blind.add(writer)
                    out.append(Problem("coverage", f"{url}: pieces of tensor {key!r} written by rank {writer} cannot "
                                       "be checked: its index is unreadable", ref.key, key, writer))
            elif (key, region.key()) not in stored[writer]:
                out.append(Problem("coverage", f"{url}/{ref.key}: tensor {key!r}: piece {region.to_json()} should be "
                                   f"stored by rank {writer}, but its index has no such piece", ref.key, key, writer))
        if not blind and elements.get(key, 0) != t.numel:
            out.append(Problem("coverage", f"{url}: tensor {key!r}: the indexes hold {elements.get(key, 0)} elements, "
                               f"its shape {list(t.shape)} has {t.numel}", None, key))
    return out


def _check_values(url: str, manifest: Manifest, indexes: dict[int, Index]) -> list[Problem]:
    """Every value a load can return decodes (the digests say the bytes are as written; this says
    what was written is a value ckptkit can give back)."""
    out: list[Problem] = []
    items: list[tuple[str, Any, str, int | None]] = [(k, v, MANIFEST_NAME, None) for k, v in manifest.values.items()]
    items += [(k, v, MANIFEST_NAME, r) for k, groups in manifest.rank_values.items() for v, ranks in groups for r in ranks[:1]]
    for rank, idx in sorted(indexes.items()):
        items += [(k, v, manifest.indexes[rank].key, rank) for k, v in idx.values.items() if not _is_generator(v)]
    for key, value, file, rank in items:
        try:
            decode_value(value, f"{url}/{file}: value {key!r}")
        except CkptkitError as exc:
            out.append(Problem("value", str(exc), file, key, rank))
    return out


def _is_generator(value: Any) -> bool:
    return isinstance(value, dict) and "__generator__" in value


def _check_objects(store: ByteStore, indexes: dict[int, Index]) -> tuple[list[Work], list[Problem], int]:
    """Every data object exists with at least its recorded size; returns the pieces that can be read."""
    out: list[Problem] = []
    work: list[Work] = []
    nobjects = 0
    for rank, idx in sorted(indexes.items()):
        for obj, recorded in idx.objects.items():
            nobjects += 1
            where = f"{store.url}/{obj}: data object of rank {rank}"
            entries = [e for e in idx.entries if e.object == obj]
            try:
                actual = store.size(obj)
            except OSError as exc:
                out.append(Problem("object", f"{where} cannot be examined: {exc}", obj, rank=rank))
                continue
            if actual is None:
                out.append(Problem("object", f"{where} is missing; it holds pieces of {_names(entries)}",
                                   obj, _single(entries), rank))
                continue
            beyond = [e for e in entries if e.offset + e.nbytes > actual]
            if actual < recorded:
                lost = f"; pieces of {_names(beyond)} lie past its end" if beyond else ""
                out.append(Problem("object", f"{where} is truncated: {actual} bytes, its index records {recorded}{lost}",
                                   obj, _single(beyond), rank))
            work += [(rank, idx.block, e) for e in entries if e.offset + e.nbytes <= actual]
    return work, out, nobjects


def _check_entry(store: ByteStore, item: Work, tick: Callable[[int], None]) -> list[Problem]:
    """Re-read one stored piece in chunks of whole blocks (at most READ_CHUNK) and compare every CRC32C."""
    rank, block, e = item
    step = block * max(1, READ_CHUNK // block) if block <= READ_CHUNK else READ_CHUNK
    buf = memoryview(bytearray(min(step, e.nbytes)))
    bad: list[int] = []
    crc = filled = index = pos = 0
    try:
        while pos < e.nbytes:
            n = min(len(buf), e.nbytes - pos)
            store.read_into(e.object, e.offset + pos, buf[:n])
            i = 0
            while i < n:  # a block larger than READ_CHUNK is checksummed across reads
                take = min(block - filled, n - i)
                crc = crc32c.crc32c(buf[i:i + take], crc)
                filled, i = filled + take, i + take
                if filled == block or pos + i == e.nbytes:
                    if crc != e.crcs[index]:
                        bad.append(index)
                    index, crc, filled = index + 1, 0, 0
            pos += n
            tick(n)
    except (CkptkitError, OSError) as exc:
        return [Problem("read", f"{store.url}/{e.object}: reading tensor {e.tensor!r} (rank {rank}) failed: {exc}",
                        e.object, e.tensor, rank)]
    if e.nbytes == 0 and e.crcs[0] != crc32c.crc32c(b""):
        bad.append(0)
    if not bad:
        return []
    lo = e.offset + bad[0] * block
    return [Problem("checksum", f"{store.url}/{e.object} (written by rank {rank}): checksum mismatch in tensor "
                    f"{e.tensor!r}, piece {e.region.to_json()}: {len(bad)} of {len(e.crcs)} blocks differ, first at "
                    f"bytes [{lo}, {min(lo + block, e.offset + e.nbytes)})", e.object, e.tensor, rank)]


def _names(entries: list[IndexEntry], limit: int = 5) -> str:
    names = sorted({e.tensor for e in entries})
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    label = "tensor " if len(names) == 1 else "tensors "
    return (label + ", ".join(repr(n) for n in names[:limit]) + more) if names else "no tensors"


def _single(entries: list[IndexEntry]) -> str | None:
    names = {e.tensor for e in entries}
    return names.pop() if len(names) == 1 else None
