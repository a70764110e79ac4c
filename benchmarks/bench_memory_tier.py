"""Memory tier (issue 26): what it costs a training loop, and how fast a lost node resumes from it.

Nodes are simulated on one machine the way tests/test_memory_tier.py does it: each group
of ranks gets its own memory folder under /dev/shm (``<shm>/<tier>/node{rank // ranks_per_node}``),
and a lost node is its folder deleted (with its ranks restarted). Two protections:

  r1   MemoryTier(replicas=1, ranks_per_node=world/2): 2 simulated nodes of 2 ranks, each rank's
       snapshot also held by the same local slot on the other node
  p4   MemoryTier(parity=4, ranks_per_node=world/4): 4 simulated nodes of 1 rank, one XOR parity
       group over the 4 nodes (1/3 of a snapshot per rank instead of a whole replica)

Part 1 -- step-time overhead ("training"). bench_async's part-2 loop (async_training.py): a small
language model (TinyLM: embedding, residual MLP blocks, head) under FSDP2 (``fully_shard`` per
block and at the root), AdamW, synthetic tokens, gloo on CPU. ``--rounds`` rounds (default 10);
a round runs one block of ``--steps`` steps (default 20) of each variant, the order rotated every
round so slow drifts of the machine hit every variant alike:

  none        no checkpointing (the baseline)
  r1-every1   CheckpointManager(root, save=SavePolicy(), memory=MemoryTier(every_steps=1, replicas=1, ...)),
              ``maybe_save(step, state)`` after every step: a memory snapshot every step
  r1-every5   the same with every_steps=5
  p4-every1   MemoryTier(every_steps=1, parity=4, ...)
  p4-every5   MemoryTier(every_steps=5, parity=4, ...)

``--device-ms N`` follows every training step's compute with N ms in which the host only waits
(then ``maybe_save``): a model of a GPU step, whose host launches the work and then waits for the
device, its cores free meanwhile. What it does not model: a GPU node has more host cores than
ranks, here the compute part still has 4 ranks on 2 cores, and the background work that starts at
a snapshot shares them with the next step's compute before the idle part comes. Without it (the
default) the step is CPU-bound: 4 ranks fill 2 cores, and every cycle of background work comes out
of the steps.

Persistent saves are off (``SavePolicy()`` has no interval), so only the memory tier is
measured. Step time = train step + maybe_save, slowest rank; a variant's mean = block wall time /
steps. A block starts at a multiple of 5 steps, so every snapshot but the block's last has
further steps in the block to overlap its background work (write into the node folder, copy to
the peer or parity exchange) with; the wait for the last one after the block ("tail wait") is
reported, not counted (as in bench_async). The overhead is reported pooled and as the mean of
the paired per-round overheads with a 95% confidence half-width. The time a snapshot blocks the
step (maybe_save at a snapshot step) is compared with a bare ``copy_`` of the same local tensors
into preallocated buffers (the floor).

Part 2 -- a lost node to the first resumed step ("recovery"). bench_io's state (the same as
bench_async part 1): the ``Shard(0)`` DTensor shards of a small GPT, bf16 parameters plus two
fp32 Adam moments, ~1.26 GiB over 4 ranks. Each tier's run starts with a persistent checkpoint of
step 0 (a run has one; its memory restores then have it to fall back on). First the blocking time of one memory snapshot of it
(``maybe_save``, slowest rank) against the bare-copy floor, and the time until the snapshot is
protected (``mgr.wait()``), ``--reps`` times each after a warm-up snapshot, copy and snapshot
alternating. The last snapshot of each tier stays in node memory; the same state is also saved
as a persistent checkpoint on local disk (under ``--out``) and on a local S3 server (moto in its
own process, benchmarks/moto_process.py, as bench_s3 uses it). Then ``--reps`` + 1 rounds (the
first one reported apart as the first restore of the run: it pays one-time costs such as the
s3fs client), methods rotated per round, each on every rank:

  memory-r1   node 1's memory folder deleted (its ranks' own copies and the replicas it held);
              ranks 2, 3 get their snapshot from their peers' replicas
  memory-p4   node 1's memory folder deleted; rank 1's snapshot rebuilt from the group's parity
  memory-r1-intact / memory-p4-intact
              no node lost (a crashed process restarted, a rollback): every rank reads its own copy
  disk        the persistent checkpoint on local disk (CheckpointManager without a memory tier)
  s3          the persistent checkpoint on s3://bucket/run through the moto server

Before each: every rank's destination state is zeroed (the restarted job's fresh tensors) and
the page cache dropped when /proc/sys/vm/drop_caches is writable (else the disk figure is
warm-cache; the report says which; /dev/shm is not page cache and is never dropped). Timed from a
barrier: a fresh ``CheckpointManager`` in the same process group + ``restore_latest(state)``, then
(after an untimed check that the restored shards equal the saved ones, torch.equal, and a
barrier) the first step: an AdamW-like in-place update of every restored tensor (moments
decayed, parameters moved) and an all-reduce -- the state has no model, so this proxy touches
every restored byte once as an optimizer step does. Each phase is the slowest rank's. The
process restart itself (torchrun noticing, new processes importing torch, joining the process
group) is the same for all methods and not measured here: bench_resilience measures it.

Run: torchrun --nproc_per_node=4 benchmarks/bench_memory_tier.py [--quick] [--out DIR]
(or benchmarks/run_all.py, which does that). ``--quick``: a ~32 MiB state and a tiny model, few
rounds (a smoke test; the ratios mean little).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import gc
import json
import math
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import ckptkit  # noqa: E402
from async_training import (  # noqa: E402
    TRAIN_FULL, TRAIN_QUICK, TrainConfig, agree_ok, fsdp_job, cpu_seconds, gather_floats, percentile, state_is_live,
)
from bench_io import FULL, QUICK, barrier, build_state, local_shards, settle, verify  # noqa: E402
from common import CopyFloor, GiB, MiB, median, memory_tier_world_ok, remove_tree, spread, table, write_results  # noqa: E402
from moto_process import CREDENTIALS, MotoProcess  # noqa: E402

SCRATCH_PREFIX = "bench_memory_tier-scratch-"
SHM_PREFIX = "bench_memory_tier-"
_CLEANUP: list[str] = []  # this run's scratch and /dev/shm folders, for the SIGTERM handler

TARGET_OVERHEAD_EVERY5 = 0.03  # step overhead <= 3% with a snapshot every 5 steps
EVERY = 5  # the "every 5 steps" interval
TIERS = ("r1", "p4")
VARIANTS = ("none", "r1-every1", "r1-every5", "p4-every1", "p4-every5")
RESTORE_METHODS = ("memory-r1", "memory-p4", "memory-r1-intact", "memory-p4-intact", "disk", "s3")
LOST_NODE = 1
SOURCE_LETTER = {"memory": "m", "peer": "R", "parity": "X", "persistent": "P"}
# bench_resilience's measured process restart on this machine (docs/benchmarks.md, 2026-11-30):
# crash -> first resumed step 3.86 s, of which the checkpoint load 0.08 s and the first step 0.14 s.
DOC_RESTART_S = 3.86 - 0.08 - 0.14


def tier_options(kind: str, every: int, shm: str, rank: int, world: int) -> ckptkit.MemoryTier:
    """``r1``: 2 simulated nodes, one replica; ``p4``: 4 simulated nodes, one parity group of 4."""
    if kind == "r1":
        rpn = world // 2
        return ckptkit.MemoryTier(every_steps=every, replicas=1, root=os.path.join(shm, "r1", f"node{rank // rpn}"),
                                  ranks_per_node=rpn, timeout_seconds=120.0)
    rpn = world // 4
    return ckptkit.MemoryTier(every_steps=every, parity=4, root=os.path.join(shm, "p4", f"node{rank // rpn}"),
                              ranks_per_node=rpn, timeout_seconds=120.0)


def lose_node(shm: str, kind: str) -> None:
    """Node LOST_NODE's memory is gone (call on one rank, between barriers)."""
    shutil.rmtree(os.path.join(shm, kind, f"node{LOST_NODE}"), ignore_errors=True)


def slowest(x: float) -> float:
    return max(v[0] for v in gather_floats([x]))


def mean_ci(xs: list[float]) -> tuple[float, float | None]:
    """Mean and its 95% confidence half-width (normal approximation, as bench_async)."""
    m = statistics.fmean(xs)
    return m, (1.96 * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else None)


# =========================================================================== part 1: training loop


def part_training(args: argparse.Namespace, mesh: Any, rank: int, world: int, scratch: str, shm: str,
                  say: Callable[[str], None]) -> dict[str, Any]:
    cfg = TRAIN_QUICK if args.quick else TRAIN_FULL
    cfg = TrainConfig(hidden=args.train_hidden or cfg.hidden, layers=args.train_layers or cfg.layers,
                      vocab=cfg.vocab, batch=cfg.batch, seq=cfg.seq)
    steps = max(EVERY, (args.steps or (10 if args.quick else 20)) // EVERY * EVERY)
    rounds = args.rounds or (3 if args.quick else 10)

    n_params, compute_step, make_state = fsdp_job(cfg, mesh, rank)
    device_s = args.device_ms / 1000

    def train_step() -> None:
        compute_step()
        if device_s:  # --device-ms: the host waits as it would for a GPU's compute; its cores are free meanwhile
            time.sleep(device_s)

    for _ in range(3 if args.quick else 10):
        train_step()
    cached = make_state()
    train_step()
    train_step()
    live, why = state_is_live(cached, make_state())
    live = agree_ok(live)
    local = [t for t in local_shards(cached).values() if isinstance(t, torch.Tensor)]
    rank_bytes = sum(t.nbytes for t in local)
    state_bytes = int(sum(v[0] for v in gather_floats([float(rank_bytes)])))
    say(f"part 1: TinyLM {n_params / 1e6:.2f}M params ({asdict(cfg)}), FSDP2 over {world} ranks, AdamW; state "
        f"{state_bytes / MiB:.1f} MiB ({rank_bytes / MiB:.2f} MiB/rank); state dict "
        f"{'built once (live tensors)' if live else 'rebuilt per save (' + why + ')'}")

    floor = CopyFloor(local)
    floor_s = []
    for _ in range(10):
        barrier()
        floor_s.append(slowest(floor.run()))
    del floor

    managers: dict[str, Any] = {}
    for v in VARIANTS[1:]:
        kind, every = v.split("-every")
        managers[v] = ckptkit.CheckpointManager(
            os.path.join(scratch, f"train-{v}"), save=ckptkit.SavePolicy(),
            memory=tier_options(kind, int(every), os.path.join(shm, f"train-{v}"), rank, world),
        )
    counter = [0]

    def run_block(v: str, n: int) -> dict[str, Any]:
        mgr = managers.get(v)
        base = counter[0]
        times: list[float] = []
        call: list[float] = []
        snap_steps: list[int] = []
        every = mgr._memory.options.every_steps if mgr is not None else 0  # noqa: SLF001
        barrier()
        c0 = cpu_seconds()
        t_start = time.perf_counter()
        for j in range(n):
            t0 = time.perf_counter()
            train_step()
            if mgr is not None:
                g = base + j
                t1 = time.perf_counter()
                mgr.maybe_save(g, cached if live else make_state())
                if g % every == 0:
                    call.append(time.perf_counter() - t1)
                    snap_steps.append(j)
            times.append(time.perf_counter() - t0)
        wall = time.perf_counter() - t_start
        t_tail = time.perf_counter()
        if mgr is not None:
            mgr.wait()
        tail = time.perf_counter() - t_tail
        cpu = cpu_seconds() - c0
        counter[0] += n
        per_rank = gather_floats(times)
        walls = gather_floats([wall, tail, cpu])
        calls = gather_floats(call) if call else []
        barrier()
        return {
            "steps": n, "wall_s": max(w[0] for w in walls), "tail_wait_s": max(w[1] for w in walls),
            "cpu_s": sum(w[2] for w in walls),
            "step_s": [max(per_rank[r][j] for r in range(world)) for j in range(n)],
            "snapshots": len(snap_steps), "snapshot_steps": snap_steps,
            "snapshot_call_s": [max(calls[r][i] for r in range(world)) for i in range(len(snap_steps))] if calls else [],
        }

    results: dict[str, Any] = {v: {"blocks": []} for v in VARIANTS}
    t_loop = time.perf_counter()
    for v in VARIANTS:  # warm-up: the first snapshot makes the staging buffer, the tier's groups are warm
        run_block(v, EVERY)
    for rnd in range(rounds):
        order = list(VARIANTS[rnd % len(VARIANTS):] + VARIANTS[:rnd % len(VARIANTS)])
        for v in order:
            results[v]["blocks"].append(run_block(v, steps))
        say(f"  round {rnd + 1}/{rounds}: mean step "
            + ", ".join(f"{v} {results[v]['blocks'][-1]['wall_s'] / steps * 1e3:.1f}" for v in VARIANTS) + " ms")
    loop_s = time.perf_counter() - t_loop
    final_live = agree_ok(state_is_live(cached, make_state())[0]) if live else False
    for mgr in managers.values():
        mgr.close()
    managers.clear()
    gc.collect()
    barrier()

    base_blocks = results["none"]["blocks"]
    base_cpu = sum(b["cpu_s"] for b in base_blocks) / sum(b["steps"] for b in base_blocks)
    for v in VARIANTS:
        r = results[v]
        blocks = r["blocks"]
        all_steps = [s for b in blocks for s in b["step_s"]]
        r["mean_step_s"] = sum(b["wall_s"] for b in blocks) / sum(b["steps"] for b in blocks)
        r["p50_step_s"] = percentile(all_steps, 50)
        r["p99_step_s"] = percentile(all_steps, 99)
        r["max_step_s"] = max(all_steps)
        rm = [b["wall_s"] / b["steps"] for b in blocks]
        r["round_cv"] = statistics.pstdev(rm) / statistics.fmean(rm)
        r["snapshots"] = sum(b["snapshots"] for b in blocks)
        calls = [x for b in blocks for x in b["snapshot_call_s"]]
        r["snapshot_call_median_s"] = median(calls) if calls else None
        r["snapshot_call_max_s"] = max(calls) if calls else None
        snap = [b["step_s"][j] for b in blocks for j in b["snapshot_steps"]]
        r["snapshot_step_median_s"] = median(snap) if snap else None
        r["tail_wait_median_s"] = median([b["tail_wait_s"] for b in blocks])
        r["cpu_per_step_s"] = sum(b["cpu_s"] for b in blocks) / sum(b["steps"] for b in blocks)
    base_mean = results["none"]["mean_step_s"]
    for v in VARIANTS:
        r = results[v]
        r["overhead"] = r["mean_step_s"] / base_mean - 1
        r["round_overhead"] = [b["wall_s"] / b["steps"] / (bb["wall_s"] / bb["steps"]) - 1
                               for b, bb in zip(r["blocks"], base_blocks)]
        r["overhead_mean_of_rounds"], r["overhead_ci95"] = mean_ci(r["round_overhead"])
        every = int(v.split("-every")[1]) if v != "none" else None
        r["every_steps"] = every
        r["excess_per_snapshot_s"] = (r["mean_step_s"] - base_mean) * every if every else None
        r["extra_cpu_per_snapshot_s"] = (r["cpu_per_step_s"] - base_cpu) * every if every else None
    return {
        "model": asdict(cfg), "params": n_params, "state_bytes": state_bytes, "bytes_per_rank": rank_bytes,
        "steps_per_block": steps, "rounds": rounds, "loop_seconds": loop_s, "device_ms": args.device_ms,
        "state_built_once": live, "state_live_check": why, "state_live_at_end": final_live,
        "copy_floor_s": floor_s, "copy_floor_median_s": median(floor_s),
        "variants": results,
    }


# =========================================================================== part 2: a lost node


def first_step(state: dict[str, Any]) -> None:
    """The proxy of the first resumed step: an AdamW-like in-place update of every restored tensor
    (moments decayed, parameters moved along the first moment), then an all-reduce."""
    model, avg, sq = state["model"], state["optim"]["exp_avg"], state["optim"]["exp_avg_sq"]
    with torch.no_grad():
        for name, p in model.items():
            m, v = avg[name].to_local(), sq[name].to_local()
            m.mul_(0.9)
            v.mul_(0.999)
            p.to_local().sub_(m, alpha=1e-3)
    dist.all_reduce(torch.zeros(1))


def part_recovery(args: argparse.Namespace, mesh: Any, rank: int, world: int, scratch: str, shm: str,
                  say: Callable[[str], None]) -> dict[str, Any]:
    cfg = QUICK if args.quick else FULL
    t0 = time.perf_counter()
    state = build_state(cfg, mesh, rank, world, "random")
    src = local_shards(state)
    rank_bytes = sum(t.nbytes for t in src.values())
    n_tensors = len(src)
    total_bytes = int(sum(v[0] for v in gather_floats([float(rank_bytes)])))
    say(f"part 2: {total_bytes / GiB:.3f} GiB state ({rank_bytes / MiB:.1f} MiB/rank, {len(src)} tensors/rank), "
        f"built in {time.perf_counter() - t0:.1f}s")

    # ---- (a) what one snapshot blocks, vs the bare copy; then until it is protected
    floor = CopyFloor(list(src.values()))
    copy_s: list[float] = []
    snap: dict[str, dict[str, Any]] = {}
    step = 0
    for kind in TIERS:
        mgr = ckptkit.CheckpointManager(os.path.join(scratch, f"mem-run-{kind}"), save=ckptkit.SavePolicy(),
                                        memory=tier_options(kind, 1, shm, rank, world))
        # a persistent step before the snapshots, as a run has one (the memory tier's restores then
        # have it to fall back on, and check an own copy by loading it: docs/memory_tier.md)
        mgr.save(step, state)
        mgr.wait()
        rec: dict[str, Any] = {"block_s": [], "protected_s": []}

        def snapshot() -> tuple[float, float]:
            nonlocal step
            step += 1
            settle(rank, drop=False)
            t = time.perf_counter()
            mgr.maybe_save(step, state)
            blocked = time.perf_counter() - t
            mgr.wait()
            protected = time.perf_counter() - t
            b = gather_floats([blocked, protected])
            barrier()
            return max(x[0] for x in b), max(x[1] for x in b)

        rec["warmup_block_s"], rec["warmup_protected_s"] = snapshot()
        say(f"  snapshot {kind} warm-up: blocks {rec['warmup_block_s'] * 1e3:.0f} ms, protected after "
            f"{rec['warmup_protected_s']:.2f} s")
        for rep in range(args.reps):
            pair = ["copy", "snap"] if rep % 2 == 0 else ["snap", "copy"]
            for what in pair:
                if what == "copy":
                    settle(rank, drop=False)
                    copy_s.append(slowest(floor.run()))
                else:
                    b, p = snapshot()
                    rec["block_s"].append(b)
                    rec["protected_s"].append(p)
            say(f"  snapshot {kind} rep {rep + 1}/{args.reps}: blocks {rec['block_s'][-1] * 1e3:.0f} ms "
                f"(copy {copy_s[-1] * 1e3:.0f} ms), protected after {rec['protected_s'][-1]:.2f} s")
        rec["step"] = step
        mgr.close()
        snap[kind] = rec
    del floor
    gc.collect()
    floor_med = median(copy_s)
    for rec in snap.values():
        rec["block_median_s"] = median(rec["block_s"])
        rec["protected_median_s"] = median(rec["protected_s"])
        rec["block_vs_copy"] = rec["block_median_s"] / floor_med if floor_med > 0 else None
    # The state never changes: every snapshot and checkpoint holds the same bytes. Each restore must
    # come back to its tier's newest snapshot; the persistent checkpoints are saved at the last step.
    saved_step = step
    expected = {"memory-r1": snap["r1"]["step"], "memory-p4": snap["p4"]["step"], "memory-r1-intact": snap["r1"]["step"],
                "memory-p4-intact": snap["p4"]["step"], "disk": saved_step, "s3": saved_step}

    # ---- (b) the persistent checkpoints: local disk and S3 (moto)
    os.environ.update(CREDENTIALS)
    server: MotoProcess | None = None
    info: list[Any] = [None, None]
    try:
        if rank == 0:
            server = MotoProcess(os.path.join(scratch, "moto.log"))
            info = [server.endpoint, server.new_bucket()]
        dist.broadcast_object_list(info, 0)
        os.environ["AWS_ENDPOINT_URL"] = info[0]
        roots = {"disk": os.path.join(scratch, "disk-run"), "s3": f"s3://{info[1]}/run"}
        save_s: dict[str, float] = {}
        for m, root in roots.items():
            barrier()
            t = time.perf_counter()
            with ckptkit.CheckpointManager(root, save=ckptkit.SavePolicy()) as mgr:
                mgr.save(saved_step, state)
                mgr.wait()
            save_s[m] = slowest(time.perf_counter() - t)
            say(f"  persistent save to {m} ({root}): {save_s[m]:.1f} s")

        # ---- (c) a lost node -> the first resumed step
        dest = build_state(cfg, mesh, rank, world, "zeros")
        dest_local = list(local_shards(dest).values())
        restores: dict[str, list[dict[str, Any]]] = {m: [] for m in RESTORE_METHODS}
        cold_all = True
        for rnd in range(args.reps + 1):
            order = list(RESTORE_METHODS[rnd % len(RESTORE_METHODS):] + RESTORE_METHODS[:rnd % len(RESTORE_METHODS)])
            for m in order:
                for t in dest_local:
                    t.zero_()
                if m.startswith("memory") and not m.endswith("-intact") and rank == 0:
                    lose_node(shm, m.removeprefix("memory-"))
                cold = settle(rank, drop=not args.no_drop_caches)
                cold_all = cold_all and cold
                t_a = time.perf_counter()
                if m.startswith("memory"):
                    kind = m.removeprefix("memory-").removesuffix("-intact")
                    mgr = ckptkit.CheckpointManager(os.path.join(scratch, f"mem-run-{kind}"),
                                                    memory=tier_options(kind, 1, shm, rank, world))
                else:
                    mgr = ckptkit.CheckpointManager(roots[m])
                t_b = time.perf_counter()
                got = mgr.restore_latest(dest)
                t_c = time.perf_counter()
                last = mgr.last_restore
                bad = verify(src, local_shards(dest))
                ok = agree_ok(got == expected[m] and not bad)
                barrier()
                t_d = time.perf_counter()
                first_step(dest)
                t_e = time.perf_counter()
                phases = gather_floats([t_b - t_a, t_c - t_b, t_c - t_a, t_e - t_d])
                mgr.close()
                barrier()
                r = {
                    "manager_s": max(p[0] for p in phases), "restore_s": max(p[1] for p in phases),
                    "to_restored_s": max(p[2] for p in phases), "first_step_s": max(p[3] for p in phases),
                    "step": got, "sources": list(last.sources) if last is not None else None,
                    "reported_s": last.seconds if last is not None else None, "verified": ok, "cold": cold,
                }
                r["total_s"] = r["to_restored_s"] + r["first_step_s"]
                if not ok:
                    print(f"bench_memory_tier: rank {rank}: {m}: restored step {got} (expected {expected[m]}), "
                          f"{len(bad)} tensors differ: {bad[:4]}", file=sys.stderr, flush=True)
                restores[m].append(r)
                say(f"  {'first ' if rnd == 0 else ''}restore {m:9s}: manager {r['manager_s']:.2f}s + restore_latest "
                    f"{r['restore_s']:.2f}s + first step {r['first_step_s']:.2f}s = {r['total_s']:.2f}s "
                    f"(step {got}, sources {r['sources']}, {'ok' if ok else 'MISMATCH'})")
        del dest, dest_local
    finally:
        if server is not None:
            server.stop()
    barrier()

    methods: dict[str, Any] = {}
    for m, rs in restores.items():
        timed = rs[1:]
        methods[m] = {
            "first": rs[0], "timed": timed,
            **{f"{k}_median_s": median([r[k] for r in timed]) for k in
               ("manager_s", "restore_s", "to_restored_s", "first_step_s", "total_s")},
            "total_spread": spread([r["total_s"] for r in timed]),
            "sources": timed[-1]["sources"],
            "verified": all(r["verified"] for r in rs),
        }
    for base in ("memory-r1", "memory-p4"):
        for m in methods.values():
            m[f"total_vs_{base}"] = m["total_s_median_s"] / methods[base]["total_s_median_s"]
            m[f"restore_vs_{base}"] = m["restore_s_median_s"] / methods[base]["restore_s_median_s"]
    return {
        "model": asdict(cfg), "total_bytes": total_bytes, "bytes_per_rank": rank_bytes, "tensors_per_rank": n_tensors,
        "copy_floor_s": copy_s, "copy_floor_median_s": floor_med, "snapshots": snap,
        "saved_step": saved_step, "persistent_save_s": save_s, "page_cache_dropped": cold_all,
        "methods": methods,
    }


# =========================================================================== report


def restart_figure(out: str) -> tuple[float, str]:
    """bench_resilience's measured process restart: from its JSON under ``out`` if there, else docs."""
    try:
        with open(os.path.join(out, "bench_resilience.json")) as f:
            r = json.load(f)["real_run"]
        return (r["crash_to_first_step_s"] - r["checkpoint_load_s"] - r["restored_to_first_step_s"],
                f"{os.path.join(out, 'bench_resilience.json')}")
    except (OSError, KeyError, TypeError, ValueError):
        return DOC_RESTART_S, "docs/benchmarks.md (bench_resilience, 2026-11-30)"


def report(args: argparse.Namespace, world: int, p1: dict[str, Any] | None, p2: dict[str, Any] | None) -> dict[str, Any]:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f}"

    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    targets: dict[str, Any] = {}
    if p1 is not None:
        var = p1["variants"]
        print()
        print(f"== part 1: step-time overhead of the memory tier: TinyLM {p1['params'] / 1e6:.2f}M params under FSDP2 on "
              f"{world} ranks, AdamW, {p1['state_bytes'] / MiB:.1f} MiB of state; persistent saves off ==")
        if p1["device_ms"]:
            print(f"EMULATED DEVICE-BOUND STEP (--device-ms {p1['device_ms']:g}): each training step is followed by "
                  f"{p1['device_ms']:g} ms in which the host only waits, as it does while a GPU computes; the tier's "
                  "background work can use the cores then. A model of a GPU node's host, not a GPU measurement.")
        print(f"{p1['rounds']} rounds; a round = one block of {p1['steps_per_block']} steps per variant, order rotated "
              f"({p1['rounds'] * p1['steps_per_block']} timed steps per variant); step = train step + maybe_save, "
              "slowest rank; baseline = none")
        headers = ["variant", "mean ms", "p50 ms", "p99 ms", "max ms", "overhead", "paired ±95%", "block CV",
                   "snapshots", "snapshot call ms", "vs copy", "excess/snap ms", "CPU/snap ms", "tail wait ms"]
        rows = []
        floor = p1["copy_floor_median_s"]
        for v, r in var.items():
            base = v == "none"
            call = r["snapshot_call_median_s"]
            rows.append([
                v + (" [baseline]" if base else ""), ms(r["mean_step_s"]), ms(r["p50_step_s"]), ms(r["p99_step_s"]),
                ms(r["max_step_s"]),
                "-" if base else f"{r['overhead'] * 100:+.1f}%",
                "-" if base else f"{r['overhead_mean_of_rounds'] * 100:+.1f}% ±{(r['overhead_ci95'] or 0) * 100:.1f}",
                f"{r['round_cv'] * 100:.1f}%", str(r["snapshots"]), ms(call),
                "-" if call is None else x(call / floor),
                "-" if base else f"{r['excess_per_snapshot_s'] * 1e3:.1f}",
                "-" if base else f"{r['extra_cpu_per_snapshot_s'] * 1e3:.0f}",
                "-" if base else ms(r["tail_wait_median_s"]),
            ])
        print(table(headers, rows))
        print(f"(bare copy_ of the same local tensors: {ms(floor)} ms median (slowest rank) = the floor of what a "
              "snapshot blocks. overhead = mean step / baseline mean step - 1, pooled; paired = mean of the per-round "
              "overheads with its 95% confidence half-width; snapshot call = maybe_save at a snapshot step (with "
              "every_steps=1 it includes waiting for the previous snapshot's protection); excess/snap = (mean step - "
              "baseline) x interval; CPU/snap = extra CPU time of all ranks per snapshot, threads included; tail "
              "wait = after the block's last step, not counted)")
        if not p1["device_ms"]:
            print(f"NOTE: {os.cpu_count()} CPU cores for {world} ranks: the tier's background thread (write into /dev/shm, "
                  "copy to the peer, parity) competes with training for the same cores; on a GPU node it would run on "
                  "otherwise idle host cores (--device-ms N models that)")
        if args.quick:
            print("NOTE: --quick is a smoke test: a tiny model, few rounds; the overheads mean little")
        print("targets (printed, not asserted):")
        for v in ("r1-every5", "p4-every5"):
            r = var[v]
            ok = r["overhead"] <= TARGET_OVERHEAD_EVERY5
            targets[f"{v}-overhead"] = {"overhead": r["overhead"], "met": ok,
                                        "overhead_mean_of_rounds": r["overhead_mean_of_rounds"], "ci95": r["overhead_ci95"]}
            print(f"  {v} step overhead {r['overhead'] * 100:+.1f}% (paired {r['overhead_mean_of_rounds'] * 100:+.1f}% "
                  f"±{(r['overhead_ci95'] or 0) * 100:.1f}; target <= {TARGET_OVERHEAD_EVERY5 * 100:.0f}%: "
                  f"{'ok' if ok else 'MISSED'})")

    if p2 is not None:
        print()
        print(f"== part 2: a lost node: {world} ranks, {p2['total_bytes'] / GiB:.3f} GiB state "
              f"({p2['bytes_per_rank'] / MiB:.0f} MiB/rank, bf16 params + fp32 moments, Shard(0) DTensors) ==")
        floor = p2["copy_floor_median_s"]
        rows = [["bare copy_ [floor]", ms(floor), "1.00x", "-", str(len(p2["copy_floor_s"]))]]
        for kind, rec in p2["snapshots"].items():
            rows.append([f"memory snapshot {kind}", ms(rec["block_median_s"]), x(rec["block_vs_copy"]),
                         f"{rec['protected_median_s']:.2f}", str(len(rec["block_s"]))])
        print("one snapshot: what blocks the trainer (maybe_save) vs the bare copy, and until it is protected "
              "(mgr.wait(): written into node memory and copied to the peer / parity); medians, slowest rank")
        print(table(["what", "blocks ms", "vs copy", "protected s", "n"], rows))
        print("persistent save of the same state (once, total): "
              + ", ".join(f"{m} {s:.1f} s" for m, s in p2["persistent_save_s"].items()))
        res = p2["methods"]
        print()
        print(f"lost node {LOST_NODE} -> first resumed step, median of {args.reps} after a first restore; page cache "
              f"{'dropped before each (cold disk reads)' if p2['page_cache_dropped'] else 'NOT dropped (warm-cache disk figures)'}; "
              "slowest rank per phase; baseline = memory-r1")
        headers = ["method", "manager s", "restore_latest s", "first step s", "total s", "vs memory-r1", "vs memory-p4",
                   "restore vs r1", "spread", "first restore s", "sources", "restored ok"]
        rows = []
        for m, r in res.items():
            rows.append([
                m + (" [baseline]" if m == "memory-r1" else ""), f"{r['manager_s_median_s']:.2f}",
                f"{r['restore_s_median_s']:.2f}", f"{r['first_step_s_median_s']:.2f}", f"{r['total_s_median_s']:.2f}",
                x(r["total_vs_memory-r1"]), x(r["total_vs_memory-p4"]), x(r["restore_vs_memory-r1"]),
                f"{r['total_spread'] * 100:.0f}%", f"{r['first']['total_s']:.2f}",
                "".join(SOURCE_LETTER.get(s, "?") for s in (r["sources"] or [])),
                "yes" if r["verified"] else "NO",
            ])
        print(table(headers, rows))
        restart, where = restart_figure(args.out)
        print("(manager = a fresh CheckpointManager in the same process group; restore_latest = find the newest step "
              "every rank can get back and load it; first step = AdamW-like in-place update of every restored tensor "
              "+ an all-reduce (a proxy: this state has no model); total = manager + restore_latest + first step. "
              "sources per rank: m = own node's memory, R = a peer's replica, X = parity rebuild, P = persistent "
              "checkpoint. first restore = the run's first restore of each method (one-time costs: s3fs "
              "client, imports), not in the median)")
        print(f"the process restart itself (torchrun noticing, new processes, imports, process group) is the same for "
              f"every method and not measured here: {restart:.2f} s on this machine per {where}")
        for m in ("memory-r1-intact", "memory-p4-intact"):
            print(f"  {m} (no node lost): {res[m]['total_s_median_s']:.2f} s to the first resumed step, disk "
                  f"{res['disk']['total_s_median_s'] / res[m]['total_s_median_s']:.2f}x of it")
        for m in ("disk", "s3"):
            print(f"  {m} / memory: {res[m]['total_vs_memory-r1']:.2f}x memory-r1, {res[m]['total_vs_memory-p4']:.2f}x "
                  f"memory-p4 (to the first resumed step); with the {restart:.1f} s restart added: "
                  f"{(res[m]['total_s_median_s'] + restart) / (res['memory-r1']['total_s_median_s'] + restart):.2f}x / "
                  f"{(res[m]['total_s_median_s'] + restart) / (res['memory-p4']['total_s_median_s'] + restart):.2f}x")
        targets["restore_ratios"] = {f"{m}_vs_{b}": res[m][f"total_vs_{b}"] for m in ("disk", "s3")
                                     for b in ("memory-r1", "memory-p4")}
        targets["restart_s"] = restart
        targets["restart_source"] = where
        if args.quick:
            print("NOTE: --quick is a smoke test: a ~32 MiB state; fixed per-call costs dominate")
    return targets


# =========================================================================== driver


def run(args: argparse.Namespace) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    if not memory_tier_world_ok("bench_memory_tier"):
        return 2
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    t_begin = time.perf_counter()

    def say(msg: str) -> None:
        if rank == 0:
            print(f"[{time.perf_counter() - t_begin:6.1f}s] {msg}", file=sys.stderr, flush=True)

    os.makedirs(args.out, exist_ok=True)
    load_start = list(os.getloadavg())
    shm_parent = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    names = [tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=args.out), tempfile.mkdtemp(prefix=SHM_PREFIX, dir=shm_parent)] \
        if rank == 0 else [None, None]
    dist.broadcast_object_list(names, 0)
    scratch, shm = names
    _CLEANUP.extend([scratch, shm])
    p1 = p2 = None
    t0 = time.perf_counter()
    try:
        if "training" in args.parts:
            p1 = part_training(args, mesh, rank, world, scratch, os.path.join(shm, "train"), say)
        if "recovery" in args.parts:
            p2 = part_recovery(args, mesh, rank, world, scratch, shm, say)
        barrier()
    finally:
        if rank == 0:
            remove_tree(scratch)
            remove_tree(shm)
    ok = True
    if rank == 0:
        targets = report(args, world, p1, p2)
        if p2 is not None:
            ok = all(m["verified"] for m in p2["methods"].values())
        write_results(args.out, "bench_memory_tier", {
            "quick": bool(args.quick), "reps": args.reps, "world_size": world, "seconds": time.perf_counter() - t0,
            "loadavg_at_start": load_start, "loadavg_at_end": list(os.getloadavg()), "shm_parent": shm_parent, "scratch_parent": os.path.abspath(args.out),
            "env": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "ckptkit": ckptkit.__version__, "platform": platform.platform()},
            "targets": {"step_overhead_every5_max": TARGET_OVERHEAD_EVERY5, **targets},
            "training": p1, "recovery": p2,
        })
    flag = [ok]
    dist.broadcast_object_list(flag, 0)
    return 0 if flag[0] else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~32 MiB state, a tiny model, few rounds (smoke test, < 2 min)")
    ap.add_argument("--out", default="bench-out", help="scratch directory and where bench_memory_tier.json goes (default ./bench-out)")
    ap.add_argument("--reps", type=int, default=None, help="part 2: timed snapshots per tier and timed restores per method "
                    "(default 3, --quick 1); the median is reported")
    ap.add_argument("--parts", default="training,recovery", help="comma-separated: training (part 1), recovery (part 2)")
    ap.add_argument("--steps", type=int, default=0, help="part 1: steps per block, a multiple of 5 (default 20, --quick 10)")
    ap.add_argument("--rounds", type=int, default=0, help="part 1: rounds of one block per variant (default 10, --quick 3)")
    ap.add_argument("--device-ms", type=float, default=0.0,
                    help="part 1: after each training step's compute, wait this long with the host idle, as for a GPU's "
                         "compute (an emulated device-bound step; default 0: the CPU-bound step as it is)")
    ap.add_argument("--train-hidden", type=int, default=0)
    ap.add_argument("--train-layers", type=int, default=0)
    ap.add_argument("--no-drop-caches", action="store_true", help="part 2: do not drop the page cache before restores")
    args = ap.parse_args(argv)
    if args.reps is None:
        args.reps = 1 if args.quick else 3
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    args.parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not args.parts or args.parts - {"training", "recovery"}:
        ap.error("--parts takes training and/or recovery")
    return args


def _on_sigterm(signum: int, frame: Any) -> None:
    """torchrun stops every rank with SIGTERM when one fails: a background copy may be waiting on a
    rank that is gone, so remove this run's folders and leave at once (the moto server dies with
    rank 0: PR_SET_PDEATHSIG)."""
    for d in _CLEANUP:
        remove_tree(d)
    try:
        sys.stderr.write(f"bench_memory_tier: rank {os.environ.get('RANK', '?')}: SIGTERM, scratch removed\n")
        sys.stderr.flush()
    finally:
        os._exit(143)


def install_signal_handlers() -> None:
    """SIGTERM removes this run's folders (GiBs in /dev/shm) and exits, even while the main thread is
    blocked inside a collective, where a Python signal handler never runs: a helper thread reads the
    signal wakeup fd and does it then. ``kill -USR1 <pid>`` prints every thread's stack (a hang)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    signal.signal(signal.SIGTERM, _on_sigterm)
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)

    def watch() -> None:
        while True:
            if signal.SIGTERM in os.read(r, 64):
                _on_sigterm(signal.SIGTERM, None)

    threading.Thread(target=watch, name="bench-sigterm", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    install_signal_handlers()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\.checkpoint.*")
    torch.set_num_threads(1)
    # a collective of the benchmark's own that waits 10 minutes fails instead of hanging for gloo's 30
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    try:
        return run(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
