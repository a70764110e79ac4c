"""Which checkpoints to keep: pure policy, no I/O.

Rules, each optional, combined by union:

* ``keep_last``: the K newest committed checkpoints;
* ``keep_every``: milestones, every checkpoint whose step is a multiple of N;
* ``keep_best``: the k best by a metric recorded in the checkpoint (``min``
  or ``max``).

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
        if self.k < 1:
            raise OptionsError(f"keep_best k must be >= 1, got {self.k}")
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
            if v is not None and (not isinstance(v, int) or v < 1):
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


def decide(records: list[Record], policy: RetentionPolicy) -> Decision:
    committed = sorted((r for r in records if r.committed), key=lambda r: (r.step, r.name))
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

