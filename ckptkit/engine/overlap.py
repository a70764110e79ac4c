"""The overlapped snapshot (``AsyncOptions(snapshot="overlap")``): the copy into staging runs while training goes on.

A blocking snapshot copies the state before ``save`` returns. An overlapped one
only *records* the state at the save call — the work queued so far (a CUDA event
on the training stream) and every saved tensor's version counter
(``tensor._version``, which torch bumps on every in-place change of the tensor or a
view of it) — and returns. The persist thread then copies each piece into the
staging buffer: on the CPU directly; for GPU tensors on a side stream that first
waits for that event, so the copy reads the state as of the save call, and that
keeps every source's memory from being reused until the copy has read it
(``record_stream``).

Nothing stops training from changing the state meanwhile except the **gate**:
the first thing that would change it — the ``step`` of a guarded optimizer, whose
``register_step_pre_hook`` calls :meth:`OverlapSnapshot.pass_gate` — waits there.
On the CPU the gate waits for the copy itself; for GPU tensors it waits only until
every copy is queued, then makes the current stream wait for the side stream's
event, so the optimizer's kernels queue at once and run after the copy.

A change that does not go through a guard is never a silent race: each tensor's
version is checked after its copy (on the CPU), again once every copy is final
(after the side stream's event, on a GPU), again just before the commit, and once
more at the gate, on the thread that trains. A tensor whose version moved fails
the save with :class:`~ckptkit.errors.SnapshotRaceError` naming it; the commit
then fails on every rank and the previous checkpoint stays as it was. Writes
that bypass the version counter — ``tensor.data``, numpy or DLPack views, raw
pointers of extensions, other processes — are outside what can be detected; the
contract (docs/overlap.md) forbids them before the gate.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ckptkit.engine.dtensor_grid import is_dtensor, local_of
from ckptkit.engine.staging import piece_pair
from ckptkit.errors import SaveError, SnapshotRaceError
from ckptkit.plan.save_plan import SavePlan

log = logging.getLogger("ckptkit")


def _counter(t: torch.Tensor) -> int:
    """What an in-place change of ``t`` moves: for a DTensor both its own counter (an op on the DTensor)
    and its local tensor's (an op on ``to_local()``, an EMA on the shard); each moves alone."""
    if is_dtensor(t):
        return int(t._version) + int(local_of(t)._version)
    return int(t._version)


def _version(t: torch.Tensor, name: str) -> int:
    try:
        return _counter(t)
    except RuntimeError as exc:  # inference tensors track no versions
        raise SaveError(
            f"tensor {name!r} cannot be saved with snapshot='overlap': it has no version counter "
            f"(an inference-mode tensor?), so a change racing the background copy could not be detected ({exc})"
        ) from exc


_PENDING: weakref.WeakSet[OverlapSnapshot] = weakref.WeakSet()
"""The snapshots of this process whose gate is not passed yet (what :func:`pass_pending_gates` waits for)."""


def pass_pending_gates() -> None:
    """Pass the gate of every pending overlapped snapshot of this process: what ckptkit's own loader does
    before writing into tensors (its writes go through a memoryview, which no guard hooks and no version
    counter sees: a ``ckptkit.load`` into the live state right after an overlapped save committed the
    loaded bytes under the new step, found by a hunt on 2026-12-06)."""
    for snap in list(_PENDING):
        snap.pass_gate()


class OverlapSnapshot:
    """One overlapped snapshot: made on the training thread at the save call, copied by the persist
    thread (:meth:`copy`), waited for at the gate (:meth:`pass_gate`), judged before the commit
    (:meth:`verdict`)."""

    def __init__(self, plan: SavePlan, tensors: list[torch.Tensor], buffer_of: Callable[[bool], torch.Tensor],
                 where: str, watched: list[torch.Tensor] | None = None) -> None:
        """``buffer_of(on_device)``: the staging buffer, asked for on the persist thread (allocating a
        pinned buffer of many GiB the first time takes a while, and the save call should not wait).
        ``watched``: per tensor, the object whose version counter an in-place change moves — a DTensor
        for its local tensor (an in-place op on a DTensor moves the DTensor's counter, not its local
        tensor's: until 2026-12-06 no change of DTensor state could be seen here); default ``tensors``."""
        self.plan = plan
        self.tensors = tensors
        self.watched = watched if watched is not None else tensors
        self._buffer_of = buffer_of
        self.buffer: torch.Tensor | None = None
        self.where = where
        self.names: dict[int, str] = {}
        for item in plan.items:
            self.names.setdefault(item.ref, item.tensor)
        self.versions = {ref: _version(self.watched[ref], name) for ref, name in self.names.items()}
        devices = {tensors[ref].device for ref in self.names if tensors[ref].device.type == "cuda"}
        if len(devices) > 1:
            raise SaveError(f"saving {where} with snapshot='overlap': this rank's tensors are on several GPUs "
                            f"({sorted(str(d) for d in devices)}); one device per rank is supported")
        self.device = devices.pop() if devices else None
        self._start: Any = None
        if self.device is not None:  # the copy must see everything queued before the save call
            self._start = torch.cuda.Event()
            self._start.record(torch.cuda.current_stream(self.device))
        self._done: Any = None  # the side stream's event after the last copy
        self.queued = threading.Event()  # every copy issued (on the CPU: done), or the copy failed
        self.final = threading.Event()  # every copied byte is in the buffer (or the copy failed)
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self.gate_passed = False
        self._gate_checked = threading.Event()
        self.gate_error: SnapshotRaceError | None = None
        self.verified = False  # the verdict passed: the copy is final and was the state at the save call
        _PENDING.add(self)

    # ----------------------------------------------------------- the persist thread
    def copy(self, side_stream: Any = None) -> None:
        """Copy every piece into the buffer (the persist thread). Never raises: a failure is
        :attr:`error`, raised by :meth:`verdict`."""
        try:
            self.buffer = self._buffer_of(self.device is not None)
            if self.device is None:
                self._copy_host()
            else:
                self._copy_device(side_stream)
        except BaseException as exc:  # noqa: BLE001 - reported through verdict()
            self.error = exc
        finally:
            self.queued.set()
        try:
            if self.error is None and self._done is not None:
                self._done.synchronize()
                self._check(self.names)
        except BaseException as exc:  # noqa: BLE001
            self.error = exc
        finally:
            self.final.set()

    def abandon(self, exc: BaseException) -> None:
        """The persist thread failed before :meth:`copy` ran: no gate may wait for a copy that never comes."""
        if not self.final.is_set():
            self.error = self.error or exc
            self.queued.set()
            self.final.set()

    def _copy_host(self) -> None:
        buf = self.buffer
        assert buf is not None
        with torch.no_grad():
            for item in self.plan.items:
                src, dst = piece_pair(item, self.tensors[item.ref], buf)
                dst.copy_(src)
                self._check((item.ref,))

    def _copy_device(self, side: Any) -> None:
        buf = self.buffer
        assert buf is not None
        with torch.no_grad(), torch.cuda.device(self.device), torch.cuda.stream(side):
            side.wait_event(self._start)
            for item in self.plan.items:
                local = self.tensors[item.ref]
                src, dst = piece_pair(item, local, buf)
                dst.copy_(src, non_blocking=True)
                if local.device.type == "cuda":
                    local.record_stream(side)  # its memory is not reused before the side stream read it
            self._done = torch.cuda.Event()
            self._done.record(side)

    def _moved(self, refs: Any) -> int | None:
        return next((ref for ref in refs if _counter(self.watched[ref]) != self.versions[ref]), None)

    def _check(self, refs: Any) -> None:
        """Raise if a tensor of ``refs`` moved, unless the gate was passed: from then on the state may
        change (the copy is final on the CPU, ordered before the change on a GPU) and the gate's own
        check covers every change before it."""
        with self._lock:
            if self.gate_passed:
                return
            ref = self._moved(refs)
        if ref is not None:
            raise self._race(ref, "before its background copy was final")

    def _race(self, ref: int, when: str) -> SnapshotRaceError:
        return SnapshotRaceError(
            f"saving {self.where}: tensor {self.names[ref]!r} was changed in place {when}, by a path no guard "
            "hooks (snapshot='overlap' requires every change of the saved state to go through a guarded "
            "optimizer's step, or to come after it); this save is abandoned and nothing of it is committed"
        )

    def verdict(self) -> BaseException | None:
        """Just before the commit (the persist thread): the copy's error, a moved version, or the
        gate's finding; None when the staged bytes are the state at the save call."""
        self.final.wait()
        if self.error is not None:
            return self.error
        with self._lock:
            if not self.gate_passed:
                ref = self._moved(self.names)
                if ref is not None:
                    return self._race(ref, "before its background copy was final")
                self.verified = True  # a later gate finding came after every copy was final
                return None
        self._gate_checked.wait()
        with self._lock:
            if self.gate_error is not None:
                return self.gate_error
            self.verified = True
        return None

    # ---------------------------------------------------------- the training thread
    def pass_gate(self) -> None:
        """Called by a guard's hook (or the next save, ``wait``, ``close``) before the state changes:
        wait for the copy (CPU) or order the current stream after it (GPU), then check versions."""
        with self._lock:
            if self.gate_passed:
                return
            self.gate_passed = True
            _PENDING.discard(self)
            if self.verified:  # the copy was verified final before the commit: nothing to wait for
                self._gate_checked.set()
                return
        try:
            if self.device is None:
                self.final.wait()
            else:
                self.queued.wait()
                if self._done is not None:
                    torch.cuda.current_stream(self.device).wait_event(self._done)
            ref = self._moved(self.names)
            if ref is not None:
                race = self._race(ref, "between the save call and the guarded step")
                with self._lock:
                    late = self.verified
                    if not late:
                        self.gate_error = race
                if late:  # the commit came first, after verifying every copy final: the change came after it
                    log.debug("%s (after the commit, which had verified every copy final: the checkpoint stands)", race)
        finally:
            self._gate_checked.set()
