"""The one read engine: every path that reads a checkpoint goes through a :class:`ReadSession`.

``load`` (a job's tensors at its layout), ``open(...)[key][slice]`` (a box of one tensor),
``reshard`` (target pieces, streamed) and ``verify`` (every stored byte) differ only in what
they ask for. Everything between the question and the bytes is here, once:

1. **metadata** — the manifest (read and checked once), and the indexes of exactly the ranks a
   read needs, each digest-checked against the manifest and cached for the session's life;
2. **source matching** — target regions intersected with the stored pieces
   (:func:`~ckptkit.plan.load_plan.match_sources`; a gap is a :class:`CoverageError`);
3. **read plan** — byte ranges widened to checksum blocks and coalesced
   (:func:`~ckptkit.plan.load_plan.plan_reads`);
4. **object checks** — a missing or truncated data object is reported before any caller memory
   is touched (once per object per session);
5. **verified reads** — :func:`~ckptkit.engine.reader.execute_reads`: ranged reads, every block's
   CRC32C checked, a mismatch read again before it counts as damage, then read from the store's
   :attr:`~ckptkit.storage.base.ByteStore.fallback` tier (a node-local copy's bucket) if it has one.

So a new way of reading (read-once-and-broadcast, a memory tier) is one change here, and every
reader gets it. Thread-safe: several threads may read through one session (diff, exports).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import crc32c

from ckptkit.engine.load_progress import ProgressRecord, ProgressStore
from ckptkit.engine.metadata_io import read_index, read_manifest
from ckptkit.errors import CkptkitError, CorruptCheckpointError
from ckptkit.layout.box import Box, Region
from ckptkit.layout.coverage import named_axes, region_text
from ckptkit.layout.index import Index, IndexEntry
from ckptkit.layout.manifest import Manifest
from ckptkit.layout.pieces import LocalBox
from ckptkit.layout.strict_json import gc_paused
from ckptkit.plan.load_plan import CopyOp, ReadRequest, Target, match_sources, plan_reads
from ckptkit.storage.base import ByteStore

if TYPE_CHECKING:  # torch is imported only by the paths that move tensors: verify and inspect need none
    import torch

    from ckptkit.engine.buffers import BufferPool

# Largest single read of a whole-piece check (verify): memory stays bounded however large a piece is.
CHECK_CHUNK = 64 << 20


@dataclass(frozen=True)
class ReadPlan:
    """What a set of targets needs: the verified byte-range requests and the bytes they read."""

    requests: tuple[ReadRequest, ...]
    writers: frozenset[int]

    @property
    def nbytes(self) -> int:
        return sum(r.length for r in self.requests)


class ReadSession:
    """One committed checkpoint opened for reading (metadata cached, objects checked once)."""

    def __init__(self, store: ByteStore, manifest: Manifest | None = None, *, io_threads: int = 4,
                 progress: ProgressRecord | None = None) -> None:
        # a load's progress (for its watchdog and on_progress): every read through the store noted
        self.progress = progress
        self.store = store if progress is None else ProgressStore(store, progress)  # type: ignore[assignment]
        self.manifest = manifest if manifest is not None else read_manifest(self.store)
        self.io_threads = io_threads
        self._lock = threading.Lock()
        # each checking thread's read buffer, kept between pieces (see check_piece)
        self._check_buffers = threading.local()
        self._indexes: dict[int, Index] = {}
        self._objects_checked: set[tuple[int, str]] = set()
        self._dtypes: dict[str, Any] = {}
        self._bytes_read = 0

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def bytes_read(self) -> int:
        """Data bytes fetched through this session so far (checksum-block widening included)."""
        return self._bytes_read

    def count_read(self, nbytes: int) -> None:
        """Data bytes fetched outside :meth:`execute` (a read-once reader's verified reads)."""
        with self._lock:
            self._bytes_read += nbytes

    @property
    def indexes_loaded(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(sorted(self._indexes))

    def dtype(self, key: str) -> torch.dtype:
        dt = self._dtypes.get(key)
        if dt is None:
            from ckptkit.engine.state import torch_dtype

            dt = self._dtypes[key] = torch_dtype(self.manifest.tensors[key].dtype)
        return dt

    # ------------------------------------------------------------ metadata

    def indexes(self, ranks: set[int] | frozenset[int], threads: int = 8) -> dict[int, Index]:
        """The indexes of ``ranks``, each read and digest-checked once per session (in parallel)."""
        with self._lock:
            missing = sorted(set(ranks) - set(self._indexes))
        if missing:
            if len(missing) == 1 or threads <= 1:
                got = [read_index(self.store, self.manifest, r) for r in missing]
            else:
                with ThreadPoolExecutor(max_workers=min(threads, len(missing)),
                                        thread_name_prefix="ckptkit-index") as pool:
                    got = list(pool.map(lambda r: read_index(self.store, self.manifest, r), missing))
            with self._lock:
                for r, idx in zip(missing, got):
                    if r not in self._indexes:
                        self._indexes[r] = idx
        with self._lock:
            return {r: self._indexes[r] for r in ranks}

    def try_index(self, rank: int) -> Index | CkptkitError:
        """Rank ``rank``'s index with every entry validated, or the error that reading it raised (verify
        reports, not raises; a load validates only the entries it reads)."""
        try:
            index = self.indexes({rank})[rank]
            index.entries  # noqa: B018 - validates every entry
            return index
        except CkptkitError as exc:
            return exc

    def entry_of(self, op: CopyOp) -> IndexEntry:
        """The index entry of the stored piece ``op`` reads (its writer's index must be loaded)."""
        entry = self._indexes[op.writer].entry(op.tensor, op.source)
        if entry is None:
            meta = self.manifest.tensors.get(op.tensor)
            held = region_text(op.source, tuple(meta.shape), named_axes(meta.rule)) if meta is not None else ""
            raise CorruptCheckpointError(
                f"{self.url}: the index of rank {op.writer} has no piece {op.source.to_json()}{held} of tensor "
                f"{op.tensor!r}, which the manifest says that rank wrote"
            )
        return entry

    # ------------------------------------------------------------ planning

    # Matching and planning build many small acyclic objects while the session holds every index it read
    # (a torchtitan rank loading at 512 ranks holds 242): with the cyclic collector running, its passes over
    # that heap took a third of the plan (1.84 -> 1.2 s measured). Both run with it paused, as parsing does.

    def match(self, targets: list[Target]) -> list[CopyOp]:
        """Copy operations filling ``targets`` from the stored pieces (metadata only: no index read)."""
        with gc_paused():
            return match_sources(targets, self.manifest.tensors, self.url)

    def plan(self, ops: list[CopyOp], extra_ranks: set[int] | frozenset[int] = frozenset()) -> ReadPlan:
        """Read requests serving ``ops``: reads the writers' indexes (and ``extra_ranks``'), plans
        block-aligned coalesced ranges, and checks every object they touch exists and is long enough."""
        with gc_paused():
            return self._plan(ops, extra_ranks)

    def _plan(self, ops: list[CopyOp], extra_ranks: set[int] | frozenset[int]) -> ReadPlan:
        writers = frozenset({op.writer for op in ops})
        indexes = self.indexes(writers | set(extra_ranks))
        from ckptkit.layout.manifest import DTYPES

        requests = plan_reads(ops, self.entry_of, itemsize_of=lambda k: DTYPES[self.manifest.tensors[k].dtype],
                              block_of=lambda r: indexes[r].block)
        self.check_objects({(r.writer, r.object) for r in requests})
        return ReadPlan(tuple(requests), writers)

    def check_objects(self, needed: set[tuple[int, str]]) -> None:
        """A missing or truncated data object is reported before any read (once per object)."""
        with self._lock:
            todo = sorted(needed - self._objects_checked)
        for writer, obj in todo:
            expected = self._indexes[writer].objects[obj]
            size = self.store.size(obj)
            if size is None:
                raise CorruptCheckpointError(f"{self.url}/{obj} (written by rank {writer}) is missing")
            if size < expected:
                raise CorruptCheckpointError(
                    f"{self.url}/{obj} (written by rank {writer}) is truncated: {size} bytes, the index records {expected}"
                )
        with self._lock:
            self._objects_checked.update(todo)

    # ------------------------------------------------------------ reading

    def execute(self, plan: ReadPlan, dests: list[torch.Tensor], *, scratch: BufferPool | None = None,
                progress: Callable[[int], None] | None = None) -> int:
        """Run ``plan`` into ``dests`` (contiguous CPU tensors, by the targets' ``ref``); bytes read."""
        from ckptkit.engine.reader import execute_reads

        dtypes = {op.op.tensor: self.dtype(op.op.tensor) for r in plan.requests for op in r.ops}
        done = None if self.progress is None else (lambda req: self.progress.placed(len(req.ops)))  # type: ignore[union-attr]
        n = execute_reads(list(plan.requests), self.store, dests, dtypes, self.url, self.io_threads, progress, scratch,
                          done)
        with self._lock:
            self._bytes_read += n
        return n

    def read_box(self, key: str, box: Box, out: torch.Tensor | None = None,
                 scratch: BufferPool | None = None) -> torch.Tensor:
        """The elements of ``box`` of tensor ``key`` (model space) as a contiguous CPU tensor.

        ``out`` (a contiguous CPU tensor of the box's shape and the tensor's dtype) receives them
        when given. The result is allocated only once the stored bytes are known to be there."""
        import torch

        dtype = self.dtype(key)
        if box.is_empty():
            return out if out is not None else torch.empty(box.sizes, dtype=dtype)
        target = Target(0, key, Region(box), tuple(box.sizes), LocalBox(tuple(0 for _ in box.sizes)))
        plan = self.plan(self.match([target]))
        if out is None:
            try:
                out = torch.empty(box.sizes, dtype=dtype)
            except (RuntimeError, MemoryError) as exc:
                raise CkptkitError(f"{self.url}: cannot allocate {box.numel} elements of {key!r} ({exc})") from None
        self.execute(plan, [out], scratch=scratch)
        return out

    def _check_buffer(self, n: int) -> memoryview:
        """This thread's buffer of ``n`` bytes for :meth:`check_piece`, reused from piece to piece: a new
        one per piece (a zero-filled ``bytearray``, its pages faulted in on first touch) cost more
        CPU than the read and the CRC together (measured 2026-12-05: 44 ms of CPU to verify a
        128 MiB snapshot in 4 MiB pieces, ~25 ms with reuse). A thread holds one, as before."""
        buf = getattr(self._check_buffers, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._check_buffers.buf = bytearray(n)
        return memoryview(buf)[:n]

    def check_piece(self, rank: int, entry: IndexEntry, tick: Callable[[int], None] | None = None) -> list[int]:
        """Re-read one stored piece in bounded chunks and compare every block's CRC32C; the indexes
        of the blocks that differ (what ``verify`` reports). Storage errors propagate."""
        block = self._indexes[rank].block
        step = block * max(1, CHECK_CHUNK // block) if block <= CHECK_CHUNK else CHECK_CHUNK
        buf = self._check_buffer(min(step, entry.nbytes))
        bad: list[int] = []
        crc = filled = index = pos = 0
        while pos < entry.nbytes:
            n = min(len(buf), entry.nbytes - pos)
            self.store.read_into(entry.object, entry.offset + pos, buf[:n])
            i = 0
            while i < n:  # a block larger than CHECK_CHUNK is checksummed across reads
                take = min(block - filled, n - i)
                crc = crc32c.crc32c(buf[i:i + take], crc)
                filled, i = filled + take, i + take
                if filled == block or pos + i == entry.nbytes:
                    if crc != entry.crcs[index]:
                        bad.append(index)
                    index, crc, filled = index + 1, 0, 0
            pos += n
            with self._lock:
                self._bytes_read += n
            if tick is not None:
                tick(n)
        if entry.nbytes == 0 and entry.crcs[0] != crc32c.crc32c(b""):
            bad.append(0)
        return bad
