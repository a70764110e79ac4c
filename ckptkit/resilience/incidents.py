"""The incident log and the loss history, stored next to the checkpoints.

Each incident (a detection and what was done about it, a restart, an
emergency save) is one small JSON object under ``<run>/.ckptkit/incidents/``,
and the loss history is flushed in chunks under ``<run>/.ckptkit/metrics/``. Small objects,
not an appended file, so the same code works on a local disk and in an S3
bucket (which cannot append). Rank 0 writes; any process can read them back
(``ckptkit report``, and ``resume`` takes skip ranges and each rollback's
state from the log, so what a rollback decided after the newest checkpoint
still holds after a crash: see recovery.py).

Reading the log is a decision every rank must make alike: a rank that resumed
without a rollback's skip range would train on the data the others skip. So a
resume reads it once (the group's first rank) and broadcasts what it read, or
the error (:meth:`IncidentLog.read_agreed`); and nothing is dropped quietly:

* a record the store could not return (a :class:`StorageError` after retries,
  one listed but gone) is an error naming it — "could not read" says nothing
  about what the record holds;
* a damaged record (not strict JSON — truncated, a duplicated key, over
  :data:`MAX_RECORD_BYTES` — or fields of the wrong type, a non-finite time or
  step) is an error naming it,
  unless the caller opts in with ``IncidentLogOptions(skip_damaged=True)``: then
  it is left out with a warning that names it.

Records are parsed by :func:`ckptkit.layout.strict_json.load_json` like every other
document; non-finite floats (a NaN loss) are written as ``{"__float__": "nan"}``.
Records written before that tag hold a bare ``NaN`` loss: the reader still takes
those constants (a resume must read the logs earlier versions wrote).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptkit.errors import (
    CheckpointNotFoundError,
    CkptkitError,
    CorruptCheckpointError,
    ManifestError,
    OptionsError,
    PeerFailureError,
    StorageError,
    TooLargeError,
)
from ckptkit.layout.strict_json import MAX_METADATA_BYTES, as_dict, as_int, as_str, load_json
from ckptkit.storage.base import ByteStore

if TYPE_CHECKING:
    from ckptkit.engine.collective import Comm

log = logging.getLogger("ckptkit")

INCIDENTS = ".ckptkit/incidents"  # dot-prefixed: never mistaken for a checkpoint folder
METRICS = ".ckptkit/metrics"
RUN_INFO = ".ckptkit/run.json"  # {"name": ...}: what the report calls the run (ResilienceController(name=...))
#: Largest incident record read (a rollback's record, with the controller's whole state, is a few KiB).
MAX_RECORD_BYTES = 16 << 20
#: Largest metrics chunk read (``flush_every`` rows of three numbers).
MAX_CHUNK_BYTES = 16 << 20
_MAX_STEP = 2**62
_MAX_TIME = 253402300799.0  # 9999-12-31T23:59:59Z: datetime formats nothing later
_RECORD = re.compile(r"^[^/]+\.json$")  # directly under INCIDENTS
_TEMPORARY = re.compile(r"^[^/]+\.json\.tmp-[0-9a-z-]+$")  # a local put_bytes interrupted before its rename
_FLOAT_TAG = "__float__"


@dataclass(frozen=True)
class IncidentLogOptions:
    """How a resume reads the incident log.

    ``skip_damaged``: go on without a damaged record (bad JSON, a wrong field) instead of
    raising; each one left out is named in a warning. Off by default: a damaged record may be
    a rollback whose skip range and re-warm the restarted run would silently lose. A record the
    store could not *read* is always an error (retry when the store answers).
    """

    skip_damaged: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.skip_damaged, bool):
            raise OptionsError(f"IncidentLogOptions.skip_damaged must be True or False, got {self.skip_damaged!r}")


@dataclass
class Incident:
    kind: str  # spike, skip_step, rollback_decided, rollback, lower_lr, stop, restart, preempt, emergency_save, save_abandoned
    step: int
    detail: str = ""
    time: float = field(default_factory=time.time)
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "step": self.step, "detail": self.detail, "time": self.time, "data": self.data}

    @staticmethod
    def from_json(doc: dict[str, Any], where: str = "incident record") -> Incident:
        """The record ``doc`` (as :func:`load_json` parsed it); ManifestError naming ``where`` and the
        field when a field a resume relies on has the wrong type."""
        kind = as_str(doc.get("kind"), f"{where}: kind")
        if not kind:
            raise ManifestError(f"{where}: kind: expected a non-empty string")
        step = as_int(doc.get("step"), f"{where}: step", -_MAX_STEP, _MAX_STEP)
        detail = as_str(doc.get("detail"), f"{where}: detail")
        when = doc.get("time")
        if not isinstance(when, (int, float)) or isinstance(when, bool) or not 0 <= when <= _MAX_TIME:
            # a time no clock gives (before 1970, after 9999) is a damaged record: `ckptkit report` crashed
            # on one formatting it (found by a hunt, 2026-12-06)
            raise ManifestError(f"{where}: time: expected seconds since 1970 (up to year 9999), got {when!r:.40}")
        data = _decode_floats(as_dict(doc.get("data"), f"{where}: data"), f"{where}: data")
        if kind == "rollback":
            _check_rollback(data, f"{where}: data")
        elif kind == "rollback_decided":
            _check_intent(data, f"{where}: data")
        return Incident(kind, step, detail, float(when), data)


def _check_rollback(data: dict[str, Any], where: str) -> None:
    """The fields of a rollback record that a resume acts on (skip range, the state it adopts)."""
    skip = data.get("skip")
    if skip is not None:
        _check_range(skip, f"{where}: skip")
    state = data.get("state")
    if state is None:
        return  # logged before rollbacks carried their state
    state = as_dict(state, f"{where}: state")
    as_int(data.get("seq"), f"{where}: seq", 0)
    as_int(data.get("restored"), f"{where}: restored", 0)
    skips = state.get("skips")
    if skips is not None:
        if not isinstance(skips, list):
            raise ManifestError(f"{where}: state.skips: expected a list, got {type(skips).__name__}")
        for item in skips:
            _check_range(item, f"{where}: state.skips")
    if state.get("ladder") is not None:
        as_dict(state["ladder"], f"{where}: state.ladder")


def _check_intent(data: dict[str, Any], where: str) -> None:
    """The fields of a decided rollback that a resume acts on (it may finish the rollback)."""
    as_int(data.get("seq"), f"{where}: seq", 1)
    as_int(data.get("restore_at_most"), f"{where}: restore_at_most", -_MAX_STEP, _MAX_STEP)
    if data.get("skip") is not None:
        _check_range(data["skip"], f"{where}: skip")
    skips = data.get("skips")
    if not isinstance(skips, list):
        raise ManifestError(f"{where}: skips: expected a list, got {type(skips).__name__}")
    for item in skips:
        _check_range(item, f"{where}: skips")
    as_dict(data.get("ladder"), f"{where}: ladder")
    if not isinstance(data.get("lower_lr"), bool):
        raise ManifestError(f"{where}: lower_lr: expected true or false, got {data.get('lower_lr')!r:.40}")
    spikes = data.get("spikes")
    if not isinstance(spikes, list):
        raise ManifestError(f"{where}: spikes: expected a list of steps, got {type(spikes).__name__}")
    for s in spikes:
        as_int(s, f"{where}: spikes", -_MAX_STEP, _MAX_STEP)


def _check_range(value: Any, where: str) -> None:
    if not isinstance(value, list) or len(value) != 2:
        raise ManifestError(f"{where}: expected a sample range [first, end], got {value!r:.80}")
    first = as_int(value[0], where, 0)
    if as_int(value[1], where, first) < first:
        raise ManifestError(f"{where}: the range ends before it starts")


def _encode_floats(value: Any) -> Any:
    """``value`` with every non-finite float tagged (strict JSON has no NaN; a NaN loss is news)."""
    if isinstance(value, float) and not math.isfinite(value):
        return {_FLOAT_TAG: repr(value)}
    if isinstance(value, dict):
        return {k: _encode_floats(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode_floats(v) for v in value]
    return value


def _decode_floats(value: Any, where: str) -> Any:
    """The inverse of :func:`_encode_floats` (depth is bounded by the strict loader)."""
    if isinstance(value, dict):
        if len(value) == 1 and _FLOAT_TAG in value:
            text = value[_FLOAT_TAG]
            if text not in ("nan", "inf", "-inf"):
                raise ManifestError(f"{where}: malformed float {text!r:.40}")
            return float(text)
        return {k: _decode_floats(v, where) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_floats(v, where) for v in value]
    return value


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
        self._unwritten: list[tuple[str, bytes]] = []  # records the store refused: retried at the next

    def _put_later(self, key: str, data: bytes) -> None:
        assert self._io is not None
        self._io.submit(self._put_quietly, key, data)

    def _put_quietly(self, key: str, data: bytes) -> None:
        try:
            self.store.put_bytes(key, data)
        except (CkptkitError, OSError) as exc:  # the history is advisory: never fail training over it
            log.warning("ckptkit: could not write %s: %s", key, exc)

    def wait(self) -> None:
        """Block until every background write issued so far is stored (FIFO, one worker), and try
        the incident records the store refused once more."""
        self._write_unwritten()
        if self._io is not None:
            done: Future = self._io.submit(lambda: None)
            done.result()

    def record(self, incident: Incident) -> None:
        """Store ``incident`` now (one writer: the group's first rank), or keep it to retry.

        Only the writer writes, so a store error raised here was raised on that rank alone: the
        others went on into the job's next collective and the job died with it (reproduced: a
        spike's record on a store that refused it; a hang where the error is caught). A failed write
        is logged, kept, and retried before every later record and at :meth:`wait`; the state it
        carries (a skip range, a rollback's) is in every checkpoint saved from then on anyway."""
        if not self.writer:
            return
        self._seq += 1
        key = f"{INCIDENTS}/{incident.time:017.6f}-{self._seq:05d}-{uuid.uuid4().hex[:6]}.json"
        self._unwritten.append((key, json.dumps(_encode_floats(incident.to_json()), allow_nan=False).encode()))
        self._write_unwritten()

    def _write_unwritten(self) -> None:
        while self._unwritten:
            key, data = self._unwritten[0]
            try:
                self.store.put_bytes(key, data)
            except (CkptkitError, OSError) as exc:
                log.error("ckptkit: could not write the incident record %s/%s (%d waiting; retried with the "
                          "next record and at close; a crash before it is written restarts without it, "
                          "from a checkpoint that holds the state it records if one was saved since): %s",
                          self.store.url, key, len(self._unwritten), exc)
                return
            self._unwritten.pop(0)

    def read(self, options: IncidentLogOptions = IncidentLogOptions()) -> list[Incident]:
        """Every record, in time order, read by this process alone (``ckptkit report``, tests).

        StorageError naming the record the store could not return; CorruptCheckpointError naming
        a damaged one, unless ``options.skip_damaged`` (then a warning names each one left out)."""
        incidents, skipped = self._read_all(options)
        _warn_skipped(skipped)
        return incidents

    def read_agreed(self, comm: Comm, options: IncidentLogOptions = IncidentLogOptions()) -> list[Incident]:
        """:meth:`read` by the group's first rank, broadcast: every rank gets the same records, or
        raises the same error (collective; a single process without torch.distributed reads alone).

        Every rank reading on its own could see different logs (a per-node cache, a read that
        failed on one rank only), and a rank that missed a rollback would resume without its skip
        range or re-warm while the others kept them."""
        reader = comm.broadcast(comm.rank) == comm.rank  # the broadcast's source: the group's first rank
        failure: BaseException | None = None
        sent: tuple[bool, Any, str, str] = (True, None, "", "")
        if reader:
            try:
                incidents, skipped = self._read_all(options)
                sent = (True, ([i.to_json() for i in incidents], skipped), "", "")
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or the others hang
                failure = exc
                sent = (False, None, str(exc) or type(exc).__name__, type(exc).__name__)
        ok, payload, error, error_type = comm.broadcast(sent)
        if failure is not None:
            raise failure
        if not ok:
            cls = _SHARED_ERRORS.get(error_type)
            if cls is None:
                raise PeerFailureError(f"reading the incident log failed on the rank that reads it: "
                                       f"{error_type}: {error}")
            raise cls(error)
        docs, skipped = payload
        _warn_skipped(skipped)
        return [Incident(d["kind"], d["step"], d["detail"], d["time"], d["data"]) for d in docs]

    def _read_all(self, options: IncidentLogOptions) -> tuple[list[Incident], list[str]]:
        """``(records in time order, reasons of the damaged ones left out)``; see :meth:`read`."""
        if not isinstance(options, IncidentLogOptions):
            raise OptionsError(f"options must be IncidentLogOptions(...), got {options!r}")
        where = f"{self.store.url}/{INCIDENTS}"
        try:
            keys = self.store.list_keys(INCIDENTS)
        except StorageError as exc:
            raise StorageError(f"{where}: could not list the incident log: {exc}") from None
        out: list[Incident] = []
        skipped: list[str] = []
        budget = MAX_METADATA_BYTES  # the whole log, like any one metadata document
        for key in keys:
            name = key[len(INCIDENTS) + 1:]
            if _TEMPORARY.match(name):
                log.info("ckptkit: %s/%s is a write interrupted before its rename, not a record", self.store.url, key)
                continue
            try:
                incident, size = self._read_record(key, name, budget)
            except _Damaged as exc:
                if not options.skip_damaged:
                    raise CorruptCheckpointError(
                        f"{exc}: a damaged incident record (a resume will not guess what it held: a rollback's "
                        "skip range and re-warm may be in it). Repair or remove it, or resume with "
                        "ResilienceController(incident_log=IncidentLogOptions(skip_damaged=True)) "
                        "(ckptkit.resilience.incidents) to go on without it"
                    ) from None
                skipped.append(str(exc))
                continue
            budget -= size
            out.append(incident)
        return sorted(out, key=lambda i: (i.time, i.step)), skipped

    def _read_record(self, key: str, name: str, budget: int) -> tuple[Incident, int]:
        where = f"{self.store.url}/{key}"
        if not _RECORD.match(name):
            raise _Damaged(f"{where}: not an incident record (records are <time>-<seq>-<id>.json)")
        try:
            data = self.store.read_bytes(key, limit=min(MAX_RECORD_BYTES, max(budget, 0)))
        except CheckpointNotFoundError:
            raise StorageError(f"{where}: the incident record was listed but could not be read (it is gone); "
                               "not resuming without it") from None
        except StorageError as exc:
            raise StorageError(f"{where}: could not read this incident record: {exc}; not resuming without it "
                               "(retry when the store answers)") from None
        except (CorruptCheckpointError, ManifestError) as exc:  # too large, not a regular file, a link outside
            raise _Damaged(str(exc) if where in str(exc) else f"{where}: {exc}") from None
        try:
            # nonfinite: records written before floats were tagged hold a bare NaN loss (still read)
            return Incident.from_json(load_json(data, where, nonfinite=True), where), len(data)
        except ManifestError as exc:
            raise _Damaged(str(exc)) from None

    def write_name(self, name: str) -> None:
        """Record the run's human name (rank 0; one small object, rewritten only when it changes)."""
        if not self.writer:
            return
        try:  # the writer alone: an error raised here would leave the other ranks in the next collective
            if self.read_name() != name:
                self.store.put_bytes(RUN_INFO, json.dumps({"name": name}).encode())
        except (CkptkitError, OSError) as exc:
            log.warning("ckptkit: could not record the run's name %r in %s/%s: %s", name, self.store.url, RUN_INFO, exc)

    def read_name(self) -> str | None:
        """The run's name; None if none was recorded or it cannot be read (it only titles reports)."""
        where = f"{self.store.url}/{RUN_INFO}"
        try:
            doc = load_json(self.store.read_bytes(RUN_INFO, limit=1 << 16), where)
        except CheckpointNotFoundError:  # runs of earlier versions, or no name given
            return None
        except (CkptkitError, OSError) as exc:
            log.warning("ckptkit: ignoring the run's name: %s", exc)
            return None
        name = doc.get("name")
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
        """The loss history, in time order. Advisory (plots, a lower bound of steps lost): a chunk
        that cannot be read or parsed is left out with a warning naming it, never quietly."""
        rows: list[tuple[int, float | None, float | None]] = []
        for key in self.store.list_keys(METRICS):
            if _TEMPORARY.match(key.rsplit("/", 1)[-1]):
                continue  # a write interrupted before its rename
            try:
                chunk = json.loads(self.store.read_bytes(key, limit=MAX_CHUNK_BYTES))  # NaN: a non-finite loss
                rows.extend(_metric_row(r) for r in chunk)
            except (CkptkitError, OSError, ValueError, TypeError, RecursionError) as exc:
                log.warning("ckptkit: leaving out loss-history chunk %s/%s: %s", self.store.url, key,
                            str(exc)[:200] or type(exc).__name__)
        return rows  # in time order: a rolled-back stretch appears twice, as it happened


class _Damaged(Exception):
    """A record that was read but holds something other than an incident (internal)."""


#: Errors the reading rank's failure is raised as on every rank (anything else: PeerFailureError).
_SHARED_ERRORS: dict[str, type[CkptkitError]] = {
    c.__name__: c for c in (StorageError, CorruptCheckpointError, TooLargeError, ManifestError, OptionsError)
}


def _warn_skipped(skipped: list[str]) -> None:
    for reason in skipped:
        log.warning("ckptkit: resuming without a damaged incident record (IncidentLogOptions(skip_damaged=True)): %s",
                    reason)


def _metric_row(row: Any) -> tuple[int, float | None, float | None]:
    if (not isinstance(row, list) or len(row) != 3 or not isinstance(row[0], int) or isinstance(row[0], bool)
            or any(v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)) for v in row[1:])):
        raise ValueError(f"a row {row!r:.80} is not [step, loss, grad_norm]")
    return row[0], row[1], row[2]
