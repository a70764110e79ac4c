"""The progress marker: how far a job got, durable enough to count the steps a crash lost.

One small object, ``<run>/.ckptkit/progress.json``, overwritten by rank 0 as
training goes. After a crash, ``reached - restored step`` is the work lost.
The job may die by SIGKILL, so nothing here relies on a clean exit; and only
rank 0 writes, so the marker means the same when the job comes back at another
world size.

For every step ``k`` rank 0 notes, in order:

* ``{"step": k-1, "entering": k}`` when step ``k`` starts (``ctl.batches``
  hands out its batch). It is durable before rank 0 joins step ``k``'s
  agreement (the controller's one all-reduce per step), and no rank can finish
  step ``k`` without rank 0 in that all-reduce; so while this is the newest
  marker, the job reached ``k-1`` or at most ``k``.
* ``{"step": k, "entering": null}`` once the agreement is done: the job reached
  exactly ``k`` (it cannot finish ``k+1`` before the next "entering" is durable).

When rank 0 lives to see the failure, it makes the count exact before it goes:
if the all-reduce raises (a peer died), or the loop ends inside step ``k``
before its agreement (an error, e.g. a peer's death surfacing in the
framework's own collectives of the forward pass), it writes
``{"step": k-1, "entering": null}``. So a restart knows the exact count unless
rank 0 itself was killed inside an agreement or with its "entering" note
stored, and then it knows it to within one step ("at least N, at most N+1").

Writes run on one background thread that writes only the newest note (older
ones not yet started are dropped), so the wait before the all-reduce is free
when the write (issued as the step began) finished during the forward and
backward pass: an fsync'd local write or an object-store PUT per step, off the
critical path unless steps are shorter than a write.
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ckptkit.errors import CheckpointNotFoundError, CkptkitError, ManifestError
from ckptkit.layout.strict_json import as_int, load_json
from ckptkit.storage.base import ByteStore

log = logging.getLogger("ckptkit")

PROGRESS = ".ckptkit/progress.json"  # dot-prefixed: never mistaken for a checkpoint folder
MAX_MARKER_BYTES = 1 << 16  # a marker is one small object; anything larger is not one
WAIT_S = 2.0  # the most a step waits for its "entering" note; a store slower than that costs exactness


@dataclass(frozen=True)
class Progress:
    """What the previous job's marker says."""

    step: int  # the newest step whose agreement rank 0 completed
    entering: int | None  # rank 0 may have been inside this step's agreement (then reached is step or this)
    closed: bool  # the job ended with close()
    job: str = ""

    @staticmethod
    def from_json(doc: dict[str, Any]) -> Progress:
        """The marker's fields, each of its exact type (ManifestError otherwise)."""
        entering = doc.get("entering")
        closed, job = doc.get("closed", False), doc.get("job", "")
        if not isinstance(closed, bool) or not isinstance(job, str):
            raise ManifestError(f"{PROGRESS}: 'closed' must be a boolean and 'job' a string")
        return Progress(as_int(doc.get("step"), f"{PROGRESS}: step", 0),
                        as_int(entering, f"{PROGRESS}: entering", 0) if entering is not None else None, closed, job)


@dataclass(frozen=True)
class Lost:
    """Steps trained since the restored checkpoint and thrown away: at least ``at_least``, at most ``at_most``."""

    restored: int
    at_least: int
    at_most: int | None  # None: nothing bounds it from above
    reached: int  # the newest step the job certainly reached

    @property
    def exact(self) -> bool:
        return self.at_least == self.at_most

    def describe(self) -> str:
        n = f"{self.at_least} step{'' if self.at_least == 1 else 's'} lost"
        if self.exact:
            return n
        return f"at least {n}" + (f" (at most {self.at_most})" if self.at_most is not None else "")


def steps_lost(progress: Progress | None, restored: int, fallback_reached: int | None = None) -> Lost | None:
    """How much work a job that resumes from step ``restored`` lost, from the previous job's marker.

    Without a marker (a job that never completed a step, or one from before
    markers) ``fallback_reached`` (e.g. the newest logged loss) gives a lower
    bound and nothing bounds it from above; None if nothing is known.
    """
    if progress is None:
        if fallback_reached is None or fallback_reached <= restored:
            return None
        return Lost(restored, fallback_reached - restored, None, fallback_reached)
    low = max(0, progress.step - restored)
    high = max(low, progress.entering - restored) if progress.entering is not None else low
    return Lost(restored, low, high, progress.step)


class ProgressMarker:
    """Rank 0's writer of the marker (a no-op elsewhere), and anyone's reader."""

    def __init__(self, store: ByteStore, writer: bool) -> None:
        self.store = store
        self.writer = writer
        self.job = uuid.uuid4().hex[:12]  # tells one job's notes from the next one's
        self._cond = threading.Condition()
        self._wanted: tuple[int, bytes] | None = None
        self._version = 0
        self._written = 0
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._behind = 0  # a version a wait gave up on: until it is written, waits do not block
        self._failing = False

    # ---------------------------------------------------------------- writing
    def note(self, step: int, entering: int | None = None, *, closed: bool = False) -> int:
        """Ask for the marker to say this; return a version to :meth:`wait` for."""
        if not self.writer:
            return 0
        doc = {"step": step, "entering": entering, "closed": closed, "job": self.job, "time": time.time()}
        with self._cond:
            if self._stopped:  # after close(): write in the caller's thread
                self._put(json.dumps(doc).encode())
                return 0
            self._version += 1
            self._wanted = (self._version, json.dumps(doc).encode())
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckptkit-progress", daemon=True)
                self._thread.start()
                atexit.register(self.close)  # an exit by an uncaught error still stores the newest note
            self._cond.notify_all()
            return self._version

    def wait(self, version: int, timeout: float = WAIT_S) -> bool:
        """Block until the note ``version`` (or a newer one) is stored; False on timeout.

        A store that cannot keep up stalls training once, not every step: after
        a timeout, waits return at once until the writer has caught up, and the
        count after a crash in that stretch may be short (a warning says so).
        """
        if not self.writer:
            return True
        with self._cond:
            if self._written < self._behind:
                return False
            done = self._cond.wait_for(lambda: self._written >= version, timeout)
            if not done:
                self._behind = version
        if not done:
            log.warning("ckptkit: the progress marker took over %.1fs to write; until it catches up, the steps "
                        "lost to a crash may be counted short", timeout)
        return done

    def write(self, step: int, entering: int | None = None, *, closed: bool = False,
              timeout: float = WAIT_S) -> bool:
        """:meth:`note` and :meth:`wait`: the marker says this before the call returns."""
        return self.wait(self.note(step, entering, closed=closed), timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or (self._wanted is not None
                                                               and self._wanted[0] > self._written))
                if self._wanted is None or self._wanted[0] <= self._written:
                    return  # stopped with nothing left to write
                version, data = self._wanted
            self._put(data)
            with self._cond:
                self._written = max(self._written, version)
                self._cond.notify_all()

    def _put(self, data: bytes) -> None:
        try:
            self.store.put_bytes(PROGRESS, data)
            self._failing = False
        except (CkptkitError, OSError) as exc:  # advisory: never fail training over it
            if not self._failing:
                log.warning("ckptkit: could not write the progress marker (steps lost to a crash may be "
                            "counted short until it works again): %s", exc)
            self._failing = True

    def close(self, timeout: float = WAIT_S) -> None:
        """Write what is pending and stop the thread."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    # ---------------------------------------------------------------- reading
    def read(self) -> Progress | None:
        """What the previous job left (None if no marker, or an unreadable one). Advisory, and read by
        rank 0 alone before the collective restore: nothing in it may raise. Until 2026-12-06 a marker
        holding ``Infinity`` or ``1e999`` raised OverflowError there, and the other ranks waited in the
        restore for rank 0 (found by a hunt); it is now parsed strictly, at most 64 KiB of it."""
        try:
            return Progress.from_json(load_json(self.store.read_bytes(PROGRESS, limit=MAX_MARKER_BYTES), PROGRESS))
        except Exception as exc:  # noqa: BLE001 - advisory: an unreadable marker is no marker
            if not isinstance(exc, CheckpointNotFoundError):  # no marker: a fresh run
                log.warning("ckptkit: ignoring the progress marker %s (%s)", PROGRESS, exc)
            return None
