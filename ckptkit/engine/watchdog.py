"""The load watchdog: a rank that stops making progress fails the load on every rank, by name.

DCP loads hang silently at 256-1,024 GPUs because nothing in a load times out: one rank's
storage read never returns, and every other rank waits for it in the next collective until the
process group's own timeout (30 minutes for gloo) ends the job with a message that names neither
the rank nor the object. Here:

* **The load runs on a worker thread; the calling thread watches it** (:func:`supervise`). A
  thread stuck in a read (or in a collective) cannot be interrupted, but it can be left behind:
  the calling thread raises :class:`~ckptkit.errors.LoadStalledError` and the abandoned load
  raises at its next step (:class:`~ckptkit.engine.load_progress.ProgressRecord` is aborted), so
  it neither writes further into the caller's state nor enters another collective. The caller's
  grad/inference mode and current CUDA device and stream go with it to the worker.
* **A rank judges itself** from its :class:`~ckptkit.engine.load_progress.ProgressRecord`: no
  progress for ``stall_seconds`` while not waiting for other ranks is a stall. It names the
  object of its oldest read in flight.
* **Every rank learns it out of band**, through the job's c10d key-value store (the TCPStore
  every ``init_process_group`` has), never through a collective the stalled rank would have to
  join. Each rank publishes a heartbeat (its progress, a counter) under its own key; the first
  verdict is written with ``compare_set``, so every rank raises the same one; every rank polls
  the verdict key. A rank too frozen to judge itself (SIGSTOP, a C call holding the interpreter,
  a dead process gloo has not noticed) stops beating: each rank watches its next
  :data:`WATCHED_PEERS` ranks on a ring of the group and posts the verdict for a silent one.
  This builds on :mod:`~ckptkit.engine.read_once`'s failure handling rather than replacing it:
  a reader whose read *fails* is still reported through the window's agreement, and one that
  *dies* still fails its peers' receives (``PeerFailureError``); the watchdog covers what those
  cannot see, a rank that neither fails nor dies.

The watchdog looks at its own rank every ``min(stall_seconds / 8, 5)`` s. Store traffic per rank
and round (every ``min(stall_seconds / 8, 60)`` s): one set, two checks, one multi-get, with keys under a per-load prefix (a counter per group, the same on every rank
because loads are collective; torchrun's restart count keeps a restarted attempt away from a
dead attempt's keys). A rank deletes its own key of the load before last, when every rank has
finished it. If the store cannot be reached, the rank logs it and keeps watching itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from ckptkit.engine.load_progress import LoadProgress, ProgressRecord
from ckptkit.errors import LoadStalledError

log = logging.getLogger("ckptkit")

POLL_MAX = 5.0
"""The longest time between two looks at the progress, in seconds."""
STORE_PERIOD_MAX = 60.0
"""The longest time between two rounds of store traffic (heartbeat, peer check, verdict check): an
eighth of ``stall_seconds``, at most this. At the default 600 s that is one round a minute per rank,
about 1,100 store calls a second at 16,384 ranks (a round every 5 s would be 13,000)."""
WATCHED_PEERS = 2
"""How many ring neighbours each rank watches for silence (any one frozen rank is watched by two)."""
_SEQ: dict[str, int] = {}
_SEQ_LOCK = threading.Lock()


def poll_interval(stall_seconds: float | None) -> float:
    """How often the watchdog looks: 8 times per ``stall_seconds`` (a stall is caught within an
    eighth of it), at most every :data:`POLL_MAX` s (the store is reached less often: see
    :meth:`Heartbeats.due`); every second
    when there is only an ``on_progress`` callback to feed."""
    if stall_seconds is None:
        return 1.0
    return min(POLL_MAX, max(0.02, stall_seconds / 8))


def supervise(body: Callable[[], Any], record: ProgressRecord, *, where: str, comm: Any,
              stall_seconds: float | None, on_progress: Callable[[LoadProgress], None] | None) -> Any:
    """Run ``body`` (a load) under the watchdog: its result, its own error, or LoadStalledError.

    With neither a watchdog nor a callback, ``body`` runs on the calling thread, as before."""
    if stall_seconds is None and on_progress is None:
        return body()
    beats = Heartbeats.open(comm, stall_seconds) if stall_seconds is not None else None
    judge = _Judge(record, where, stall_seconds, beats, comm.world_size > 1)
    worker = _Worker(body)
    interval = poll_interval(stall_seconds)
    try:
        if beats is not None:
            beats.publish(record.snapshot())
        worker.start()
        while not worker.wait(interval):
            snap = record.snapshot()
            _report(on_progress, snap)
            stalled = judge(snap)
            if stalled is not None:
                raise stalled
    except BaseException as exc:  # a stall, or the caller's KeyboardInterrupt: the load is left behind
        record.abort(f"the load was stopped: {type(exc).__name__}: {exc}")
        raise
    finally:
        if beats is not None:
            beats.close()
    _report(on_progress, record.snapshot())
    return worker.result()


def _report(on_progress: Callable[[LoadProgress], None] | None, snap: LoadProgress) -> None:
    if on_progress is None:
        return
    try:
        on_progress(snap)
    except Exception:  # noqa: BLE001 - one rank raising here would leave the others waiting for it
        log.warning("LoadOptions.on_progress raised; the load goes on", exc_info=True)


class _Worker:
    """The load's thread, started with the caller's torch thread state; daemonic, so one left
    behind in a read that never returns does not keep the interpreter from exiting."""

    def __init__(self, body: Callable[[], Any]) -> None:
        self._body = body
        self._enter = caller_context()
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ckptkit-load", daemon=True)

    def _run(self) -> None:
        try:
            with self._enter():
                self._value = self._body()
        except BaseException as exc:  # noqa: BLE001 - raised on the calling thread
            self._error = exc
        finally:
            self._done.set()

    def start(self) -> None:
        self._thread.start()

    def wait(self, seconds: float) -> bool:
        return self._done.wait(seconds)

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


def caller_context() -> Callable[[], Any]:
    """A context manager factory that puts the calling thread's torch state on another thread:
    grad and inference mode (in-place copies into inference tensors need it) and the current CUDA
    device and stream (so copies into the caller's GPU tensors are ordered on its stream)."""
    import torch

    grad = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()
    stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None

    @contextmanager
    def enter() -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(grad))
            if inference:
                stack.enter_context(torch.inference_mode())
            if stream is not None:
                torch.cuda.set_device(stream.device)
                stack.enter_context(torch.cuda.stream(stream))
            yield

    return enter


class _Judge:
    """Decides, at each poll, whether the load is stalled on this rank or another."""

    def __init__(self, record: ProgressRecord, where: str, stall: float | None, beats: Heartbeats | None,
                 distributed: bool) -> None:
        self.record, self.where, self.stall, self.beats = record, where, stall, beats
        self.distributed = distributed
        self.warned = False
        self.logged_at = 0.0

    def __call__(self, snap: LoadProgress) -> LoadStalledError | None:
        if self.stall is None:
            return None
        verdict = self._own(snap)
        if self.beats is not None and (verdict is not None or self.beats.due()):
            self.beats.publish(snap)
            verdict = verdict or self.beats.silent_peer(self.where)
            verdict = self.beats.claim(verdict) if verdict is not None else self.beats.posted()
        if verdict is None:
            return None
        option = f"LoadOptions(stall_seconds={self.stall:g})"
        if self.distributed:
            text = f"{verdict['text']}; the load was stopped on every rank ({option}). The process group may hold " \
                   "collectives that will never complete: restart the job"
        else:
            text = f"{verdict['text']}; the load was stopped ({option})"
        return LoadStalledError(text, verdict["rank"], verdict["object"])

    def _own(self, snap: LoadProgress) -> dict | None:
        assert self.stall is not None
        if snap.seconds - self.logged_at >= 10:
            self.logged_at = snap.seconds
            log.debug("loading %s: rank %d %s", self.where, snap.rank, snap.describe())
        if snap.waiting or snap.idle_seconds < self.stall / 2:
            self.warned = False
            return None
        if snap.idle_seconds < self.stall:
            if not self.warned:
                self.warned = True
                log.warning("loading %s: rank %d has made no progress for %.1f s, %s; the watchdog stops the "
                            "load at %g s", self.where, snap.rank, snap.idle_seconds, snap.describe(), self.stall)
            return None
        text = f"loading {self.where}: rank {snap.rank} made no progress for {snap.idle_seconds:.1f} s, " \
               f"{snap.describe()}"
        log.error("%s", text)
        return {"rank": snap.rank, "object": snap.object, "text": text}


class Heartbeats:
    """This rank's progress under a key of the job's c10d store, its ring neighbours' read back,
    and the load's one verdict. Store failures are logged once and end the peer watch (the rank
    still judges itself)."""

    def __init__(self, store: Any, seq: int, me: int, ranks: list[int], stall: float) -> None:
        self.store, self.seq, self.me, self.ranks, self.stall = store, seq, me, ranks, stall
        self.count = 0
        self.start = time.monotonic()
        watched = [(me + i) % len(ranks) for i in range(1, WATCHED_PEERS + 1)]
        self.peers = {k: _Peer(changed=self.start) for k in dict.fromkeys(watched) if k != me}
        self.broken = False
        self.last_round = self.start

    @classmethod
    def open(cls, comm: Any, stall: float) -> Heartbeats | None:
        """The heartbeats of one load over ``comm``'s group; None for a one-process load."""
        group_rank = getattr(comm, "group_rank", None)
        if comm.world_size <= 1 or group_rank is None:
            return None
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(comm.group if comm.group is not None else dist.group.WORLD)
        gid = hashlib.sha1(json.dumps(ranks).encode()).hexdigest()[:12]
        with _SEQ_LOCK:  # counted whatever follows, so the ranks' counters never drift apart
            seq = _SEQ[gid] = _SEQ.get(gid, 0) + 1
        try:
            base = dist.distributed_c10d._get_default_store()
        except Exception as exc:  # noqa: BLE001 - the rank still watches itself
            log.warning("load watchdog: no key-value store to reach the other ranks (%s); this rank watches "
                        "only itself", exc)
            return None
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"ckptkit/load-watchdog/{attempt}/{gid}", base)
        beats = cls(store, seq, group_rank, ranks, stall)
        beats._op(lambda: store.delete_key(beats._beat_key(group_rank, seq - 2)))  # every rank finished that load
        return beats

    def due(self) -> bool:
        """Whether a round of store traffic is due (see :data:`STORE_PERIOD_MAX`)."""
        now = time.monotonic()
        if now - self.last_round < min(STORE_PERIOD_MAX, max(0.02, self.stall / 8)):
            return False
        self.last_round = now
        return True

    def _beat_key(self, rank: int, seq: int | None = None) -> str:
        return f"{self.seq if seq is None else seq}/beat/{rank}"

    @property
    def _verdict_key(self) -> str:
        return f"{self.seq}/verdict"

    def _op(self, fn: Callable[[], Any]) -> Any:
        if self.broken:
            return None
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a watchdog that cannot reach the store must not fail the load
            self.broken = True
            log.warning("load watchdog: the key-value store failed (%s); this rank now watches only itself", exc)
            return None

    def publish(self, snap: LoadProgress) -> None:
        self.count += 1
        beat = {"n": self.count, "state": "loading", "rank": snap.rank, "object": snap.object, "text": snap.describe()}
        self._op(lambda: self.store.set(self._beat_key(self.me), json.dumps(beat)))

    def close(self) -> None:
        """This rank is out of the load (finished or stopped): its watchers stop watching it."""
        self.count += 1
        self._op(lambda: self.store.set(self._beat_key(self.me), json.dumps({"n": self.count, "state": "done"})))

    def posted(self) -> dict | None:
        """The verdict another rank posted, if any."""
        def get() -> dict | None:
            if not self.store.check([self._verdict_key]):
                return None
            return json.loads(self.store.get(self._verdict_key))

        return self._op(get)

    def claim(self, verdict: dict) -> dict:
        """Post ``verdict`` unless one is there already; the one every rank raises."""
        won = self._op(lambda: self.store.compare_set(self._verdict_key, "", json.dumps(verdict)))
        return verdict if won is None else json.loads(won)

    def silent_peer(self, where: str) -> dict | None:
        """A verdict for a watched rank whose heartbeat has not changed for ``stall`` seconds.

        A rank that has not *started* the load is only logged: ranks that reach a load far apart
        are the caller's doing (one may legitimately do more before it), not a stall of the load,
        and the group's own timeout still bounds the wait, as before."""
        if not self.peers:
            return None
        keys = [self._beat_key(k) for k in self.peers]
        now = time.monotonic()
        got = self._op(lambda: self.store.multi_get(keys) if self.store.check(keys) else
                       [self.store.get(k) if self.store.check([k]) else None for k in keys])
        if got is None:
            return None
        for (rank, peer), raw in zip(self.peers.items(), got):
            beat = json.loads(raw) if raw is not None else None
            if beat is not None and beat["state"] == "done":
                continue
            if beat is not None and beat["n"] != peer.beat:
                peer.beat, peer.changed, peer.last = beat["n"], now, beat
            elif now - peer.changed >= self.stall:
                if peer.last is not None:
                    return _silent(where, peer.last, now - peer.changed)
                if not peer.warned:
                    peer.warned = True
                    log.warning("loading %s: rank %d has not started the load %.1f s after rank %d did", where,
                                self.ranks[rank], now - peer.changed, self.ranks[self.me])
        return None


@dataclass
class _Peer:
    """What a rank last saw of a watched rank's heartbeat, and when (its own clock) it changed."""

    changed: float
    beat: int | None = None
    last: dict | None = None
    warned: bool = False


def _silent(where: str, last: dict, seconds: float) -> dict:
    """The verdict for a rank whose heartbeat stopped (its last report: ``last``)."""
    text = (f"loading {where}: rank {last['rank']} stopped reporting progress {seconds:.1f} s ago (it may be frozen "
            f"or dead; its last report: {last['text']})")
    log.error("%s", text)
    return {"rank": last["rank"], "object": last["object"], "text": text}
