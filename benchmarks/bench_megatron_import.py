"""A Megatron ``torch_dist`` checkpoint with its distributed-optimizer state, imported and exported back, vs raw I/O.

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

  raw copy   (baseline) the same for the ckptkit checkpoint the import wrote (kept, untimed, as the
             export's source)
  export     ``ckptkit convert IMPORTED OUT --format megatron --to tp4pp1``: weights and the optimizer
             state in the distributed optimizer's ``fully_reshardable`` form, at a new layout
  export --max-memory 8MiB
             the same export with every target chunk over 8 MiB written as slabs (the largest is 31 MiB) (checked the same way)
  megatron   (baseline) Megatron-core's own change of layout: ``dist_checkpointing.load`` of the source
             at tp4pp1 (model and optimizer state) and ``save`` there, on 4 gloo processes
             (benchmarks/megatron_reshard_worker.py); peak RSS is the sum over its processes

Ratios: each command's wall / its raw copy's, the export's / Megatron's, and peak RSS against the largest
tensor. After the first run the import is checked against the source (three tensors, bit for bit, read
back through ckptkit and DCP) and its optimizer record against the saved step; the export likewise
(the same tensors through DCP's own read of both torch_dist folders, and the step in its param groups).

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

from bench_reshard import against_raw_copy, run_child, run_ranks  # noqa: E402
from common import (GiB, MiB, command_vs_raw_rows, median, quick_reps_out_args, remove_tree,  # noqa: E402
                    run_main, spread, table, tree_bytes, write_results)

TARGET = {"tp": 4, "pp": 1, "dp": 1}
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


def check_export(src: str, out: str) -> None:
    """Three tensors of each state equal between the source and the export (the export's vocabulary rows past
    the source's are the new tp's padding), and the step in the export's param groups."""
    import torch
    import torch.distributed.checkpoint as dcp

    for key in CHECKED:
        for prefix in ("", "optimizer.state.param.", "optimizer.state.exp_avg_sq."):
            shapes = {}
            for folder in (src, out):
                meta = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata[prefix + key]
                shapes[folder] = {prefix + key: torch.empty(meta.size, dtype=meta.properties.dtype)}
                dcp.load(shapes[folder], checkpoint_id=folder, no_dist=True)
            a, b = shapes[src][prefix + key], shapes[out][prefix + key]
            if not torch.equal(a, b[:a.shape[0]]) or b[a.shape[0]:].any():
                raise AssertionError(f"export's {prefix + key} differs from the Megatron source's")
    common = torch.load(os.path.join(out, "common.pt"), weights_only=True)
    if {g["step"] for g in common["optimizer"]["optimizer"]["param_groups"]} != {1000.0}:
        raise AssertionError(f"export's param groups {common['optimizer']}")


def megatron_relayout(src: str, scratch: str, spec: dict, reps: int) -> tuple[list[float], list[int]]:
    """Megatron's own load at tp4pp1 + save there, ``reps`` times: walls and summed peak RSS."""
    walls, rss = [], []
    for rep in range(reps):
        dst = os.path.join(scratch, f"megatron-{rep}")
        os.makedirs(dst)
        wall, peaks, _ = run_ranks(4, ["reshard", json.dumps({**spec, **TARGET}), src, dst],
                                   29500 + (os.getpid() + rep + 1) % 1000)
        walls.append(wall)
        rss.append(sum(peaks))
        print(f"  rep {rep} megatron load+save: {wall:.2f}s, RSS sum {rss[-1] / MiB:.0f} MiB", flush=True)
        remove_tree(dst)
    return walls, rss


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return quick_reps_out_args(__doc__, "a ~0.1 GiB checkpoint instead of >= 2 GiB", argv)


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
        export = run_export(src, scratch, spec, args.reps, largest)
        write_results(args.out, "bench_megatron_import", {
            "quick": args.quick, "bytes": total, "files": files, "cold_cache": cold, "reps": args.reps,
            "raw_seconds": median(raw_t), "convert_seconds": median(cv_t), "convert_inner_seconds": median(cv_inner),
            "wall_ratio": median(cv_t) / median(raw_t), "peak_rss": max(cv_rss), "largest_tensor": largest, **export,
        })
        return 0
    finally:
        remove_tree(scratch)


def run_export(src: str, scratch: str, spec: dict, reps: int, largest: int) -> dict:
    """The way back: export the import to torch_dist at tp4pp1 with its optimizer, against a raw copy of the
    import and against Megatron's own load + save at tp4pp1."""
    imported = os.path.join(scratch, "imported")
    run_child([sys.executable, "-m", "ckptkit.cli.main", "convert", src, imported])
    total, files = tree_bytes(imported)
    print(f"\nexport source (the import): {total / GiB:.2f} GiB in {files} files; target tp4pp1", flush=True)
    raw_t, ex_t, ex_rss, ex_inner, _ = against_raw_copy(
        imported, scratch, reps, "export",
        lambda dst: ["convert", imported, dst, "--format", "megatron", "--to", "tp4pp1"],
        lambda dst: check_export(src, dst))
    raw_b, ex_b, ex_b_rss, ex_b_inner, _ = against_raw_copy(
        imported, scratch, reps, "export-budget",
        lambda dst: ["convert", imported, dst, "--format", "megatron", "--to", "tp4pp1", "--max-memory", "8MiB"],
        lambda dst: check_export(src, dst))
    mg_t, mg_rss = megatron_relayout(src, scratch, spec, reps)
    print(table(["method", "seconds", "MiB/s", "x raw", "peak RSS"],
                command_vs_raw_rows("raw copy of the import (baseline)", raw_b, "export --max-memory 8MiB",
                                    ex_b, ex_b_inner, total, ex_b_rss)))
    print(f"under --max-memory 8MiB: wall {median(ex_b) / median(raw_b):.2f}x raw, peak RSS "
          f"{max(ex_b_rss) / MiB:.0f} MiB vs {max(ex_rss) / MiB:.0f} MiB with whole chunks")
    print(table(["method", "seconds", "MiB/s", "x raw", "peak RSS"],
                command_vs_raw_rows("raw copy of the import (baseline)", raw_t, "ckptkit export (--format megatron)",
                                    ex_t, ex_inner, total, ex_rss)
                + [["Megatron load+save at tp4pp1 (baseline)", f"{median(mg_t):.2f}", f"{total / MiB / median(mg_t):.0f}",
                    f"{median(mg_t) / median(raw_t):.2f}", f"{max(mg_rss) / MiB:.0f} MiB (sum)"]]))
    print(f"\nexport wall vs raw I/O: {median(ex_t) / median(raw_t):.2f}x; vs Megatron's own load+save: "
          f"{median(ex_t) / median(mg_t):.2f}x; peak RSS {max(ex_rss) / MiB:.0f} MiB "
          f"({max(ex_rss) / largest:.2f}x the largest fp32 tensor) vs Megatron's {max(mg_rss) / MiB:.0f} MiB")
    remove_tree(imported)
    return {"export_bytes": total, "export_raw_seconds": median(raw_t), "export_seconds": median(ex_t),
            "export_inner_seconds": median(ex_inner), "export_wall_ratio": median(ex_t) / median(raw_t),
            "export_peak_rss": max(ex_rss), "megatron_seconds": median(mg_t), "megatron_peak_rss_sum": max(mg_rss),
            "export_vs_megatron": median(ex_t) / median(mg_t), "budget_export_seconds": median(ex_b),
            "budget_export_wall_ratio": median(ex_b) / median(raw_b), "budget_export_peak_rss": max(ex_b_rss)}


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
