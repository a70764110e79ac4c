"""A save, load and reshard of a job of hundreds or thousands of ranks, simulated in one process.

Why: the layouts ckptkit is for (tp4·pp8 over dp 32, ZeRO-3 over 512 ranks,
FSDP2 x TP over 1,024) cannot run here, but everything ckptkit decides for
them is metadata. Each rank's state (its framework's real declarations, with
meta-device tensors: no memory behind them) goes through ckptkit's own code,
rank by rank, exactly as in a job:

* save: ``flatten_state`` -> ``classify_state`` -> the replica agreement
  (``combine_replica_meshes``, ``agree_plain_replicas``) -> ``plan_agreed`` ->
  ``write_index`` (the rank's real index; data objects are sparse files of the
  planned size, and the block checksums are stand-ins, as no data exists) ->
  rank 0's ``merge_gathered`` -> ``publish``;
* load: a target rank's state -> its targets (:func:`load_targets`) -> ``ReadSession``
  (manifest and index digests checked, source matching, read planning, object
  checks) — every byte it would read is planned, none is read;
* reshard: ``plan_reshard`` over the committed manifest, ``check_plan``.

What replaces the process group: a collective's result is every rank's
contribution, which the simulation has in hand after a first pass over the
ranks (:class:`Gathered`; no pass is needed for frameworks that declare only
explicit pieces, whose planning gather carries nothing). Nothing of ckptkit is
replaced. Times are CPU seconds (:data:`clock`); each rank's own planning is
timed with what earlier ranks left behind frozen out of the garbage collector,
as in a job, where that is in other processes.

Checks: every tensor of the manifest is covered exactly once
(:func:`ckptkit.layout.coverage.check_coverage`, grids included), every stored
piece the manifest names is in its writer's index and nothing else is
(:func:`check_indexes`), every target rank's load and the reshard are
complete (the planners raise a CoverageError / ReshardError on any gap).
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ckptkit.engine.collective import Outcome
from ckptkit.engine.dtensor_grid import grid_of, is_dtensor, local_of
from ckptkit.engine.loader import _check_meta
from ckptkit.engine.metadata_io import read_manifest
from ckptkit.engine.read_session import ReadSession
from ckptkit.engine.saver import (
    Classified,
    _plain_hash,
    agree_plain_replicas,
    bind,
    classify_state,
    merge_gathered,
    mesh_reports,
    plain_descs,
    plan_agreed,
    publish,
    values_digest,
    write_index,
)
from ckptkit.engine.state import flatten_state
from ckptkit.layout.box import Box, Region
from ckptkit.layout.config import ParallelConfig
from ckptkit.layout.coverage import check_coverage, named_axes
from ckptkit.layout.index import IndexEntry
from ckptkit.layout.manifest import Manifest
from ckptkit.layout.pieces import LocalBox
from ckptkit.plan.load_plan import Target
from ckptkit.plan.mesh_replicas import combine_replica_meshes
from ckptkit.plan.reshard_plan import ReshardPlan, ReshardPlanOptions, check_plan, plan_reshard
from ckptkit.plan.save_plan import SavePlan, mesh_fingerprint
from ckptkit.storage.local import LocalStore

BLOCK = 4 << 20  # SaveOptions' default checksum block
clock = time.process_time
"""Every figure is CPU seconds of this process: the machines these run on are shared, and the wall
clock would count other jobs' time as ours (ranks here are simulated one after another on one core)."""
ATTEMPT = "5ca1e5a7e000"  # a save attempt id (12 hex digits; every object name carries one)


class Gathered:
    """A collective's result on one rank, when every rank's contribution is already known.

    The planning functions that take a Comm use only ``rank``, ``world_size`` and ``all_gather``;
    the simulation's first pass over the ranks collected what each contributes, so the gather is
    a lookup. It refuses a contribution that differs from the one collected."""

    def __init__(self, rank: int, contributions: list[Any]) -> None:
        self.rank = rank
        self.world_size = len(contributions)
        self._contributions = contributions

    def all_gather(self, obj: Any) -> list[Any]:
        if obj != self._contributions[self.rank]:
            raise AssertionError(f"rank {self.rank} contributes another value than the first pass collected")
        return list(self._contributions)


@dataclass
class SaveStats:
    """What a simulated save measured: per-rank planning, index sizes, rank 0's merge, the manifest."""

    world: int
    plan_seconds: list[float] = field(default_factory=list)
    index_seconds: list[float] = field(default_factory=list)
    index_bytes: list[int] = field(default_factory=list)
    pieces: list[int] = field(default_factory=list)
    tensor_bytes: int = 0
    merge_seconds: float = 0.0
    serialize_seconds: float = 0.0
    manifest_bytes: int = 0
    tensors: int = 0
    index_hashes: dict[int, tuple[int, int]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        n = max(1, len(self.plan_seconds))
        return {
            "ranks": self.world, "tensors": self.tensors, "tensor_bytes": self.tensor_bytes,
            "pieces": sum(self.pieces), "pieces_per_rank_max": max(self.pieces, default=0),
            "plan_per_rank_s_mean": sum(self.plan_seconds) / n, "plan_per_rank_s_max": max(self.plan_seconds, default=0),
            "index_per_rank_s_mean": sum(self.index_seconds) / n,
            "merge_s": self.merge_seconds, "manifest_serialize_s": self.serialize_seconds,
            "manifest_bytes": self.manifest_bytes, "index_bytes_total": sum(self.index_bytes),
            "index_bytes_max": max(self.index_bytes, default=0),
            "metadata_bytes": self.manifest_bytes + sum(self.index_bytes),
        }


def piece_hash(tensor: str, region: Any) -> int:
    """A hash of one stored piece, summed per writer to compare indexes with the manifest (in one process)."""
    return hash((tensor, region.key())) % (1 << 64)


def _entries(plan: SavePlan, block: int) -> list[IndexEntry]:
    """The index entries persist would write: the plan's pieces with a checksum per block. No data exists,
    so the checksums are stand-ins of a real one's size (10 digits), not checksums of anything."""
    return [IndexEntry(i.tensor, i.region, i.object, i.offset, i.nbytes,
                       tuple(zlib.crc32(f"{i.object}:{i.offset}:{b}".encode()) | 1 << 31
                             for b in range(max(1, -(-i.nbytes // block)))))
            for i in plan.items]


def classified(state: dict[str, Any], rank: int) -> tuple[Classified, float]:
    """``ckptkit.save``'s first step on a rank's state, and its CPU seconds (building the state is not counted)."""
    t0 = clock()
    cls = classify_state(flatten_state(state), rank, shapes_only=True)  # meta tensors: planned, never written
    return cls, clock() - t0


class SaveSim:
    """One simulated save to a local folder (manifest and indexes real, data objects sparse)."""

    def __init__(self, root: str, world: int, block: int = BLOCK) -> None:
        self.store = LocalStore(root)
        self.root = root
        self.world = world
        self.block = block
        self.stats = SaveStats(world)

    def run(self, state_of: Callable[[int], dict[str, Any]], *, keep: bool = True) -> Manifest:
        """Save every rank's state (``state_of(rank)``), commit, and return the committed manifest.

        ``keep``: hold each rank's classification between the two passes (False: ask ``state_of``
        again, for states that are cheap to rebuild and costly to hold)."""
        return self.run_classified(lambda rank: classified(state_of(rank), rank), keep=keep)

    def run_classified(self, classify: Callable[[int], tuple[Classified, float]], *, keep: bool = True,
                       explicit_only: bool = False) -> Manifest:
        """:meth:`run` from each rank's classification and the CPU seconds it took (:func:`classified`).

        ``explicit_only``: the ranks declare every tensor piece by piece (Megatron, DeepSpeed), so what
        the planning all-gather carries is known to be empty and the first pass is skipped; each rank
        is checked to declare no grid or plain tensor."""
        kept: dict[int, tuple[Classified, float]] = {}
        first: list[Outcome] = [Outcome(True, ([], None))] * self.world
        descs: list[Any] = [()] * self.world
        for rank in range(0 if explicit_only else self.world):  # pass one: what each gives the all-gather
            cls, seconds = classify(rank)
            first[rank] = Outcome(True, (mesh_reports(cls.grid), _plain_hash(cls.plain)))
            descs[rank] = plain_descs(cls.plain)
            if keep:
                kept[rank] = (cls, seconds)
        hashes = [o.payload[1] for o in first]
        sends = [d if h is not None and hashes.index(h) == r else None for r, (d, h) in enumerate(zip(descs, hashes))]
        t0 = clock()
        combined = combine_replica_meshes([o.payload[0] for o in first])  # every rank computes the same
        combine_seconds = clock() - t0
        gathered, digests, groups_of = [], [], {}
        for rank in range(self.world):  # pass two: each rank plans and persists its index
            gc.freeze()  # what earlier ranks left is not this rank's to collect (in a job it is in another process)
            cls, seconds = kept.pop(rank) if rank in kept else classify(rank)
            if explicit_only and (cls.grid or cls.plain):
                raise AssertionError(f"rank {rank} declares grid or plain tensors; explicit_only does not hold")
            mesh_fingerprint.cache_clear()  # a rank's own process has only its own meshes in this cache
            t0 = clock()
            if hashes[rank] not in groups_of:  # one answer per set of plain tensors
                groups_of[hashes[rank]] = agree_plain_replicas(cls.plain, hashes, Gathered(rank, sends))
            plan = plan_agreed(cls, groups_of[hashes[rank]], combined, rank, self.world)
            self.stats.plan_seconds.append(seconds + combine_seconds + clock() - t0)
            gathered.append(self._persist(rank, cls, plan))
            digests.append(values_digest(cls.values))
        gc.unfreeze()
        firsts = {d: r for r, d in reversed(list(enumerate(digests)))}
        gathered = [(g[0], g[1], g[2], g[3] if firsts[digests[r]] == r else None) for r, g in enumerate(gathered)]
        return self._commit(gathered, digests)

    def _persist(self, rank: int, cls: Classified, plan: SavePlan) -> tuple:
        """The rank's index written for real, its data object a sparse file of the planned size."""
        prep = bind(plan, cls).for_attempt(ATTEMPT)
        t0 = clock()
        report = write_index(prep, self.store, self.block, _entries(prep.plan, self.block))
        self.stats.index_seconds.append(clock() - t0)
        self.stats.index_bytes.append(report.index.size)
        self.stats.pieces.append(len(plan.items))
        self.stats.index_hashes[rank] = (sum(piece_hash(i.tensor, i.region) for i in plan.items) % (1 << 64),
                                         len(plan.items))
        for obj, size in prep.plan.objects.items():
            path = os.path.join(self.root, obj)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.truncate(size)
        return (Outcome(True, report), plan.nbytes, sum(prep.plan.objects.values()), cls.values)

    def _commit(self, gathered: list[tuple], digests: list[str]) -> Manifest:
        t0 = clock()
        manifest, total = merge_gathered(gathered, digests, self.store.url, {"simulated": True}, ATTEMPT)
        t1 = clock()
        blob = manifest.to_json_bytes()
        self.stats.serialize_seconds = clock() - t1
        self.stats.merge_seconds = t1 - t0
        publish(self.store, blob)
        self.stats.manifest_bytes = len(blob)
        self.stats.tensor_bytes = total
        self.stats.tensors = len(manifest.tensors)
        return read_manifest(self.store)


def check_exactly_once(manifest: Manifest, where: str = "sim") -> int:
    """Every tensor of the manifest, grid or explicit, covered by its stored pieces exactly once
    (:func:`check_coverage` raises otherwise). Returns the elements checked."""
    elements = 0
    for key, meta in manifest.tensors.items():
        check_coverage(key, meta.shape, tuple(meta.stored_pieces()), where, named_axes(meta.rule))
        elements += meta.numel
    return elements


def check_indexes(manifest: Manifest, stats: SaveStats) -> None:
    """Every piece the manifest says rank ``w`` stored is in ``w``'s index, and ``w`` stored nothing else:
    what a loader trusts when it reads ``w``'s object for a piece (compared as per-writer sums of piece
    hashes and counts, one tensor at a time, so thousands of ranks' pieces are never held at once)."""
    sums: dict[int, list[int]] = {}
    for key, meta in manifest.tensors.items():
        for region, writer in meta.stored_pieces():
            if region.numel:
                slot = sums.setdefault(writer, [0, 0])
                slot[0] = (slot[0] + piece_hash(key, region)) % (1 << 64)
                slot[1] += 1
    for rank, (digest, count) in stats.index_hashes.items():
        got = tuple(sums.get(rank, (0, 0)))
        if got != (digest, count):
            raise AssertionError(f"rank {rank}: its index holds {count} pieces, the manifest assigns it {got[1]} "
                                 "(or other pieces)")
    extra = sorted(set(sums) - set(stats.index_hashes))
    if extra:
        raise AssertionError(f"the manifest assigns pieces to ranks {extra[:5]} that wrote none")


@dataclass
class LoadStats:
    """A simulated load at another layout: every target rank's metadata work, and what it would read."""

    ranks: int = 0
    manifest_parse_seconds: float = 0.0
    match_seconds: list[float] = field(default_factory=list)
    read_plan_seconds: list[float] = field(default_factory=list)
    total_seconds: list[float] = field(default_factory=list)
    indexes_needed: list[int] = field(default_factory=list)
    index_bytes_needed: list[int] = field(default_factory=list)
    requests: int = 0
    target_bytes: int = 0
    read_bytes: int = 0

    def summary(self) -> dict[str, Any]:
        n = max(1, self.ranks)
        return {
            "ranks": self.ranks, "manifest_parse_per_rank_s_max": self.manifest_parse_seconds,
            "match_per_rank_s_max": max(self.match_seconds, default=0),
            "read_plan_per_rank_s_max": max(self.read_plan_seconds, default=0),
            "match_per_rank_s_mean": sum(self.match_seconds) / n,
            "read_plan_per_rank_s_mean": sum(self.read_plan_seconds) / n,
            "per_rank_s_mean": sum(self.total_seconds) / n, "per_rank_s_max": max(self.total_seconds, default=0),
            "indexes_per_rank_max": max(self.indexes_needed, default=0),
            "index_bytes_per_rank_max": max(self.index_bytes_needed, default=0),
            "requests": self.requests, "target_bytes": self.target_bytes, "read_bytes": self.read_bytes,
        }


def load_targets(state: dict[str, Any], manifest: Manifest, where: str) -> list[Target]:
    """The pieces a load of ``state`` asks for, as the loader's ``_targets`` derives them (its dtype and
    shape checks included), without the destination buffers it also makes: those copy non-CPU tensors
    to the CPU, and these tensors are meta. Every key must be in the checkpoint."""
    flat = flatten_state(state)
    targets: list[Target] = []
    for ref, leaf in enumerate(flat.tensors):
        t = leaf.obj
        _check_meta(manifest, leaf.key, t.dtype, tuple(t.shape), where)
        if is_dtensor(t):
            layout, coord = grid_of(t, leaf.key)
            held = layout.local_pieces(coord)
            shape = tuple(local_of(t).shape)
            targets += [Target(ref, leaf.key, Region(box), shape, LocalBox(lo)) for lo, box in (held[1] if held else [])
                        if not box.is_empty()]
        elif t.numel():
            targets.append(Target(ref, leaf.key, Region(Box.full(tuple(t.shape))), tuple(t.shape), LocalBox((0,) * t.dim())))
    for ref, leaf in enumerate(flat.sharded, start=len(flat.tensors)):
        s = leaf.obj
        for p in s.pieces:
            _check_meta(manifest, p.tensor, s.local.dtype, p.shape, where)
            if p.numel:
                targets.append(Target(ref, p.tensor, p.region, tuple(s.local.shape), p.local))
    return targets


def grid_targets(cls: Classified, manifest: Manifest, where: str) -> list[Target]:
    """The targets of a rank declared by its classification (grid tensors at its coordinate), for SPMD
    ranks derived from one built rank (tests/scale_titan.py); dtypes and shapes checked like the loader's."""
    targets: list[Target] = []
    for ref, d in enumerate(cls.grid + cls.plain):
        meta = manifest.tensors[d.key]
        if (meta.dtype, tuple(meta.shape)) != (d.dtype, tuple(d.layout.shape)):
            raise AssertionError(f"{where}: {d.key} is {meta.dtype}{list(meta.shape)} stored, "
                                 f"{d.dtype}{list(d.layout.shape)} wanted")
        held = d.layout.local_pieces(d.coord)
        targets += [Target(ref, d.key, Region(box), tuple(d.local_shape), LocalBox(lo))
                    for lo, box in (held[1] if held else []) if not box.is_empty()]
    return targets


def simulate_load(root: str, ranks: Iterable[tuple[int, Any]]) -> LoadStats:
    """Plan the load of every given target rank from the checkpoint at ``root``: ``(rank, what)`` where
    ``what`` is the rank's state, or a function of the manifest returning its targets.

    Each rank opens its own session (parses the manifest, reads only the indexes it needs), as a job's
    ranks do; a rank whose targets the stored pieces do not cover raises CoverageError."""
    store = LocalStore(root)
    out = LoadStats()
    sizes = {r: ref.size for r, ref in read_manifest(store).indexes.items()}
    for rank, what in ranks:
        gc.freeze()  # what earlier ranks left is not this rank's to collect (in a job: another process)
        t0 = clock()
        manifest = read_manifest(store)  # each rank parses the manifest itself, and its layouts on first use
        session = ReadSession(store, manifest)
        t1 = clock()
        where = f"sim load rank {rank}"
        targets = what(manifest, where) if callable(what) else load_targets(what, manifest, where)
        ops = session.match(targets)
        t2 = clock()
        read = session.plan(ops)
        t3 = clock()
        out.manifest_parse_seconds = max(out.manifest_parse_seconds, t1 - t0)
        out.match_seconds.append(t2 - t1)
        out.read_plan_seconds.append(t3 - t2)
        out.total_seconds.append(t3 - t0)
        out.ranks += 1
        out.indexes_needed.append(len(read.writers))
        out.index_bytes_needed.append(sum(sizes[w] for w in read.writers))
        out.requests += len(read.requests)
        out.target_bytes += sum(t.region.numel * session.dtype(t.tensor).itemsize for t in targets)
        out.read_bytes += read.nbytes
    gc.unfreeze()
    return out


@dataclass
class ReshardStats:
    target: str
    ranks: int
    seconds: float
    tensors: int
    pieces: int
    unruled: list[str]
    bytes: int

    def summary(self) -> dict[str, Any]:
        return dict(self.__dict__)


def simulate_reshard(manifest: Manifest, target: ParallelConfig,
                     options: ReshardPlanOptions = ReshardPlanOptions(max_memory=8 << 30)) -> tuple[ReshardPlan, ReshardStats]:
    """``ckptkit reshard --to TARGET``'s plan (a source piece missing or doubled raises ReshardError),
    checked against the layout it records, and its output covering every tensor exactly once."""
    t0 = clock()
    plan = plan_reshard(manifest.tensors, target, options)
    seconds = clock() - t0
    check_plan(plan)
    for t in plan.tensors:
        meta = t.meta()
        check_coverage(t.key, meta.shape, tuple(meta.stored_pieces()), f"reshard to {target}", named_axes(t.rule))
    pieces = sum(len(t.pieces) for t in plan.tensors)
    return plan, ReshardStats(str(target), target.world_size, seconds, len(plan.tensors), pieces, list(plan.unruled),
                              plan.nbytes)


def scratch_dir(prefix: str) -> str:
    """A folder for a simulated checkpoint: in memory (/dev/shm) where there is one, as the thousands of
    index writes each fsync, and the sparse data objects take no space there either."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    return tempfile.mkdtemp(prefix=prefix, dir=base)
