"""Model-space access: a lazy slice vs loading everything; zarr export vs raw writes of the same bytes.

One process. The state is a GPT's training state (benchmarks/gpt_shapes.py):
bf16 parameters plus two fp32 Adam moments each, >= 1 GiB by default
(``--quick``: ~70 MiB). It is saved as a multi-rank job would lay it out:
every tensor split along dim 0 into ``--shards`` (default 8) pieces, each its
own local tensor (``ckptkit.Sharded`` box pieces), written with the default
4 MiB checksum blocks. Then, on the same disk, ``--reps`` times each (median
reported; the page cache dropped before every read when
/proc/sys/vm/drop_caches is writable, else warm; the report says which):

  full load    (baseline of the slice) ckptkit.load of every tensor into
               preallocated full-size tensors: what reading one tensor costs
               without a lazy view
  slice rows   ckptkit.open(path)[largest][n/16 : n/16 + n/8] — one 1/8 slice
               along dim 0 of the largest tensor, straddling two stored
               pieces; time includes opening the view (manifest, one index)
  slice cols   the same tensor's first 1/8 of columns: row-major pieces make
               this read (nearly) the whole tensor — shown for honesty
  zarr slice   the row slice read from the zarr export with tensorstore
  raw write    (baseline of the export) every tensor's bytes from memory,
               ndarray.tofile into one file per tensor, each fsynced, then the
               directory
  zarr export  ckptkit_converters.zarr.convert.export_zarr (default options: tensorstore,
               sharding codec, CRC32C per chunk, file_io_sync) — reads the
               checkpoint through the lazy view *and* writes the group
  zarr import  ckptkit_converters.zarr.convert.import_zarr back to a committed checkpoint

Bytes read are what ckptkit fetched from storage (checksum-block widening
included). Ratios: time / baseline time (< 1: faster); throughput in MiB/s of
the logical tensor bytes. Every result is checked (torch.equal) once.

Run: .venv/bin/python benchmarks/bench_modelspace.py [--quick] [--reps 3] [--out DIR]
(or benchmarks/run_all.py, which runs it as a plain single-process script).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import ckptkit  # noqa: E402
from ckptkit_converters.zarr.convert import export_zarr, import_zarr  # noqa: E402
from common import run_main, GiB, MiB, drop_page_cache, fsync_dir, median, remove_tree, spread, table, tree_bytes  # noqa: E402
from gpt_shapes import ModelConfig, param_shapes  # noqa: E402

FULL = ModelConfig(hidden=1024, ffn=2816, layers=8, vocab=32000)  # 1.26 GiB with two fp32 moments
QUICK = ModelConfig(hidden=384, ffn=1024, layers=2, vocab=10000)  # ~70 MiB
SCRATCH_PREFIX = "bench_modelspace-scratch-"


def build_state(cfg: ModelConfig, shards: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(state to save: every tensor as ``shards`` row pieces, {key: full tensor})."""
    gen = torch.Generator().manual_seed(1234)
    full: dict[str, torch.Tensor] = {}
    for name, shape in param_shapes(cfg):
        full[f"model/{name}"] = torch.randn(shape, generator=gen).to(torch.bfloat16)
        full[f"optim/exp_avg/{name}"] = torch.randn(shape, generator=gen).mul_(1e-3)
        full[f"optim/exp_avg_sq/{name}"] = torch.rand(shape, generator=gen).mul_(1e-6)
    holders = []  # one local tensor per piece, as the ranks of a job would hold them
    for key, t in full.items():
        for local in torch.tensor_split(t, min(shards, t.shape[0])):
            lo = sum(h.local.shape[0] for h in holders if h.pieces[0].tensor == key)
            offsets = (lo, *([0] * (t.dim() - 1)))
            holders.append(ckptkit.Sharded(local, [ckptkit.box_piece(key, tuple(t.shape), offsets, tuple(local.shape))]))
    return {"pieces": holders}, full


def full_targets(full: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Zeroed, faulted-in full-size tensors at the checkpoint's keys (nested as the keys say)."""
    out: dict[str, Any] = {}
    for key, t in full.items():
        node = out
        *parents, leaf = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = torch.zeros_like(t)
    return out


def flatten(nested: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in nested.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def raw_write(full: dict[str, torch.Tensor], d: str) -> None:
    os.makedirs(d)
    for i, t in enumerate(full.values()):
        with open(os.path.join(d, f"t{i:05d}.bin"), "wb") as f:
            t.reshape(-1).view(torch.uint8).numpy().tofile(f)
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(d)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run(args: argparse.Namespace) -> int:
    cfg = QUICK if args.quick else FULL
    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=args.out)
    results: dict[str, dict[str, Any]] = {}
    ok = True
    try:
        state, full = build_state(cfg, args.shards)
        total = sum(t.nbytes for t in full.values())
        key = max(full, key=lambda k: full[k].nbytes)
        big = full[key]
        n = big.shape[0]
        lo, hi = n // 16, n // 16 + n // 8
        cols = big.shape[1] // 8
        ckpt = os.path.join(scratch, "ckpt")
        say(f"bench_modelspace: {len(full)} tensors, {total / GiB:.3f} GiB; each in {args.shards} row pieces; "
            f"largest {key} {list(big.shape)} {str(big.dtype).removeprefix('torch.')} ({big.nbytes / MiB:.1f} MiB)")
        t_save, _ = timed(lambda: ckptkit.save(state, ckpt))
        say(f"  saved in {t_save:.2f}s")
        cold = drop_page_cache() if not args.no_drop_caches else False
        say(f"  reads are {'COLD' if cold else 'WARM'}")

        def settle() -> None:
            if cold:
                drop_page_cache()
            else:
                os.sync()

        def record(name: str, seconds: float, nbytes: int | None = None, **extra: Any) -> None:
            r = results.setdefault(name, {"s": [], "bytes_read": None, **extra})
            r["s"].append(seconds)
            if nbytes is not None:
                r["bytes_read"] = nbytes

        zarr_dir = os.path.join(scratch, "export.zarr")
        for rep in range(args.reps):
            dest = full_targets(full)  # allocated and faulted in outside the timing
            settle()
            t, res = timed(lambda dest=dest: ckptkit.load(dest, ckpt))
            record("full load", t, res.bytes_read)
            if rep == 0:
                loaded = flatten(dest)
                ok &= all(torch.equal(loaded[k], full[k]) for k in full)
            dest = loaded = None  # free before the next measurement
            for name, index, want in (("slice rows", (slice(lo, hi),), big[lo:hi]),
                                      ("slice cols", (slice(None), slice(0, cols)), big[:, :cols])):
                settle()

                def read_slice(index: tuple = index) -> tuple[torch.Tensor, Any]:
                    view = ckptkit.open(ckpt)
                    return view[key][index], view

                t, (got_slice, view) = timed(read_slice)
                record(name, t, view.bytes_read, indexes=len(view.indexes_loaded))
                if rep == 0:
                    ok &= torch.equal(got_slice, want)
            settle()
            t, _ = timed(lambda: raw_write(full, os.path.join(scratch, "raw")))
            record("raw write", t)
            remove_tree(os.path.join(scratch, "raw"))
            settle()
            remove_tree(zarr_dir)
            t, res = timed(lambda: export_zarr(ckpt, zarr_dir))
            record("zarr export", t, res.bytes_read)
            if rep == 0:
                results["zarr export"]["disk"] = tree_bytes(zarr_dir)
            settle()
            t, arr = timed(lambda: _ts_slice(zarr_dir, key, lo, hi))
            record("zarr slice", t)
            if rep == 0:
                ok &= np.array_equal(arr.view(np.int16 if big.dtype == torch.bfloat16 else np.int32),
                                     big[lo:hi].view(torch.int16 if big.dtype == torch.bfloat16 else torch.int32).numpy())
            settle()
            back = os.path.join(scratch, "back")
            t, res = timed(lambda back=back: import_zarr(zarr_dir, back))
            record("zarr import", t, res.bytes_read)
            if rep == 0:
                view = ckptkit.open(back)
                ok &= all(torch.equal(view[k][...], full[k]) for k in (key, "model/embed.weight"))
            remove_tree(back)
            say(f"  rep {rep + 1}/{args.reps}: " + ", ".join(f"{k} {v['s'][-1]:.3f}s" for k, v in results.items()))
    finally:
        remove_tree(scratch)
    report(args, cfg, total, key, list(big.shape), (lo, hi), cold, results, ok)
    return 0 if ok else 1


def _ts_slice(zarr_dir: str, key: str, lo: int, hi: int) -> np.ndarray:
    import tensorstore as ts

    from ckptkit_converters.zarr.layout import node_path

    arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(zarr_dir, node_path(key))}}).result()
    return arr[lo:hi].read().result()


def report(args: argparse.Namespace, cfg: ModelConfig, total: int, key: str, shape: list[int], rows: tuple[int, int],
           cold: bool, results: dict[str, dict[str, Any]], ok: bool) -> None:
    for r in results.values():
        r["median_s"] = median(r["s"])
        r["spread"] = spread(r["s"])
    base_read = results["full load"]
    base_write = results["raw write"]

    def mibs(r: dict[str, Any], nbytes: int) -> str:
        return f"{nbytes / MiB / r['median_s']:.0f}"

    print()
    print(f"== model-space access: {total / GiB:.3f} GiB checkpoint ({len(param_shapes(cfg)) * 3} tensors, "
          f"{args.shards} row pieces each), one process; reads {'COLD (page cache dropped)' if cold else 'WARM'} ==")
    print(f"slice: {key} {shape}, rows [{rows[0]}, {rows[1]}) (1/8) or the first 1/8 of columns; "
          f"median of {args.reps} reps; ratios are time / baseline time (< 1: faster)")
    rows_out = []
    for name in ("full load", "slice rows", "slice cols", "zarr slice"):
        r = results[name]
        read = r["bytes_read"]
        rows_out.append([name + (" [baseline]" if name == "full load" else ""), f"{r['median_s']:.4f}",
                         f"{r['median_s'] / base_read['median_s']:.4f}x",
                         "-" if read is None else f"{read / MiB:.1f}",
                         "-" if read is None else f"{read / base_read['bytes_read']:.4f}x",
                         str(r.get("indexes", "-")), f"{r['spread'] * 100:.0f}%"])
    print(table(["read", "s", "vs full load", "MiB read", "bytes vs full", "indexes", "spread"], rows_out))
    print()
    rows_out = []
    for name in ("raw write", "zarr export", "zarr import"):
        r = results[name]
        rows_out.append([name + (" [baseline]" if name == "raw write" else ""), f"{r['median_s']:.3f}", mibs(r, total),
                         f"{r['median_s'] / base_write['median_s']:.2f}x", f"{r['spread'] * 100:.0f}%"])
    print(table(["write (all tensors)", "s", "MiB/s", "vs raw write", "spread"], rows_out))
    disk, files = results["zarr export"].get("disk", (0, 0))
    print(f"zarr group on disk: {disk / MiB:.0f} MiB in {files} files; export and import include reading their source; "
          f"every result checked: {'yes' if ok else 'NO'}")
    if args.quick:
        print("NOTE: --quick is a smoke test; at this size fixed per-call costs dominate")
    out = {
        "benchmark": "bench_modelspace",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                 "ckptkit": ckptkit.__version__, "platform": platform.platform()},
        "config": {"model": dataclasses.asdict(cfg), "shards": args.shards,
                   "reps": args.reps, "quick": args.quick, "cold": cold, "total_bytes": total,
                   "slice_tensor": key, "slice_shape": shape, "slice_rows": list(rows)},
        "results": results,
        "verified": ok,
    }
    path = os.path.join(args.out, "modelspace.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2, default=str)
    print(f"results: {path}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~70 MiB instead of >= 1 GiB (smoke test)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per measurement (default 3)")
    ap.add_argument("--shards", type=int, default=8, help="row pieces per tensor (default 8)")
    ap.add_argument("--out", default="bench-out", help="scratch and results directory (default ./bench-out)")
    ap.add_argument("--no-drop-caches", action="store_true", help="never drop the page cache (warm reads)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
