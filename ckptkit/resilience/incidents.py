"""The incident log and the loss history, stored next to the checkpoints.

Each incident (a detection and what was done about it, a restart, an
emergency save) is one small JSON object under ``<run>/.ckptkit/incidents/``,
and the loss history is flushed in chunks under ``<run>/.ckptkit/metrics/``. Small objects,
not an appended file, so the same code works on a local disk and in an S3
bucket (which cannot append). Rank 0 writes; any process can read them back
(``ckptkit report``, and ``resume`` takes skip ranges and each rollback's
state from the log, so what a rollback decided after the newest checkpoint
still holds after a crash: see recovery.py).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ckptkit.errors import CkptkitError
from ckptkit.storage.base import ByteStore

log = logging.getLogger("ckptkit")

INCIDENTS = ".ckptkit/incidents"  # dot-prefixed: never mistaken for a checkpoint folder
METRICS = ".ckptkit/metrics"
RUN_INFO = ".ckptkit/run.json"  # {"name": ...}: what the report calls the run (ResilienceController(name=...))


@dataclass
class Incident:
    kind: str  # spike, skip_step, rollback, lower_lr, stop, restart, preempt, emergency_save, save_abandoned
    step: int
    detail: str = ""
    time: float = field(default_factory=time.time)
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "step": self.step, "detail": self.detail, "time": self.time, "data": self.data}

    @staticmethod
    def from_json(doc: dict[str, Any]) -> Incident:
        return Incident(str(doc.get("kind", "")), int(doc.get("step", -1)), str(doc.get("detail", "")),
                        float(doc.get("time", 0.0)), dict(doc.get("data") or {}))


class IncidentLog:
    def __init__(self, store: ByteStore, writer: bool) -> None:
        self.store = store
        self.writer = writer
        self._seq = 0
        self._pending: list[tuple[int, float | None, float | None]] = []
        # The loss history is written on one background thread, in order: an fsync'd local write
        # or an S3 PUT must not stall the training step that produced it. Incidents stay
        # synchronous (a skip range, a rollback's state must be durable at once). The progress
        # marker has its own writer (progress.py).
        self._io = ThreadPoolExecutor(1, thread_name_prefix="ckptkit-log") if writer else None

    def _put_later(self, key: str, data: bytes) -> None:
        assert self._io is not None
        self._io.submit(self._put_quietly, key, data)

    def _put_quietly(self, key: str, data: bytes) -> None:
        try:
            self.store.put_bytes(key, data)
        except (CkptkitError, OSError) as exc:  # the history is advisory: never fail training over it
            log.warning("ckptkit: could not write %s: %s", key, exc)

    def wait(self) -> None:
        """Block until every background write issued so far is stored (FIFO, one worker)."""
        if self._io is not None:
            done: Future = self._io.submit(lambda: None)
            done.result()

    def record(self, incident: Incident) -> None:
        if not self.writer:
            return
        self._seq += 1
        key = f"{INCIDENTS}/{incident.time:017.6f}-{self._seq:05d}-{uuid.uuid4().hex[:6]}.json"
        self.store.put_bytes(key, json.dumps(incident.to_json(), allow_nan=True).encode())

    def read(self) -> list[Incident]:
        out = []
        for key in self.store.list_keys(INCIDENTS):
            try:
                out.append(Incident.from_json(json.loads(self.store.read_bytes(key))))
            except (CkptkitError, ValueError, TypeError):
                continue
        return sorted(out, key=lambda i: (i.time, i.step))

    def write_name(self, name: str) -> None:
        """Record the run's human name (rank 0; one small object, rewritten only when it changes)."""
        if self.writer and self.read_name() != name:
            self.store.put_bytes(RUN_INFO, json.dumps({"name": name}).encode())

    def read_name(self) -> str | None:
        try:
            doc = json.loads(self.store.read_bytes(RUN_INFO, limit=1 << 16))
        except (CkptkitError, OSError, ValueError, TypeError):  # absent (runs of earlier versions) or unreadable
            return None
        name = doc.get("name") if isinstance(doc, dict) else None
        return name if isinstance(name, str) and name.strip() else None

    def metric(self, step: int, loss: float | None, grad_norm: float | None, flush_every: int = 10) -> None:
        if self.writer:
            self._pending.append((step, loss, grad_norm))
            if len(self._pending) >= flush_every:
                self.flush_metrics()

    def flush_metrics(self) -> None:
        if not self.writer or not self._pending:
            return
        first = self._pending[0][0]
        key = f"{METRICS}/{time.time():017.6f}-{first:09d}.json"
        self._put_later(key, json.dumps(self._pending, allow_nan=True).encode())
        self._pending = []

    def read_metrics(self) -> list[tuple[int, float | None, float | None]]:
        rows = []
        for key in self.store.list_keys(METRICS):
            try:
                rows.extend(tuple(r) for r in json.loads(self.store.read_bytes(key)))
            except (CkptkitError, ValueError, TypeError):
                continue
        return rows  # in time order: a rolled-back stretch appears twice, as it happened
