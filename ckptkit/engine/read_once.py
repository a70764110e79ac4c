"""Read-once loads: the ranks that need the same stored bytes read them from storage once.

With data parallelism every replica of the weights needs the same pieces: Megatron's DP group,
HSDP's replicate dimension, the module weights of ZeRO-1/2, expert-DP groups. Read separately,
a dp32 job pulls its weights from shared storage 32 times at every restart — the load that
saturates a file system and trips collective timeouts at scale.

Here every rank plans its reads as always (byte ranges of data objects, widened to whole
checksum blocks and coalesced), and one all-gather shares the plans. Each object's ranges are
cut at every range boundary of every rank into *runs* — stretches of bytes that the same set of
ranks needs (:func:`split_runs`). A run one rank needs, it reads itself. A run several ranks
need gets **one reader** among them (the one with the fewest bytes assigned so far,
:func:`assign_readers`), which reads it from storage and sends it to the others over the job's
(gloo) process group. Runs are cut at range boundaries, and ranges at checksum-block boundaries,
so every rank ends up with its own request's bytes whole and checks every block's CRC32C itself,
as any read does; a request whose bytes fail is read again from storage by that rank (then from
the fallback tier), so a rank never trusts another's bytes further than its own checksums.

Runs move in *windows* of at most :data:`WINDOW` bytes; each window's reads end with an agreement
(one all-gather of errors) before anything is sent, so a reader that cannot read makes the load
fail on every rank, naming the reader and the object, and a reader that dies fails its peers'
receives (bounded by the group's timeout), never a silent hang. A reader that neither fails nor
dies (a read that never returns) is the load watchdog's (:mod:`ckptkit.engine.watchdog`): the
transfers here count as waiting for other ranks in the load's progress, so only the stuck reader
is named.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ckptkit.engine.read_session import ReadPlan, ReadSession
from ckptkit.engine.reader import _verify_view, execute_request, place
from ckptkit.engine.tensor_bytes import as_bytes
from ckptkit.errors import CorruptCheckpointError, PeerFailureError
from ckptkit.plan.load_plan import ReadRequest

log = logging.getLogger("ckptkit")

WINDOW = 256 << 20
"""Bytes of runs moved per window (every rank's reads and sends of a window complete before the next)."""

Range = tuple[str, int, int]  # (object, start, end)


@dataclass(frozen=True)
class Run:
    """Bytes ``[start, end)`` of ``object`` that exactly the ranks ``needers`` need."""

    object: str
    start: int
    end: int
    needers: tuple[int, ...]

    @property
    def length(self) -> int:
        return self.end - self.start


def split_runs(ranges_by_rank: list[list[Range]]) -> list[Run]:
    """Every needed byte of every object, once, as runs of one needer set, cut at every range
    boundary of every rank (so each run lies inside one range of each of its needers); sorted, pure."""
    events: dict[str, list[tuple[int, int, int]]] = {}
    for rank, ranges in enumerate(ranges_by_rank):
        for obj, start, end in ranges:
            if end > start:
                events.setdefault(obj, []).extend(((start, 1, rank), (end, -1, rank)))
    out: list[Run] = []
    for obj in sorted(events):
        active: dict[int, int] = {}
        evs = sorted(events[obj])
        i = 0
        while i < len(evs):
            pos = evs[i][0]
            while i < len(evs) and evs[i][0] == pos:
                _, delta, rank = evs[i]
                active[rank] = active.get(rank, 0) + delta
                if not active[rank]:
                    del active[rank]
                i += 1
            if i < len(evs) and active:
                # never merged with the previous run: a cut is some rank's range boundary, and every run
                # must lie inside one request of each of its needers
                out.append(Run(obj, pos, evs[i][0], tuple(sorted(active))))
    return out


def assign_readers(runs: list[Run]) -> list[int]:
    """One reader per run: the needing rank with the fewest bytes assigned so far, ties going round
    the needers by the run's position (equal loads spread over ranks and objects). Pure and
    deterministic: every rank computes the same answer."""
    load: dict[int, int] = {}
    out = []
    for i, run in enumerate(runs):
        start = i % len(run.needers)
        order = run.needers[start:] + run.needers[:start]
        best = min(order, key=lambda r: load.get(r, 0))
        out.append(best)
        load[best] = load.get(best, 0) + run.length
    return out


def windows(runs: list[Run], limit: int = WINDOW, keep: list[int] | None = None) -> Iterator[list[int]]:
    """Indexes of ``runs`` (or of those in ``keep``) in consecutive groups of at most ``limit`` bytes
    (a larger run alone). Every rank must pass the same runs and ``keep``."""
    group: list[int] = []
    size = 0
    for i in (range(len(runs)) if keep is None else keep):
        run = runs[i]
        if group and size + run.length > limit:
            yield group
            group, size = [], 0
        group.append(i)
        size += run.length
    if group:
        yield group


@dataclass
class _Pending:
    """One of this rank's read requests, filled run by run."""

    req: ReadRequest
    buf: torch.Tensor | None = None
    missing: int = 0
    sources: set[int] = field(default_factory=set)

    def slice(self, run: Run) -> torch.Tensor:
        if self.buf is None:
            self.buf = torch.empty(self.req.length, dtype=torch.uint8)
        lo = run.start - self.req.offset
        return self.buf[lo:lo + run.length]


def read_once(session: ReadSession, plan: ReadPlan | None, targets: list[torch.Tensor], comm: object,
              *, window: int = WINDOW) -> tuple[int, int]:
    """Execute ``plan`` into ``targets``, every byte needed by several ranks read once in the job.

    Collective. ``plan`` is None on a rank whose planning failed: then nothing is read anywhere
    (the caller's agreement raises that rank's error). Returns (bytes this rank read from
    storage, bytes it received from other ranks)."""
    me = comm.group_rank  # type: ignore[attr-defined]
    mine = None if plan is None else [(r.object, r.offset, r.offset + r.length) for r in plan.requests]
    everyone = comm.all_gather_json((session.url, mine))  # type: ignore[attr-defined]
    if plan is None or any(ranges is None for _, ranges in everyone):
        return 0, 0
    if len({url for url, _ in everyone}) != 1:  # ranks loading different checkpoints: nothing to share
        return session.execute(plan, targets), 0
    runs = split_runs([[(o, a, b) for o, a, b in ranges] for _, ranges in everyone])
    readers = assign_readers(runs)
    pending = [_Pending(r) for r in plan.requests]
    of_run = _requests_of_runs(runs, pending, me)
    # requests no other rank shares a byte of are read as always (in parallel, straight into the targets)
    shared_requests = {id(p) for i, ps in of_run.items() if len(runs[i].needers) > 1 for p in ps}
    alone = tuple(p.req for p in pending if id(p) not in shared_requests)
    # A failure on this rank never leaves the windows early: every rank enters each window's agreement
    # (its all-gather), the failure goes into the next one, or is raised after the last. Until
    # 2026-12-06 a damaged piece that one rank read alone (here, or a request completed in a window
    # and checked by _finish) raised on that rank at once: it skipped the remaining windows' collectives,
    # the ranks paired different collectives, and the load hung (reproduced: 4 ranks, several windows).
    failure: tuple[BaseException, str] | None = None
    read = 0
    try:
        read = session.execute(ReadPlan(alone, plan.writers), targets) if alone else 0
    except Exception as exc:  # noqa: BLE001 - carried into the first window's agreement, or raised after
        failure = (exc, "the bytes only this rank reads")
    received = 0
    for p in pending:
        p.missing = p.req.length if id(p) in shared_requests else 0
    # the bytes of those requests that only this rank needs: read first, here, in parallel (no collective;
    # a failure is carried into the first window's agreement so no rank is left waiting)
    solo = [i for i, ps in of_run.items()
            if len(runs[i].needers) == 1 and any(id(p) in shared_requests for p in ps)]
    solo_read, solo_failure = _read_runs(session, solo, runs, of_run)
    pending_error = failure or solo_failure
    read += solo_read
    for i in solo:
        for p in of_run[i]:
            p.missing -= runs[i].length
    shared = [i for i, run in enumerate(runs) if len(run.needers) > 1]  # the same list on every rank
    for group in windows(runs, window, keep=shared):
        got_read, got_received = _window(session, group, runs, readers, of_run, comm, me, pending_error)
        pending_error = None
        read += got_read
        received += got_received
        for i in group:
            for p in of_run.get(i, []):
                p.missing -= runs[i].length
                if p.missing == 0:
                    try:
                        read += _finish(session, p, targets)
                    except Exception as exc:  # noqa: BLE001 - agreed in the next window, or raised after the last
                        pending_error = pending_error or (exc, p.req.object)
    if pending_error is not None:
        raise pending_error[0]  # every rank has been through every window: the caller's agreement follows
    return read, received


def _read_runs(session: ReadSession, idxs: list[int], runs: list[Run], of_run: dict[int, list[_Pending]],
               ) -> tuple[int, tuple[BaseException, str] | None]:
    """Read runs ``idxs`` from storage into this rank's request buffers, ``session.io_threads`` at a
    time. Returns the bytes read and the first failure (with its object), not raised."""
    for i in idxs:  # buffers allocated here, on one thread
        of_run[i][0].slice(runs[i])

    def fetch(i: int) -> None:
        run, first = runs[i], of_run[i][0]
        session.store.read_into(run.object, run.start, as_bytes(first.slice(run)))
        for other in of_run[i][1:]:
            other.slice(run).copy_(first.slice(run))

    failure: tuple[BaseException, str] | None = None
    read = 0
    with ThreadPoolExecutor(max_workers=max(1, min(session.io_threads, len(idxs) or 1)),
                            thread_name_prefix="ckptkit-read-once") as pool:
        for i, fut in [(i, pool.submit(fetch, i)) for i in idxs]:
            try:
                fut.result()
                read += runs[i].length
            except Exception as exc:  # noqa: BLE001 - agreed in the next window, so every rank fails together
                if failure is None:
                    failure = (exc, runs[i].object)
    session.count_read(read)
    return read, failure


def _requests_of_runs(runs: list[Run], pending: list[_Pending], me: int) -> dict[int, list[_Pending]]:
    """run index -> this rank's requests containing it (runs are cut at every request boundary)."""
    by_object: dict[str, list[_Pending]] = {}
    for p in pending:
        by_object.setdefault(p.req.object, []).append(p)
    out: dict[int, list[_Pending]] = {}
    for i, run in enumerate(runs):
        if me not in run.needers:
            continue
        out[i] = [p for p in by_object.get(run.object, [])
                  if p.req.offset <= run.start and run.end <= p.req.offset + p.req.length]
    return out


def _window(session: ReadSession, group: list[int], runs: list[Run], readers: list[int],
            of_run: dict[int, list[_Pending]], comm: object, me: int,
            earlier: tuple[BaseException, str] | None = None) -> tuple[int, int]:
    read, failure = _read_runs(session, [i for i in group if readers[i] == me], runs, of_run)
    failure = earlier or failure
    error, failed = failure if failure is not None else (None, None)
    errors = comm.all_gather_json(None if error is None else (f"{type(error).__name__}: {error}", failed))  # type: ignore[attr-defined]
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        if error is not None:
            raise error
        rank, (text, obj) = bad[0]
        raise PeerFailureError(f"{session.url}: rank {rank} failed reading {obj} (a load that shares the bytes "
                               f"ranks have in common): {text}")
    ops = []
    received = 0
    net = getattr(comm, "group", None)
    for tag, i in enumerate(group):
        run, reader = runs[i], readers[i]
        if len(run.needers) == 1:
            continue
        if reader == me:
            src = of_run[i][0].slice(run)
            ops += [dist.P2POp(dist.isend, src, _global(net, peer), net, tag) for peer in run.needers if peer != me]
        elif me in run.needers:
            first = of_run[i][0]
            first.sources.add(reader)
            ops.append(dist.P2POp(dist.irecv, first.slice(run), _global(net, reader), net, tag))
            received += run.length
    if ops:
        with _waiting(session):  # a transfer waits for other ranks: not this rank's own stall
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if session.progress is not None:
            session.progress.received(received)
    for i in group:  # a received run that two of this rank's requests share
        if readers[i] != me and me in runs[i].needers and len(of_run[i]) > 1:
            for other in of_run[i][1:]:
                other.slice(runs[i]).copy_(of_run[i][0].slice(runs[i]))
    return read, received


def _finish(session: ReadSession, p: _Pending, targets: list[torch.Tensor]) -> int:
    """Check a complete request's every block, then place it; bytes that fail are read again by
    this rank from storage (and its fallback tier) before they count as damage. Returns the bytes
    read from storage for that."""
    assert p.buf is not None
    dtypes = {op.op.tensor: session.dtype(op.op.tensor) for op in p.req.ops}
    try:
        _verify_view(p.req, 0, as_bytes(p.buf), list(p.req.checks), session.url)
    except CorruptCheckpointError as exc:
        log.warning("%s (bytes from rank(s) %s); reading them from storage here", exc, sorted(p.sources) or "self")
        p.buf = None
        n = execute_request(p.req, session.store, targets, dtypes, session.url)
        session.count_read(n)
        _placed(session, p)
        return n
    place(p.req, p.buf, targets, dtypes)
    p.buf = None
    _placed(session, p)
    return 0


def _placed(session: ReadSession, p: _Pending) -> None:
    if session.progress is not None:
        session.progress.placed(len(p.req.ops))


def _waiting(session: ReadSession) -> AbstractContextManager[None]:
    """Waiting for other ranks, in a load's progress (the watchdog does not count it as idle)."""
    return nullcontext() if session.progress is None else session.progress.waiting()


def _global(group: object, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)
