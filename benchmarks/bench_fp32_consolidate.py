"""Consolidating a ZeRO-3 checkpoint to one fp32 safetensors file: ckptkit's streamed ``export_fp32``
vs DeepSpeed's ``zero_to_fp32``, peak memory and time.

Setup (not timed): ``torchrun`` with 2 gloo processes on the CPU trains a
DeepSpeed ZeRO-3 engine (fp32, torch AdamW) over an MLP sized so the
checkpointed state (fp32 partitions, exp_avg, exp_avg_sq) is >= 2 GiB
(``--quick``: ~20 MiB), one optimizer step, and saves it natively with
``engine.save_checkpoint``; ``import_deepspeed`` then makes the ckptkit
checkpoint of that folder.

Measured, ``--reps`` times each (median; page cache dropped before each run
when /proc/sys/vm/drop_caches is writable), each in its own subprocess with
its peak RSS taken from ``wait4``:

  zero_to_fp32   (baseline) ``deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict``
                 of the native folder to safetensors (what DeepSpeed users run)
  export_fp32    ``ckptkit_converters.deepspeed.export_fp32`` of the ckptkit checkpoint, streamed
                 under ``--max-memory`` (default 256 MiB)

The two files are compared tensor by tensor (they must be equal). Ratios: peak RSS
and wall against the baseline; target: peak RSS bounded by the budget plus the
interpreter, whatever the model size, where the baseline grows with the model.

Run: .venv/bin/python benchmarks/bench_fp32_consolidate.py [--quick] [--max-memory 256MiB] [--reps 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

from bench_reshard import run_child  # noqa: E402
from common import GiB, MiB, drop_page_cache, exit_on_sigterm, median, remove_tree, table, torchrun_command, write_results  # noqa: E402

TAG = "global_step1"
BASELINE = r"""
import sys, warnings
warnings.filterwarnings("ignore")
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
convert_zero_checkpoint_to_fp32_state_dict(sys.argv[1], sys.argv[2], safe_serialization=True, max_shard_size="1000GB")
"""
OURS = r"""
import sys
from ckptkit_converters.deepspeed import export_fp32
export_fp32(sys.argv[1], sys.argv[2], max_memory=int(sys.argv[3]))
"""


def save_phase(args: argparse.Namespace) -> None:
    """Under torchrun: one ZeRO-3 optimizer step, then DeepSpeed's own save."""
    import torch

    from bench_deepspeed import mlp, setup_deepspeed

    warnings.filterwarnings("ignore")
    deepspeed = setup_deepspeed()
    width, depth = (512, 4) if args.quick else (4096, 11)
    model = mlp(width, depth)
    world = torch.distributed.get_world_size()
    cfg = {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 9,
           "zero_optimization": {"stage": 3, "memory_efficient_linear": False}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters(),
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randn(2, width, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(args.native, tag=TAG)


def measured_run(code: str, *argv: str) -> tuple[float, int]:
    """``python -c code argv`` in a subprocess: (wall seconds, its own peak RSS), measured one process
    removed (bench_reshard.run_child: Linux carries ru_maxrss across exec, and this process holds torch
    and has imported the checkpoint, so a direct child would report our peak instead of its own)."""
    wall, rss, _ = run_child([sys.executable, "-c", code, *argv])
    return wall, rss


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~20 MiB instead of >= 2 GiB (smoke test)")
    ap.add_argument("--max-memory", default="256MiB", help="export_fp32's budget")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--phase", default="main", choices=["main", "save"], help=argparse.SUPPRESS)
    ap.add_argument("--native", default="", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    import torch
    from safetensors import safe_open

    from ckptkit_converters.deepspeed import import_deepspeed

    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="bench_fp32_consolidate-scratch-", dir=args.out)
    budget = parse_size(args.max_memory)
    try:
        native, ours = os.path.join(scratch, "native"), os.path.join(scratch, "ckptkit")
        cmd = [*torchrun_command(), "--nproc_per_node=2", "--standalone", os.path.abspath(__file__), "--phase", "save", "--native", native, *(["--quick"] if args.quick else [])]
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
        stored = sum(os.path.getsize(p) for p in glob.glob(os.path.join(native, TAG, "*")))
        import_deepspeed(native, ours)
        print(f"ZeRO-3 checkpoint (dp 2, fp32, AdamW): {stored / GiB:.2f} GiB native; budget {budget / MiB:.0f} MiB",
              flush=True)
        times: dict[str, list[float]] = {"zero_to_fp32": [], "export_fp32": []}
        rss: dict[str, list[int]] = {"zero_to_fp32": [], "export_fp32": []}
        cold = True
        for rep in range(args.reps):
            for name in times:
                cold &= drop_page_cache()
                if name == "zero_to_fp32":
                    out_dir = os.path.join(scratch, f"theirs-{rep}")
                    wall, peak = measured_run(BASELINE, native, out_dir)
                else:
                    wall, peak = measured_run(OURS, ours, os.path.join(scratch, f"ours-{rep}.safetensors"), str(budget))
                times[name].append(wall)
                rss[name].append(peak)
                print(f"  rep {rep} {name}: {wall:.2f}s, peak RSS {peak / MiB:.0f} MiB", flush=True)
        theirs_file = glob.glob(os.path.join(scratch, "theirs-0", "*.safetensors"))[0]
        with safe_open(theirs_file, "pt") as a, safe_open(os.path.join(scratch, "ours-0.safetensors"), "pt") as b:
            assert set(a.keys()) == set(b.keys()), "the two files hold different tensors"
            for k in a.keys():
                if not torch.equal(a.get_tensor(k), b.get_tensor(k)):
                    raise RuntimeError(f"{k} differs between zero_to_fp32 and export_fp32")
            fp32_bytes = sum(_numel(a.get_slice(k).get_shape()) for k in a.keys()) * 4
        base_t, base_rss = median(times["zero_to_fp32"]), max(rss["zero_to_fp32"])
        ours_t, ours_rss = median(times["export_fp32"]), max(rss["export_fp32"])
        rows = [["zero_to_fp32 (baseline)", f"{base_t:.2f}", "1.00", f"{base_rss / MiB:.0f} MiB", "1.00"],
                [f"export_fp32 --max-memory {args.max_memory}", f"{ours_t:.2f}", f"{ours_t / base_t:.2f}",
                 f"{ours_rss / MiB:.0f} MiB", f"{ours_rss / base_rss:.2f}"]]
        print(f"\npage cache: {'dropped before every run' if cold else 'warm (drop_caches not writable)'}; "
              f"reps {args.reps}; the two files are equal, tensor for tensor ({fp32_bytes / GiB:.2f} GiB of fp32)")
        print(table(["method", "seconds", "x baseline", "peak RSS", "x baseline"], rows))
        write_results(args.out, "bench_fp32_consolidate", {
            "quick": args.quick, "native_bytes": stored, "fp32_bytes": fp32_bytes, "budget": budget,
            "cold_cache": cold, "reps": args.reps, "zero_to_fp32_seconds": base_t, "export_fp32_seconds": ours_t,
            "zero_to_fp32_peak_rss": base_rss, "export_fp32_peak_rss": ours_rss,
            "rss_ratio": ours_rss / base_rss, "wall_ratio": ours_t / base_t,
        })
        return 0
    finally:
        remove_tree(scratch)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    if args.phase == "save":
        save_phase(args)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
