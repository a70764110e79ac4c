"""Run every benchmark: ``make bench`` (``.venv/bin/python benchmarks/run_all.py $(BENCH_ARGS)``).

* ``bench_io.py`` (save/load throughput), ``bench_async.py`` (what an
  asynchronous save blocks, and its cost to a training loop) and
  ``bench_memory_tier.py`` (the memory tier's cost to a training loop, and a
  lost node's time to the first resumed step from memory vs disk vs S3),
  ``bench_parity_memory.py`` (the process memory a parity snapshot's protection and
  a parity rebuild take, against the rank's state), ``bench_tier_cpu.py`` (the host CPU one
  memory snapshot's protection takes, r1 and p4, against the former SHA-256 digests) and
  ``bench_read_once.py`` (a dp4 load of replicated weights, read once vs by every
  replica, on local disk and S3) under
  ``torchrun --nproc_per_node=4``;
* ``bench_s3.py`` (object-store throughput through a local moto S3 server it
  starts itself: ckptkit's native and tensorstore engines vs raw s3fs vs DCP
  over fsspec, and both engines on local files) as a plain single-process script;
* ``bench_modelspace.py`` (a lazy slice vs a full load; zarr export/import vs raw writes) as a plain single-process script;
* ``bench_reshard.py`` (offline ``ckptkit reshard`` tp2pp2 -> tp4pp2 in a subprocess vs a raw copy of the same bytes) as a plain single-process script, then again with ``--moe`` (a 64-expert MoE GPT, ep8 -> tp2 ep4);
* ``bench_hf_export.py`` (``ckptkit convert --format hf`` of a 2.6 GiB 64-expert Qwen3-MoE checkpoint in a
  subprocess vs a raw write of the same bytes; peak RSS vs 2x the largest tensor + 300 MB);
* ``bench_scale_layouts.py`` (planning time and metadata size of the realistic layouts at 128, 512
  and 1,024 ranks, from every rank's real declarations on a fake process group; each layout in a
  process of its own) as a plain single-process script;
* every other ``benchmarks/bench_*.py`` that defines ``main()`` (e.g.
  ``bench_plan_scale.py``) as a plain single-process script.

``--quick`` and ``--out`` are passed on to each, ``--reps`` to the torchrun
ones and to bench_s3. Exit status: 0 only if every benchmark exited 0. Scratch
checkpoints that a killed benchmark left under ``--out`` are removed at the end.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import remove_tree, torchrun_command  # noqa: E402

IO_BENCH = "bench_io.py"
ASYNC_BENCH = "bench_async.py"
MEMORY_BENCH = "bench_memory_tier.py"
READ_ONCE_BENCH = "bench_read_once.py"
PARITY_MEMORY_BENCH = "bench_parity_memory.py"
TIER_CPU_BENCH = "bench_tier_cpu.py"
TORCHRUN_BENCHES = (IO_BENCH, ASYNC_BENCH, MEMORY_BENCH, PARITY_MEMORY_BENCH, TIER_CPU_BENCH, READ_ONCE_BENCH)  # run under torchrun, in this order
S3_BENCH = "bench_s3.py"  # a plain script that also takes --reps
VARIANTS = {"bench_reshard.py": [[], ["--moe"]], "bench_reshard_spread.py": [[], ["--command", "dcp"]]}  # scripts run more than once, with these extra arguments
SCRATCH_PREFIXES = ("bench_io-scratch-", "bench_async-scratch-", "bench_s3-scratch-", "bench_modelspace-scratch-", "bench_torchtitan-scratch-",
                    "bench_deepspeed-scratch-", "bench_reshard-scratch-", "bench_hf_export-scratch-",
                    "bench_memory_tier-scratch-", "bench_parity_memory-scratch-", "bench_tier_cpu-scratch-", "bench_read_once-scratch-", "bench_reshard_spread-scratch-",
                    "bench_fp32_consolidate-scratch-", "bench_megatron_import-scratch-",
                    "bench_megatron_dp_import-scratch-", "bench_megatron_legacy_import-scratch-")


def other_benchmarks() -> list[str]:
    """bench_*.py in this directory, except the torchrun ones, that declare a module-level main()."""
    out = []
    for path in sorted(glob.glob(os.path.join(HERE, "bench_*.py"))):
        if os.path.basename(path) in TORCHRUN_BENCHES:
            continue
        with open(path, encoding="utf-8") as f:
            if re.search(r"^def main\(", f.read(), re.MULTILINE):
                out.append(path)
    return out


def run(name: str, cmd: list[str]) -> tuple[str, int, float]:
    print(f"\n### {name}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(cmd)
    except OSError as exc:
        print(f"### {name}: could not start: {exc}", flush=True)
        return name, 127, time.perf_counter() - t0
    try:
        rc = proc.wait()
    except KeyboardInterrupt:  # the child got the same SIGINT: let it clean up, then stop
        rc = proc.wait()
        raise
    return name, rc, time.perf_counter() - t0


def run_selected(args: argparse.Namespace, out: str, wanted: Callable[[str], bool], results: list) -> None:
    common = (["--quick"] if args.quick else []) + ["--out", out]
    torchrun = [*torchrun_command(), "--standalone", f"--nproc_per_node={args.nproc}"]
    reps = ["--reps", str(args.reps)] if args.reps else []
    dist_args = common + reps
    for bench in TORCHRUN_BENCHES:
        if wanted(bench):
            results.append(run(bench, [*torchrun, os.path.join(HERE, bench), *dist_args]))
    for path in filter(wanted, other_benchmarks()):
        extra = reps if os.path.basename(path) == S3_BENCH else []
        for variant in VARIANTS.get(os.path.basename(path), [[]]):
            name = " ".join([os.path.basename(path), *variant])
            results.append(run(name, [sys.executable, path, *common, *extra, *variant]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--out", default="bench-out", help="scratch and results directory (default ./bench-out)")
    ap.add_argument("--reps", type=int, default=None,
                    help="repetitions per method for bench_io, bench_async, bench_memory_tier and bench_s3 "
                         "(default: their own, 3, 5, 3 and 3)")
    ap.add_argument("--nproc", type=int, default=4, help="ranks for bench_io, bench_async and bench_memory_tier (default 4; bench_memory_tier needs a multiple of 4)")
    ap.add_argument("--only", default="", help="comma-separated benchmark names to run (e.g. bench_io); default all")
    args = ap.parse_args(argv)
    only = {n.strip().removesuffix(".py") for n in args.only.split(",") if n.strip()}

    def wanted(path: str) -> bool:
        return not only or os.path.basename(path).removesuffix(".py") in only

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    results: list[tuple[str, int, float]] = []
    try:
        run_selected(args, out, wanted, results)
    except KeyboardInterrupt:
        print("\n### interrupted", flush=True)
        results.append(("(interrupted)", 130, 0.0))
    finally:
        # A benchmark killed hard (SIGKILL) cannot remove its own scratch checkpoints.
        for prefix in SCRATCH_PREFIXES:
            for leftover in glob.glob(os.path.join(out, prefix + "*")):
                remove_tree(leftover)

    if not results:
        print(f"no benchmark matched --only {args.only!r}")
        return 2
    print("\n### summary")
    for name, rc, secs in results:
        print(f"  {name:24s} {'ok' if rc == 0 else f'FAILED (exit {rc})':18s} {secs:6.1f}s")
    print(f"  results in {out}")
    return 0 if all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
