"""DCP's best async mode, the baseline of ``benchmarks/gpu_bench.py`` (bench-vs-dcp): ``async_save`` on a
thread with its pinned-memory ``DefaultStager``, and its isolated save timings."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch


class DCP:
    """DCP's best async mode: ``async_save`` on a thread with ``DefaultStager`` (pinned memory, async staging on
    a side stream, non-blocking copies), the stager (and its cached pinned buffers) reused from save to save.

    torch 2.11's stager was seen (on CPU stand-ins) to fail its second ``stage`` with ``KeyError(<class
    'type'>)``; should that happen, each save gets a fresh stager (no buffer reuse: DCP then pays its
    allocation every save) and :attr:`note` says so in the figures."""

    note: str | None = None

    def __init__(self) -> None:
        self.stager = self._new()

    @staticmethod
    def _new() -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
                                            use_non_blocking_copy=True))

    def save(self, state: dict[str, Any], path: str) -> Any:
        from torch.distributed.checkpoint import async_save
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if DCP.note is not None:
            self.stager.close()
            self.stager = self._new()
        resp = async_save(state, checkpoint_id=path, async_checkpointer_type=AsyncCheckpointerType.THREAD,
                          async_stager=self.stager)
        return resp

    def staged(self, resp: Any) -> None:
        self._wait(resp.staging_completion)

    def uploaded(self, resp: Any) -> None:
        self._wait(resp.upload_completion)

    def _wait(self, future: Any) -> None:
        try:
            future.result()
        except KeyError as exc:
            if DCP.note is not None or exc.args != (type,):
                raise
            DCP.note = (f"torch {torch.__version__}: DCP's DefaultStager failed on reuse (KeyError(type)); "
                        "a fresh stager per save (no pinned-buffer reuse)")
            print(f"gpu_bench: {DCP.note}", flush=True)
            raise _Retry() from exc

    def close(self) -> None:
        self.stager.close()


class _Retry(Exception):
    pass


def dcp_isolated(state: dict[str, torch.Tensor], scratch: Any, reps: int) -> dict[str, float]:
    dcp = DCP()
    ret, staged, persisted = [], [], []
    try:
        for rep in range(reps + 1):
            for attempt in (0, 1):  # a second attempt only after the stager failed on reuse (see DCP)
                path = scratch.next()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                resp = dcp.save(state, path)
                t1 = time.perf_counter()
                try:
                    dcp.staged(resp)
                    t2 = time.perf_counter()
                    dcp.uploaded(resp)
                    t3 = time.perf_counter()
                    break
                except _Retry:
                    scratch.drop(path)
            if rep:
                ret.append(t1 - t0)
                staged.append(t2 - t0)
                persisted.append(t3 - t0)
            scratch.drop(path)
    finally:
        dcp.close()
    return {"return_s": statistics.median(ret), "staged_s": statistics.median(staged),
            "persisted_s": statistics.median(persisted)}
