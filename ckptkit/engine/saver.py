"""A save, phase by phase: classify -> plan -> (snapshot) -> check target -> persist -> commit.

* **classify** (local): sort the state's leaves into grid-laid tensors
  (DTensors, plain tensors), explicit pieces and values; fingerprint the
  structure so an unchanged structure can reuse its plan.
* **plan** (collective: one all-gather of small per-mesh reports): find meshes
  that replicate each other, decide this rank's writes.
* **check target** (collective: one broadcast): rank 0 refuses a committed
  checkpoint and names this save *attempt*: every object it writes carries
  the attempt id, so two writers of one step never share an object name.
* **persist**: write the data object and the index, durably.
* **commit**: ranks report to rank 0 (one gather; values are sent once per
  distinct set, found by an all-gather of digests), rank 0 merges and
  validates the manifest and publishes it atomically (put-if-absent), then
  tells everyone the outcome (one broadcast). A failed or losing attempt
  removes its own objects and nothing else.

Errors travel inside the collectives, so every rank raises the same
:class:`SaveError` and none is left waiting.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ckptkit.engine.dtensor_grid import grid_of, is_dtensor, local_of
from ckptkit.engine.checkpoint_dir import foreign_keys, new_attempt, remove_attempt, remove_other_attempts
from ckptkit.engine.collective import Comm, Outcome, failed_ranks, failure_text
from ckptkit.engine.state import FlatState, check_savable, check_state_root, dtype_name, flatten_state
from ckptkit.engine.writer import write_pieces
from ckptkit.errors import CheckpointNotFoundError, CkptkitError, CommitOutcomeUnknownError, SaveError
from ckptkit.version import __version__
from ckptkit.layout.grid import GridLayout, Mesh, Replicate
from ckptkit.layout.index import Index
from ckptkit.layout.manifest import MANIFEST_NAME, IndexRef, Manifest, sha256_hex
from ckptkit.layout.rules import PartitionRule, rule_from_grid
from ckptkit.layout.values import check_key, encode_value
from ckptkit.layout.strict_json import gc_paused
from ckptkit.plan.merge import RankReport, merge_reports, merge_values
from ckptkit.plan.mesh_replicas import MeshReport, PlainDesc, combine_replica_meshes, plain_group_mesh, plain_replica_groups
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
class Classified:
    """The state's leaves, sorted for planning, and the structure's fingerprint. Local.

    ``grid`` are DTensors (laid out on their device mesh), ``plain`` the plain tensors (a
    one-rank mesh each until the ranks holding the same key are found)."""

    grid: list[GridDecl]
    plain: list[GridDecl]
    explicit: list[ExplicitDecl]
    tensors: list[torch.Tensor]
    values: dict[str, Any]
    per_rank_values: dict[str, Any]
    per_rank_keys: tuple[str, ...]
    fingerprint: str
    watched: list[Any] = field(default_factory=list)  # FlatState.tensor_objects: what in-place changes move


@dataclass
class Prepared:
    """Everything persist and commit need: the plan and the tensors and values it refers to."""

    plan: SavePlan
    tensors: list[torch.Tensor]
    values: dict[str, Any]
    per_rank_values: dict[str, Any]
    per_rank_keys: tuple[str, ...]
    attempt: str | None = None
    watched: list[Any] | None = None  # Classified.watched (an overlapped snapshot checks their versions)

    def for_attempt(self, attempt: str) -> Prepared:
        """Bound to save attempt ``attempt``: its objects named for it (see :func:`data_object_key`)."""
        return replace(self, plan=self.plan.for_attempt(attempt), attempt=attempt)


def _fail(exc: BaseException) -> Outcome:
    """A rank's failure, carried through the next collective so every rank raises it (naming the
    rank) and none is left waiting. Any exception: one that is not ckptkit's or the storage's (a
    torch ``RuntimeError``, a ``MemoryError``, a bug) used to escape before the collective on its
    rank alone, and the other ranks waited there until the process group's timeout."""
    return Outcome(False, error=failure_text(exc, "saving"), error_type=type(exc).__name__)


def _raise_failures(outcomes: list[Outcome], rank: int, where: str, phase: str) -> None:
    if all(o.ok for o in outcomes):
        return
    raise SaveError(f"saving {where} failed during {phase}: "
                    + failed_ranks([None if o.ok else o.error for o in outcomes]))


def classify(flat: FlatState, rank: int, *,
             shapes_only: bool = False) -> tuple[list[GridDecl], list[GridDecl], list[ExplicitDecl], list[torch.Tensor]]:
    """DTensors -> grid decls on their mesh (replica meshes found by :func:`combine_replica_meshes`);
    plain tensors -> grid decls on a one-rank mesh (replicas found per key by
    :func:`plain_replica_groups`); Sharded -> explicit decls."""
    tensors: list[torch.Tensor] = []
    grid: list[GridDecl] = []
    plain: list[GridDecl] = []
    own = Mesh(("rank",), (1,), (rank,))
    for leaf in flat.tensors:
        t = leaf.obj
        check_savable(leaf.key, t, shapes_only)
        if is_dtensor(t):
            layout, coord = grid_of(t, leaf.key)
            local = local_of(t)
        else:
            local = t
            layout, coord = GridLayout(own, (Replicate(),), tuple(t.shape)), (0,)
        tensors.append(local)
        # a DTensor's layout also as a degree-independent rule, so `reshard --to` can lay it out anew
        rule = rule_from_grid(layout, leaf.expert_axis) if is_dtensor(t) else None
        (grid if is_dtensor(t) else plain).append(
            GridDecl(len(tensors) - 1, leaf.key, dtype_name(t.dtype), t.dtype.itemsize, tuple(local.shape), layout, coord,
                     rule)
        )
    explicit: list[ExplicitDecl] = []
    for leaf in flat.sharded:
        s = leaf.obj
        check_savable(leaf.key, s.local, shapes_only)
        tensors.append(s.local)
        explicit.append(
            ExplicitDecl(len(tensors) - 1, dtype_name(s.local.dtype), s.local.dtype.itemsize, tuple(s.local.shape), s.pieces,
                         s.rule)
        )
    return grid, plain, explicit, tensors


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


def plain_descs(plain: list[GridDecl]) -> tuple[PlainDesc, ...]:
    return tuple(sorted((d.key, d.dtype, tuple(d.layout.shape)) for d in plain))


def _plain_hash(plain: list[GridDecl]) -> str | None:
    return hashlib.sha256(repr(plain_descs(plain)).encode()).hexdigest()[:32] if plain else None


def agree_plain_replicas(plain: list[GridDecl], hashes: list[str | None], comm: Comm) -> dict[str, tuple[int, ...]]:
    """``key -> holder ranks`` of the plain tensors two or more ranks hold. Collective when ranks
    hold different sets of plain tensors (then every rank enters one more all-gather, in which the
    first rank holding each distinct set sends it); every rank computes the same answer."""
    distinct = sorted({h for h in hashes if h is not None})
    ranks_of = {h: tuple(r for r, x in enumerate(hashes) if x == h) for h in distinct}
    if len(distinct) <= 1:
        holders = ranks_of[distinct[0]] if distinct else ()
        return {d.key: holders for d in plain} if len(holders) > 1 else {}
    mine = hashes[comm.rank]
    first = mine is not None and ranks_of[mine][0] == comm.rank
    sets = comm.all_gather(plain_descs(plain) if first else None)
    return plain_replica_groups([(sets[ranks_of[h][0]], ranks_of[h]) for h in distinct])


def apply_plain_groups(plain: list[GridDecl], groups: dict[str, tuple[int, ...]], rank: int,
                       world_size: int) -> list[GridDecl]:
    """Move plain tensors held by several ranks onto the mesh of their holders (Replicate).

    One every rank holds (an optimizer's step count next to DTensor parameters) is replicated at
    any layout: it gets that rule, so ``reshard --to`` places it like the rest."""
    out, positions = [], {}
    for d in plain:
        holders = groups.get(d.key)
        if holders is None:
            out.append(d)
            continue
        where = positions.get(holders)
        if where is None:
            where = positions[holders] = (plain_group_mesh(holders), holders.index(rank))
        layout = GridLayout(where[0], (Replicate(), Replicate()), d.layout.shape)
        rule = PartitionRule() if len(holders) == world_size else d.rule
        out.append(replace(d, layout=layout, coord=(where[1], 0), rule=rule))
    return out


def encode_values(flat: FlatState) -> tuple[dict[str, Any], dict[str, Any], tuple[str, ...]]:
    values = {leaf.key: encode_value(leaf.obj, leaf.key) for leaf in flat.values}
    per_rank: dict[str, Any] = {}
    for leaf in flat.generators:
        check_key(leaf.key)
        state = leaf.obj.get_state()
        per_rank[leaf.key] = {"__generator__": base64.b64encode(state.numpy().tobytes()).decode("ascii")}
    for leaf in flat.per_rank:
        per_rank[leaf.key] = encode_value(leaf.obj.value, leaf.key)
    return values, per_rank, tuple(sorted(per_rank))


@dataclass(frozen=True)
class Target:
    """A save attempt's target, as rank 0 found it: the attempt's id, and whether objects of
    other (crashed or concurrent) attempts were there."""

    attempt: str
    leftovers: bool


def check_target(store: ByteStore) -> Target:
    """Rank 0, before anything is written: refuse a committed target or a folder that is not a
    checkpoint's, and name this attempt.

    Leftovers of other attempts are left alone: one may be a crashed save, but one may be another
    job saving the same step right now, and deleting its objects would corrupt its checkpoint.
    Whichever attempt commits removes the others' objects (:func:`remove_other_attempts`)."""
    if store.exists(MANIFEST_NAME):
        raise SaveError(
            f"{store.url} already holds a committed checkpoint; ckptkit never overwrites one "
            "(save to a new path, or delete it first; a CheckpointManager that restored an older step on "
            "purpose, with at_most=, drops the newer ones with discard_after(step))"
        )
    leftovers = bool(store.list_children())
    if leftovers:
        foreign = foreign_keys(store)
        if foreign:
            shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
            raise SaveError(
                f"{store.url} is not empty and holds files ckptkit did not write ({shown}); "
                "refusing to save there (is it a run directory rather than a checkpoint path?)"
            )
    return Target(new_attempt(), leftovers)


def classify_state(flat: FlatState, rank: int, *, shapes_only: bool = False) -> Classified:
    """Every leaf's declaration; made with the collector paused (a declaration per tensor, at every
    synchronous save: :meth:`~ckptkit.layout.index.Index.to_json_bytes`). ``shapes_only``: meta tensors
    are planned too (a plan needs shapes only: the scale simulations plan thousands of ranks' states
    without their memory); a save refuses them."""
    with gc_paused():
        grid, plain, explicit, tensors = classify(flat, rank, shapes_only=shapes_only)
        values, per_rank_values, per_rank_keys = encode_values(flat)
    return Classified(grid, plain, explicit, tensors, values, per_rank_values, per_rank_keys,
                      structure_fingerprint(grid + plain, explicit), flat.tensor_objects())


def structure_fingerprint(grid: list[GridDecl], explicit: list[ExplicitDecl]) -> str:
    """Identity of everything a plan depends on (not of tensor values): an asynchronous save reuses the
    plan of an equal fingerprint. The partition rule is part of it (the manifest records it; until
    2026-12-06 a save whose rule alone changed committed the previous save's), and so is each leaf's
    position in the state (the plan binds tensors by it)."""
    h = hashlib.sha256()
    for d in grid:
        lay = d.layout
        h.update(repr((d.ref, d.key, d.dtype, d.local_shape, mesh_fingerprint(lay.mesh), lay.placements, lay.shape,
                       lay.padded, lay.fused, d.coord, d.rule)).encode())
    for e in explicit:
        h.update(repr((e.ref, e.dtype, e.local_shape, e.pieces, e.rule)).encode())
    return h.hexdigest()


def plan_collective(cls: Classified | None, failure: Outcome, comm: Comm, where: str) -> tuple[SavePlan | None, Outcome]:
    """Agree on mesh replicas and plan this rank's writes. Collective (one all-gather).

    ``failure`` is this rank's classification error, if any: it travels in the
    all-gather, so every rank raises it. A planning error after the gather is
    returned, to be carried to the commit gather, so no rank is left waiting.
    """
    first = (Outcome(True, (mesh_reports(cls.grid), _plain_hash(cls.plain)))
             if cls is not None and failure.ok else failure)
    outcomes = comm.all_gather(first)
    _raise_failures(outcomes, comm.rank, where, "preparation")
    assert cls is not None
    try:
        groups = agree_plain_replicas(cls.plain, [o.payload[1] for o in outcomes], comm)
        combined = combine_replica_meshes([o.payload[0] for o in outcomes])
        with gc_paused():  # an item per piece (Index.to_json_bytes); after the gathers, so no wait is paused
            return plan_agreed(cls, groups, combined, comm.rank, comm.world_size), Outcome(True)
    except Exception as exc:  # noqa: BLE001 - carried to the commit gather
        return None, _fail(exc)


def plan_agreed(cls: Classified, groups: dict[str, tuple[int, ...]], combined: dict[str, tuple[Mesh, int]], rank: int,
                world_size: int) -> SavePlan:
    """This rank's plan once the ranks agree on replicas (the part of :func:`plan_collective` after its
    gathers): pure, so a simulation of many ranks in one process plans each exactly as a job would."""
    decls = apply_replica_meshes(cls.grid, combined) + apply_plain_groups(cls.plain, groups, rank, world_size)
    return plan_save(rank, decls, cls.explicit)


def bind(plan: SavePlan, cls: Classified) -> Prepared:
    """A plan (possibly cached from an earlier save of the same structure) with this save's tensors."""
    return Prepared(plan, cls.tensors, cls.values, cls.per_rank_values, cls.per_rank_keys, watched=cls.watched)


def check_target_collective(store: ByteStore, comm: Comm) -> Target:
    """Rank 0 checks the target and names the attempt; all raise on failure, all learn the attempt."""
    outcome = Outcome(True)
    if comm.rank == 0:
        try:
            outcome = Outcome(True, check_target(store))
        except Exception as exc:  # noqa: BLE001 - carried through the broadcast below
            outcome = _fail(exc)
    outcome = comm.broadcast(outcome)
    _raise_failures([outcome], comm.rank, store.url, "preparation")
    return outcome.payload


def persist(
    prep: Prepared,
    store: ByteStore,
    block: int,
    progress: Callable[[int], None] | None = None,
    release: Callable[[int], None] | None = None,
) -> RankReport:
    """Write this rank's data object(s) from the live tensors, then its index, durably. Not collective.

    ``release(ref)``, when given, is told that tensor ``ref``'s bytes are written and checksummed
    (called once per written piece of it)."""
    entries = write_pieces(store, prep.plan, lambda item: prep.tensors[item.ref], block, progress,
                           None if release is None else lambda item: release(item.ref))
    return write_index(prep, store, block, entries)


def write_index(prep: Prepared, store: ByteStore, block: int, entries: list) -> RankReport:
    """Write this rank's index (after its data is durable) and the report for the coordinator."""
    index = Index(prep.plan.rank, block, dict(prep.plan.objects), entries, prep.per_rank_values)
    data = index.to_json_bytes()
    key = index_object_key(prep.plan.rank, prep.attempt)
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
    report: Outcome, prep: Prepared | None, store: ByteStore, comm: Comm, metadata: dict[str, Any] | None,
    deadline: float | None = None, target: Target | None = None,
) -> int:
    """Gather reports and values, merge, publish the manifest; return the checkpoint's total bytes.
    Collective (an all-gather of value digests, a gather, a broadcast)."""
    object_bytes = sum(prep.plan.objects.values()) if prep is not None else 0
    values = prep.values if prep is not None else {}
    digests = comm.all_gather(values_digest(values))
    send = values if digests.index(digests[comm.rank]) == comm.rank else None  # each distinct set once
    gathered = comm.gather((report, prep.plan.nbytes if prep is not None else 0, object_bytes, send))
    outcome: Outcome
    attempt = target.attempt if target is not None else None
    if comm.rank == 0:
        assert gathered is not None
        try:
            _raise_failures([g[0] for g in gathered], 0, store.url, "planning or persist")
            if deadline is not None and time.monotonic() > deadline:
                raise SaveError(f"{store.url}: abandoned: the save could not be committed before its deadline")
            with gc_paused():  # every rank's report becomes the manifest's objects (Index.to_json_bytes)
                manifest, total = merge_gathered(gathered, digests, store.url, metadata, attempt)
            publish(store, manifest.to_json_bytes())
            outcome = Outcome(True, total)
        except Exception as exc:  # noqa: BLE001 - carried through the broadcast below
            outcome = _fail(exc)
            if not isinstance(exc, (CkptkitError, OSError)):  # the coordinator's own failure: say whose
                outcome = replace(outcome, error=f"rank {comm.rank} (committing): {outcome.error}")
            if not isinstance(exc, CommitOutcomeUnknownError):  # a commit that may have happened keeps what it names
                _clean_up_failed(store, attempt)
        else:
            if target is not None and target.leftovers:
                _remove_other_attempts(store, target.attempt)
    else:
        outcome = Outcome(True)
    outcome = comm.broadcast(outcome)
    if not outcome.ok:
        raise SaveError(outcome.error if outcome.error.startswith("saving") else f"saving {store.url} failed: {outcome.error}")
    return int(outcome.payload)


def merge_gathered(gathered: list[Any], digests: list[str], where: str, metadata: dict[str, Any] | None,
                   attempt: str | None) -> tuple[Manifest, int]:
    """Rank 0's merge of what :func:`commit` gathered (per rank: its report, tensor bytes, object bytes
    and its values if first with their digest) into the manifest; and the checkpoint's tensor bytes.
    Pure, apart from the creation time: a simulation of many ranks merges exactly as a job does."""
    total = sum(g[1] for g in gathered)
    stored = sum(g[2] + g[0].payload.index.size for g in gathered)
    meta = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ckptkit_version": __version__,
        "tensor_bytes": total,  # model-space bytes of every stored piece
        "stored_bytes": stored,  # data objects (with alignment) and indexes, without the manifest
        "user": encode_value(dict(metadata or {}), "metadata"),
    }
    agreed, rank_values = merge_values(_value_groups(digests, [g[3] for g in gathered]))
    manifest = merge_reports([g[0].payload for g in gathered], world_size=len(gathered), values=agreed,
                             rank_values=rank_values, meta=meta, parallel=None, where=where, attempt=attempt)
    if rank_values:
        log.warning("%s: values %s differ between ranks; each rank's own value is stored and restored to it "
                    "(wrap such values in ckptkit.PerRank to say so)", where, sorted(rank_values)[:5])
    return manifest, total


def values_digest(values: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(values, separators=(",", ":"), allow_nan=False).encode()).hexdigest()


def _value_groups(digests: list[str], sent: list[dict[str, Any] | None]) -> list[tuple[dict[str, Any], tuple[int, ...]]]:
    """The distinct value sets of the world and the ranks holding each (one rank sent each)."""
    groups: dict[str, tuple[dict[str, Any], list[int]]] = {}
    for rank, digest in enumerate(digests):
        if digest not in groups:
            values = sent[rank]
            assert values is not None  # the first rank with each digest sends its values
            groups[digest] = (values, [])
        groups[digest][1].append(rank)
    return [(v, tuple(r)) for v, r in groups.values()]


def publish(store: ByteStore, manifest: bytes) -> None:
    """The commit: create the manifest if absent. If every answer to the request was lost,
    whether it happened is decided by reading the manifest back."""
    try:
        if store.put_if_absent(MANIFEST_NAME, manifest):
            return
    except (CkptkitError, OSError) as exc:
        stored = _read_back(store, exc)
        if stored is None:
            raise exc from None  # no manifest there: nothing was committed
        if stored == manifest:
            log.warning("commit of %s: the answer was lost but the manifest is ours; committed", store.url)
            return
        raise SaveError(f"{store.url}: another writer committed this checkpoint first") from exc
    raise SaveError(f"{store.url}: another writer committed this checkpoint first")


def _read_back(store: ByteStore, failure: BaseException, tries: int = 4) -> bytes | None:
    """The manifest as stored after a commit whose answer was lost (None: there is none), read again
    with backoff while the store fails; :class:`CommitOutcomeUnknownError` if it never answers."""
    pause = 0.5
    for attempt in range(tries):
        try:
            return store.read_bytes(MANIFEST_NAME)
        except CheckpointNotFoundError:
            return None
        except (CkptkitError, OSError) as exc:
            if attempt == tries - 1:
                raise CommitOutcomeUnknownError(
                    f"{store.url}: the commit's answer was lost ({failure}) and its manifest could not be read "
                    f"back to learn whether it happened ({exc}); its objects are kept: `ckptkit verify` says "
                    "whether it committed, and gc removes it if not") from exc
            time.sleep(pause)
            pause *= 2
    return None


def _clean_up_failed(store: ByteStore, attempt: str | None) -> None:
    """Best effort, never raising: the outcome must still reach every rank. Removes this
    attempt's objects only — a racing writer's (committed or not) are not ours."""
    if attempt is None:
        return
    try:
        remove_attempt(store, attempt)
    except (CkptkitError, OSError) as exc:
        log.warning("could not clean up the failed save at %s: %s", store.url, exc)


def _remove_other_attempts(store: ByteStore, attempt: str) -> None:
    try:
        removed = remove_other_attempts(store, attempt)
        if removed:
            log.info("removed %d objects of other save attempts at %s", len(removed), store.url)
    except (CkptkitError, OSError) as exc:
        log.warning("could not remove leftovers of other save attempts at %s: %s", store.url, exc)


def save_state(
    state: Any,
    store: ByteStore,
    comm: Comm,
    *,
    block: int,
    metadata: dict[str, Any] | None = None,
    deadline: float | None = None,
) -> SaveResult:
    """Save the nested ``state`` (a synchronous save). Collective; a state one rank cannot save (a
    tensor it cannot store, two keys that collide) fails every rank, naming that rank."""
    t0 = time.perf_counter()
    check_state_root(state)
    cls, failure = None, Outcome(True)
    try:
        cls = classify_state(flatten_state(state), comm.rank)
    except Exception as exc:  # noqa: BLE001 - carried through the planning gather
        failure = _fail(exc)
    plan, report = plan_collective(cls, failure, comm, store.url)
    target = check_target_collective(store, comm)
    prep = bind(plan, cls).for_attempt(target.attempt) if plan is not None and cls is not None else None
    if prep is not None:
        try:
            report = Outcome(True, persist(prep, store, block))
        except Exception as exc:  # noqa: BLE001 - carried through the commit gather
            report = _fail(exc)
    total = commit(report, prep, store, comm, metadata, deadline, target)
    assert prep is not None  # commit raised otherwise
    seconds = time.perf_counter() - t0
    log.info(
        "saved %s: %.3f GiB on rank %d, %.3f GiB total in %.2fs (%.2f GiB/s per rank)",
        store.url, prep.plan.nbytes / 2**30, comm.rank, total / 2**30, seconds,
        prep.plan.nbytes / 2**30 / max(seconds, 1e-9),
    )
    return SaveResult(store.url, prep.plan.nbytes, total, seconds)
