"""Verifying a checkpoint end to end: digests, coverage, object sizes, every block's checksum.

Every problem found goes into a :class:`VerifyReport` (never raised), so one damaged object does
not hide another. Bytes are re-read through the read engine
(:meth:`~ckptkit.engine.read_session.ReadSession.check_piece`) in bounded chunks; no torch, no
pickle.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from ckptkit.engine.read_session import ReadSession
from ckptkit.errors import (
    CheckpointNotFoundError,
    CkptkitError,
    CoverageError,
    ManifestError,
    StorageError,
    UncommittedCheckpointError,
)
from ckptkit.layout.index import Index, IndexEntry
from ckptkit.layout.manifest import DTYPES, MANIFEST_NAME, Manifest
from ckptkit.layout.values import decode_value
from ckptkit.options import Progress
from ckptkit.storage.base import ByteStore
from ckptkit.storage.url import open_store

Work = tuple[int, int, IndexEntry]  # (rank, checksum block size, piece): one read job of verify


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


def verify(url: str | os.PathLike[str], progress: Progress | None = None, *, threads: int = 4,
           storage_options: dict[str, Any] | None = None) -> VerifyReport:
    """Check a checkpoint end to end: metadata digests, coverage, object sizes, every block checksum.

    Never raises for a problem found in the checkpoint (a missing or
    uncommitted one included): every problem goes into the report, so one
    damaged object does not hide another. Only a URL that cannot be opened at
    all (an unsupported protocol) raises. ``progress(done, total)`` follows
    the stored bytes checked; each of ``threads`` readers holds at most
    ``CHECK_CHUNK`` bytes, so memory stays bounded on any checkpoint size.
    """
    store = open_store(url, storage_options)
    try:
        session = ReadSession(store)
    except UncommittedCheckpointError as exc:
        return VerifyReport(store.url, True, (Problem("uncommitted", str(exc), MANIFEST_NAME),))
    except CheckpointNotFoundError as exc:  # nothing there
        return VerifyReport(store.url, False, (Problem("missing", str(exc)),))
    except StorageError as exc:  # could not be read at all (network, permissions): not evidence of damage
        return VerifyReport(store.url, False, (Problem("read", str(exc), MANIFEST_NAME),))
    except CkptkitError as exc:
        return VerifyReport(store.url, True, (Problem("manifest", str(exc), MANIFEST_NAME),))
    manifest = session.manifest
    problems: list[Problem] = []
    indexes: dict[int, Index] = {}
    pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ckptkit-verify")
    try:
        ranks = sorted(manifest.indexes)
        for rank, got in zip(ranks, pool.map(session.try_index, ranks)):
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

        for found in pool.map(lambda item: _check_entry(session, item, tick), work):
            problems += found
    finally:  # on an interrupt, drop the queued reads rather than finish them
        pool.shutdown(cancel_futures=True)
    pieces = sum(len(i.entries) for i in indexes.values())
    return VerifyReport(store.url, True, tuple(problems), len(manifest.tensors), pieces, nobjects, done[0])


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
            want = e.region.numel * DTYPES[t.dtype]  # the manifest parser admits only these dtypes
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


def _check_entry(session: ReadSession, item: Work, tick: Callable[[int], None]) -> list[Problem]:
    """Re-read one stored piece through the read engine and compare every CRC32C."""
    rank, block, e = item
    url = session.url
    try:
        bad = session.check_piece(rank, e, tick)
    except (CkptkitError, OSError) as exc:
        return [Problem("read", f"{url}/{e.object}: reading tensor {e.tensor!r} (rank {rank}) failed: {exc}",
                        e.object, e.tensor, rank)]
    if not bad:
        return []
    lo = e.offset + bad[0] * block
    return [Problem("checksum", f"{url}/{e.object} (written by rank {rank}): checksum mismatch in tensor "
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
