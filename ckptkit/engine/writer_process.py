"""A persistent writer process: persists snapshots from shared memory, outside the trainer's GIL.

The option ``AsyncOptions(executor="process")``. The staging buffer lives in
shared memory and is handed to the process once (torch shares the storage,
not the bytes); each save then sends only the plan. The process writes the
data object and computes the checksums, and returns them; the trainer's
background thread writes the index and coordinates the commit as with the
thread executor. The process is started once and reused by every save.
"""

from __future__ import annotations

import queue
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp

from ckptkit.errors import SaveError
from ckptkit.layout.manifest import IndexEntry
from ckptkit.plan.save_plan import SavePlan
from ckptkit.storage.base import ByteStore

_POLL = 1.0


def _serve(requests: Any, responses: Any) -> None:
    from ckptkit.engine.writer import write_staged

    torch.set_num_threads(1)
    buffers: dict[int, torch.Tensor] = {}
    while True:
        msg = requests.get()
        if msg is None:
            return
        buffer_id, buffer, store, plan, block = msg
        if buffer is not None:
            buffers = {buffer_id: buffer}  # one staging buffer at a time, like the pool
        try:
            entries = write_staged(store, plan, buffers[buffer_id], block)
            responses.put(("ok", [e.crcs for e in entries]))
        except BaseException as exc:  # noqa: BLE001 - reported to the trainer
            responses.put(("err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))


class WriterProcess:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._requests = ctx.Queue()
        self._responses = ctx.Queue()
        self._proc = ctx.Process(target=_serve, args=(self._requests, self._responses), daemon=True,
                                 name="ckptkit-writer")
        try:
            self._proc.start()
        except AssertionError as exc:  # multiprocessing refuses children of daemonic processes
            raise SaveError(
                f"cannot start the ckptkit writer process ({exc}); use AsyncOptions(executor='thread') here"
            ) from None
        self._sent: int | None = None

    def write(self, store: ByteStore, plan: SavePlan, buffer: torch.Tensor, block: int) -> list[IndexEntry]:
        """Persist ``buffer`` (shared memory) as ``plan``'s data object; return its index entries."""
        buffer_id = id(buffer.untyped_storage())
        send = buffer if self._sent != buffer_id else None
        self._requests.put((buffer_id, send, store, plan, block))
        self._sent = buffer_id
        while True:
            try:
                reply = self._responses.get(timeout=_POLL)
                break
            except queue.Empty:
                if not self._proc.is_alive():
                    raise SaveError(f"the ckptkit writer process died (exit code {self._proc.exitcode})") from None
        if reply[0] != "ok":
            raise SaveError(f"the ckptkit writer process failed: {reply[1]}")
        # write_staged answers in plan.items order
        return [IndexEntry(i.tensor, i.region, i.object, i.offset, i.nbytes, tuple(c)) for i, c in zip(plan.items, reply[1])]

    def close(self) -> None:
        if self._proc.is_alive():
            self._requests.put(None)
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
