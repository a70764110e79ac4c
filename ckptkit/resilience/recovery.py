"""What a restart takes from the incident log because its checkpoint may predate a rollback.

A rollback changes more than the model: it adds a skip range, and the ladder
remembers it (the escalation to a lower learning rate and then a stop counts
rollbacks), may lower the learning rate for good, and starts the re-warm ramp
at the restored step. The next checkpoint saves all of that in
``state["resilience"]``, but a crash before it leaves the checkpoint the
rollback restored as the newest one, and that was saved *before* the rollback.
So each rollback incident carries the controller's whole resilience state right
after it (what a checkpoint at the restored step would hold if saved then), and
``seq``, the number of rollbacks in the run's history so far; a checkpoint
holds that count too (its ladder's list of rollbacks). On a restart,
:func:`missing_rollbacks` lists the rollbacks the restored checkpoint does not
know about, and the controller adopts their state: at once when the rollback
restored that very checkpoint, or when the replay reaches the restored step if
that checkpoint was lost and an older one was restored instead. All steps are
absolute, so the same record means the same thing after any number of restarts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ckptkit.resilience.incidents import Incident


@dataclass(frozen=True)
class RolledBack:
    """One rollback as the incident log has it."""

    seq: int  # rollbacks in the run's history including this one
    at: int  # the step whose spike triggered it
    restored: int  # the checkpoint step it went back to: the re-warm starts here
    state: dict[str, Any]  # the controller's exported state right after it

    @staticmethod
    def from_incident(incident: Incident) -> RolledBack | None:
        d = incident.data
        if incident.kind != "rollback" or not isinstance(d.get("state"), dict):
            return None  # not a rollback, or one logged before rollbacks carried their state
        try:
            return RolledBack(int(d["seq"]), incident.step, int(d["restored"]), d["state"])
        except (KeyError, TypeError, ValueError):
            return None


def missing_rollbacks(incidents: Iterable[Incident], known: int) -> list[RolledBack]:
    """The rollbacks a checkpoint that knows of ``known`` rollbacks lacks, oldest first.

    Incidents come in time order. A rollback to a step at or before an earlier
    rollback's restored step abandons that one's trajectory (and its state is
    part of the later one's), so only the chain of rollbacks that is still the
    run's history is returned: their ``restored`` steps strictly increase.
    """
    chain: list[RolledBack] = []
    for incident in incidents:
        rb = RolledBack.from_incident(incident)
        if rb is None or rb.seq <= known:
            continue
        while chain and chain[-1].restored >= rb.restored:
            chain.pop()
        chain.append(rb)
    return chain


INTENT = "rollback_decided"
"""The incident kind recorded when a rollback is decided, before anything is restored or discarded."""


@dataclass(frozen=True)
class RollbackIntent:
    """A rollback as decided, recorded before its restore starts.

    A rollback restores a checkpoint, then deletes the abandoned trajectory's newer ones, then
    records its outcome; a job killed in between (the restore of a large checkpoint takes minutes)
    used to restart without any of it: from the newest checkpoint (the abandoned trajectory's, when
    the kill came before the discard), with no skip range and no re-warm, training again on the
    data the controller had decided to skip. This record lets the restart finish the rollback."""

    seq: int  # rollbacks in the run's history once this one is done
    at: int  # the step whose spike triggered it
    reason: str
    restore_at_most: int
    skip: tuple[int, int] | None
    lower_lr: bool
    spikes: tuple[int, ...]
    skips: Any  # the skip ranges after it (SkipRanges.to_json)
    ladder: dict[str, Any]  # the ladder's state as decided, before Ladder.rolled_back

    def data(self) -> dict[str, Any]:
        return {"seq": self.seq, "restore_at_most": self.restore_at_most,
                "skip": list(self.skip) if self.skip else None, "lower_lr": self.lower_lr,
                "spikes": list(self.spikes), "skips": self.skips, "ladder": self.ladder}

    @staticmethod
    def from_incident(incident: Incident) -> RollbackIntent | None:
        d = incident.data
        if incident.kind != INTENT or not isinstance(d.get("ladder"), dict):
            return None
        try:
            skip = d.get("skip")
            return RollbackIntent(int(d["seq"]), incident.step, incident.detail, int(d["restore_at_most"]),
                                  (int(skip[0]), int(skip[1])) if skip else None, bool(d.get("lower_lr")),
                                  tuple(int(s) for s in d.get("spikes", ())), d.get("skips"), d["ladder"])
        except (KeyError, TypeError, ValueError, IndexError):
            return None


def unfinished_rollback(incidents: Iterable[Incident]) -> RollbackIntent | None:
    """The newest rollback decided whose outcome the log does not record (its ``rollback`` record,
    or a ``stop`` because nothing could be restored), or None. Incidents come in time order."""
    pending: RollbackIntent | None = None
    for incident in incidents:
        intent = RollbackIntent.from_incident(incident)
        if intent is not None:
            pending = intent
        elif pending is not None and incident.step == pending.at and (
                incident.kind == "stop" or incident.kind == "rollback" and incident.data.get("seq") == pending.seq):
            pending = None
    return pending
