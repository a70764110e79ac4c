"""Resilience scenario: spike detection, steps lost, restart cost, and goodput under failures.

Three parts, one run:

1. **Detection on a trace suite.** Synthetic loss and grad-norm traces
   (a decaying curve with Gaussian or heavy-tailed Student-t noise; 20,000
   steps each), with spikes injected at random steps: 1.2x, 1.5x, 2x and 5x
   the clean value, or non-finite, lasting 1-5 steps. Every detector sees the
   same traces. A spike counts as caught when flagged within 3 steps of its
   onset; a flag anywhere else is a false positive. Detectors:

     ckptkit sigma   mean + 6 sigma over 128 steps (the default; OLMo-core's rule)
     ckptkit mad     median + 6 * 1.4826 * MAD over 128 steps
     nan-only        (baseline) flag only non-finite values, what trainers do by default
     1.5x EMA        (baseline) flag a value above 1.5x its exponential moving average

2. **A real run with incidents.** ``examples/tiny_gpt.py`` under ``torchrun``
   (2 ranks, FSDP2, async checkpoints every 10 steps) with a poisoned data
   range and a ``kill -9`` of one rank: the incident log's steps lost per
   incident, and the time from the crash to the first resumed step, split
   into the restart (torchrun noticing, new processes, imports, process
   group) and the checkpoint load alone.

3. **Goodput under failures.** A simulated 30-day run (Monte Carlo over
   exponential failures at the given MTBF) checkpointing at the planner's
   Young/Daly interval vs fixed naive intervals, for a synchronous save and
   for an asynchronous one (short blocking snapshot, persist in the
   background; a failure before the commit loses that checkpoint). ETTR =
   useful work / wall time; the planner's first-order estimate is printed
   next to each simulated figure.
   Then (3b, benchmarks/goodput_tiers.py) a memory tier in front of the
   persistent one at Llama 3's failure rate, for a 70B tp4 pp8 dp32 job whose
   saves the file system's aggregate bandwidth bounds: persistent only at the
   planner's interval, memory tier + persistent at the planner's two
   intervals, and naive intervals, with the figures the job assumes stated
   there.

Run: python benchmarks/bench_resilience.py [--quick] [--out DIR] [--skip-run]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, ROOT)

from common import median, remove_tree, table, torchrun_command  # noqa: E402
from goodput_tiers import LLAMA3_MTBF_HOURS, print_tiers, tier_suite  # noqa: E402

from ckptkit.resilience.detectors import DetectorConfig, SpikeDetector  # noqa: E402
from ckptkit.resilience.planner import goodput, young_daly_interval  # noqa: E402
from ckptkit.resilience.report import load_report  # noqa: E402

CAUGHT_WITHIN = 3  # steps after the onset
MAGNITUDES = (1.2, 1.5, 2.0, 5.0, math.inf)  # inf = non-finite

# ------------------------------------------------------------------ part 1: detection


@dataclass(frozen=True)
class Event:
    onset: int
    length: int
    magnitude: float


def clean_trace(n: int, rng: random.Random, signal: str, noise: str) -> list[float]:
    """A loss-like (decaying to a floor) or grad-norm-like (decaying, noisier) clean trace."""
    level, start, tau, rel = (2.0, 8.0, n / 5, 0.02) if signal == "loss" else (0.3, 2.0, n / 10, 0.08)
    out = []
    for t in range(n):
        z = rng.gauss(0, 1) if noise == "gauss" else _student_t(rng, 4) / math.sqrt(2)  # unit variance
        out.append((level + start * math.exp(-t / tau)) * max(0.05, 1 + rel * z))
    return out


def _student_t(rng: random.Random, df: int) -> float:
    return rng.gauss(0, 1) / math.sqrt(sum(rng.gauss(0, 1) ** 2 for _ in range(df)) / df)


def inject(trace: list[float], rng: random.Random, count: int, first: int) -> tuple[list[float], list[Event]]:
    out, events = list(trace), []
    slots = sorted(rng.sample(range(first, len(trace) - 10, 40), count))  # events 40+ steps apart
    for onset in slots:
        ev = Event(onset, rng.randint(1, 5), rng.choice(MAGNITUDES))
        for t in range(onset, onset + ev.length):
            out[t] = math.nan if math.isinf(ev.magnitude) else trace[t] * ev.magnitude
        events.append(ev)
    return out, events


Detector = Callable[[], Callable[[float], bool]]


def ckptkit_detector(method: str) -> Detector:
    def make() -> Callable[[float], bool]:
        det = SpikeDetector(DetectorConfig(window=128, warmup=32, k=6.0, method=method))  # type: ignore[arg-type]
        return lambda v: det.observe(v).spike
    return make


def nan_only() -> Callable[[float], bool]:
    return lambda v: not math.isfinite(v)


def ema_ratio() -> Callable[[float], bool]:
    state = {"ema": None}

    def observe(v: float) -> bool:
        if not math.isfinite(v):
            return True
        ema = state["ema"]
        spike = ema is not None and v > 1.5 * ema
        if not spike:
            state["ema"] = v if ema is None else 0.98 * ema + 0.02 * v
        return spike
    return observe


DETECTORS: dict[str, Detector] = {
    "ckptkit sigma": ckptkit_detector("sigma"),
    "ckptkit mad": ckptkit_detector("mad"),
    "nan-only": nan_only,
    "1.5x EMA": ema_ratio,
}


def score(make: Detector, traces: list[tuple[list[float], list[Event]]]) -> dict:
    caught_by_mag: dict[str, list[int]] = {}
    delays: list[int] = []
    false_pos = clean_steps = 0
    for values, events in traces:
        observe = make()
        flags = [observe(v) for v in values]
        near = set()
        for ev in events:
            window = range(ev.onset, ev.onset + ev.length + CAUGHT_WITHIN)
            near.update(window)
            hit = next((t for t in range(ev.onset, ev.onset + CAUGHT_WITHIN + 1) if flags[t]), None)
            caught_by_mag.setdefault(_mag_label(ev.magnitude), []).append(hit is not None)
            if hit is not None:
                delays.append(hit - ev.onset)
        for t, f in enumerate(flags):
            if t not in near:
                clean_steps += 1
                false_pos += f
    all_caught = [c for v in caught_by_mag.values() for c in v]
    return {
        "recall": sum(all_caught) / len(all_caught),
        "recall_by_magnitude": {k: sum(v) / len(v) for k, v in sorted(caught_by_mag.items())},
        "false_positives_per_10k": 1e4 * false_pos / clean_steps,
        "false_positives": false_pos,
        "clean_steps": clean_steps,
        "median_delay_steps": median(delays) if delays else None,
    }


def _mag_label(m: float) -> str:
    return "non-finite" if math.isinf(m) else f"{m:g}x"


def detection_suite(quick: bool, seed: int) -> dict:
    rng = random.Random(seed)
    n, per_kind = (5000, 3) if quick else (20000, 10)
    results: dict = {}
    for signal in ("loss", "grad_norm"):
        for noise in ("gauss", "student-t"):
            traces = [inject(clean_trace(n, rng, signal, noise), rng, count=n // 400, first=200)
                      for _ in range(per_kind)]
            clean = [(clean_trace(n, rng, signal, noise), []) for _ in range(per_kind)]
            for name, make in DETECTORS.items():
                injected = score(make, traces)
                only_clean = score_clean(make, clean)
                results[f"{signal}/{noise}/{name}"] = {**injected, "clean_trace_false_positives_per_10k": only_clean}
    return results


def score_clean(make: Detector, clean: list[tuple[list[float], list[Event]]]) -> float:
    flags = steps = 0
    for values, _ in clean:
        observe = make()
        flags += sum(observe(v) for v in values)
        steps += len(values)
    return 1e4 * flags / steps


def print_detection(res: dict) -> None:
    rows = []
    for key, r in res.items():
        signal, noise, name = key.split("/")
        by = r["recall_by_magnitude"]
        rows.append([signal, noise, name, f"{100 * r['recall']:.1f}%"]
                    + [f"{100 * by.get(m, 0):.0f}%" for m in ("1.2x", "1.5x", "2x", "5x", "non-finite")]
                    + [f"{r['false_positives_per_10k']:.2f}", f"{r['clean_trace_false_positives_per_10k']:.2f}",
                       "-" if r["median_delay_steps"] is None else f"{r['median_delay_steps']:.0f}"])
    print(table(["signal", "noise", "detector", "recall", "1.2x", "1.5x", "2x", "5x", "NaN",
                 "FP/10k (around)", "FP/10k (clean)", "delay"], rows))


# ------------------------------------------------------------ part 2: a real run


def real_run(workdir: str, steps: int) -> dict:
    run = os.path.join(workdir, "run")
    timings = os.path.join(workdir, "timings.jsonl")
    cmd = [*torchrun_command(), "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           os.path.join(ROOT, "examples", "tiny_gpt.py"), "train", "--run-dir", run, "--layout", "fsdp",
           "--steps", str(steps), "--poison", "320-368", "--crash-at", str(steps - 13), "--timings", timings]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    wall = time.time() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"the tiny_gpt run failed (rc {proc.returncode})")
    events = [json.loads(line) for line in open(timings)]
    report = load_report(os.path.join(run, "ckpt"))
    incidents = [{"kind": i.kind, "step": i.step, "steps_lost": i.data.get("steps_lost"), "detail": i.detail}
                 for i in report.incidents if i.kind in ("rollback", "restart")]
    crash = next(e for e in events if e["event"] == "crash")
    start1 = next(e for e in events if e["event"] == "start" and e["attempt"] == 1)
    restored1 = next(e for e in events if e["event"] == "restored" and e["attempt"] == 1)
    first1 = next(e for e in events if e["event"] == "first_step" and e["attempt"] == 1)
    ckpt_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(run, "ckpt"))
                     if "step-" in d for f in fs) // max(1, len([d for d in os.listdir(os.path.join(run, "ckpt"))
                                                                 if d.startswith("step-")]))
    return {
        "wall_s": wall,
        "incidents": incidents,
        "crash_to_new_process_s": start1["t_process"] - crash["t"],
        "new_process_to_restored_s": restored1["t"] - start1["t_process"],
        "checkpoint_load_s": restored1["load_s"],
        "restored_to_first_step_s": first1["t"] - restored1["t"],
        "crash_to_first_step_s": first1["t"] - crash["t"],
        "checkpoint_bytes": ckpt_bytes,
    }


def print_real_run(r: dict) -> None:
    print(table(["incident", "at step", "steps lost", "detail"],
                [[i["kind"], str(i["step"]), str(i["steps_lost"]), i["detail"][:70]] for i in r["incidents"]]))
    total = r["crash_to_first_step_s"]
    rows = [[name, f"{r[key]:.2f} s", f"{100 * r[key] / total:.0f}%"] for name, key in (
        ("crash -> new worker process (torchrun)", "crash_to_new_process_s"),
        ("new process -> state restored (imports, pg, model, load)", "new_process_to_restored_s"),
        ("  of which ckptkit restore (checkpoint load alone)", "checkpoint_load_s"),
        ("restored -> first resumed step done", "restored_to_first_step_s"),
        ("crash -> first resumed step", "crash_to_first_step_s"))]
    print(table(["restart phase", "time", "share"], rows))
    print(f"checkpoint size {r['checkpoint_bytes'] / 1024:.0f} KiB; restart-to-first-step / load alone = "
          f"{r['crash_to_first_step_s'] / max(r['checkpoint_load_s'], 1e-9):.0f}x")


# ------------------------------------------------------------ part 3: goodput


@dataclass(frozen=True)
class Scenario:
    name: str
    blocking_s: float  # training stalls this long per checkpoint
    persist_s: float  # after which the checkpoint commits (0 for synchronous saves)
    restart_s: float
    mtbf_s: float
    work_s: float


def simulate(sc: Scenario, interval_s: float, rng: random.Random) -> float:
    """ETTR of one simulated run: useful work / wall time."""
    wall = 0.0
    committed = 0.0  # work saved in a committed checkpoint
    pending: list[tuple[float, float]] = []  # (commit wall time, work) of saves in flight
    work = 0.0
    next_failure = rng.expovariate(1 / sc.mtbf_s)
    while work < sc.work_s:
        # train until the next checkpoint (or the end)
        seg = min(interval_s, sc.work_s - work)
        end = wall + seg + (sc.blocking_s if work + seg < sc.work_s else 0.0)
        if next_failure < end:
            wall = next_failure
            committed = max([committed] + [w for t, w in pending if t <= wall])
            pending = []
            work = committed
            wall += sc.restart_s
            next_failure = wall + rng.expovariate(1 / sc.mtbf_s)
            continue
        wall, work = end, work + seg
        committed = max([committed] + [w for t, w in pending if t <= wall])
        pending = [(t, w) for t, w in pending if t > wall]
        if work < sc.work_s:
            if sc.persist_s > 0:
                pending.append((wall + sc.persist_s, work))
            else:
                committed = work
    return sc.work_s / wall


def goodput_suite(quick: bool, seed: int, mtbf_hours: float, naive_minutes: list[float]) -> dict:
    mtbf = mtbf_hours * 3600
    scenarios = [
        Scenario("synchronous save (60 s)", 60.0, 0.0, 300.0, mtbf, 30 * 86400),
        Scenario("async save (3 s snapshot, 60 s persist)", 3.0, 60.0, 300.0, mtbf, 30 * 86400),
    ]
    runs = 20 if quick else 200
    out = {}
    for sc in scenarios:
        planned = max(young_daly_interval(sc.blocking_s, sc.mtbf_s), sc.persist_s)  # saves never queue
        intervals = {"planner (Young/Daly)": planned, **{f"naive every {m:g} min": m * 60 for m in naive_minutes}}
        rows = {}
        for label, tau in intervals.items():
            rng = random.Random(seed)
            sims = [simulate(sc, tau, rng) for _ in range(runs)]
            mean = sum(sims) / len(sims)
            sd = math.sqrt(sum((s - mean) ** 2 for s in sims) / max(1, len(sims) - 1))
            rows[label] = {"interval_s": tau, "ettr_mean": mean, "ettr_sd": sd,
                           "planner_estimate": goodput(tau, sc.blocking_s, sc.mtbf_s, sc.restart_s)}
        out[sc.name] = {"scenario": asdict(sc), "runs": runs, "intervals": rows}
    return out


def print_goodput(res: dict) -> None:
    for name, sc in res.items():
        rows_in = sc["intervals"]
        best_naive = max(v["ettr_mean"] for k, v in rows_in.items() if k.startswith("naive"))
        p = rows_in["planner (Young/Daly)"]["ettr_mean"]
        print(f"{name}: MTBF {sc['scenario']['mtbf_s'] / 3600:g} h, restart {sc['scenario']['restart_s']:g} s, "
              f"{sc['runs']} simulated 30-day runs")
        print(table(["interval", "every", "ETTR (simulated)", "ETTR (planner's estimate)", "planner / this"],
                    [[k, f"{v['interval_s'] / 60:.1f} min", f"{100 * v['ettr_mean']:.2f}% +- {100 * v['ettr_sd']:.2f}",
                      f"{100 * v['planner_estimate']:.2f}%", f"{p / v['ettr_mean']:.3f}x"] for k, v in rows_in.items()]))
        print(f"planner vs best naive interval: {p / best_naive:.3f}x ETTR\n")


# ------------------------------------------------------------------ main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer traces and simulated runs, a shorter real run")
    ap.add_argument("--out", default=None, help="write results JSON into this directory")
    ap.add_argument("--skip-run", action="store_true", help="skip part 2 (the torchrun job)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--mtbf-hours", type=float, default=3.0)
    ap.add_argument("--naive-minutes", type=float, nargs="+", default=[10.0, 60.0, 180.0])
    ap.add_argument("--tier-mtbf-hours", type=float, default=LLAMA3_MTBF_HOURS,
                    help="job MTBF for part 3b, the memory tier (default: Llama 3's, 466 interruptions in 54 days)")
    args = ap.parse_args()

    results: dict = {"benchmark": "resilience", "when": datetime.datetime.now().isoformat(timespec="seconds"),
                     "host": platform.node(), "cpus": os.cpu_count(), "quick": args.quick}
    print("== 1. spike detection on the trace suite "
          f"(caught = flagged within {CAUGHT_WITHIN} steps of the onset) ==")
    results["detection"] = detection_suite(args.quick, args.seed)
    print_detection(results["detection"])

    if not args.skip_run:
        print("\n== 2. a real run: tiny GPT, 2 ranks, poisoned data and a kill -9 ==")
        workdir = tempfile.mkdtemp(prefix="ckptkit-bench-res-")
        try:
            results["real_run"] = real_run(workdir, steps=50 if args.quick else 70)
        finally:
            remove_tree(workdir)
        print_real_run(results["real_run"])

    print(f"\n== 3. goodput of a simulated 30-day run, failures at MTBF {args.mtbf_hours:g} h ==")
    results["goodput"] = goodput_suite(args.quick, args.seed, args.mtbf_hours, args.naive_minutes)
    print_goodput(results["goodput"])
    print(f"== 3b. a memory tier in front of persistent checkpoints: 70B tp4 pp8 dp32 (1,024 ranks), "
          f"failures at MTBF {args.tier_mtbf_hours:.2f} h ==")
    t0 = time.perf_counter()
    results["goodput_tiers"] = tier_suite(args.quick, args.seed, args.tier_mtbf_hours, args.naive_minutes)
    print_tiers(results["goodput_tiers"])
    print(f"(part 3b simulated in {time.perf_counter() - t0:.1f} s)")

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "bench_resilience.json")
        with open(path, "w") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
