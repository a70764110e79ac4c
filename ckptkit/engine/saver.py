"""A save, phase by phase: prepare -> (snapshot) -> persist -> commit.

* **prepare** (every rank, on the caller's thread): classify the state's
  leaves, agree on who holds which plain tensors (one all-gather of a
  fingerprint per rank), plan this rank's writes. Rank 0 also checks the
  target: a committed checkpoint there is never overwritten; leftovers of a
  crashed save are removed.
* **persist**: write the data object and the index, durably.
* **commit**: ranks report to rank 0 (one gather), rank 0 merges and
  validates the manifest and publishes it atomically (put-if-absent), then
  tells everyone the outcome (one broadcast).

Errors travel inside the collectives, so every rank raises the same
:class:`SaveError` and none is left waiting.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ckptkit.adapters.dtensor import grid_of, is_dtensor, local_of
from ckptkit.engine.checkpoint_dir import remove_uncommitted
from ckptkit.engine.collective import Comm, Outcome
from ckptkit.engine.state import FlatState, dtype_name
from ckptkit.engine.writer import write_pieces
from ckptkit.errors import CkptkitError, SaveError
from ckptkit.version import __version__
from ckptkit.layout.grid import GridLayout, Mesh, Replicate
from ckptkit.layout.manifest import MANIFEST_NAME, Index, IndexRef, sha256_hex
from ckptkit.layout.values import encode_value
from ckptkit.plan.merge import RankReport, merge_reports
from ckptkit.plan.mesh_replicas import MeshReport, combine_replica_meshes
from ckptkit.plan.save_plan import ExplicitDecl, GridDecl, SavePlan, index_object_key, mesh_fingerprint, plan_save
from ckptkit.storage.base import ByteStore

log = logging.getLogger("ckptkit")


@dataclass(frozen=True)
class SaveResult:
    """What a finished save reports on every rank."""

    path: str
    rank_bytes: int
    total_bytes: int
    seconds: float


@dataclass
class Prepared:
    """Everything persist and commit need, decided on the caller's thread."""

    plan: SavePlan
    tensors: list[torch.Tensor]
    values: dict[str, Any]
    per_rank_values: dict[str, Any]
    per_rank_keys: tuple[str, ...]
    decls: tuple[list[GridDecl], list[ExplicitDecl]] = field(default_factory=lambda: ([], []))


def _fail(exc: BaseException) -> Outcome:
    return Outcome(False, error=str(exc) or type(exc).__name__, error_type=type(exc).__name__)


def _raise_failures(outcomes: list[Outcome], rank: int, where: str, phase: str) -> None:
    failed = [(r, o) for r, o in enumerate(outcomes) if not o.ok]
    if not failed:
        return
    lines = "; ".join(f"rank {r}: {o.error}" for r, o in failed[:4])
    more = f" (and {len(failed) - 4} more ranks)" if len(failed) > 4 else ""
    raise SaveError(f"saving {where} failed during {phase}: {lines}{more}")


def classify(flat: FlatState, rank: int) -> tuple[list[GridDecl], list[ExplicitDecl], list[torch.Tensor]]:
    """DTensors -> grid decls on their mesh; plain tensors -> grid decls on a one-rank mesh
    (replicas across ranks are found by :func:`combine_replica_meshes`); Sharded -> explicit decls."""
    tensors: list[torch.Tensor] = []
    grid: list[GridDecl] = []
    own = Mesh(("rank",), (1,), (rank,))
    for leaf in flat.tensors:
        t = leaf.obj
        if is_dtensor(t):
            layout, coord = grid_of(t, leaf.key)
            local = local_of(t)
        else:
            local = t
            layout, coord = GridLayout(own, (Replicate(),), tuple(t.shape)), (0,)
        tensors.append(local)
        grid.append(
            GridDecl(len(tensors) - 1, leaf.key, dtype_name(t.dtype), t.dtype.itemsize, tuple(local.shape), layout, coord)
        )
    explicit: list[ExplicitDecl] = []
    for leaf in flat.sharded:
        s = leaf.obj
        tensors.append(s.local)
        explicit.append(
            ExplicitDecl(len(tensors) - 1, dtype_name(s.local.dtype), s.local.dtype.itemsize, tuple(s.local.shape), s.pieces)
        )
    return grid, explicit, tensors


def mesh_reports(grid: list[GridDecl]) -> list[MeshReport]:
    """Per mesh this rank holds grid tensors on: its fingerprint, what it holds, where this rank sits."""
    by_mesh: dict[str, list[GridDecl]] = {}
    for d in grid:
        by_mesh.setdefault(mesh_fingerprint(d.layout.mesh), []).append(d)
    out = []
    for fp, decls in by_mesh.items():
        content = sorted(
            (d.key, d.dtype, d.layout.shape, repr(d.layout.placements), d.layout.padded, repr(d.layout.fused))
            for d in decls
        )
        mesh = decls[0].layout.mesh
        key_hash = hashlib.sha256(repr(content).encode()).hexdigest()[:32]
        out.append(MeshReport(fp, key_hash, mesh.dims, mesh.shape, decls[0].coord))
    return out


def apply_replica_meshes(grid: list[GridDecl], combined: dict[str, tuple[Mesh, int]]) -> list[GridDecl]:
    """Move decls whose mesh has replicas onto the combined mesh (Replicate along the new dim)."""
    out = []
    for d in grid:
        hit = combined.get(mesh_fingerprint(d.layout.mesh))
        if hit is None:
            out.append(d)
            continue
        mesh, index = hit
        layout = GridLayout(mesh, (Replicate(), *d.layout.placements), d.layout.shape, d.layout.padded, d.layout.fused)
        out.append(replace(d, layout=layout, coord=(index, *d.coord)))
    return out


def encode_values(flat: FlatState) -> tuple[dict[str, Any], dict[str, Any], tuple[str, ...]]:
    values = {leaf.key: encode_value(leaf.obj, leaf.key) for leaf in flat.values}
    per_rank: dict[str, Any] = {}
    for leaf in flat.generators:
        state = leaf.obj.get_state()
        per_rank[leaf.key] = {"__generator__": base64.b64encode(state.numpy().tobytes()).decode("ascii")}
    for leaf in flat.per_rank:
        per_rank[leaf.key] = encode_value(leaf.obj.value, leaf.key)
    return values, per_rank, tuple(sorted(per_rank))


def check_target(store: ByteStore) -> None:
    """Rank 0, before anything is written: refuse a committed target, clear a crashed one."""
    if store.exists(MANIFEST_NAME):
        raise SaveError(
            f"{store.url} already holds a committed checkpoint; ckptkit never overwrites one "
            "(save to a new path, or delete it first)"
        )
    if store.list_children():
        removed = remove_uncommitted(store)
        if removed:
            log.warning("removed %d leftover objects of an uncommitted save at %s", len(removed), store.url)


def prepare(flat: FlatState, store: ByteStore, comm: Comm) -> tuple[Prepared | None, Outcome]:
    """Classify, agree on plain-tensor replica groups, check the target, plan. Collective.

    Returns the prepared save, or None and the failure; a failure on one rank
    after the all-gather is carried to the commit gather rather than raised,
    so the other ranks are not left waiting.
    """
    try:
        grid, explicit, tensors = classify(flat, comm.rank)
        values, per_rank_values, per_rank_keys = encode_values(flat)
        reports = mesh_reports(grid)
        if comm.rank == 0:
            check_target(store)
        first = Outcome(True, reports)
    except (CkptkitError, OSError) as exc:
        first = _fail(exc)
    outcomes = comm.all_gather(first)
    _raise_failures(outcomes, comm.rank, store.url, "preparation")
    try:
        combined = combine_replica_meshes([o.payload for o in outcomes])
        grid = apply_replica_meshes(grid, combined)
        plan = plan_save(comm.rank, grid, explicit)
    except CkptkitError as exc:
        return None, _fail(exc)
    return Prepared(plan, tensors, values, per_rank_values, per_rank_keys, (grid, explicit)), Outcome(True)


def persist(
    prep: Prepared,
    store: ByteStore,
    block: int,
    tensor_for: Callable[[Any], torch.Tensor] | None = None,
    progress: Callable[[int], None] | None = None,
) -> RankReport:
    """Write this rank's data object(s) and index, durably. Not collective."""
    source = tensor_for or (lambda item: prep.tensors[item.ref])
    entries = write_pieces(store, prep.plan, source, block, progress)
    index = Index(prep.plan.rank, block, dict(prep.plan.objects), entries, prep.per_rank_values)
    data = index.to_json_bytes()
    key = index_object_key(prep.plan.rank)
    store.put_bytes(key, data)
    return RankReport(
        prep.plan.rank,
        IndexRef(prep.plan.rank, key, len(data), sha256_hex(data)),
        prep.plan.grid_reports,
        prep.plan.explicit_reports,
        prep.plan.rotation_digest,
        prep.per_rank_keys,
    )


def commit(
    report: Outcome, prep: Prepared | None, store: ByteStore, comm: Comm, metadata: dict[str, Any] | None
) -> int:
    """Gather reports, merge, publish the manifest; return the checkpoint's total bytes. Collective."""
    object_bytes = sum(prep.plan.objects.values()) if prep is not None else 0
    gathered = comm.gather((report, prep.plan.nbytes if prep is not None else 0, object_bytes))
    outcome: Outcome
    if comm.rank == 0:
        assert gathered is not None
        try:
            _raise_failures([g[0] for g in gathered], 0, store.url, "persist")
            total = sum(g[1] for g in gathered)
            stored = sum(g[2] + g[0].payload.index.size for g in gathered)
            meta = {
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "ckptkit_version": __version__,
                "tensor_bytes": total,  # model-space bytes of every stored piece
                "stored_bytes": stored,  # data objects (with alignment) and indexes, without the manifest
                "user": encode_value(dict(metadata or {}), "metadata"),
            }
            manifest = merge_reports(
                [g[0].payload for g in gathered],
                world_size=comm.world_size,
                values=prep.values if prep is not None else {},
                meta=meta,
                parallel=None,
                where=store.url,
            )
            if not store.put_if_absent(MANIFEST_NAME, manifest.to_json_bytes()):
                raise SaveError(f"{store.url}: another writer committed this checkpoint first")
            outcome = Outcome(True, total)
        except (CkptkitError, OSError) as exc:
            outcome = _fail(exc)
            if not store.exists(MANIFEST_NAME):
                try:
                    remove_uncommitted(store)  # an uncommitted save leaves nothing behind
                except (CkptkitError, OSError):
                    log.warning("could not clean up the failed save at %s", store.url)
    else:
        outcome = Outcome(True)
    outcome = comm.broadcast(outcome)
    if not outcome.ok:
        raise SaveError(outcome.error if outcome.error.startswith("saving") else f"saving {store.url} failed: {outcome.error}")
    return int(outcome.payload)


def save_state(
    flat: FlatState,
    store: ByteStore,
    comm: Comm,
    *,
    block: int,
    metadata: dict[str, Any] | None = None,
) -> SaveResult:
    t0 = time.perf_counter()
    prep, report = prepare(flat, store, comm)
    if prep is not None:
        try:
            report = Outcome(True, persist(prep, store, block))
        except (CkptkitError, OSError) as exc:
            report = _fail(exc)
    total = commit(report, prep, store, comm, metadata)
    assert prep is not None  # commit raised otherwise
    seconds = time.perf_counter() - t0
    log.info(
        "saved %s: %.3f GiB on rank %d, %.3f GiB total in %.2fs (%.2f GiB/s per rank)",
        store.url, prep.plan.nbytes / 2**30, comm.rank, total / 2**30, seconds,
        prep.plan.nbytes / 2**30 / max(seconds, 1e-9),
    )
    return SaveResult(store.url, prep.plan.nbytes, total, seconds)
