"""Planning time and metadata size of the realistic layouts at 128, 512 and 1,024 ranks, on one machine.

Every rank's real declarations (Megatron-core's sharded_state_dict and distributed optimizer on a
fake process group with meta tensors; torchtitan's FSDP2 x TP DTensors; DeepSpeed ZeRO-3's
partitions) go through ckptkit's save planning, rank 0's merge, the exactly-once coverage check,
the load planning of target ranks at another layout, and a reshard plan
(tests/scale_layouts_job.py, tests/scale_sim.py; what is real and what is not: their docstrings).

Layouts, each at 128 / 512 / 1,024 ranks:

* Megatron dense: Llama-3-70B (hidden 8192, 80 layers, ffn 28672, GQA 64/8, vocab 128256, SwiGLU)
  at tp4·pp8·dp{4,16,32}, bf16 with the distributed optimizer; load at tp8·pp4·dp8; reshard to tp2pp8;
* Megatron MoE: Mixtral-8x7B (32 layers, 8 experts) at tp2·pp8·ep8·etp1·dp{8,32,64}; load at
  tp4·pp4·ep4·etp1; reshard to tp2pp4ep4etp1;
* DeepSpeed ZeRO-3: Llama-3-70B (Hugging Face names) at dp {128,512,1024}; load at half the dp;
* torchtitan FSDP2 x TP: llama3 70B at fsdp{16,64,128} x tp8; load at twice the fsdp, half the tp.

Per rank: planning time (classify + plan; the mean and the slowest rank), index bytes; rank 0: merge
and manifest serialisation time; the manifest's bytes and the total metadata (manifest + every
index); a loading rank at the other layout: manifest parse, source matching and read planning
(a sample of target ranks: every model-parallel position and every shard of one; ``--all-load-ranks``
for all). Each layout runs in a process of its own (torch's fake process group). CPU-bound, one core.

Run: .venv/bin/python benchmarks/bench_scale_layouts.py [--quick] [--ranks 128,512] [--layouts dense,moe]
(--quick: 128 ranks with a few layers per model object, about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from common import MiB, table, write_results  # noqa: E402

LAYOUTS = ("dense", "moe", "zero3", "titan")


def spec(layout: str, ranks: int, quick: bool, all_load: bool) -> dict[str, Any]:
    """The job spec of ``layout`` at ``ranks`` ranks (tests/scale_layouts_job.py)."""
    load = "all" if all_load else "sample"
    if layout == "dense":
        out: dict[str, Any] = {"scenario": "megatron-dense", "dp": ranks // 32, "load": load}
    elif layout == "moe":
        out = {"scenario": "megatron-moe", "dp": ranks // 16, "pp": 8, "load_dp": ranks // 16, "load": load}
    elif layout == "zero3":
        out = {"scenario": "zero3", "dp": ranks, "load_dp": ranks // 2, "load": load}
    else:
        out = {"scenario": "titan", "dp": ranks // 8, "tp": 8, "load": load,
               "check": [ranks - 1] if quick else [ranks - 1, ranks // 2 + 3]}
    if quick:
        out["layers"] = {"dense": 8, "moe": 8, "zero3": 4, "titan": 2}[layout]
    return out


def run_job(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    proc = subprocess.run([sys.executable, "-m", "tests.scale_layouts_job", json.dumps(specs)], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"tests.scale_layouts_job failed:\n{proc.stderr[-6000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def rows(results: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["layout", "ranks", "layers", "tensors", "pieces", "plan/rank ms (max)", "merge+ser s",
               "manifest MiB", "indexes MiB", "load at", "load/rank s (max)", "reshard s", "wall s"]
    out = []
    for r in results:
        s, load = r["save"], r["load"]
        per_load = load.get("per_rank_s_max", load["manifest_parse_per_rank_s_max"] + load["match_per_rank_s_max"]
                            + load["read_plan_per_rank_s_max"])  # older results: the slowest phases' sum
        out.append([r["layout"], str(s["ranks"]), str(r["model_layers"]), str(s["tensors"]), str(s["pieces"]),
                    f"{s['plan_per_rank_s_mean'] * 1e3:.1f} ({s['plan_per_rank_s_max'] * 1e3:.0f})",
                    f"{s['merge_s'] + s['manifest_serialize_s']:.2f}", f"{s['manifest_bytes'] / MiB:.2f}",
                    f"{s['index_bytes_total'] / MiB:.1f}", r["load_layout"], f"{per_load:.2f}",
                    f"{r['reshard']['seconds']:.2f}", f"{r['wall_s']:.0f}"])
    return headers, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="128 ranks, a few layers per model object")
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--ranks", default="128,512,1024", help="rank counts (default 128,512,1024)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"subset of {','.join(LAYOUTS)}")
    ap.add_argument("--all-load-ranks", action="store_true", help="plan the load of every target rank")
    args = ap.parse_args(argv)
    counts = [128] if args.quick else [int(x) for x in args.ranks.split(",")]
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    results = []
    for layout in layouts:  # one process per layout (the rank counts share its imports); torchtitan: per job
        specs = [spec(layout, n, args.quick, args.all_load_ranks) for n in counts]
        done = [r for s in specs for r in run_job([s])] if layout == "titan" else run_job(specs)
        runs = ", ".join(f"{r['save']['ranks']} ranks in {r['wall_s']:.0f} s" for r in done)
        print(f"  {layout}: {runs}", flush=True)
        results += done
    headers, body = rows(results)
    print("\n== realistic layouts at their real rank counts (one core, metadata only) ==")
    print(table(headers, body))
    print("plan/rank: classify + plan of one rank (mean, slowest); merge+ser: rank 0's merge and manifest "
          "serialisation; load/rank: the slowest loading rank's manifest parse + source matching + read plan")
    write_results(args.out, "bench_scale_layouts", {"quick": args.quick, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
