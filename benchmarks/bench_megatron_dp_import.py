"""Import of Megatron's default distributed-optimizer form, ``dp_reshardable``, vs raw I/O and vs the model-space form.

The ``dp_reshardable`` import places every weight's state by walking the buckets (docs/megatron.md): it reads the
weights and the main copies twice, once to place and once to write. This measures what that costs against the
two baselines that bound it, on the same training state written both ways.

Setup (not timed): tests/dp_reshardable_sim.py writes a bf16 GPT at tp2 dp2 (the same layout rules as
megatron-core 0.16's distributed optimizer: 64-element alignment, each DP rank's slice of every parameter a
chunk, bucket end padded to lcm(dp, 128)) as a Megatron ``torch_dist`` folder twice: with its optimizer in
``dp_reshardable`` buckets and in the ``fully_reshardable`` model-space form (what the import writes anyway).
>= 2 GiB each by default (``--quick``: ~0.15 GiB). (Megatron's own saves of both forms are compared bit for bit
in tests/test_megatron.py; a real Megatron save of this size needs a real model on 4 CPU processes.)

Measured, ``--reps`` times each (median; page cache dropped before each run where possible), each in its own
subprocess with its peak RSS from ``wait4``:

  raw copy   (baseline) read every file of the folder and write it elsewhere, fsync'd
  convert    ``ckptkit convert SRC DST`` of the ``dp_reshardable`` folder, then of the ``fully_reshardable`` one

Ratios: each import's wall / its raw copy's, the dp_reshardable import's / the fully_reshardable import's, and
peak RSS against the largest fp32 tensor. After the first run each import is checked against what was written
(every tensor, bit for bit).

Run: .venv/bin/python benchmarks/bench_megatron_dp_import.py [--quick] [--reps 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

from bench_reshard import against_raw_copy  # noqa: E402
from common import (GiB, MiB, command_vs_raw_rows, median, quick_reps_out_args, remove_tree,  # noqa: E402
                    run_main, spread, table, tree_bytes, write_results)

FORMS = ("dp_reshardable", "fully_reshardable")


def build(folder: str, form: str, quick: bool):
    import torch

    from tests import dp_reshardable_sim as sim

    spec = dict(hidden=256, ffn=704, layers=4, vocab=8192) if quick else dict(hidden=1024, ffn=2816, layers=8,
                                                                               vocab=32000)
    s = sim.Sim(tp=2, dp=2, dtype=torch.bfloat16, divisible_by=128, form=form, **spec)
    sim.write(s, Path(folder))
    return s


def check(s, dst: str) -> None:
    """Every tensor of the import equal to what was written."""
    import torch

    import ckptkit
    from tests import dp_reshardable_sim as sim

    view = ckptkit.open(dst)
    want = sim.expected(s)
    if set(view.keys()) != set(want):
        raise AssertionError(f"imported keys differ: {sorted(set(view.keys()) ^ set(want))[:4]}")
    for key, value in want.items():
        if not torch.equal(view[key].read(), value):
            raise AssertionError(f"{key} differs from what was written")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return quick_reps_out_args(__doc__, "a ~0.15 GiB checkpoint instead of >= 2 GiB", argv)


def run(args: argparse.Namespace) -> int:
    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="bench_megatron_dp_import-scratch-", dir=args.out)
    try:
        results, rows = {}, []
        for form in FORMS:
            src = os.path.join(scratch, form)
            t0 = time.perf_counter()
            s = build(src, form, args.quick)
            total, files = tree_bytes(src)
            print(f"{form} source (bf16 GPT, tp2 dp2): {total / GiB:.2f} GiB in {files} files "
                  f"(written in {time.perf_counter() - t0:.1f}s)", flush=True)
            raw_t, cv_t, cv_rss, cv_inner, cold = against_raw_copy(
                src, scratch, args.reps, "convert", lambda dst: ["convert", src, dst], lambda dst: check(s, dst))
            largest = max(s.padded_vocab * s.hidden, s.layers * 2 * s.ffn * s.hidden) * 4
            results[form] = {"bytes": total, "raw_seconds": median(raw_t), "convert_seconds": median(cv_t),
                             "convert_inner_seconds": median(cv_inner), "wall_ratio": median(cv_t) / median(raw_t),
                             "peak_rss": max(cv_rss), "largest_tensor": largest, "cold_cache": cold,
                             "spread": spread(cv_t)}
            rows += command_vs_raw_rows(f"raw copy, {form} folder (baseline)", raw_t, f"ckptkit convert ({form})",
                                        cv_t, cv_inner, total, cv_rss)
            remove_tree(src)
        print(f"\npage cache: {'dropped before every run' if results[FORMS[0]]['cold_cache'] else 'warm'}; "
              f"reps {args.reps}")
        print(table(["method", "seconds", "MiB/s", "x raw", "peak RSS"], rows))
        dp, full = results["dp_reshardable"], results["fully_reshardable"]
        ratio = dp["convert_seconds"] / full["convert_seconds"]
        print(f"\ndp_reshardable import vs raw I/O: {dp['wall_ratio']:.2f}x; vs the fully_reshardable import of the "
              f"same state: {ratio:.2f}x; peak RSS {dp['peak_rss'] / MiB:.0f} MiB "
              f"({dp['peak_rss'] / dp['largest_tensor']:.2f}x the largest fp32 tensor) vs {full['peak_rss'] / MiB:.0f} MiB")
        write_results(args.out, "bench_megatron_dp_import", {
            "quick": args.quick, "reps": args.reps, **{f"{form}_{k}": v for form, r in results.items()
                                                       for k, v in r.items()},
            "dp_vs_fully": dp["convert_seconds"] / full["convert_seconds"]})
        return 0
    finally:
        remove_tree(scratch)


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
