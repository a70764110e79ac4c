"""Importing a Megatron ``torch_dist`` checkpoint with its distributed-optimizer state vs raw I/O of the same bytes.

Setup (not timed): Megatron-core's own ``dist_checkpointing.save`` on tp2·pp2 gloo processes
(benchmarks/megatron_reshard_worker.py) writes a GPT's bf16 weights and its optimizer state as the
distributed optimizer's ``fully_reshardable`` form stores it (``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``,
fp32, sharded like the parameter), plus the non-sharded items Megatron-LM adds to ``common.pt``
(iteration, ``args``, ``opt_param_scheduler``, the param groups with Adam's step): >= 2 GiB by default
(``--quick``: ~0.1 GiB).

Measured, ``--reps`` times each (median; page cache dropped before each run when
/proc/sys/vm/drop_caches is writable), each in its own subprocess with its peak RSS from ``wait4``:

  raw copy   (baseline) read every file of the Megatron folder and write it elsewhere, fsync'd
  convert    ``ckptkit convert SRC DST``: the import (every DCP chunk becomes a piece of the
             virtual rank whose file held it, vocabulary padding apart, the optimizer record written)

Ratios: convert wall / raw wall, and peak RSS against the largest tensor. After the first run the
import is checked against the source (three tensors, bit for bit, read back through ckptkit and DCP)
and its optimizer record against the saved step.

Not measured yet: the export back to torch_dist *with* optimizer state (ckptkit's Megatron export
writes weights only; issue 29).

Run: .venv/bin/python benchmarks/bench_megatron_import.py [--quick] [--reps 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

from bench_reshard import against_raw_copy, run_ranks  # noqa: E402
from common import (  # noqa: E402
    GiB,
    MiB,
    command_vs_raw_rows,
    exit_on_sigterm,
    median,
    remove_tree,
    spread,
    table,
    tree_bytes,
    write_results,
)

CHECKED = ("embedding.word_embeddings.weight", "decoder.layers.mlp.linear_fc1.weight", "output_layer.weight")


def build_source(folder: str, quick: bool) -> dict:
    """Megatron's own save of the model and its fully_reshardable optimizer state at tp2pp2."""
    spec = {"hidden": 256, "ffn": 704, "layers": 4, "vocab": 8192} if quick else \
        {"hidden": 1024, "ffn": 2816, "layers": 8, "vocab": 32000}
    spec.update(tp=2, pp=2, dp=1, main_state="param", megatron_lm_common=True)
    os.makedirs(folder)
    run_ranks(4, ["save", json.dumps(spec), folder], 29500 + os.getpid() % 1000)
    return spec


def check_import(src: str, dst: str) -> None:
    """Three tensors of each state equal to DCP's own read of the source, and the step recorded."""
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptkit

    view = ckptkit.open(dst)
    names = {"": "model/", "optimizer.state.param.": "optimizer/main/",
             "optimizer.state.exp_avg_sq.": "optimizer/exp_avg_sq/"}
    for key in CHECKED:
        for theirs, ours in names.items():
            got = view[ours + key].read()
            want = {theirs + key: torch.empty(got.shape, dtype=got.dtype)}
            dcp.load(want, checkpoint_id=src, no_dist=True)
            if not torch.equal(got, want[theirs + key]):
                raise AssertionError(f"{ours + key} differs from the Megatron checkpoint's {theirs + key}")
    meta = json.loads(view.values["megatron/meta"])
    if meta["optimizer"]["scalars"]["step"]["value"] != 1000.0 or meta["iteration"] != 1000:
        raise AssertionError(f"optimizer record {meta['optimizer']}, iteration {meta['iteration']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a ~0.1 GiB checkpoint instead of >= 2 GiB")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--out", default="bench-out")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="bench_megatron_import-scratch-", dir=args.out)
    try:
        src = os.path.join(scratch, "megatron")
        t0 = time.perf_counter()
        spec = build_source(src, args.quick)
        total, files = tree_bytes(src)
        print(f"Megatron torch_dist source (tp2pp2, fully_reshardable optimizer): {total / GiB:.2f} GiB in {files} "
              f"files (saved by Megatron in {time.perf_counter() - t0:.1f}s)", flush=True)
        raw_t, cv_t, cv_rss, cv_inner, cold = against_raw_copy(
            src, scratch, args.reps, "convert", lambda dst: ["convert", src, dst], lambda dst: check_import(src, dst))
        h, ffn = spec["hidden"], spec["ffn"]
        largest = max(spec["vocab"] * h, 2 * ffn * h * spec["layers"]) * 4  # an fp32 state of the largest tensor
        print(f"\npage cache: {'dropped before every run' if cold else 'warm (drop_caches not writable)'}; "
              f"reps {args.reps}, spread raw {spread(raw_t):.2f} convert {spread(cv_t):.2f}")
        print(table(["method", "seconds", "MiB/s", "x raw", "peak RSS"],
                    command_vs_raw_rows("raw copy (baseline)", raw_t, "ckptkit convert (import)", cv_t, cv_inner,
                                        total, cv_rss)))
        print(f"\nimport wall vs raw I/O: {median(cv_t) / median(raw_t):.2f}x; peak RSS {max(cv_rss) / MiB:.0f} MiB "
              f"({max(cv_rss) / largest:.2f}x the largest fp32 tensor, {largest / MiB:.0f} MiB)")
        write_results(args.out, "bench_megatron_import", {
            "quick": args.quick, "bytes": total, "files": files, "cold_cache": cold, "reps": args.reps,
            "raw_seconds": median(raw_t), "convert_seconds": median(cv_t), "convert_inner_seconds": median(cv_inner),
            "wall_ratio": median(cv_t) / median(raw_t), "peak_rss": max(cv_rss), "largest_tensor": largest,
        })
        return 0
    finally:
        remove_tree(scratch)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
