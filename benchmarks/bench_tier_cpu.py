"""The host CPU one memory snapshot's protection costs, with nothing else running.

``torchrun --nproc_per_node=4 benchmarks/bench_tier_cpu.py [--quick] [--mib N] [--tensors N] [--out DIR]``
(also run by ``benchmarks/run_all.py``). ``--tensors``: how many tensors hold the state (default: 1 MiB
each); a MoE rank holds thousands, and the garbage collector's work then shows (printed: the full
collections and the collector's pauses per snapshot, all ranks).

Why apart from bench_memory_tier: there the tier's cost is the step time it adds while 4 training
ranks fill 2 cores, a figure that moves by several points between runs of the same code. The CPU
a snapshot's background work takes is what that overhead is made of, and it can be measured
alone: each rank snapshots a state of ``--mib`` MiB of fp32 (default 8, about part 1's 8.45 MiB
per rank) with ``maybe_save`` and waits for its protection (``wait``), and nothing else runs. CPU
= the process's CPU time over all its threads (the tier's thread, its saver's, gloo's), summed
over the ranks, per snapshot; wall = the slowest rank's ``maybe_save`` + ``wait``.

Variants, a round each in rotated order:

* ``r1``: 2 simulated nodes of 2 ranks, ``MemoryTier(replicas=1)``;
* ``p4``: 4 simulated nodes, ``MemoryTier(parity=4)`` (digests: block CRC32C, since 2026-12-05);
* ``r1-new-files`` / ``p4-new-files``: the same with ``reuse_files=False``, every snapshot written
  into new ``/dev/shm`` files as before 2026-12-05 (the spare files' own baseline);
* ``p4-sha256`` [baseline]: the parity snapshot as it was before 2026-12-05: SHA-256 digests of
  the bundle and the share (the digest module's factory swapped on every rank for that variant's
  rounds) and new files every snapshot.

The floors printed beside them: a bare ``copy_`` of the same tensors into preallocated buffers, the
CPU the snapshot itself cannot avoid; and the same bytes sent by every rank to its r1 replica
holder over gloo while it receives its source's (4 MiB messages from one preallocated buffer of the whole state, no files),
the CPU the replica's trip over TCP cannot avoid (on one machine: loopback, both ends on the same
2 cores).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ckptkit  # noqa: E402
from ckptkit.memory import digest  # noqa: E402
from async_training import gather_floats  # noqa: E402
from common import CopyFloor, GcPauses, MiB, memory_tier_world_ok, run_gloo_main, table, write_results  # noqa: E402

VARIANTS = ("p4-sha256", "r1-new-files", "r1", "p4-new-files", "p4")
BASELINE = "p4-sha256"


def tier_for(variant: str, root: str, rank: int, world: int) -> ckptkit.MemoryTier:
    reuse = not (variant.endswith("-new-files") or variant == BASELINE)
    if variant.startswith("r1"):
        rpn = world // 2
        return ckptkit.MemoryTier(every_steps=1, replicas=1, root=os.path.join(root, f"node{rank // rpn}"),
                                  ranks_per_node=rpn, timeout_seconds=120.0, reuse_files=reuse)
    rpn = world // 4
    return ckptkit.MemoryTier(every_steps=1, parity=4, root=os.path.join(root, f"node{rank // rpn}"),
                              ranks_per_node=rpn, timeout_seconds=120.0, reuse_files=reuse)


def gather(x: float) -> list[float]:
    return [v[0] for v in gather_floats([x])]


def sha256_digests(expected: str | None = None) -> Any:
    """The factory of the digests before 2026-12-05: SHA-256 of the bytes."""
    return hashlib.sha256()


def measure(mgr: ckptkit.CheckpointManager, state: dict[str, torch.Tensor], first: int, n: int,
            gcs: GcPauses) -> tuple[float, float, float, float]:
    """(CPU seconds of all ranks, slowest rank's wall seconds, full collections of all ranks, seconds of all
    ranks' collections) per snapshot, over ``n`` snapshots."""
    cpu, wall = 0.0, []
    gcs.reset()
    for step in range(first, first + n):
        with torch.no_grad():
            for t in state.values():
                t.add_(1e-3)  # new bytes every snapshot, as after an optimizer step
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        mgr.maybe_save(step, state)
        mgr.wait()
        w = time.perf_counter() - t0
        cpu += time.process_time() - c0
        wall.append(max(gather(w)))
    full, pause = gcs.full, gcs.pause  # before the gathers below allocate
    return sum(gather(cpu)) / n, statistics.median(wall), sum(gather(full)) / n, sum(gather(pause)) / n


def copy_floor(state: dict[str, torch.Tensor], reps: int = 20) -> float:
    """CPU seconds of all ranks for a bare copy_ of the state into preallocated buffers (median of ``reps``)."""
    floor = CopyFloor(list(state.values()))
    times = []
    for _ in range(reps):
        dist.barrier()
        times.append(sum(gather(floor.run(time.process_time))))
    return statistics.median(times)


def transfer_floor(state: dict[str, torch.Tensor], reps: int = 10) -> float:
    """CPU seconds of all ranks for every rank sending its state to its replica holder under r1 (the
    same local slot on the other simulated node) while receiving its source's, over a gloo group of
    its own, in messages of 4 MiB between preallocated tensors (median of ``reps``): what r1's copy
    cannot go below while its bytes travel over TCP, with no file, digest or protocol around them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    to, frm = (rank + world // 2) % world, (rank - world // 2) % world
    group = dist.new_group(backend="gloo")
    # the whole state as one buffer (joined outside the timing): a state of thousands of small tensors sent
    # tensor by tensor costs more per message than the tier's transfer of its files, so would be no floor
    src = [torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])]
    dst = [torch.empty_like(s) for s in src]
    msg = 4 << 20

    def once() -> None:
        for s, d in zip(src, dst):
            for at in range(0, s.numel(), msg):
                ops = [dist.P2POp(dist.isend, s[at:at + msg], to, group), dist.P2POp(dist.irecv, d[at:at + msg], frm, group)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
    try:
        once()
        times = []
        for _ in range(reps):
            dist.barrier()
            c0 = time.process_time()
            once()
            times.append(sum(gather(time.process_time() - c0)))
    finally:
        dist.destroy_process_group(group)
    return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    if not memory_tier_world_ok("bench_tier_cpu"):
        return 2
    torch.manual_seed(rank)
    n_tensors = args.tensors or max(1, int(args.mib * MiB) // MiB)  # default: 1 MiB tensors, fp32
    numel = max(1, int(args.mib * MiB) // 4 // n_tensors)
    state = {f"t{i}": torch.randn(numel) for i in range(n_tensors)}
    gcs = GcPauses()
    rounds, per_round = (2, 5) if args.quick else (args.rounds, args.snapshots)
    os.makedirs(args.out, exist_ok=True)
    names = [tempfile.mkdtemp(prefix="bench_tier_cpu-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None),
             tempfile.mkdtemp(prefix="bench_tier_cpu-scratch-", dir=args.out)] if rank == 0 else [None, None]
    dist.broadcast_object_list(names, 0)
    shm, scratch = names
    factory = digest.new
    results: dict[str, dict[str, list[float]]] = {v: {"cpu": [], "wall": [], "full_gcs": [], "gc_s": []} for v in VARIANTS}
    try:
        managers = {v: ckptkit.CheckpointManager(os.path.join(scratch, v), save=ckptkit.SavePolicy(),
                                                 memory=tier_for(v, os.path.join(shm, v), rank, world))
                    for v in VARIANTS}
        step = 0
        for rnd in range(-1, rounds):  # round -1: warm-up (staging buffers, the tier's groups), not counted
            order = VARIANTS[rnd % len(VARIANTS):] + VARIANTS[:rnd % len(VARIANTS)]
            for v in order:
                digest.new = sha256_digests if v == BASELINE else factory
                try:
                    cpu, wall, full, gc_s = measure(managers[v], state, step, per_round if rnd >= 0 else 2, gcs)
                finally:
                    digest.new = factory
                step += per_round
                if rnd >= 0:
                    results[v]["cpu"].append(cpu)
                    results[v]["wall"].append(wall)
                    results[v]["full_gcs"].append(full)
                    results[v]["gc_s"].append(gc_s)
        for mgr in managers.values():
            mgr.close()
        floor = copy_floor(state)
        wire = transfer_floor(state)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(scratch, ignore_errors=True)
    if rank == 0:
        state_mib = sum(t.nbytes for t in state.values()) / MiB
        base = statistics.median(results[BASELINE]["cpu"])
        print(f"== the CPU of one memory snapshot's protection: {world} ranks x {state_mib:.1f} MiB in {len(state)} "
              f"tensors, nothing else "
              f"running; {rounds} rounds x {per_round} snapshots per variant, medians of the rounds ==")
        rows = [["bare copy_ of the state (floor)", f"{floor * 1e3:.1f}", f"{floor / base:.2f}x", "-", "-", "-"],
                ["gloo transfer of the state to its r1 holder (floor)", f"{wire * 1e3:.1f}", f"{wire / base:.2f}x", "-", "-",
                 "-"]]
        for v in VARIANTS:
            cpu = statistics.median(results[v]["cpu"])
            rows.append([v + (" [baseline]" if v == BASELINE else ""), f"{cpu * 1e3:.1f}", f"{cpu / base:.2f}x",
                         f"{statistics.median(results[v]['wall']) * 1e3:.1f}",
                         f"{statistics.median(results[v]['full_gcs']):.2f}",
                         f"{statistics.median(results[v]['gc_s']) * 1e3:.1f}"])
        print(table(["variant", "CPU per snapshot, all ranks (ms)", "vs baseline", "maybe_save + wait, slowest rank (ms)",
                     "full GCs, all ranks", "GC pauses, all ranks (ms)"], rows))
        med = {v: statistics.median(results[v]["cpu"]) for v in VARIANTS}
        print(f"r1 takes {med['r1'] / (floor + wire):.2f}x the CPU of its two floors together (the copy and the transfer: "
              f"{(floor + wire) * 1e3:.1f} ms); the transfer alone is {wire / med['r1']:.0%} of r1's CPU")
        print(f"reusing the retired step's files (the default) against new files: r1 {med['r1'] / med['r1-new-files']:.2f}x, "
              f"p4 {med['p4'] / med['p4-new-files']:.2f}x the CPU")
        print(f"({os.cpu_count()} CPU cores; CPU includes every thread of every rank: the snapshot's copy, the write "
              "into /dev/shm, gloo's sends and receives, digests, XOR, retiring the old step)")
        write_results(args.out, "bench_tier_cpu", {
            "quick": bool(args.quick), "world_size": world, "state_mib_per_rank": state_mib, "rounds": rounds,
            "snapshots_per_round": per_round, "copy_floor_cpu_s": floor, "transfer_floor_cpu_s": wire, "baseline": BASELINE,
            "tensors_per_rank": len(state),
            "variants": {v: {"cpu_per_snapshot_s": r["cpu"], "wall_per_snapshot_s": r["wall"], "full_gcs_per_snapshot": r["full_gcs"],
                             "gc_pause_per_snapshot_s": r["gc_s"]} for v, r in results.items()},
        })
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds of 5 snapshots (a smoke test)")
    ap.add_argument("--mib", type=float, default=8.0, help="MiB of fp32 state per rank (default 8)")
    ap.add_argument("--tensors", type=int, default=0, help="tensors the state is held in (default: 1 MiB each)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per variant (default 5)")
    ap.add_argument("--snapshots", type=int, default=20, help="snapshots per round (default 20)")
    ap.add_argument("--reps", type=int, default=1, help="accepted for run_all; rounds set the repetitions")
    ap.add_argument("--out", default="bench-out", help="scratch and results directory")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_gloo_main(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
