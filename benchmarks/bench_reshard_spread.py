"""``ckptkit reshard`` spread over 1, 2 and 4 processes (``torchrun -m ckptkit reshard``) vs a raw copy.

The source is bench_reshard.py's synthetic Megatron-GPT checkpoint at tp2pp2
(bf16 weights plus fp32 main/exp_avg/exp_avg_sq; >= 2 GiB, ``--quick`` ~40 MiB),
resharded to tp4pp2 (8 target ranks, so 4 processes get 2 each). For every
process count, ``--reps`` times (median reported; page cache dropped before
each run when /proc/sys/vm/drop_caches is writable):

  raw copy   (the baseline) a subprocess reads every data object of the source
             in 64 MiB chunks, writes and fsyncs it: the least any rewrite of
             these bytes costs on this disk
  reshard    1 process: ``python -m ckptkit reshard SRC DST --to tp4pp2 --json``;
             N > 1: ``torchrun --nproc_per_node N -m ckptkit reshard ...`` —
             wall time (interpreters, torch imports and the rendezvous included),
             the time inside the command (process 0's, from reading the source's
             manifest to the commit) and the largest process's peak RSS

Every spread output is checked byte for byte against the one-process output
(data objects equal, ``ckptkit.diff`` identical). On a 2-core machine the
ceiling is the disk and two cores: more than 2 processes can only add
contention; on a node with many cores and a parallel file system each
process adds its own stream.

``--command dcp`` times ``convert SRC DST --format dcp`` instead (the DCP export, spread the same
way; its data files compared across process counts).

Run: .venv/bin/python benchmarks/bench_reshard_spread.py [--quick] [--processes 1,2,4] [--reps 1] [--out DIR]
     [--command reshard|dcp]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, ROOT)

from bench_reshard import RAW_COPY, Model, build_source, run_child  # noqa: E402
from common import (GiB, MiB, drop_page_cache, run_main, median, remove_tree, table, torchrun_command,  # noqa: E402
                    tree_bytes, write_results)
from ckptkit.layout.config import ParallelConfig  # noqa: E402

ATTEMPT = re.compile(r"-[0-9a-f]{12}(?=\.bin$)")


def data_digests(path: str) -> dict[str, str]:
    """Each data object's digest by name, the save-attempt id dropped (a DCP export: its data files)."""
    out = {}
    folder = os.path.join(path, "data") if os.path.isdir(os.path.join(path, "data")) else path
    for name in sorted(n for n in os.listdir(folder) if n != ".metadata"):
        with open(os.path.join(folder, name), "rb") as f:
            out[ATTEMPT.sub("", name)] = hashlib.file_digest(f, "sha256").hexdigest()
    return out


def reshard_command(processes: int, src: str, dst: str, target: str, max_memory: str, command: str) -> list[str]:
    tail = (["reshard", src, dst, "--to", target, "--max-memory", max_memory, "--json"] if command == "reshard"
            else ["convert", src, dst, "--format", "dcp", "--json"])
    if processes == 1:
        return [sys.executable, "-m", "ckptkit", *tail]
    return [*torchrun_command(), f"--nproc_per_node={processes}", "--standalone", "-m", "ckptkit", *tail]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~40 MiB instead of >= 2 GiB (smoke test)")
    ap.add_argument("--processes", default="1,2,4", help="process counts to run (comma-separated)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--source", default="tp2pp2")
    ap.add_argument("--target", default="tp4pp2")
    ap.add_argument("--max-memory", default="1GiB", help="per process")
    ap.add_argument("--command", choices=["reshard", "dcp"], default="reshard",
                    help="reshard (default) or dcp: `convert SRC DST --format dcp`, the DCP export spread the same way")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    m = Model(hidden=256, ffn=704, layers=4, vocab=8000) if args.quick else Model(hidden=1024, ffn=2816, layers=8, vocab=32000)
    counts = [int(p) for p in args.processes.split(",")]
    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="bench_reshard_spread-scratch-", dir=args.out)
    env_note = f"{os.cpu_count()} cores"
    try:
        src = os.path.join(scratch, "src")
        total, _ = build_source(src, m, ParallelConfig.parse(args.source))
        stored, files = tree_bytes(src)
        print(f"source {args.source}: {total / GiB:.2f} GiB logical, {stored / GiB:.2f} GiB in {files} files; "
              f"{env_note}", flush=True)
        times: dict[str, list[float]] = {"raw": []}
        rss: dict[int, list[int]] = {p: [] for p in counts}
        inner: dict[int, list[float]] = {p: [] for p in counts}
        reference: dict[str, str] | None = None
        cold = True
        for rep in range(args.reps):
            for name in ["raw", *counts]:
                dst = os.path.join(scratch, f"{name}-{rep}")
                cold &= drop_page_cache()
                if name == "raw":
                    wall, _, _ = run_child([sys.executable, "-c", RAW_COPY, src, dst])
                else:
                    wall, peak, out = run_child(reshard_command(name, src, dst, args.target, args.max_memory, args.command))
                    rss[name].append(peak)
                    inner[name].append(json.loads(out)["seconds"])
                    digests = data_digests(dst)
                    if reference is None:
                        reference = digests
                    elif digests != reference:
                        raise RuntimeError(f"the {name}-process output differs from the first output")
                times.setdefault(str(name), []).append(wall)
                print(f"  rep {rep} {name}{'' if name == 'raw' else ' processes'}: {wall:.2f}s", flush=True)
                remove_tree(dst)
        raw = median(times["raw"])
        rows = [["raw copy (baseline)", f"{raw:.2f}", f"{total / MiB / raw:.0f}", "1.00", "-", "-"]]
        for p in counts:
            wall, within = median(times[str(p)]), median(inner[p])
            rows.append([f"{args.command}, {p} process{'es' if p > 1 else ''}", f"{wall:.2f}", f"{total / MiB / wall:.0f}",
                         f"{wall / raw:.2f}", f"{within:.2f} ({within / raw:.2f}x)", f"{max(rss[p]) / MiB:.0f} MiB"])
        print(f"\npage cache: {'dropped before every run' if cold else 'warm (drop_caches not writable)'}; "
              f"reps {args.reps}; outputs byte-identical across process counts")
        print(table(["method", "seconds", "MiB/s", "x raw", "inside the command", "peak RSS (largest process)"], rows))
        one = median(times[str(counts[0])])
        print("\nspeed-up over " + f"{counts[0]} process(es): "
              + ", ".join(f"{p}: {one / median(times[str(p)]):.2f}x" for p in counts[1:])
              + f" ({env_note}: the ceiling is the disk and the cores, not the processes)")
        write_results(args.out, "bench_reshard_spread" + ("" if args.command == "reshard" else "_dcp"), {
            "quick": args.quick, "command": args.command, "bytes": total, "source": args.source, "target": args.target, "cold_cache": cold,
            "reps": args.reps, "cores": os.cpu_count(), "raw_seconds": raw,
            "reshard_seconds": {str(p): median(times[str(p)]) for p in counts},
            "ratio_to_raw": {str(p): median(times[str(p)]) / raw for p in counts},
            "inside_seconds": {str(p): median(inner[p]) for p in counts},
            "peak_rss": {str(p): max(rss[p]) for p in counts},
        })
        return 0
    finally:
        remove_tree(scratch)


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
