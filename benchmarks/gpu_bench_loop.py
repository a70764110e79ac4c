"""The training loop of ``benchmarks/gpu_bench.py`` (bench-vs-dcp): what a save every few steps costs a step.

An MLP whose weights and AdamW moments hold about the state size asked for, a step of about 150 ms,
and a save every :data:`SAVE_EVERY` steps, against the same loop without checkpoints. Besides the
step times it records how long the training thread spent in each save call: where that call waits
for the previous save's persist (``on_busy="wait"``), the loop is bound by the storage's bandwidth,
not by the snapshot, and the figure says which.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from gpu_bench_dcp import DCP

GiB = 1 << 30
SAVE_EVERY = 5
WIDTH = 4096


class MLP(torch.nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x


class Trainer:
    """The model, its optimizer and a batch sized for a step of about 150 ms."""

    def __init__(self, state_gib: float) -> None:
        self.depth = max(1, round(state_gib * GiB / (12 * WIDTH * WIDTH)))  # fp32 weight + 2 moments: 12 bytes
        torch.manual_seed(0)
        self.model = MLP(WIDTH, self.depth).cuda()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(2048, WIDTH, device="cuda")
        for _ in range(3):
            self.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.step()
        torch.cuda.synchronize()
        t = time.perf_counter() - t0
        self.rows = int(min(65536, max(256, 2048 * 0.150 / max(t, 1e-4))))
        self.x = torch.randn(self.rows, WIDTH, device="cuda")

    def step(self, before_step: Callable[[], None] | None = None) -> None:
        self.opt.zero_grad(set_to_none=False)
        self.model(self.x).square().mean().backward()
        if before_step is not None:
            before_step()
        self.opt.step()

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(),
                "optim": {str(k): v for k, v in self.opt.state_dict()["state"].items()}}

    def state_gib(self) -> float:
        tensors = [*self.model.state_dict().values(),
                   *[t for st in self.opt.state_dict()["state"].values() for t in st.values()
                     if isinstance(t, torch.Tensor)]]
        return round(sum(t.numel() * t.element_size() for t in tensors) / GiB, 3)


def ckptkit_run(trainer: Trainer, saver: Any, scratch: Any, held: list[float]) -> Callable[[int], None]:
    """``n`` steps saving with ``saver`` every SAVE_EVERY; the save calls' seconds appended to ``held``."""
    from ckptkit.storage import open_store

    def run(n: int) -> None:
        paths = []
        for i in range(n):
            trainer.step()
            if i % SAVE_EVERY == 0:
                paths.append(scratch.next())
                t0 = time.perf_counter()
                saver.save(trainer.state(), open_store(paths[-1]))  # waits for the previous save (on_busy="wait")
                held.append(time.perf_counter() - t0)
        saver.wait()
        for path in paths:
            scratch.drop(path)

    return run


def dcp_run(trainer: Trainer, stager: DCP, scratch: Any, held: list[float]) -> Callable[[int], None]:
    """The same with DCP: staging waited for before the optimizer step (torchtitan's
    ``maybe_wait_for_staging``), one upload in flight (as ckptkit's ``on_busy="wait"``)."""

    def run(n: int) -> None:
        resp = None
        pending: list[tuple[Any, str]] = []
        for i in range(n):
            wait = None if resp is None else (lambda r=resp: stager.staged(r))
            trainer.step(before_step=wait)
            if i % SAVE_EVERY == 0:
                t0 = time.perf_counter()
                if pending:
                    stager.uploaded(pending[-1][0])
                path = scratch.next()
                resp = stager.save(trainer.state(), path)
                held.append(time.perf_counter() - t0)
                pending.append((resp, path))
        for r, path in pending:
            stager.uploaded(r)
            scratch.drop(path)

    return run


def loop(state_gib: float, scratch: Any, rounds: int, steps: int, overlap: bool) -> dict[str, Any]:
    """Mean step time of each variant, order rotated per round; overheads against no checkpointing."""
    import ckptkit
    from ckptkit.engine.async_save import AsyncSaver

    trainer = Trainer(state_gib)
    savers = {"ckptkit": AsyncSaver()}
    if overlap:
        savers["ckptkit-overlap"] = AsyncSaver(options=ckptkit.AsyncOptions(snapshot="overlap"))
        savers["ckptkit-overlap"].guard(trainer.opt)
    stager = DCP()
    held: dict[str, list[float]] = {name: [] for name in [*savers, "dcp"]}

    def no_checkpoints(n: int) -> None:
        for _ in range(n):
            trainer.step()

    variants: dict[str, Callable[[int], None]] = {"none": no_checkpoints}
    for name, saver in savers.items():
        variants[name] = ckptkit_run(trainer, saver, scratch, held[name])
    variants["dcp"] = dcp_run(trainer, stager, scratch, held["dcp"])
    try:
        for fn in variants.values():  # warm-up: buffers allocated, plans made
            fn(SAVE_EVERY + 1)
        torch.cuda.synchronize()
        for times in held.values():
            times.clear()
        means: dict[str, list[float]] = {k: [] for k in variants}
        names = list(variants)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                variants[name](steps)
                torch.cuda.synchronize()
                means[name].append((time.perf_counter() - t0) / steps)
    finally:
        for s in savers.values():
            s.close()
        stager.close()
    step = {k: statistics.mean(v) for k, v in means.items()}
    base = step["none"]
    return {"state_gib": trainer.state_gib(),
            "step_ms": {k: round(v * 1e3, 2) for k, v in step.items()},
            "overhead": {k: round(v / base - 1, 4) for k, v in step.items() if k != "none"},
            "save_call_ms": {k: round(statistics.mean(v) * 1e3, 1) for k, v in held.items() if v},
            "save_interval_ms": round(base * SAVE_EVERY * 1e3, 1),
            "where": scratch.root, "rows": trainer.rows, "depth": trainer.depth}
