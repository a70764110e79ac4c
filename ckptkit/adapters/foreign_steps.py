"""Other frameworks' own checkpoints in a run folder, and why a resume refuses to go past them.

A run that switches to ckptkit often keeps its folder: torchtitan's own manager left ``step-N``
directories of ``torch.distributed.checkpoint`` (a ``.metadata`` file and ``.distcp`` shards),
DeepSpeed's ``engine.save_checkpoint`` left ``global_stepN`` tag directories, Megatron-LM left
``iter_NNNNNNN`` directories. The adapters' checkpointers read ckptkit checkpoints only (those
formats are pickle-based; converting them is ``ckptkit convert``'s job, in ``converters/``). What
matters is that a resume never goes past one silently: a foreign step newer than the newest ckptkit
checkpoint means the run got further than ckptkit can resume, and starting from scratch or from the
older ckptkit step would throw that training away without a word.

Only names and, for DCP (whose folder name is ckptkit's own ``step-N``), the presence of its
``.metadata`` are looked at: nothing foreign is opened or read.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Callable

from ckptkit.engine.collective import first_rank_does
from ckptkit.errors import CkptkitError, ForeignCheckpointError, RestoreFloorError
from ckptkit.run_folder import STEP_PATTERN

log = logging.getLogger("ckptkit")


@dataclass(frozen=True)
class ForeignSteps:
    """How one framework's own checkpoints sit in a run folder: their directory names (the step as the
    pattern's first group; a name without one is step 0), a file inside that tells them from ckptkit's
    (None: the name is enough), and how to resume from one instead."""

    what: str
    pattern: re.Pattern[str]
    marker: str | None
    way_on: str


DCP = ForeignSteps(
    "a torch.distributed.checkpoint (DCP) checkpoint", STEP_PATTERN, ".metadata",
    "`ckptkit convert {src} DST --from dcp`, then start with initial_load_path=DST in a new checkpoint folder "
    "(in this one, a ckptkit step would win over initial_load_path)")
DEEPSPEED = ForeignSteps(
    "a DeepSpeed checkpoint (engine.save_checkpoint)", re.compile(r"^global_step([0-9]+)$"), None,
    "`ckptkit convert {folder} DST --from deepspeed --tag {name}`, then ckptkit.adapters.deepspeed.load(engine, "
    "DST) before training, with a new folder for this checkpointer")
MEGATRON = ForeignSteps(  # release: Megatron-LM's released (converted) checkpoint, loaded as iteration 0
    "a Megatron checkpoint", re.compile(r"^(?:iter_([0-9]+)|release)$"), None,
    "`ckptkit convert {src} DST --from megatron`, then ckptkit.adapters.megatron.load(model, DST, ...) before "
    "training, with a new folder for this checkpointer")


def steps_after(root: Any, kind: ForeignSteps, latest: int | None) -> list[str]:
    """Names of ``kind``'s checkpoint directories in ``root`` (a Store) after step ``latest`` (all, when
    None). A marker that cannot be inspected (a FIFO, a device or a link out of the folder in its
    place) counts as present: it is no ckptkit checkpoint either, and the caller must reach the ranks'
    agreement rather than raise on its own."""
    out = []
    for name in root.list_children():
        m = kind.pattern.match(name)
        if m is None or (latest is not None and _step(m) <= latest):
            continue
        if kind.marker is not None:
            try:
                if root.size(f"{name}/{kind.marker}") is None:
                    continue
            except CkptkitError:
                pass
        out.append(name)
    return sorted(out, key=lambda n: _step(kind.pattern.match(n)))  # type: ignore[arg-type]


def _step(m: re.Match[str]) -> int:
    return int(m.group(1) or 0)


def refuse_newer(root: Any, folder: str, comm: Any, latest: int | None,
                 kind: ForeignSteps) -> tuple[int, str] | None:
    """Raise :class:`~ckptkit.errors.ForeignCheckpointError` on every rank if ``folder`` holds a ``kind``
    checkpoint newer than ``latest``, its newest ckptkit checkpoint (any, when None). Rank 0 looks, all
    agree; a folder rank 0 cannot list fails the resume too (it cannot tell that nothing is newer).
    Returns the step and name of the newest ``kind`` checkpoint at or below ``latest`` (None: none),
    which a resume must not fall back below (:func:`refuse_fallback_past`)."""
    listed, unlisted = first_rank_does(comm, lambda: steps_after(root, kind, None), "listing the resume folder")
    if unlisted is not None:
        raise ForeignCheckpointError(
            f"{folder}: could not list the folder to make sure no checkpoint there is newer than "
            f"{'none' if latest is None else f'step {latest}'} on rank 0 ({unlisted}); retry once it answers")
    steps = [(_step(kind.pattern.match(str(n))), str(n)) for n in listed]  # type: ignore[arg-type]
    newer = [n for s, n in steps if latest is None or s > latest]
    if not newer:
        return max(steps, default=None)
    newest = newer[-1]
    where = f"{folder}/{newest}"
    way = kind.way_on.format(src=f"{folder}/{newest}", folder=folder, name=newest)
    raise ForeignCheckpointError(
        f"{where}: {kind.what}, newer than "
        f"{'any ckptkit checkpoint' if latest is None else f'the newest ckptkit checkpoint (step {latest})'} there "
        f"({len(newer)} such); this checkpointer reads ckptkit checkpoints only, and resuming without it "
        f"would go back in time. To resume from it: {way}. To resume from what ckptkit saved here instead: move "
        "the newer ones out of the folder")


@dataclass(frozen=True)
class ResumePoint:
    """Where a framework checkpointer's resume may go: ``latest``, the newest ckptkit step (None:
    none), and ``floor``, the step and folder name of the newest ``kind`` checkpoint at or below it
    (None: none). A fallback past damaged ckptkit steps must not go below the floor
    (:func:`refuse_fallback_past`)."""

    latest: int | None
    floor: tuple[int, str] | None
    kind: ForeignSteps
    folder: str

    @property
    def at_least(self) -> int | None:
        """The manager's ``at_least`` for this resume (None: no floor)."""
        return None if self.floor is None else self.floor[0]


def resume_point(manager: Any, kind: ForeignSteps) -> ResumePoint:
    """``manager.latest_common_step()`` (a :class:`ckptkit.CheckpointManager`), once no ``kind``
    checkpoint newer than it sits in the manager's folder (:func:`refuse_newer`, on the group the
    manager agrees on), and the newest ``kind`` checkpoint below it: the one resume check every
    framework checkpointer makes."""
    latest = manager.latest_common_step()
    floor = refuse_newer(manager.root, manager.root.url, manager._comm, latest, kind)
    return ResumePoint(latest, floor, kind, manager.root.url)


def refuse_fallback_past(point: ResumePoint, exc: RestoreFloorError) -> ForeignCheckpointError:
    """What a resume raises when every ckptkit step from the newest down to ``point.floor`` failed to
    load (``exc``, the manager's :class:`~ckptkit.errors.RestoreFloorError`): the next older one
    would silently go back past a ``kind`` checkpoint the run wrote. Until 2026-12-06 only the newest
    ckptkit step was compared with them, and a fallback past a damaged newest step went on below it."""
    assert point.floor is not None
    step, name = point.floor
    way = point.kind.way_on.format(src=f"{point.folder}/{name}", folder=point.folder, name=name)
    return ForeignCheckpointError(
        f"{point.folder}/{name}: {point.kind.what} of step {step}, and no ckptkit checkpoint of that step or newer "
        f"loads ({exc}); resuming from an older one would go back in time. To resume from it: {way}. To resume "
        "from the older ckptkit checkpoint instead: move the foreign one out of the folder")


def restore_newest(manager: Any, kind: ForeignSteps, load: Callable[[str], Any]) -> tuple[int, Any] | None:
    """A framework checkpointer's resume through ``manager.restore_latest_with(load)``: the newest
    ckptkit step that loads, never past a ``kind`` checkpoint of the run (newer than the newest
    ckptkit step: refused at once; older: refused if the damaged steps above it run out). None when
    the folder holds no ckptkit checkpoint."""
    point = resume_point(manager, kind)
    if point.latest is None:
        return None
    try:
        return manager.restore_latest_with(load, at_most=point.latest, at_least=point.at_least)
    except RestoreFloorError as exc:  # every ckptkit step from the newest down to the foreign one is damaged
        raise refuse_fallback_past(point, exc) from exc


def warn_uncommitted(root: Any, folder: str) -> None:
    """No committed ckptkit checkpoint, yet step folders: saves that did not commit (a fresh start is right)."""
    names = [n for n in root.list_children() if STEP_PATTERN.match(n)]
    if names:
        log.warning("%s holds step folders %s but no committed ckptkit checkpoint (saves that did not commit); "
                    "a fresh start", folder, names[:4])
