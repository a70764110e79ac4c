"""Restore the newest checkpoint that loads: damaged steps are skipped, the next older one tried.

The loop :class:`ckptkit.CheckpointManager` runs for :meth:`~ckptkit.CheckpointManager.restore_latest`
(into a state dict) and :meth:`~ckptkit.CheckpointManager.restore_latest_with` (a framework adapter's
own load), in a module of its own so that both share one definition of "damaged" and one agreement.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ckptkit.engine.loader import load_state, overwrote_state
from ckptkit.engine.state import flatten_state
from ckptkit.layout.manifest import MANIFEST_NAME
from ckptkit.run_folder import MAX_STEP, STEP_PATTERN
from ckptkit.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    CoverageError,
    LoadStalledError,
    ManifestError,
    PeerFailureError,
    RestoreFloorError,
)

log = logging.getLogger("ckptkit")

# Failures that mean "this checkpoint is unusable, try an older one" — not "the state is wrong",
# and not a storage or network failure (StorageError), which says nothing about the checkpoint:
# falling back on those would silently restore an older step, or none.
DAMAGED = (CorruptCheckpointError, ManifestError, CheckpointNotFoundError, CoverageError)


def restore_state(mgr: Any, state: dict[str, Any], strict: bool, at_most: int | None, floor: int,
                  t0: float) -> int | None:
    """:meth:`ckptkit.CheckpointManager.restore_latest` into ``state``: the memory tier's newest step
    if it is at least as new as the newest persistent one (and ``floor``), else the newest persistent
    step that loads; when damaged persistent steps are skipped, a memory step at least as new as the one
    the fallback reached is taken instead (a tie prefers memory, as the first question does; it took the
    persistent step until 2026-12-06, which hypothesis found). Until 2026-12-06 the newest persistent step counted by its
    manifest alone: one with damaged data hid every newer snapshot, the fallback went to an older
    persistent step, and the snapshots after it were deleted (found by a model-based hunt)."""
    bound = MAX_STEP if at_most is None else at_most
    overwritten = False  # whether a failed memory attempt wrote into `state`
    newer_elsewhere: Callable[[int], tuple[int | None, bool]] | None = None
    taken: list[tuple[Any, int]] = []
    if mgr._memory is not None:
        from ckptkit.memory.restore import restore_from_memory

        newest, present, steps = mgr._common_steps(bound)

        def from_memory(at_least: int) -> tuple[Any, bool]:
            return restore_from_memory(mgr._memory, state, at_most=at_most, at_least=max(floor, at_least),
                                       history=(present, steps))

        info, overwritten = from_memory(-1 if newest is None else newest)
        if info is not None:
            return mgr._restored_from_memory(info, newest)
        if overwritten:
            mgr.skipped.append(("memory tier", "a step restored from node memory failed after part of the "
                                               "state was loaded (see the log)"))

        def newer_in_memory(below: int) -> tuple[int | None, bool]:
            got, wrote = from_memory(below)  # at least as new: a tie prefers memory, as the first question does
            if got is not None:
                taken.append((got, below))
            return (None if got is None else got.step), wrote

        newer_elsewhere = newer_in_memory

    def load_step(name: str) -> tuple[str, ...]:
        return load_state(flatten_state(state), mgr.root.child(name), mgr._comm, strict=strict,
                          options=mgr.load_options).missing

    step = mgr._restored_persistent(
        lambda: newest_that_loads(mgr, load_step, bound, overwritten, floor, newer_elsewhere), t0, taken)
    if step is None and at_most is not None and mgr._memory is not None:
        # a rewind to before every checkpoint (a fresh start): the snapshots after it are the abandoned
        # trajectory's, as after a rewind to a step (they outranked a step saved again there, 2026-12-06)
        mgr._memory.discard_after(at_most)
    return step


def newest_that_loads(mgr: Any, load_step: Callable[[str], tuple[str, ...]], bound: int,
                      overwritten: bool, at_least: int = -1,
                      newer_elsewhere: Callable[[int], tuple[int | None, bool]] | None = None) -> int | None:
    """The newest persistent step (<= ``bound``) of ``mgr`` (a :class:`ckptkit.CheckpointManager`; typed
    loosely so that this module does not import the manager, which imports it) that ``load_step(name)`` loads (it returns
    the keys left out), skipping damaged ones into ``mgr.skipped``. ``overwritten``: an earlier attempt
    (the memory tier's) already wrote into the caller's state; so may a damaged step here. Then
    "nothing restored" is no longer true of it, and is raised instead of returned (:func:`overwritten_error`).
    ``at_least``: no step older than it is restored: :class:`~ckptkit.errors.RestoreFloorError` instead.
    ``newer_elsewhere(step)``: once a damaged step was skipped, before loading the older ``step`` (-1:
    none), a restore of a newer one from elsewhere (the memory tier); its step (None: none) and
    whether a failed attempt wrote into the state."""
    start_bound = bound
    vanished_retries = 0
    fell_back = False
    while True:
        step = mgr.latest_common_step(bound)
        if at_least >= 0 and (step is None or step < at_least):
            raise floor_error(mgr.root.url, mgr.skipped, at_least)
        if fell_back and newer_elsewhere is not None:
            took, wrote = newer_elsewhere(-1 if step is None else step)
            if took is not None:
                return took
            overwritten = overwritten or wrote
        if step is None:
            if overwritten:
                raise overwritten_error(mgr.root.url, mgr.skipped, None)
            return None
        name = mgr.folder.name_of(step)
        damaged: BaseException | None = None
        other: BaseException | None = None
        missing: tuple[str, ...] = ()
        lease = mgr.folder.acquire_lease(name, mgr.rank)
        try:
            missing = load_step(name)
        except LoadStalledError:
            # raised on every rank by the watchdog; the group may hold collectives the stalled rank
            # never joins, so no agreement (no collective) follows: straight to the caller
            raise
        except PeerFailureError as exc:
            damaged = exc  # another rank failed; its own flag says why
        except DAMAGED as exc:
            damaged = exc
        except Exception as exc:  # noqa: BLE001 - decided together below
            other = exc
        finally:
            mgr.folder.release_lease(lease)
        any_damaged, any_other, any_overwritten, any_missing = mgr._comm.any_flags([
            damaged is not None and not isinstance(damaged, PeerFailureError), other is not None,
            damaged is not None and overwrote_state(damaged), bool(missing)])
        if any_other:
            if other is not None:
                raise other
            said = f" ({damaged})" if isinstance(damaged, PeerFailureError) else ""  # the load named the rank
            raise PeerFailureError(f"restoring {name} failed on another rank{said}") from damaged
        if not any_damaged:
            if overwritten and any_missing:  # strict=False: tensors this step lacks hold a failed attempt's bytes
                raise overwritten_error(mgr.root.url, mgr.skipped, name)
            log.info("restored %s", name)
            return step
        overwritten = overwritten or any_overwritten
        if _vanished(mgr, name) and vanished_retries < 8:
            # deleted after it was chosen (another process's retention, between the listing and the lease):
            # not damaged, and something newer may have been committed meanwhile: choose again from the top
            vanished_retries += 1
            log.info("%s was deleted while this restore chose it; choosing the newest checkpoint again", name)
            bound = start_bound
            continue
        reason = str(damaged) if damaged is not None else "damaged on another rank"
        log.warning("skipping %s: %s", name, reason)
        mgr.skipped.append((name, reason))
        bound = step - 1
        fell_back = True


def _vanished(mgr: Any, name: str) -> bool:
    """Whether ``name`` no longer holds a manifest on every rank's view (agreed): a checkpoint deleted
    since it was listed, which a failed load must not count as damaged. Until 2026-12-06 a restore that
    raced another process's retention fell back to an older step, or to none, with a newer one there."""
    try:
        gone = not mgr.folder.root.child(name).exists(MANIFEST_NAME)
    except Exception:  # noqa: BLE001 - cannot tell: not vanished (the damage stands)
        gone = False
    return mgr._comm.all_min([int(gone)])[0] == 1


def floor_error(url: str, skipped: list[tuple[str, str]], at_least: int) -> RestoreFloorError:
    """The steps from the newest down to ``at_least`` did not load (damaged), and the caller knows
    of training at ``at_least`` that an older step would silently throw away (a framework's own
    checkpoint there: :mod:`ckptkit.adapters.foreign_steps`)."""
    tried = "; ".join(f"{name}: {reason}" for name, reason in skipped) or "none committed"
    return RestoreFloorError(f"{url}: no checkpoint of step {at_least} or newer loads ({tried}); an older one "
                             f"would go back past step {at_least} (at_least={at_least})")


def overwritten_error(url: str, skipped: list[tuple[str, str]], restored: str | None) -> CorruptCheckpointError:
    """A restore that must not look like "nothing to restore" (None) or a clean load: a damaged
    step failed after part of the state had been loaded from it, and either no older step loads
    (``restored`` None) or the one that did (non-strict) lacks some of the state's tensors, which
    still hold the failed attempt's bytes. Training on from such a state would mix checkpoints."""
    tried = "; ".join(f"{name}: {reason}" for name, reason in skipped) or "see the log"
    if restored is None:
        what = (f"{url}: no checkpoint could be restored, and the state passed in is partly "
                "overwritten: a damaged step failed after part of it had been loaded")
    else:
        what = (f"{url}: restored {restored}, which lacks some of the state's tensors (strict=False), "
                "and those hold bytes of a damaged step that failed mid-load")
    return CorruptCheckpointError(
        f"{what} ({tried}). To start from scratch, re-create the state first; to resume, repair or remove the "
        "damaged checkpoint(s) named here, or pass at_most= to restore an older step on purpose")


def superseded_after(folder: Any, skipped: list[tuple[str, str]], restored: int | None) -> dict[str, int]:
    """The damaged step folders newer than ``restored`` (``name -> step``): skipped by the restore
    (``skipped``), or with a manifest that fails its checks. The run goes on from an older step and
    saves those steps again; each is deleted right before its step is (:func:`replace_superseded`).
    Until 2026-12-06 they stayed committed, so that save was refused ("already holds a committed
    checkpoint") and the job died at it after every restart, until a human moved them aside."""
    failed = dict(skipped)
    floor = -1 if restored is None else restored
    return {r.name: r.step for r in folder.records()
            if r.step > floor and (r.status == "damaged" or r.committed and r.name in failed)}


def replace_superseded(folder: Any, superseded: dict[str, int], skipped: list[tuple[str, str]], step: int) -> None:
    """Before saving ``step``: delete the damaged folders of that step a restore went past (any naming),
    kept until now for a human to look at. One whose manifest reads well now (a transport fault at the
    restore) is never deleted; one that cannot be deleted is logged and left: the save then fails on
    every rank, naming it, as it did before."""
    for name in [n for n, s in superseded.items() if s == step]:
        del superseded[name]
        try:
            if folder.read_record(name, step).status != "damaged" and name not in dict(skipped):
                continue
            log.warning("%s: replacing %s, found damaged when the run restored an older step", folder.root.url, name)
            folder.delete(name)
        except Exception as exc:  # noqa: BLE001 - the save's own check then refuses, on every rank
            log.error("%s: could not delete the damaged %s before saving step %d again: %s", folder.root.url, name,
                      step, exc)


def prune_local_copies(tiered: Any, step: int, keep: frozenset[str]) -> list[str]:
    """Every rank, after a commit of ``step``: remove the node-local copies (``local_dir``) of step folders
    up to ``step`` that the bucket no longer holds, except saves in flight (``keep``). Retention and
    ``gc`` run on rank 0 and delete in the bucket and on rank 0's node only: every other node kept its
    copy of every step for ever, and its disk filled up until every save failed (found by a hunt,
    2026-12-06). A step deleted in the bucket after this runs is removed at the next commit. Never
    raises: a local copy that cannot be removed is logged and tried again then."""
    removed: list[str] = []
    try:
        remote = set(tiered.remote.list_children())
        for name in tiered.local.list_children():
            m = STEP_PATTERN.match(name)
            if m is None or name in remote or name in keep or int(m.group(1)) > step:
                continue
            tiered.local.child(name).delete_all()
            removed.append(name)
    except Exception as exc:  # noqa: BLE001 - a cache's housekeeping never fails a save
        log.warning("pruning the local copies under %s: %s", tiered.local.url, exc)
    return removed
