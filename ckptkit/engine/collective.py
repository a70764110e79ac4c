"""The few collectives a save or load needs, behind one small interface.

Checkpoint coordination runs over gloo even when training uses NCCL: object
collectives on NCCL need device memory and would contend with the training
stream, and a background persist must never touch the training group. When
the default group is not gloo, a dedicated gloo group over the same ranks is
created once and reused.

Every collective here is entered by every rank exactly once per phase, even
by a rank that already failed: failures travel *inside* the collective
(:class:`Outcome`), so one rank's error never leaves the others hanging.
"""

from __future__ import annotations

import atexit
import os
import json
import logging
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from ..errors import CkptkitError, SaveError

log = logging.getLogger("ckptkit")


class Comm(Protocol):
    rank: int
    world_size: int

    def all_gather(self, obj: Any) -> list[Any]: ...

    def all_gather_json(self, obj: Any) -> list[Any]: ...

    def gather(self, obj: Any) -> list[Any] | None: ...

    def broadcast(self, obj: Any) -> Any: ...

    def broadcast_json(self, obj: Any) -> Any: ...

    def any_flags(self, flags: list[bool]) -> list[bool]: ...

    def all_min(self, values: list[int]) -> list[int]: ...

    def all_max(self, values: list[float]) -> list[float]: ...


@dataclass(frozen=True)
class Outcome:
    """A phase's result on one rank: a payload, or the message of the error it raised."""

    ok: bool
    payload: Any = None
    error: str = ""
    error_type: str = ""


def failed_ranks(said: list[str | None], shown: int = 4) -> str:
    """``"rank r: what it said; ..."`` for the ranks whose entry is not None (the first ``shown``), as a
    failure on some ranks is reported on every rank: a save's preparation, a load's agreements."""
    failed = [(r, text) for r, text in enumerate(said) if text is not None]
    more = f" (and {len(failed) - shown} more ranks)" if len(failed) > shown else ""
    return "; ".join(f"rank {r}: {text}" for r, text in failed[:shown]) + more


def failure_text(exc: BaseException, doing: str) -> str:
    """What a rank's failure says to every rank: ckptkit's and the storage's errors by their message,
    anything else (a torch ``RuntimeError``, a ``MemoryError``, a bug's ``TypeError``) prefixed with its
    type and logged with its traceback here, on the rank it happened on, where the traceback exists."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, (CkptkitError, OSError)):
        return text
    log.error("unexpected %s while %s; reported on every rank", type(exc).__name__, doing, exc_info=exc)
    return f"{type(exc).__name__}: {text}"


def first_rank_does(comm: Comm, work: Callable[[], Any], doing: str) -> tuple[Any, str | None]:
    """``work()`` on the group's first rank alone; on every rank its result (JSON) and None, or None
    and the text of its failure (:func:`failure_text`). Collective.

    Rank 0 does a job's shared bookkeeping alone (listing the run's folder, deleting an abandoned
    trajectory, creating the run's id) while the other ranks go on into the next collective. An
    exception escaping there on rank 0 alone left them waiting until the process group's timeout,
    and a failure told only as a flag left them unable to say what failed: both, found one caller at
    a time until 2026-12-06, are this function's job now. Callers raise their own error from the text."""
    said: list[Any] = [None, None]
    if getattr(comm, "group_rank", comm.rank) == 0:  # the broadcast's source, in a subgroup too
        try:
            said = [work(), None]
        except Exception as exc:  # noqa: BLE001 - told to every rank, raised by each caller
            said = [None, failure_text(exc, doing)]
    value, failure = comm.broadcast_json(said)  # JSON: a list comes back, the pair is made here
    return value, failure


def every_rank_does(comm: Comm, work: Callable[[], tuple[Any, Any]], doing: str) -> tuple[Any, list[Any], str | None]:
    """``work()`` -> (result, fact) on every rank; this rank's result, every rank's fact (JSON, None
    where it failed) and, when any rank failed, :func:`failed_ranks`' text naming them (else None).
    Collective: one JSON all-gather, entered even by a rank whose ``work`` raised.

    For work each rank does on its own before a collective phase (preparing the state a save takes,
    applying what a load read): one rank failing there used to raise on that rank alone while the
    others went on into the next collective and waited for it. Callers raise their own error."""
    result = fact = failure = None
    try:
        result, fact = work()
    except Exception as exc:  # noqa: BLE001 - told to every rank, raised by each caller
        failure = failure_text(exc, doing)
    said = comm.all_gather_json([failure, fact])
    failures = [s[0] for s in said]
    return result, [s[1] for s in said], failed_ranks(failures) if any(f is not None for f in failures) else None


def agreed_preparation(comm: Comm, work: Callable[[], tuple[Any, Any]], what: str) -> tuple[Any, list[Any]]:
    """``work()`` -> (state, fact) on this rank; the state and every rank's fact (JSON), once every rank
    prepared the state it saves (:func:`every_rank_does`). An adapter's save runs code on each rank
    before the save's first collective (a Stateful's ``state_dict``, a user's client state checked for
    JSON, the engine's own records), and one rank failing there used to raise on that rank alone while
    the others went on into the save and waited for it. Now every rank raises a :class:`SaveError`
    naming ``what`` (``"checkpoint of step 500"``), the failed ranks and what each said, before
    anything is written. When every rank refused with a ckptkit error (the job's configuration: an
    unsupported optimizer's ``StateMismatchError``), each raises its own, as it did before the agreement."""
    own: list[BaseException] = []

    def kept() -> tuple[Any, Any]:
        try:
            state, fact = work()
        except Exception as exc:
            own.append(exc)
            raise
        return state, [fact]  # a list: None in the gathered facts means "failed" only

    state, facts, failed = every_rank_does(comm, kept, f"preparing the {what}")
    if failed is not None:
        if own and isinstance(own[0], CkptkitError) and all(f is None for f in facts):
            raise own[0]
        raise SaveError(f"{what} not saved: preparing the state failed on {failed}")
    return state, [f[0] for f in facts]


def agreed_state(comm: Comm, make_state: Callable[[], Any], what: str) -> Any:
    """:func:`agreed_preparation` for a save that has no per-rank fact to share: ``make_state()``'s state
    (the DeepSpeed and Megatron adapters' ``engine_state`` / ``megatron_state``), once every rank built its own."""
    state, _ = agreed_preparation(comm, lambda: (make_state(), None), what)
    return state


class LocalComm:
    """A world of one process (no torch.distributed, or a single-rank job)."""

    rank = 0
    world_size = 1

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def all_gather_json(self, obj: Any) -> list[Any]:
        return [json.loads(json.dumps(obj))]

    def gather(self, obj: Any) -> list[Any] | None:
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        return obj

    def broadcast_json(self, obj: Any) -> Any:
        return json.loads(json.dumps(obj))

    def close(self) -> None:
        """Nothing to release."""

    def any_flags(self, flags: list[bool]) -> list[bool]:
        return list(flags)

    def all_min(self, values: list[int]) -> list[int]:
        return list(values)

    def all_max(self, values: list[float]) -> list[float]:
        return [float(v) for v in values]


class TorchComm:
    """Collectives over a gloo process group; ``owned``: a group made for this communicator alone,
    which :meth:`close` destroys."""

    def __init__(self, group: Any, *, owned: bool = False) -> None:
        self.group = group
        self.owned = owned
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size(group)
        self.group_rank = dist.get_rank(group)
        self.root = dist.get_global_rank(group, 0) if group is not None else 0

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` as JSON bytes in tensors: what the load path exchanges, so nothing on
        it unpickles, not even what comes over the wire (tuples arrive as lists)."""
        data = json.dumps(obj, separators=(",", ":")).encode()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
        longest = max(int(t.item()) for t in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.group)
        return [json.loads(bytes(t[: int(n.item())].numpy())) for t, n in zip(out, sizes)]

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.group_rank == 0 else None
        dist.gather_object(obj, out, dst=self.root, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self.root, group=self.group)
        return box[0]

    def broadcast_json(self, obj: Any) -> Any:
        """The group's first rank's ``obj`` on every rank, as JSON bytes (nothing unpickles; the
        others' ``obj`` is ignored). One length and one payload broadcast: unlike an all-gather, its
        cost does not grow with the world."""
        data = json.dumps(obj, separators=(",", ":")).encode() if self.group_rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=self.root, group=self.group)
        payload = torch.zeros(int(size.item()), dtype=torch.uint8)
        if data:
            payload[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        dist.broadcast(payload, src=self.root, group=self.group)
        return json.loads(bytes(payload.numpy()))

    def any_flags(self, flags: list[bool]) -> list[bool]:
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.uint8)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(x) for x in t.tolist()]

    def all_min(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return [int(x) for x in t.tolist()]

    def all_max(self, values: list[float]) -> list[float]:
        """The largest of every rank's value at each position (float64; no NaN: how a reduction
        orders NaN is the backend's choice, so callers map it to a number first)."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [float(x) for x in t.tolist()]

    def close(self) -> None:
        """Destroy the group if this communicator owns it (:func:`release_group`); not collective."""
        if self.owned and self.group is not None:
            group, self.group = self.group, None
            release_group(group)


_gloo_groups: dict[Any, Any] = {}
_lock = threading.Lock()


def resolve_comm(process_group: Any = None) -> Comm:
    """The communicator for ``process_group`` (default: the whole world), gloo-backed."""
    if not (dist.is_available() and dist.is_initialized()):
        return LocalComm()
    group = process_group
    if dist.get_world_size(group) == 1:
        return LocalComm()
    backend = dist.get_backend(group)
    if backend != "gloo":
        with _lock:
            key = group if group is not None else "world"
            if key not in _gloo_groups:
                ranks = dist.get_process_group_ranks(group) if group is not None else None
                if not _gloo_groups:
                    atexit.register(_release_cached_groups)
                _gloo_groups[key] = dist.new_group(ranks=ranks, backend="gloo")
            group = _gloo_groups[key]
    return TorchComm(group)


def release_group(group: Any) -> None:
    """Destroy a gloo group that ckptkit made for itself, now, and let the caller drop its last reference.

    A gloo group's worker threads free each finished collective's tensors after the caller has its
    result, and freeing a tensor that Python created takes the GIL. If the group is still alive when
    the interpreter finalizes (a reference held until the last garbage collection), a worker thread
    that reaches that point then is ended by the interpreter inside C++ code, and the process aborts
    ("terminate called without an active exception", SIGABRT). Seen on a rank of a torchrun job that
    exited right after an abandoned emergency save. Destroyed here, from Python, the group's
    destructor runs with the GIL released and joins those threads while the interpreter still runs.
    Not collective: each rank releases its own handle. A group already destroyed with the whole
    world (``dist.destroy_process_group()``) is only dropped."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group(group)
        except ValueError:  # no longer registered: the world was destroyed first
            pass


def _release_cached_groups() -> None:
    """At exit, before the interpreter finalizes: the cached gloo groups of NCCL jobs (:func:`release_group`)."""
    with _lock:
        groups = list(_gloo_groups.values())
        _gloo_groups.clear()
    for group in groups:
        release_group(group)


def init_process_group(backend: str = "gloo", timeout: timedelta | None = None, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` that survives torchrun restarts: under ``torchrun
    --max-restarts`` the agent keeps one store for the whole job, and a restarted attempt could read
    the previous attempt's peer addresses before the new peers overwrote them (seen with gloo as
    ``connectFullMesh ... Connection refused``); the store is namespaced by attempt
    (``TORCHELASTIC_RESTART_COUNT``). Outside torchrun it is the plain call."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "store" in kwargs or "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, timeout=timeout, **kwargs)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                         timeout=timeout or timedelta(minutes=10))
    store = dist.PrefixStore(f"/ckptkit/attempt-{attempt}", base)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
