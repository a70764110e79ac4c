"""Restoring from the memory tier: the newest step every rank can get back, and from where.

Collective over the job. In order:

1. **Inventory.** Each rank lists the committed copies it manages in its node folder, with the
   metadata each copy's manifest records (step, rank, world size, layout fingerprint), and the
   parity shares it holds; one all-gather shares them, with every rank's current fingerprint.
   Copies taken at another world size or layout never count (and the log says so plainly).
2. **Choose a step.** The newest step (not older than ``at_least``, not newer than ``at_most``)
   for which :func:`~ckptkit.memory.topology.plan_sources` finds a source for every rank.
3. **Check what the plan uses.** The sources are planned on the inventory, and each holder
   checks the peers' copies, rebuild inputs and shares *that plan uses* end to end (digests of the
   metadata, a CRC32C of every block; a share against its digest); the failures are gathered and
   the step planned anew without them, until a plan uses only checked sources. An own copy that
   only its rank reads is checked by that rank's load, which checks every CRC and digest of what
   it reads (when a persistent step exists to fall back on; before the first one, own copies are
   checked first too, so that a damaged one leaves the state untouched). A source that fails is
   never used: the plan falls back to the next source (own ->
   peer -> parity) or the step to an older one, with a warning. Why not check everything first:
   a restart or a rollback with every node's memory intact reads every rank's own copy, and
   checking it before loading it, and the replicas or shares as well, read each snapshot two or
   three times (at a thousand nodes, every replica for the one node lost).
4. **Move and load.** Copies and shares travel over the tier's group in one agreed order; a rank
   whose copy came from a peer or a parity rebuild writes it into its own node folder (its node
   is protected again), then loads its local state from it. An own copy that fails its load is
   left out and the step planned once more; any other failure on any rank is agreed and the next
   older step is tried; none left means the persistent checkpoint. A step that failed after some
   rank loaded has written into the state, which the caller is told (``restore_latest`` then
   raises rather than report an untouched state).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from ckptkit.engine.collective import LocalComm
from ckptkit.engine.loader import load_state, overwrote_state
from ckptkit.engine.metadata_io import read_manifest
from ckptkit.engine.state import flatten_state
from ckptkit.errors import CorruptCheckpointError, ManifestError
from ckptkit.layout.manifest import MANIFEST_NAME
from ckptkit.layout.strict_json import MAX_LAYOUT_INT, MAX_WORLD, as_dict, as_int, as_str
from ckptkit.layout.values import decode_value
from ckptkit.memory import rebuild
from ckptkit.memory.local_view import LocalView, local_view
from ckptkit.memory.node_folder import verified
from ckptkit.memory.tier import MemorySnapshots
from ckptkit.memory.topology import ParityShare, Source, plan_sources

log = logging.getLogger("ckptkit")


@dataclass(frozen=True)
class RestoreInfo:
    """What the last restore did: the step, where this rank's state came from (``"memory"``,
    ``"peer"``, ``"parity"`` or ``"persistent"``), every rank's source, and the seconds it took."""

    step: int
    source: str
    sources: tuple[str, ...]
    seconds: float


@dataclass(frozen=True)
class _Copy:
    rank: int
    world_size: int
    fingerprint: str


def _inventory(tier: MemorySnapshots, at_most: int, history: tuple[int, tuple[int, ...]]) -> dict[int, dict[str, Any]]:
    """step -> {"copies": [_Copy...], "shares": [(holder, members, index)]} of what this process
    manages, leaving out what belongs to another run or to a history deleted since (:func:`_foreign`).

    Each entry is read alone, and *any* failure to read one (a damaged or hostile manifest or share
    header: whatever it raises) makes that entry unusable, logged with its file, never this rank's
    restore: the inventory comes before the restore's first agreement, and a rank that left here
    would leave every other rank waiting in it until the group's timeout."""
    out: dict[int, dict[str, Any]] = {}
    for step in tier.folder.steps():
        if step > at_most:
            continue
        readers = [(r, f"{tier.folder.rank_store(step, r).url} (rank {r}'s copy of step {step})",
                    functools.partial(_copy_entry, tier, step, r, history)) for r in tier.folder.ranks_at(step)]
        readers += [(h, f"{tier.folder.step_path(step)}/share-{h:05d}.json (parity share {h} of step {step})",
                     functools.partial(_share_entry, tier, step, h, history)) for h in tier.folder.shares_at(step)]
        found: list[Any] = []
        foreign: str | None = None
        for holder, where, read in readers:
            got = _entry(where, read) if tier.claims(holder) else None
            if isinstance(got, str):
                foreign = foreign or got
            elif got is not None:
                found.append(got)
        copies = [g for g in found if isinstance(g, _Copy)]
        shares = [g for g in found if isinstance(g, tuple)]
        if foreign is not None:
            log.warning("memory tier: step %d in %s is not restored: %s", step, tier.folder.root, foreign)
        if copies or shares:
            out[step] = {"copies": copies, "shares": shares}
    return out


def _entry(where: str, read: Any) -> Any:
    """``read()``: an entry, or why it is another run's (a string), or None when it cannot be read at
    all, whatever it raised (logged, naming ``where``)."""
    try:
        return read()
    except Exception as exc:  # noqa: BLE001 - any failure is this entry's, never a rank leaving the restore
        log.warning("memory tier: %s is unreadable, not used: %s: %s", where, type(exc).__name__, exc)
        return None


def _copy_entry(tier: MemorySnapshots, step: int, r: int, history: tuple[int, tuple[int, ...]]) -> _Copy | str | None:
    """Rank ``r``'s copy of ``step`` as its manifest records it (checked: exact types, bounded
    integers), or why it is not this run's; CorruptCheckpointError naming the manifest if damaged."""
    store = tier.folder.rank_store(step, r)
    where = f"{store.url}/{MANIFEST_NAME}"
    try:
        meta = as_dict(decode_value(read_manifest(store).meta.get("user", {}), "memory tier"), f"{where}: user")
        copy = _Copy(as_int(meta.get("rank"), f"{where}: rank", 0, MAX_WORLD - 1),
                     as_int(meta.get("world_size"), f"{where}: world_size", 1, MAX_WORLD),
                     as_str(meta.get("fingerprint"), f"{where}: fingerprint"))
        recorded = as_int(meta.get("step"), f"{where}: step", 0)
    except ManifestError as exc:
        raise CorruptCheckpointError(str(exc)) from None
    if (recorded, copy.rank) != (step, r):
        raise CorruptCheckpointError(f"{where}: it records step {recorded}, rank {copy.rank}: moved from elsewhere")
    why = _foreign(meta, step, tier.run_id, history)
    return copy if why is None else why


def _share_entry(tier: MemorySnapshots, step: int, h: int,
                 history: tuple[int, tuple[int, ...]]) -> tuple[Any, ...] | str:
    """Parity share ``h`` of ``step`` as its header records it, or why it is not this run's."""
    header = tier.folder.share_header(step, h)
    why = _foreign({"run": header.run}, step, tier.run_id, history, lineage=False)
    return (h, header.members, header.index, header.chunk, header.lengths, header.digests) if why is None else why


def _foreign(meta: dict[str, Any], step: int, run_id: str, history: tuple[int, tuple[int, ...]], *,
             lineage: bool = True) -> str | None:
    """Why the snapshot of ``step`` whose manifest records ``meta`` is not this run's to restore, or None.

    ``history``: the newest step folder holding a manifest on any rank, and the steps of those
    this rank lists. What the snapshot records:

    * ``run``: the id of the run that took it; another id is another run at the same URL (the old
      run's folder deleted and a new run started, on the same nodes), none an older ckptkit;
    * ``base``: the newest persistent step committed on its trajectory when it was taken. Newer
      than the newest step left, it follows a history someone has deleted since (a run rewound by hand);
    * ``started``: the newest persistent save its trajectory had started (its own step's included).
      A persistent step after that and up to the snapshot's was saved by another trajectory: the
      run went on without this snapshot (its node was away while the job restarted from storage,
      at another world size or with that node's memory lost, and saved again), so it is a branch
      the run has left.

    ``lineage`` False: a parity share, which records only the run (its step's copies carry the rest)."""
    run, base, started = meta.get("run"), meta.get("base"), meta.get("started", -2)
    newest, steps = history
    if run != run_id:
        return (f"it was taken by another run (run id {run[:40]!r}; this run's, in its folder, is {run_id}: a run started "
                "anew at this URL, or another run given the same memory folder)"
                if isinstance(run, str) else "it records no run id (taken by an older ckptkit)")
    if not lineage:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (base, started)):
        return "it records no persistent step it followed"
    if base > newest:
        return (f"it followed persistent step {base}, which is gone (the newest step left is "
                f"{newest if newest >= 0 else 'none'}): the run was rewound, so it belongs to an abandoned history")
    later = [s for s in steps if started < s <= step]
    if later:
        return (f"persistent step {later[0]} was saved by another trajectory after this snapshot's last save "
                f"(step {started}): the run went on without it (restarted from storage while its node was away)")
    return None


def _usable(copies: list[_Copy], fingerprints: list[str], world_size: int) -> frozenset[int]:
    return frozenset(c.rank for c in copies
                     if c.world_size == world_size and 0 <= c.rank < world_size and c.fingerprint == fingerprints[c.rank])


def _plan(step: int, gathered: list[Any], fingerprints: list[str], world_size: int) -> dict[int, Source] | None:
    copies = [_usable(inv.get(step, {}).get("copies", []), fingerprints, world_size) for _, _, inv in gathered]
    shares: list[ParityShare | None] = []
    for _, _, inv in gathered:
        held = inv.get(step, {}).get("shares", [])
        shares.append(ParityShare(tuple(held[0][1]), held[0][2]) if held else None)
    return plan_sources(world_size, copies, [local for local, _, _ in gathered], shares)


def _explain_unusable(gathered: list[Any], fingerprints: list[str], world_size: int, rank: int) -> None:
    """Say plainly why snapshots that exist cannot be used (another world size or layout)."""
    if rank != 0:
        return
    for _, _, inv in gathered:
        for step, entry in sorted(inv.items(), reverse=True):
            for c in entry["copies"]:
                if c.world_size != world_size:
                    log.warning("memory tier: the snapshots of step %d were taken at world size %d; this job has %d "
                                "ranks: restoring from persistent storage only", step, c.world_size, world_size)
                    return
                if 0 <= c.rank < world_size and c.fingerprint != fingerprints[c.rank]:
                    log.warning("memory tier: the snapshots of step %d were taken at another layout (rank %d's state "
                                "differs): restoring from persistent storage only", step, c.rank)
                    return


#: a source a plan uses: (holder, "copy", rank of the snapshot) or (holder, "share", rank that made it)
_Item = tuple[int, str, int]


def _checked_plan(tier: MemorySnapshots, step: int, gathered: list[Any], fingerprints: list[str],
                  bad: set[_Item], load_checks_own: bool) -> tuple[dict[int, Source], list[Any]] | None:
    """A plan for ``step`` without the sources in ``bad``, whose every source its holder has checked
    (except, with ``load_checks_own``, an own copy only its rank reads: its load checks it,
    :func:`_loaded_directly`), and the
    inventory it was made from (failed sources left out); None when no plan is left. Collective:
    every rank plans from the same inventory, checks the sources it holds, and the failures are
    gathered, so every rank removes the same ones and plans again alike. Each round checks at
    least one source or ends."""
    inv = [(local, fp, _without({step: got[step]} if step in got else {}, step, h, bad))
           for h, (local, fp, got) in enumerate(gathered)]
    checked: set[_Item] = set()
    while True:
        plan = _plan(step, inv, fingerprints, tier.world_size)
        if plan is None:
            return None
        try:
            rebuilds = rebuild.plan_rebuilds(step, plan, inv)
        except CorruptCheckpointError as exc:  # the same on every rank: no rebuild can be made
            if tier.rank == 0:
                log.warning("memory tier: step %d: %s", step, exc)
            return None
        used = _used_sources(step, plan, rebuilds, inv)
        if load_checks_own:
            used -= _loaded_directly(plan, rebuilds)
        failed = [list(item) for item in sorted(used - checked) if item[0] == tier.rank and not _passes(tier, step, item)]
        gone = {(int(h), str(k), int(r)) for theirs in tier.comm.all_gather_json(failed) for h, k, r in theirs}
        checked |= used
        if not gone:
            return plan, inv
        inv = [(local, fp, _without(got, step, h, gone)) for h, (local, fp, got) in enumerate(inv)]


def _used_sources(step: int, plan: dict[int, Source], rebuilds: list[rebuild.Rebuild], inv: list[Any]) -> set[_Item]:
    """Every copy and share ``plan`` reads: each rank's own or peer copy (a rebuild also reads the
    other members' copies, which are those members' sources), and each rebuild's shares: the other
    members' (the lost member's own share holds only the others' chunks)."""
    used: set[_Item] = {(src.holder, "copy", r) for r, src in plan.items() if src.holder is not None}
    for rb in rebuilds:
        for index, holder in rb.share_holders.items():
            if index == rb.me:
                continue
            for made_by, members, i, *_ in inv[holder][2].get(step, {}).get("shares", []):
                if tuple(members) == tuple(rb.members) and i == index:
                    used.add((holder, "share", made_by))
                    break
    return used


def _loaded_directly(plan: dict[int, Source], rebuilds: list[rebuild.Rebuild]) -> set[_Item]:
    """The own copies that only their rank reads (no rebuild reads them): the load checks every
    CRC and digest of what it reads, so checking them first would read each twice. One that fails
    to load is left out and the step planned again (:func:`restore_from_memory`)."""
    read_by_rebuilds = {(h, "copy", rb.members[i]) for rb in rebuilds for i, h in rb.copy_holders.items()}
    return {(src.holder, "copy", r) for r, src in plan.items() if src.kind == "memory"} - read_by_rebuilds


def _passes(tier: MemorySnapshots, step: int, item: _Item) -> bool:
    """Whether this process's copy or share ``item`` passes every check (else say why, once)."""
    _, kind, rank = item
    try:
        if kind == "copy":
            problem = verified(tier.folder.rank_store(step, rank))
        else:
            tier.folder.check_share(step, rank)
            problem = None
    except Exception as exc:  # noqa: BLE001 - any failure is this source's, never a rank leaving the collective
        problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        what = f"rank {rank}'s copy" if kind == "copy" else f"parity share {rank}"
        log.warning("memory tier: %s of step %d at %s fails its checks and is not used: %s",
                    what, step, tier.folder.root, problem)
    return problem is None


def _without(inv: dict[int, dict[str, Any]], step: int, holder: int, gone: set[_Item]) -> dict[int, dict[str, Any]]:
    """``holder``'s inventory of ``step`` less the sources in ``gone``."""
    entry = inv.get(step)
    if entry is None:
        return inv
    copies = [c for c in entry["copies"] if (holder, "copy", c.rank) not in gone]
    shares = [s for s in entry["shares"] if (holder, "share", s[0]) not in gone]
    return {step: {"copies": copies, "shares": shares}} if copies or shares else {}


def _peer_moves(plan: dict[int, Source]) -> list[tuple[int, int, Hashable]]:
    """Every whole copy a restore moves from a peer, in one order all ranks compute alike."""
    moves: list[tuple[int, int, Hashable]] = []
    for r in sorted(plan):
        if plan[r].kind == "peer":
            assert plan[r].holder is not None
            moves.append((plan[r].holder, r, ("copy", r)))  # type: ignore[arg-type]
    return moves


def _restore_step(tier: MemorySnapshots, view: LocalView, step: int, plan: dict[int, Source],
                  gathered: list[Any]) -> tuple[BaseException | None, bool, bool]:
    """Move, rebuild and load this rank's snapshot of ``step``; the error, if any (not raised:
    every rank must reach the agreement that follows), whether the load wrote into the state (it
    did when it succeeded, here or on a rank whose peer then failed), and whether what failed was
    the load of this rank's own copy (unchecked before: :func:`_loaded_directly`)."""
    loading = loaded = False
    try:
        arrived: dict[Hashable, str | None] = {}
        rebuilt = None
        if tier.link is not None:
            arrived = tier.link.transfer_bundles(
                _peer_moves(plan), lambda key: tier.folder.outgoing(step, key[1]),  # type: ignore[index]
                lambda key, header: tier.folder.incoming(step, key[1], header))  # type: ignore[index]
            rebuilt = rebuild.walk(tier.link, tier.rank, [g[0] for g in gathered], tier.folder,
                                   rebuild.plan_rebuilds(step, plan, gathered))
        src = plan[tier.rank]
        store = rebuilt if rebuilt is not None else tier.folder.rank_store(step, tier.rank)
        if src.kind == "peer" and arrived.get(("copy", tier.rank)) is not None:
            raise CorruptCheckpointError(f"memory tier: rank {src.holder}'s copy of rank {tier.rank}'s snapshot of "
                                         f"step {step} did not arrive: {arrived[('copy', tier.rank)]}")
        loading = True
        load_state(flatten_state(view.state), store, LocalComm(), strict=True)
        loaded = True
        view.write_back()
        return None, True, False
    except Exception as exc:  # noqa: BLE001 - agreed below, then the next step is tried
        own = loading and not loaded and plan[tier.rank].kind == "memory"
        return exc, loaded or (loading and overwrote_state(exc)), own


def restore_from_memory(tier: MemorySnapshots, state: dict[str, Any], *, at_most: int | None,
                        at_least: int, history: tuple[int, tuple[int, ...]]) -> tuple[RestoreInfo | None, bool]:
    """The newest step in ``[at_least, at_most]`` every rank can restore from memory, restored;
    None when there is none (then the caller restores from persistent storage). Also whether a step
    that failed had written into ``state`` on some rank (agreed: the same on every rank), which the
    caller must not then report as untouched. ``history``: the newest persistent step folder there
    is (-1: none) and the steps this rank lists, which a snapshot's lineage must agree with
    (:func:`_foreign`). Collective."""
    overwritten = False
    t0 = time.perf_counter()
    tier._wait_quietly()
    bound = MAX_LAYOUT_INT if at_most is None else at_most
    view = local_view(state, tier.world_size, tier.rank)
    mine = _inventory(tier, bound, history)
    gathered = _gather(tier, view.fingerprint, mine)
    fingerprints = [g[1] for g in gathered]
    steps = sorted({s for _, _, inv in gathered for s in inv if s >= at_least}, reverse=True)
    candidates = [s for s in steps if _plan(s, gathered, fingerprints, tier.world_size) is not None]
    if steps and not candidates:
        _explain_unusable(gathered, fingerprints, tier.world_size, tier.rank)
    for step in candidates:
        # with a persistent step to fall back on, an own copy is checked by its load; without one, it
        # is checked first, so that an own copy found damaged leaves the state untouched and "nothing
        # to restore" (a fresh start) stays possible instead of an error (a step that failed mid-load)
        done, wrote = _restore_one(tier, view, step, gathered, fingerprints, load_checks_own=at_least >= 0)
        overwritten = overwritten or wrote
        if done is None:
            continue
        plan = done
        tier.discard_after(step)
        sources = tuple(plan[r].kind for r in range(tier.world_size))
        info = RestoreInfo(step, sources[tier.rank], sources, time.perf_counter() - t0)
        if tier.rank == 0:
            counts = {k: sources.count(k) for k in ("memory", "peer", "parity")}
            log.info("restored step %d from the memory tier in %.2fs (%s)", step, info.seconds,
                     ", ".join(f"{n} rank(s) from {k}" for k, n in counts.items() if n))
        return info, overwritten
    return None, overwritten


def _restore_one(tier: MemorySnapshots, view: LocalView, step: int, gathered: list[Any],
                 fingerprints: list[str], *, load_checks_own: bool) -> tuple[dict[int, Source] | None, bool]:
    """Restore ``step``: its plan when every rank has it back (else None), and whether a failed
    attempt wrote into the state on some rank (agreed). An own copy that fails to load is left out
    and the step planned again (its rank then gets a peer's copy or a rebuild); any other failure
    gives the step up."""
    bad: set[_Item] = set()
    overwritten = False
    while True:
        found = _checked_plan(tier, step, gathered, fingerprints, bad, load_checks_own)
        if found is None:
            if tier.rank == 0:
                log.warning("memory tier: step %d cannot be restored once damaged copies are left out; trying older",
                            step)
            return None, overwritten
        plan, checked = found
        error, wrote, own = _restore_step(tier, view, step, plan, checked)
        why = None if error is None else f"{type(error).__name__}: {error}"
        flags = tier.comm.all_gather_json([why, wrote, own])
        failed = [(r, e, o) for r, (e, _, o) in enumerate(flags) if e is not None]
        if not failed:
            return plan, overwritten
        overwritten = overwritten or any(w for _, w, _ in flags)
        if all(o for _, _, o in failed):  # only own copies failed their loads: without them, once more
            for r, e, _ in failed:
                if tier.rank == 0:
                    log.warning("memory tier: rank %d's own copy of step %d fails its checks as it loads and is not "
                                "used: %s", r, step, e)
                bad.add((plan[r].holder, "copy", r))  # type: ignore[arg-type]
            continue
        log.warning("memory tier: restoring step %d failed (rank %d: %s); trying an older step",
                    step, failed[0][0], failed[0][1])
        return None, overwritten


def _gather(tier: MemorySnapshots, fingerprint: str, inv: dict[int, dict[str, Any]]) -> list[Any]:
    """Every rank's (memory folder id, fingerprint, inventory), exchanged as JSON: nothing on the
    restore path unpickles, not even what comes over the wire."""
    doc = {str(step): {"copies": [[c.rank, c.world_size, c.fingerprint] for c in e["copies"]],
                       "shares": [[h, list(m), i, c, list(n), list(d)] for h, m, i, c, n, d in e["shares"]]}
           for step, e in inv.items()}
    out = []
    for local, fp, got in tier.comm.all_gather_json([tier.local_id(), fingerprint, doc]):
        out.append((local, fp, {int(step): {"copies": [_Copy(int(r), int(w), str(f)) for r, w, f in e["copies"]],
                                            "shares": [(int(h), tuple(int(x) for x in m), int(i), int(c),
                                                        tuple(int(x) for x in n), tuple(str(x) for x in d))
                                                       for h, m, i, c, n, d in e["shares"]]}
                                for step, e in got.items()}))
    return out


