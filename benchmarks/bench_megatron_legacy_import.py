"""Import of a legacy Megatron checkpoint with its optimizer, vs raw I/O and vs the weights alone.

The legacy import places the optimizer's numbered state by parameter and checks every placement against the
weights (docs/megatron.md, "Legacy checkpoints"): it reads the weights and the main copies once to check and
once more to write. This measures what that costs against the two baselines that bound it, on real
megatron-core saves.

Setup (not timed): benchmarks/megatron_legacy_worker.py on 4 gloo processes builds a bf16 GPT at tp2pp2 with
megatron-core 0.16 (tests/megatron_model.py at benchmark sizes), trains one step and saves it as Megatron-LM's
legacy layout does (tests/megatron_convert_job.py ``legacy_save``): once with the mixed-precision optimizer (its state in the
rank files) and once with the distributed optimizer (its state in ``distrib_optim.pt``). ~0.6 GiB each by
default (``--quick``: ~0.05 GiB).

Measured, ``--reps`` times each (median; page cache dropped before each run where possible), each in its own
subprocess with its peak RSS from ``wait4``:

  raw copy      (baseline) read every file of the folder and write it elsewhere, fsync'd
  convert       ``ckptkit convert SRC DST``: weights, moments, main copies, step, placed and checked
  weights only  ``ckptkit convert SRC DST --opt weights_only=true`` (baseline): the weights alone

Ratios: each import's wall / its raw copy's, and the full import's / the weights-only one's. After the first run
each import is checked: every main copy cast to bf16 equals its weight, every moment was trained (non-zero), the
step is 1; the weights-only import holds no optimizer tensor.

Run: .venv/bin/python benchmarks/bench_megatron_legacy_import.py [--quick] [--reps 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

from bench_reshard import against_raw_copy  # noqa: E402
from common import (GiB, command_vs_raw_rows, median, quick_reps_out_args, remove_tree,  # noqa: E402
                    run_main, spread, table, tree_bytes, write_results)

FORMS = ("mixed", "distributed")
VOCAB = "250"  # tests/megatron_model.py's vocabulary (its args record the padded size only)


def build(folder: str, form: str, quick: bool) -> None:
    """A real Megatron legacy save of ``form`` at ``folder`` (4 gloo processes through torch.distributed.run)."""
    hidden, ffn = (256, 704) if quick else (1024, 2816)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "--standalone",
           os.path.join(HERE, "megatron_legacy_worker.py"),
           folder, form, str(hidden), str(ffn)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the legacy save failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def check(dst: str, weights_only: bool) -> None:
    import torch

    import ckptkit

    view = ckptkit.open(dst)
    opt = [k for k in view.keys() if k.startswith("optimizer/")]
    if weights_only:
        if opt:
            raise AssertionError(f"a weights-only import holds {opt[:3]}")
        return
    meta = json.loads(view.values["megatron/meta"])
    if meta["optimizer"]["scalars"]["step"]["value"] != 1.0:
        raise AssertionError(f"optimizer record {meta['optimizer']}")
    for key in [k for k in view.keys() if k.startswith("model/") and not k.endswith(".vocab_padding")]:
        name = key[len("model/"):]
        weight, main = view[key].read(), view[f"optimizer/main/{name}"].read()
        if not torch.equal(main.to(weight.dtype), weight):
            raise AssertionError(f"{name}: the main copy is not the weight")
        if not view[f"optimizer/exp_avg_sq/{name}"].read().any():
            raise AssertionError(f"{name}: an untrained second moment")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return quick_reps_out_args(__doc__, "a ~0.05 GiB checkpoint instead of ~0.6 GiB", argv)


def run(args: argparse.Namespace) -> int:
    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="bench_megatron_legacy_import-scratch-", dir=args.out)
    results: dict = {"quick": args.quick, "reps": args.reps}
    try:
        for form in FORMS:
            src = os.path.join(scratch, f"legacy-{form}")
            t0 = time.perf_counter()
            build(src, form, args.quick)
            total, files = tree_bytes(src)
            print(f"\nMegatron legacy save, {form} optimizer (tp2pp2, bf16): {total / GiB:.2f} GiB in {files} files "
                  f"(trained and saved by megatron-core in {time.perf_counter() - t0:.1f}s)", flush=True)
            raw_t, cv_t, cv_rss, cv_in, cold = against_raw_copy(
                src, scratch, args.reps, "convert", lambda dst: ["convert", src, dst, "--vocab-size", VOCAB],
                lambda dst: check(dst, False))
            raw_w, wo_t, wo_rss, wo_in, _ = against_raw_copy(
                src, scratch, args.reps, "weights-only",
                lambda dst: ["convert", src, dst, "--vocab-size", VOCAB, "--opt", "weights_only=true"],
                lambda dst: check(dst, True))
            print(f"page cache: {'dropped before every run' if cold else 'warm (drop_caches not writable)'}; "
                  f"spread raw {spread(raw_t):.2f} convert {spread(cv_t):.2f} weights-only {spread(wo_t):.2f}")
            print(table(["method", "seconds", "MiB/s", "x raw", "peak RSS"],
                        command_vs_raw_rows("raw copy (baseline)", raw_t, "ckptkit convert (with optimizer)", cv_t,
                                            cv_in, total, cv_rss)
                        + command_vs_raw_rows("raw copy (baseline)", raw_w, "ckptkit convert weights_only", wo_t,
                                              wo_in, total, wo_rss)[1:]))
            ratio = median(cv_t) / median(wo_t)
            print(f"{form}: import with optimizer {median(cv_t) / median(raw_t):.2f}x raw I/O, "
                  f"{ratio:.2f}x the weights-only import (which writes {1 / 7:.0%} of the bytes or so)")
            results[form] = {"bytes": total, "files": files, "raw_seconds": median(raw_t),
                             "convert_seconds": median(cv_t), "convert_inner_seconds": median(cv_in),
                             "weights_only_seconds": median(wo_t), "wall_ratio": median(cv_t) / median(raw_t),
                             "vs_weights_only": ratio, "peak_rss": max(cv_rss), "cold_cache": cold}
            remove_tree(src)
        write_results(args.out, "bench_megatron_legacy_import", results)
        return 0
    finally:
        remove_tree(scratch)


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
