"""Which checkpoints to keep: pure policy, no I/O.

Rules, each optional, combined by union:

* ``keep_last``: the K newest committed checkpoints;
* ``keep_every``: milestones, every checkpoint whose step is a multiple of N;
* ``keep_best``: the k best by a metric recorded in the checkpoint (``min``
  or ``max``).

A :class:`RollbackHold` (from the resilience controller) keeps, on top of the
rules, the checkpoints a spike rollback decided from now on would restore: a
policy of ``keep_last=1`` must not delete the only checkpoint old enough to
roll back to and leave the run stopped for a human.

The newest committed checkpoint is always kept, whatever the rules say: it
is what a restart resumes from. Uncommitted checkpoints are never decided
here — they are garbage for :meth:`CheckpointManager.gc`, and one of them
may be a save in flight. With no rule at all, everything is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptkit.errors import CkptkitError, LayoutError, OptionsError
from ckptkit.layout.values import decode_value


@dataclass(frozen=True)
class BestK:
    metric: str
    k: int
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        # an int, as keep_last's: k=2.0 passed here and failed retention on rank 0 alone (a TypeError
        # after the commit, the other ranks left waiting) until 2026-12-06
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise OptionsError(f"keep_best k must be a positive integer, got {self.k!r}")
        if not isinstance(self.metric, str):
            raise OptionsError(f"keep_best metric must be a metric's name (a string), got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise OptionsError(f"keep_best mode must be 'min' or 'max', got {self.mode!r}")


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: BestK | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise OptionsError(f"{name} must be a positive integer, got {v!r}")

    @property
    def keeps_everything(self) -> bool:
        return self.keep_last is None and self.keep_every is None and self.keep_best is None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.keep_last is not None:
            out["keep_last"] = self.keep_last
        if self.keep_every is not None:
            out["keep_every"] = self.keep_every
        if self.keep_best is not None:
            out["keep_best"] = [self.keep_best.metric, self.keep_best.k, self.keep_best.mode]
        return out

    @staticmethod
    def from_json(value: Any) -> RetentionPolicy:
        if not isinstance(value, dict):
            return RetentionPolicy()
        best = value.get("keep_best")
        try:
            return RetentionPolicy(
                value.get("keep_last"),
                value.get("keep_every"),
                BestK(str(best[0]), int(best[1]), best[2]) if isinstance(best, list) and len(best) == 3 else None,
            )
        except (LayoutError, TypeError, ValueError):
            return RetentionPolicy()


@dataclass(frozen=True)
class RollbackHold:
    """The checkpoints spike rollbacks may still restore, which retention keeps whatever its rules.

    A rollback decided from now on restores the newest checkpoint at or before some step
    ``A >= at_most`` (its episode's first spike, the open episode's first or a step still to come,
    minus ``steps_before``). Every checkpoint after ``at_most`` may be the newest at or before some
    such ``A``, and the newest at or before ``at_most`` is it for ``A = at_most``. A rollback right
    after, before anything new is committed, starts from the step the first one restored, at least
    that newest one ``h``: its bound is at least ``h + 1 - steps_before``. ``depth`` rollbacks in a
    row are provided for: each of them restores exactly the checkpoint it would with nothing ever
    deleted."""

    at_most: int
    steps_before: int = 1
    depth: int = 1

    def __post_init__(self) -> None:
        for name in ("at_most", "steps_before", "depth"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or abs(v) > 2**62:
                raise OptionsError(f"RollbackHold.{name} must be an integer, got {v!r}")
        if self.steps_before < 1 or self.depth < 1:
            raise OptionsError(f"RollbackHold needs steps_before >= 1 and depth >= 1, got {self!r}")

    def targets(self, committed_steps: list[int]) -> set[int]:
        """The steps among ``committed_steps`` it holds: every one after the deepest rollback's bound,
        and the newest at or before it."""
        bound = self.at_most
        newest: int | None = None
        for level in range(self.depth):
            older = [s for s in committed_steps if s <= bound]
            if not older or (newest is not None and max(older) == newest):
                break  # nothing older, or a fixed point (steps_before 1): deeper levels hold nothing new
            newest = max(older)
            if level + 1 < self.depth:
                bound = newest + 1 - self.steps_before
        held = {s for s in committed_steps if s > bound}
        return held | ({newest} if newest is not None and newest <= bound else set())

    def to_json(self) -> list[int]:
        return [self.at_most, self.steps_before, self.depth]

    @staticmethod
    def from_json(value: Any) -> RollbackHold | None:
        """A hold recorded in a manifest (for ``ckptkit ls``), or None when absent or not one."""
        try:
            return RollbackHold(*value) if isinstance(value, list) and len(value) == 3 else None
        except (CkptkitError, TypeError):
            return None


Status = Literal["committed", "uncommitted", "damaged", "unreadable"]


@dataclass(frozen=True)
class Record:
    """What retention needs to know about one checkpoint.

    ``status`` keeps "absent" and "could not be read" apart: ``uncommitted`` (no manifest: a crashed
    or running save), ``damaged`` (a manifest that fails its checks), ``unreadable`` (the store
    failed to answer: nothing is known, so nothing may be decided from it — see
    :func:`unknown`). ``reason`` says why for the last three."""

    name: str
    step: int
    committed: bool
    metrics: dict[str, Any] = field(default_factory=dict)
    status: Status | None = None
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.status is None:
            object.__setattr__(self, "status", "committed" if self.committed else "uncommitted")
        elif self.committed != (self.status == "committed"):
            raise OptionsError(f"record {self.name}: committed={self.committed} contradicts status {self.status!r}")


@dataclass(frozen=True)
class Decision:
    keep: dict[str, tuple[str, ...]]  # name -> reasons ("latest", "last", "milestone", "best")
    delete: tuple[str, ...]


def unknown(records: list[Record]) -> list[Record]:
    """Records whose state could not be read: while any exists, no deletion may be decided."""
    return [r for r in records if r.status == "unreadable"]


def decide(records: list[Record], policy: RetentionPolicy, rollback: RollbackHold | None = None,
           distrusted: frozenset[str] = frozenset()) -> Decision:
    """What ``policy`` keeps and deletes among ``records``; with ``rollback``, also keep what spike
    rollbacks may still restore. ``distrusted``: committed checkpoints known not to load (a restore
    went past them: their data failed its checksums, which a record's manifest cannot show); neither
    counted nor deleted, left for a human or for the save that replaces them. Counted, a damaged
    newest step was kept as "latest" and the ``keep_last`` checkpoints that load were deleted."""
    committed = sorted((r for r in records if r.committed and r.name not in distrusted), key=lambda r: (r.step, r.name))
    reasons: dict[str, list[str]] = {r.name: [] for r in committed}
    if committed:
        reasons[committed[-1].name].append("latest")
    if policy.keeps_everything:
        for r in committed:
            reasons[r.name].append("all")
    if policy.keep_last is not None:
        for r in committed[-policy.keep_last:]:
            reasons[r.name].append("last")
    if policy.keep_every is not None:
        for r in committed:
            if r.step % policy.keep_every == 0:
                reasons[r.name].append("milestone")
    if policy.keep_best is not None:
        best = policy.keep_best
        scored = []
        for r in committed:
            v = r.metrics.get(best.metric)
            if isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and math.isfinite(v):
                scored.append(((v if best.mode == "min" else -v), -r.step, r.name))
        for _, _, name in sorted(scored)[: best.k]:
            reasons[name].append("best")
    if rollback is not None:
        held = rollback.targets([r.step for r in committed])
        for r in committed:  # two folders of one step (another naming): both, whichever a restore picks
            if r.step in held:
                reasons[r.name].append("rollback")
    keep = {name: tuple(why) for name, why in reasons.items() if why}
    delete = tuple(r.name for r in committed if r.name not in keep)
    return Decision(keep, delete)


def stored_metrics(user_meta: Any) -> dict[str, Any]:
    """The metrics a checkpoint's user metadata records, decoded (a NaN loss is a float again, not its
    JSON tag); {} when there are none or they are not a dict of values."""
    metrics = user_meta.get("metrics") if isinstance(user_meta, dict) else None
    if not isinstance(metrics, dict):
        return {}
    try:
        decoded = decode_value(metrics, "metrics")
    except CkptkitError:  # a hostile manifest's metrics: not a reason to refuse the checkpoint
        return {}
    return decoded if isinstance(decoded, dict) else {}


def step_mismatch(user_meta: Any, step: int) -> str | None:
    """Why a step folder named for ``step`` is not that step's checkpoint (its manifest records another:
    a copy or rename under another step's name, which a restore must never return as this step), or None."""
    recorded = user_meta.get("step") if isinstance(user_meta, dict) else None
    if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded != step:
        return f"its manifest records step {recorded}, not {step}: a checkpoint copied or renamed under another step's name"
    return None

