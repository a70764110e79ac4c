"""A persistent writer process: persists snapshots from shared memory, outside the trainer's GIL.

The option ``AsyncOptions(executor="process")``. The staging buffer lives in
shared memory and is handed to the process once (torch shares the storage,
not the bytes); each save then sends only where each piece lies in it, as
packed integers (a rank's thousands of plan items, pickled on the trainer's
side and unpickled from the answer, held the trainer's GIL for tens of ms a
save). The process writes the data object and computes the checksums, and
returns them, packed as well; the trainer's
background thread writes the index and coordinates the commit as with the
thread executor. The process is started once and reused by every save.

A save staged in waves (:mod:`ckptkit.engine.waves`) sends its schedule with
the plan; the process then streams each window as the trainer fills it,
through a :class:`~ckptkit.engine.waves.WaveChannel` made before the process
starts (multiprocessing semaphores are shared only by inheritance).
"""

from __future__ import annotations

import itertools
import queue
import traceback
from array import array
from typing import Any

import torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler

from ckptkit.engine.tensor_bytes import as_bytes
from ckptkit.engine.waves import WaveChannel, WaveSchedule, write_waves
from ckptkit.errors import SaveError
from ckptkit.layout.index import IndexEntry
from ckptkit.plan.save_plan import SavePlan
from ckptkit.storage.base import ByteStore

_POLL = 1.0
READY_TIMEOUT = 120.0


def _serve(requests: Any, responses: Any, channel: WaveChannel) -> None:
    from ckptkit.engine.writer import write_staged_spans

    torch.set_num_threads(1)
    responses.put(("ready", None))
    buffers: dict[int, torch.Tensor] = {}
    while True:
        msg = requests.get()
        if msg is None:
            return
        buffer_id, buffer, store, job, block = msg
        if buffer is not None:
            buffers = {buffer_id: buffer}  # one staging buffer at a time, like the pool
        try:
            if job[0] == "waves":
                _, plan, waves = job
                crcs = [e.crcs for e in write_waves(store, plan, buffers[buffer_id], block, waves, channel)]
            else:
                _, obj, packed = job
                flat = array("q")
                flat.frombytes(packed)
                spans = list(zip(flat[0::2], flat[1::2]))
                crcs = write_staged_spans(store, obj, as_bytes(buffers[buffer_id]), spans, block)
            responses.put(("ok", _pack_crcs(crcs)))
        except BaseException as exc:  # noqa: BLE001 - reported to the trainer
            responses.put(("err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))


def _pack_crcs(crcs: list[tuple[int, ...]]) -> tuple[bytes, bytes]:
    """Every piece's block CRCs as two packed arrays: how many each piece has, and all of them."""
    return array("I", map(len, crcs)).tobytes(), array("I", itertools.chain.from_iterable(crcs)).tobytes()


def _unpack_crcs(packed: tuple[bytes, bytes], pieces: int) -> list[tuple[int, ...]]:
    counts, flat = array("I"), array("I")
    counts.frombytes(packed[0])
    flat.frombytes(packed[1])
    if len(counts) != pieces or sum(counts) != len(flat):
        raise SaveError(f"the ckptkit writer process answered {len(counts)} pieces' checksums for {pieces}, "
                        f"{len(flat)} checksums where it counted {sum(counts)}")
    out, at = [], 0
    for n in counts:
        out.append(tuple(flat[at:at + n]))
        at += n
    return out


class WriterProcess:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._requests = ctx.Queue()
        self._responses = ctx.Queue()
        self.channel = WaveChannel.for_processes(ctx)
        self._proc = ctx.Process(target=_serve, args=(self._requests, self._responses, self.channel), daemon=True,
                                 name="ckptkit-writer")
        try:
            self._proc.start()
        except AssertionError as exc:  # multiprocessing refuses children of daemonic processes
            raise SaveError(
                f"cannot start the ckptkit writer process ({exc}); use AsyncOptions(executor='thread') here"
            ) from None
        # The buffer the process holds, and its number there. Held here (not an ``id()``, which Python
        # gives to a new object as soon as the old one is gone) so a new buffer is always handed over:
        # the process would otherwise persist the previous save's bytes under the new step.
        self._sent: torch.Tensor | None = None
        self._sent_number = 0
        self._ready = False

    def _wait_ready(self) -> None:
        """The writer says so once it runs. A script without an ``if __name__ == "__main__":``
        guard is re-imported by the spawned writer and may never get there: fail clearly."""
        try:
            reply = self._responses.get(timeout=READY_TIMEOUT)
        except queue.Empty:
            self.close()
            raise SaveError(
                f"the ckptkit writer process did not start within {READY_TIMEOUT:.0f}s. It is started with "
                "'spawn' and re-imports your main module: guard the training script with "
                "`if __name__ == \"__main__\":` (or use AsyncOptions(executor='thread'))"
            ) from None
        if reply[0] != "ready":
            raise SaveError(f"the ckptkit writer process failed to start: {reply}")
        self._ready = True

    def alive(self) -> bool:
        return self._proc.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode

    def write(self, store: ByteStore, plan: SavePlan, buffer: torch.Tensor, block: int,
              waves: WaveSchedule | None = None) -> list[IndexEntry]:
        """Persist ``buffer`` (shared memory) as ``plan``'s data object — whole, or window by window as
        the trainer stages it (``waves``); return its index entries."""
        if not self._ready:
            self._wait_ready()
        send = None
        if buffer is not self._sent:
            send, self._sent_number = buffer, self._sent_number + 1
        buffer_id = self._sent_number
        if waves is not None:
            job: tuple[Any, ...] = ("waves", plan, waves)
        else:
            (obj,) = plan.objects
            job = ("spans", obj, array("q", itertools.chain.from_iterable((i.offset, i.nbytes) for i in plan.items)).tobytes())
        self._check_sendable(store)
        self._requests.put((buffer_id, send, store, job, block))
        self._sent = buffer
        while True:
            try:
                reply = self._responses.get(timeout=_POLL)
                break
            except queue.Empty:
                if not self._proc.is_alive():
                    raise SaveError(f"the ckptkit writer process died (exit code {self._proc.exitcode})") from None
        if reply[0] != "ok":
            raise SaveError(f"the ckptkit writer process failed: {reply[1]}")
        # answered in plan.items order
        crcs = _unpack_crcs(reply[1], len(plan.items))
        return [IndexEntry(i.tensor, i.region, i.object, i.offset, i.nbytes, c) for i, c in zip(plan.items, crcs)]

    def _check_sendable(self, store: ByteStore) -> None:
        """Pickle ``store`` here (a small object: a URL and its options): the queue pickles requests in its
        feeder thread, which only prints a failure and drops the request, and the save then waited for an
        answer forever."""
        try:
            ForkingPickler.dumps(store)
        except Exception as exc:  # noqa: BLE001 - any pickling failure
            raise SaveError(f"{store.url}: this store cannot be handed to the writer process ({type(exc).__name__}: "
                            f"{exc}); use AsyncOptions(executor='thread') with it") from exc

    def close(self) -> None:
        if self._proc.is_alive():
            self._requests.put(None)
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
