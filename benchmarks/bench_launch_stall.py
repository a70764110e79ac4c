"""How long an asynchronous save's background work keeps the training thread from running Python.

``.venv/bin/python benchmarks/bench_launch_stall.py [--quick] [--tensors 4096,512] [--mib 1024] [--reps 5]``
(also run by ``benchmarks/run_all.py``).

Why: on a GPU the training thread's work on the host is launching kernels, and it needs the GIL for
every one. While a save persists in a background thread of the same process, any stretch in which
that thread holds the GIL, or in which Python's cyclic garbage collector walks the heap, is a stretch
in which no kernel is launched; once the device's queue runs dry, the step waits. This cannot be
seen on a CPU-bound training loop (the save's threads and the training compete for cores anyway),
so the training thread here is a stand-in: a loop of tiny in-place torch ops (a few microseconds of
host work each, as a kernel launch is), pinned to one core, with every other thread of the process
(and the process executor's writer process) pinned to the others. What it measures is then only
what the GIL and the collector cost it, not a core shared with the save.

Per save of ``--mib`` MiB of fp32 state held as N tensors (``--tensors``; a MoE rank holds thousands:
every local expert's weights, and two Adam moments of each), from the call's return until the
checkpoint is committed, medians over ``--reps`` saves after a warm-up save:

* the loop's throughput against the same loop with nothing else running (the baseline, 1.00x);
* its stalls: the time spent in gaps longer than 1 ms between two iterations, and the longest gap;
* the garbage collector's full (generation 2) collections and their pause, process-wide.

Variants, in rotated order each round: ``raw-write`` (the floor: a background thread writes the
same bytes to one file, nothing else), ``thread`` (``AsyncOptions()``, the default executor) and
``process`` (``AsyncOptions(executor="process")``: the persist in a writer process).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import ckptkit  # noqa: E402
from common import GcPauses, MiB, median, run_main, table, write_results  # noqa: E402

VARIANTS = ("raw-write", "thread", "process")
GAP = 1e-3  # a gap between two iterations longer than this is a stall
BATCH = 10  # tiny ops per iteration


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 reps, 256 MiB, 4096 tensors only")
    ap.add_argument("--tensors", default="4096,512", help="tensor counts, comma-separated")
    ap.add_argument("--mib", type=int, default=1024, help="MiB of state")
    ap.add_argument("--reps", type=int, default=5, help="saves per variant (median reported)")
    ap.add_argument("--out", default="bench-out", help="scratch (under /dev/shm when it exists) and results")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.mib, args.tensors = 2, 256, "4096"
    return args


class Cores:
    """The training thread alone on the first allowed core, everything else of the job on the others
    (when there are at least two; else nothing is pinned and the figures include sharing a core)."""

    def __init__(self) -> None:
        allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.pinned = len(allowed) >= 2
        self.mine, self.rest = ({allowed[0]}, set(allowed[1:])) if self.pinned else (set(), set())
        if self.pinned:
            os.sched_setaffinity(threading.get_native_id(), self.mine)

    def others(self) -> None:
        """Pin every other thread of this process, and every thread of its child processes, to the rest."""
        if not self.pinned:
            return
        me = threading.get_native_id()
        tasks = [f"/proc/self/task/{t}" for t in os.listdir("/proc/self/task") if int(t) != me]
        for child in _children():
            try:
                tasks += [f"/proc/{child}/task/{t}" for t in os.listdir(f"/proc/{child}/task")]
            except OSError:
                pass
        for task in tasks:
            try:
                os.sched_setaffinity(int(task.rsplit("/", 1)[1]), self.rest)
            except OSError:  # ended meanwhile
                pass


def _children() -> list[int]:
    found: list[int] = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                found += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return found


def launch_loop(until: Callable[[], bool], seconds: float | None = None) -> tuple[int, float, float, float]:
    """Tiny in-place ops until ``until()`` (or for ``seconds``): (iterations, elapsed, stalled, longest gap)."""
    a, b = torch.ones(1), torch.ones(1)
    n, stalled, longest = 0, 0.0, 0.0
    start = last = time.perf_counter()
    end = start + seconds if seconds is not None else None
    while True:
        for _ in range(BATCH):
            a.add_(b)
        now = time.perf_counter()
        n += 1
        gap = now - last
        if gap > GAP:
            stalled += gap
            longest = max(longest, gap)
        last = now
        if (end is not None and now >= end) or until():
            return n, now - start, stalled, longest


def raw_write(state: dict[str, torch.Tensor], path: str) -> threading.Thread:
    """The floor: the same bytes written by a background thread (GIL released in every write)."""
    buffers = [memoryview(t.numpy()).cast("B") for t in state.values()]

    def write() -> None:
        with open(path, "wb") as f:
            for buf in buffers:
                f.write(buf)
        os.unlink(path)

    thread = threading.Thread(target=write, name="raw-write")
    thread.start()
    return thread


def one_save(variant: str, state: dict[str, torch.Tensor], root: str, tag: str, cores: Cores,
             gcs: GcPauses) -> dict[str, float]:
    gcs.reset()
    path = os.path.join(root, f"{variant}-{tag}")
    if variant == "raw-write":
        thread = raw_write(state, path)
        done: Callable[[], bool] = lambda: not thread.is_alive()  # noqa: E731
    else:
        executor = "process" if variant == "process" else "thread"
        handle = ckptkit.save_async(state, path, options=ckptkit.AsyncOptions(executor=executor))
        done = handle.done
    cores.others()
    n, elapsed, stalled, longest = launch_loop(done)
    if variant == "raw-write":
        thread.join()
    else:
        handle.wait()
        shutil.rmtree(path, ignore_errors=True)
    return {"iterations": n, "seconds": elapsed, "stalled": stalled, "longest": longest,
            "full_gcs": gcs.full, "gc_pause": gcs.full_pause}


def measure(count: int, args: argparse.Namespace, root: str, cores: Cores, gcs: GcPauses) -> dict[str, Any]:
    numel = args.mib * MiB // 4 // count
    state = {f"layers.{i}.weight": torch.randn(numel) for i in range(count)}
    for variant in VARIANTS:  # warm-up: the process executor's writer, page faults of the files
        one_save(variant, state, root, "warm", cores, gcs)
    n, elapsed, _, _ = launch_loop(lambda: False, seconds=2.0)
    idle_rate = n / elapsed
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for rep in range(args.reps):
        for variant in VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]:
            runs[variant].append(one_save(variant, state, root, str(rep), cores, gcs))
    result: dict[str, Any] = {"tensors": count, "mib": args.mib, "idle_rate": idle_rate, "variants": {}}
    for variant, rs in runs.items():
        result["variants"][variant] = {
            "persist_s": median([r["seconds"] for r in rs]),
            "throughput_vs_idle": median([r["iterations"] / r["seconds"] / idle_rate for r in rs]),
            "stalled_ms": median([1e3 * r["stalled"] for r in rs]),
            "longest_ms": median([1e3 * r["longest"] for r in rs]),
            "full_gcs": median([r["full_gcs"] for r in rs]),
            "gc_pause_ms": median([1e3 * r["gc_pause"] for r in rs]),
        }
    del state
    return result


def run(args: argparse.Namespace) -> int:
    cores = Cores()
    gcs = GcPauses()
    parent = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else args.out
    os.makedirs(parent, exist_ok=True)
    root = tempfile.mkdtemp(prefix="ckptkit-launch-stall-", dir=parent)
    results = []
    try:
        for count in (int(c) for c in args.tensors.split(",")):
            results.append(measure(count, args, root, cores, gcs))
    finally:
        ckptkit.close_async()
        shutil.rmtree(root, ignore_errors=True)
    where = "training thread alone on one core" if cores.pinned else "NOT pinned (one core): figures include sharing it"
    print(f"launch-loop stalls during an async save's persist ({where}); {args.reps} saves per variant, medians")
    rows = []
    for res in results:
        for variant, v in res["variants"].items():
            name = f"{res['tensors']} tensors, {variant}" + (" [floor]" if variant == "raw-write" else "")
            rows.append([name, f"{v['persist_s']:.2f}", f"{v['throughput_vs_idle']:.2f}x", f"{v['stalled_ms']:.0f}",
                         f"{v['longest_ms']:.1f}", f"{v['full_gcs']:g}", f"{v['gc_pause_ms']:.0f}"])
    print(table(["save", "persist s", "loop vs idle", "stalled ms", "longest gap ms", "full GCs", "GC pause ms"], rows))
    write_results(args.out, "bench_launch_stall", {"reps": args.reps, "pinned": cores.pinned, "results": results})
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
