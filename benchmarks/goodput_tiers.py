"""Goodput of a memory tier in front of persistent checkpoints, simulated (bench_resilience.py part 3b).

The job: a 70B GPT at tp4 pp8 dp32 (1,024 ranks, 128 nodes of 8 GPUs), ZeRO-1, mixed-precision
Adam: a 912.7 GiB checkpoint (0.89 GiB written per rank), 4.84 GiB of state held per rank.
The figures (stated, not measured; plausible for an H100-class cluster):

* persistent tier: 5 GB/s per rank, 200 GB/s aggregate for the shared file system (so the
  file system bounds the save: 4.9 s); restart from it 300 s (scheduler, process start,
  process groups, model build and load);
* memory tier: XOR parity over groups of 8 nodes (44 GiB of host memory per node), copy into
  node memory at 10 GB/s per rank (0.52 s), then parity over the network at 25 GB/s per rank
  before the snapshot counts; restart from it 60 s (the same restart, a load from memory);
* failures: Llama 3's rate (466 interruptions in 54 days on 16,384 GPUs: a job MTBF of 2.8 h;
  a 1,024-GPU job at the same per-GPU rate would see ~45 h, so this is a stress case), 90% of
  them recoverable from memory (one node lost per parity group);
* saves synchronous, or asynchronous with 10% of each write blocking training.

Every failure draws one exponential gap and one coin (memory-recoverable or not) whatever the
intervals, so every interval pair sees the same failures (common random numbers): ratios between
rows are much less noisy than the rows themselves.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

from common import table

from ckptkit.resilience import MemoryTierPlanOptions, goodput, plan_tiers, two_tier_goodput

JOB = dict(params=70e9, tp=4, pp=8, dp=32, zero=1)
WRITE_GBPS, FS_GBPS, NETWORK_GBPS = 5.0, 200.0, 25.0
MEMORY = MemoryTierPlanOptions(parity=8, ranks_per_node=8, memory_gbps=10.0, node_failure_share=0.9,
                               restart_seconds=60.0)
PERSISTENT_RESTART_S = 300.0
LLAMA3_MTBF_HOURS = 54 * 24 / 466  # 2.78 h


@dataclass(frozen=True)
class TierScenario:
    """One job's costs: what each tier stalls, when its copy becomes usable, what a restart from it costs."""

    name: str
    mtbf_s: float
    work_s: float
    memory_share: float  # of failures recoverable from memory
    memory_blocking_s: float
    memory_write_s: float  # from the snapshot's start until it is protected (usable)
    memory_restart_s: float
    persistent_blocking_s: float
    persistent_write_s: float  # from the save's start until it commits
    persistent_restart_s: float


def _next_multiple(work: float, every: float) -> float:
    """Step-based schedules (``every_steps``): the next multiple of the interval after ``work``."""
    return math.inf if math.isinf(every) else (math.floor(work / every + 1e-9) + 1) * every


def simulate_tiers(sc: TierScenario, memory_s: float, persistent_s: float, rng: random.Random) -> float:
    """ETTR of one simulated run (useful work / wall time). ``memory_s = inf``: no memory tier, so
    every failure restarts from the persistent tier. One snapshot and one save in flight at most
    (a new one supersedes an unfinished one; the planner's intervals exceed the write times)."""
    work_s, mtbf = sc.work_s, sc.mtbf_s
    wall = work = mem_done = disk_done = 0.0
    pend_m = pend_p = (math.inf, 0.0)  # (usable at wall time, work) of the snapshot / save in flight
    next_failure = rng.expovariate(1 / mtbf)
    while work < work_s:
        next_m, next_p = _next_multiple(work, memory_s), _next_multiple(work, persistent_s)
        # a run of one tier's writes before the other's next: take all but the last at once
        if next_m < next_p and sc.memory_write_s <= memory_s:
            wall, work, mem_done, pend_m = _run(memory_s, sc.memory_blocking_s, sc.memory_write_s,
                                                min(next_p, work_s), next_failure, wall, work, mem_done, pend_m)
            next_m = _next_multiple(work, memory_s)
        elif next_p < next_m and sc.persistent_write_s <= persistent_s:
            wall, work, disk_done, pend_p = _run(persistent_s, sc.persistent_blocking_s, sc.persistent_write_s,
                                                 min(next_m, work_s), next_failure, wall, work, disk_done, pend_p)
            next_p = _next_multiple(work, persistent_s)
        target = min(next_m, next_p, work_s)
        last = target >= work_s
        is_m, is_p = not last and target == next_m, not last and target == next_p
        start = wall + (target - work)  # the snapshot/save starts when the segment's work is done
        end = start + is_m * sc.memory_blocking_s + is_p * sc.persistent_blocking_s
        if next_failure < end:
            if pend_m[0] <= next_failure:
                mem_done = max(mem_done, pend_m[1])
            if pend_p[0] <= next_failure:
                disk_done = max(disk_done, pend_p[1])
            from_memory = rng.random() < sc.memory_share and not math.isinf(memory_s)  # always one coin
            work = max(mem_done, disk_done) if from_memory else disk_done
            mem_done = work  # a lost node took the newer snapshots' pieces with it
            pend_m = pend_p = (math.inf, 0.0)
            wall = next_failure + (sc.memory_restart_s if from_memory else sc.persistent_restart_s)
            next_failure = wall + rng.expovariate(1 / mtbf)
            continue
        if pend_m[0] <= start:
            mem_done, pend_m = max(mem_done, pend_m[1]), (math.inf, 0.0)
        if pend_p[0] <= start:
            disk_done, pend_p = max(disk_done, pend_p[1]), (math.inf, 0.0)
        wall, work = end, target
        if is_m:
            pend_m = (start + sc.memory_write_s, work)
        if is_p:
            pend_p = (start + sc.persistent_write_s, work)
    return work_s / wall


def _run(every: float, cost: float, write: float, before: float, failure: float, wall: float, work: float,
         done: float, pend: tuple[float, float]) -> tuple[float, float, float, tuple[float, float]]:
    """Jump over one tier's writes at multiples of ``every`` below ``before`` that end before the
    next failure, all but the last of them (the step-by-step loop takes that one): the state the
    loop would reach, in one step. Each write is usable before the next starts (``write <= every``),
    so the newest but one is done and the newest is in flight."""
    j0 = math.floor(work / every + 1e-9) + 1  # the first write's index
    # write j's blocking part ends at wall + (j * every - work) + (j - j0 + 1) * cost, by the failure
    j_fail = math.floor((failure - wall + work + (j0 - 1) * cost) / (every + cost) - 1e-9)
    j_last = min(j_fail, math.ceil(before / every - 1e-9) - 1) - 1  # below ``before``; one left to the loop
    if j_last - j0 < 1:
        return wall, work, done, pend
    if pend[0] <= wall + (j0 * every - work):  # the one in flight is done when the first starts
        done = max(done, pend[1])
    start_last = wall + (j_last * every - work) + (j_last - j0) * cost
    done = max(done, (j_last - 1) * every)
    return start_last + cost, j_last * every, done, (start_last + write, j_last * every)


def scenarios(mtbf_hours: float) -> list[tuple[TierScenario, object]]:
    """The job's scenarios (synchronous and asynchronous saves), each with the planner's two-tier plan."""
    out = []
    for label, fraction in (("synchronous saves", 1.0), ("async saves, 10% blocking", 0.1)):
        t = plan_tiers(**JOB, mtbf_hours=mtbf_hours, write_gbps=WRITE_GBPS, fs_gbps=FS_GBPS,
                       restart_seconds=PERSISTENT_RESTART_S, blocking_fraction=fraction, memory=MEMORY)
        protect_s = t.held_per_rank / (NETWORK_GBPS * 1e9)
        sc = TierScenario(label, t.mtbf_seconds, 30 * 86400, MEMORY.node_failure_share, t.memory_cost_seconds,
                          t.memory_copy_seconds + protect_s, MEMORY.restart_seconds, t.persistent_cost_seconds,
                          t.persistent_only.save_seconds, PERSISTENT_RESTART_S)
        out.append((sc, t))
    return out


def tier_suite(quick: bool, seed: int, mtbf_hours: float, naive_minutes: list[float]) -> dict:
    """Simulated ETTR per interval choice, next to the planner's first-order estimate."""
    runs = 10 if quick else 100
    out = {}
    for sc, t in scenarios(mtbf_hours):
        p_only = t.persistent_only.interval_seconds
        choices = {
            "persistent only, planner": (math.inf, p_only),
            "memory + persistent, planner": (t.memory_interval_seconds, t.persistent_interval_seconds),
            **{f"persistent only, every {m:g} min": (math.inf, m * 60) for m in naive_minutes},
            "memory every 10 min + persistent every 60 min": (600.0, 3600.0),
        }
        rows = {}
        for label, (tau_m, tau_p) in choices.items():
            rng = random.Random(seed)
            sims = [simulate_tiers(sc, tau_m, tau_p, rng) for _ in range(runs)]
            mean = sum(sims) / runs
            sd = math.sqrt(sum((s - mean) ** 2 for s in sims) / max(1, runs - 1))
            rows[label] = {"memory_interval_s": None if math.isinf(tau_m) else tau_m, "persistent_interval_s": tau_p,
                           "ettr_mean": mean, "ettr_sd": sd, "planner_estimate": _estimate(sc, tau_m, tau_p)}
        out[sc.name] = {"scenario": asdict(sc), "runs": runs, "host_gib_per_node": t.host_memory_per_node / 2**30,
                        "intervals": rows}
    return out


def _estimate(sc: TierScenario, tau_m: float, tau_p: float) -> float:
    if math.isinf(tau_m):
        return goodput(tau_p, sc.persistent_blocking_s, sc.mtbf_s, sc.persistent_restart_s)
    return two_tier_goodput(tau_m, tau_p, sc.memory_blocking_s, sc.persistent_blocking_s, sc.mtbf_s,
                            sc.memory_share, sc.memory_restart_s, sc.persistent_restart_s)


def _every(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def print_tiers(res: dict) -> None:
    for name, sc in res.items():
        s, rows_in = sc["scenario"], sc["intervals"]
        print(f"{name}: MTBF {s['mtbf_s'] / 3600:.2f} h, {100 * s['memory_share']:g}% of failures from memory "
              f"(restart {s['memory_restart_s']:g} s, else {s['persistent_restart_s']:g} s); blocking: snapshot "
              f"{s['memory_blocking_s']:.2f} s, save {s['persistent_blocking_s']:.2f} s (commits after "
              f"{s['persistent_write_s']:.1f} s); host memory {sc['host_gib_per_node']:.1f} GiB/node; "
              f"{sc['runs']} simulated 30-day runs")
        tiered = rows_in["memory + persistent, planner"]["ettr_mean"]
        print(table(["intervals", "memory", "persistent", "ETTR (simulated)", "ETTR (planner's estimate)",
                     "memory+persistent / this"],
                    [[k, _every(v["memory_interval_s"]), _every(v["persistent_interval_s"]),
                      f"{100 * v['ettr_mean']:.2f}% +- {100 * v['ettr_sd']:.2f}", f"{100 * v['planner_estimate']:.2f}%",
                      f"{tiered / v['ettr_mean']:.3f}x"] for k, v in rows_in.items()]))
        alone = rows_in["persistent only, planner"]["ettr_mean"]
        print(f"memory tier + persistent vs persistent only (both at the planner's intervals): "
              f"{100 * tiered:.2f}% vs {100 * alone:.2f}% ETTR = {tiered / alone:.3f}x\n")
