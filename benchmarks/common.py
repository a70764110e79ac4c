"""Small helpers shared by the benchmark scripts (no ckptkit imports here)."""

from __future__ import annotations

import os
import signal
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

GiB = 1 << 30
MiB = 1 << 20

DROP_CACHES = "/proc/sys/vm/drop_caches"


def torchrun_command() -> list[str]:
    """``torchrun`` of the interpreter running us (next to ``sys.executable``, not resolved:
    a virtualenv's python is a symlink), else ``python -m torch.distributed.run``."""
    candidate = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if os.access(candidate, os.X_OK):
        return [candidate]
    return [sys.executable, "-m", "torch.distributed.run"]


def drop_page_cache() -> bool:
    """``sync`` then drop the page cache (needs root). True if the cache was dropped."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tree_bytes(path: str) -> tuple[int, int]:
    """(total bytes, number of files) under ``path``."""
    total = files = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            total += os.path.getsize(os.path.join(dirpath, n))
            files += 1
    return total, files


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def spread(xs: Sequence[float]) -> float:
    """(max - min) / median: how much the repetitions disagree."""
    m = median(xs)
    return (max(xs) - min(xs)) / m if m > 0 else 0.0


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None) -> str:
    """A plain fixed-width text table; ``align`` is one of 'l'/'r' per column (default: first left)."""
    align = align or ("l" + "r" * (len(headers) - 1))
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]

    def fmt(cells: Sequence[str]) -> str:
        out = []
        for c, w, a in zip(cells, widths, align):
            out.append(str(c).ljust(w) if a == "l" else str(c).rjust(w))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(headers), sep, *(fmt(r) for r in rows)])


def command_vs_raw_rows(baseline: str, raw_t: Sequence[float], name: str, t: Sequence[float],
                        inner: Sequence[float], nbytes: int, rss: Sequence[int]) -> list[list[str]]:
    """Rows of the house table for a CLI command timed in a subprocess against a raw-I/O baseline of the
    same bytes: wall, MiB/s, the ratio to the baseline, peak RSS, and the time inside the command."""
    mib = 2**20
    raw, wall, within = median(raw_t), median(t), median(inner)
    return [
        [baseline, f"{raw:.2f}", f"{nbytes / mib / raw:.0f}", "1.00", "-"],
        [name, f"{wall:.2f}", f"{nbytes / mib / wall:.0f}", f"{wall / raw:.2f}", f"{max(rss) / mib:.0f} MiB"],
        ["  (inside the command)", f"{within:.2f}", f"{nbytes / mib / within:.0f}", f"{within / raw:.2f}", ""],
    ]


def exit_on_sigterm() -> None:
    """run_all, torchrun (when another rank fails) or a terminal stop a benchmark with SIGTERM: turn it
    into SystemExit so ``finally`` blocks still remove scratch directories and stop servers."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def quick_reps_out_args(doc: str, quick: str, argv: list[str] | None) -> Any:
    """The arguments of a one-checkpoint benchmark: ``--quick`` (what it does instead, ``quick``), ``--reps``
    (each method's repetitions, median reported) and ``--out`` (scratch and results directory)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--reps", type=int, default=1, help="repetitions of each method (median reported)")
    ap.add_argument("--out", default="bench-out", help="scratch and results directory")
    return ap.parse_args(argv)


def run_main(parse_args: Callable[[list[str] | None], Any], run: Callable[[Any], int], argv: list[str] | None) -> int:
    """A benchmark's ``main``: parse its arguments, turn SIGTERM into SystemExit (:func:`exit_on_sigterm`), run.
    Each script still defines ``def main(argv=None)`` itself: ``run_all`` finds benchmarks by it."""
    args = parse_args(argv)
    exit_on_sigterm()
    return run(args)


def run_gloo_main(parse_args: Callable[[list[str] | None], Any], run: Callable[[Any], int],
                  argv: list[str] | None) -> int:
    """A torchrun benchmark's ``main``: :func:`run_main` inside a gloo world that is destroyed at the end,
    whatever happened."""
    import torch.distributed as dist

    def in_world(args: Any) -> int:
        dist.init_process_group("gloo")
        try:
            return run(args)
        finally:
            dist.destroy_process_group()

    return run_main(parse_args, in_world, argv)


def memory_tier_world_ok(name: str) -> bool:
    """Whether the world has a multiple of 4 ranks, as the memory-tier benchmarks' simulated nodes need
    (r1: 2 nodes, p4: 4 nodes); rank 0 says why not."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if world % 4 and dist.get_rank() == 0:
        print(f"{name} needs a multiple of 4 ranks (r1: 2 nodes, p4: 4 nodes), got {world}", file=sys.stderr)
    return world % 4 == 0


class CopyFloor:
    """A bare ``copy_`` of every local tensor into preallocated buffers: the floor of a snapshot."""

    def __init__(self, tensors: list[Any]) -> None:
        import torch

        self.src = tensors
        self.buffers = [torch.empty_like(t) for t in tensors]
        self.run()  # fault the pages in

    def run(self, clock: Callable[[], float] = time.perf_counter) -> float:
        """Copy once; the seconds ``clock`` counted (wall time, or ``time.process_time`` for CPU)."""
        import torch

        t0 = clock()
        with torch.no_grad():
            for b, t in zip(self.buffers, self.src):
                b.copy_(t)
        return clock() - t0


class GcPauses:
    """The garbage collector's collections and their pauses, process-wide, since the last :meth:`reset`:
    ``full`` (generation 2) and ``full_pause``; ``young`` (generations 0 and 1) and ``pause`` (all)."""

    def __init__(self) -> None:
        import gc

        self.reset()
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        self.pause += took
        if info.get("generation") == 2:
            self.full += 1
            self.full_pause += took
        else:
            self.young += 1

    def reset(self) -> None:
        self.full, self.young, self.full_pause, self.pause = 0, 0, 0.0, 0.0


def write_results(out_dir: str, name: str, fields: dict) -> str:
    """Write ``out_dir/<name>.json`` with the benchmark's figures plus when/where it ran; returns the path."""
    import datetime
    import json
    import platform

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    record = {"benchmark": name.removeprefix("bench_"), "when": datetime.datetime.now().isoformat(timespec="seconds"),
              "host": platform.node(), **fields}
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"results: {path}")
    return path
