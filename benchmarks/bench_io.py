"""Save/load throughput: ckptkit vs torch.distributed.checkpoint vs torch.save vs raw file I/O.

Every rank holds the FSDP-style (``Shard(0)`` over a 1-D mesh of all ranks)
shards of a small GPT: bf16 parameters plus two fp32 Adam moments per
parameter, as DTensors built with ``DTensor.from_local`` from locally
generated random shards. On that same state and the same disk, for each
method, ``--reps`` repetitions (default 3) of

    save to a fresh directory -> (sync, drop page cache) -> load into freshly
    allocated destinations -> delete the directory

are timed; a time is the slowest rank's, between barriers. Methods:

  ckptkit  ckptkit.save / ckptkit.load (into new DTensors of the same layout)
  dcp      torch.distributed.checkpoint.save / load, default FileSystemWriter/Reader
  torch    torch.save of the rank's {key: local shard} dict to its own file + fsync;
           torch.load(weights_only=True) (allocates its own tensors)
  raw      (baseline) the same bytes of the local shards, ndarray.tofile into one
           file per rank + fsync; read back with readinto into preallocated arrays

Reads are cold (page cache dropped before every load, every method alike)
when ``/proc/sys/vm/drop_caches`` is writable, else warm; the report says which.
Each method's first load is checked against the saved tensors (torch.equal).

Run: torchrun --nproc_per_node=4 benchmarks/bench_io.py [--quick] [--out DIR]
(or benchmarks/run_all.py, which does that).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

import ckptkit  # noqa: E402
from common import GiB, MiB, drop_page_cache, median, remove_tree, spread, table, tree_bytes, run_gloo_main  # noqa: E402
from gpt_shapes import ModelConfig, param_shapes  # noqa: E402

METHODS = ("ckptkit", "dcp", "torch", "raw")
LABEL = {
    "ckptkit": "ckptkit",
    "dcp": "DCP (FileSystemWriter)",
    "torch": "torch.save/load",
    "raw": "raw tofile/readinto",
}
TARGET_VS_RAW = 1.25  # ckptkit within 1.25x of raw
TARGET_VS_DCP = 1.0  # ckptkit not slower than DCP


# --------------------------------------------------------------------------- the state


FULL = ModelConfig(hidden=1024, ffn=2816, layers=8, vocab=32000)  # ~1.26 GiB with fp32 moments
QUICK = ModelConfig(hidden=256, ffn=704, layers=2, vocab=6912)  # ~32 MiB


def _global_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def _dtensor(local: torch.Tensor, mesh: Any, shape: tuple[int, ...]) -> DTensor:
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=_global_stride(shape))


def build_state(cfg: ModelConfig, mesh: Any, rank: int, world: int, fill: str) -> dict[str, Any]:
    """{"model": {name: bf16 DTensor}, "optim": {"exp_avg"|"exp_avg_sq": {name: fp32 DTensor}}}.

    ``fill="random"``: seeded random shards (the state that is saved);
    ``fill="zeros"``: zero-filled, already faulted-in destinations for a load.
    """
    gen = torch.Generator().manual_seed(1234 + rank)
    model: dict[str, DTensor] = {}
    avg: dict[str, DTensor] = {}
    avg_sq: dict[str, DTensor] = {}
    for name, shape in param_shapes(cfg):
        if shape[0] % world:
            raise SystemExit(f"{name}: dim 0 of {shape} does not divide over {world} ranks")
        local_shape = (shape[0] // world, *shape[1:])
        if fill == "random":
            p = torch.randn(local_shape, generator=gen).to(torch.bfloat16)
            m = torch.randn(local_shape, generator=gen).mul_(1e-3)
            v = torch.rand(local_shape, generator=gen).mul_(1e-6)
        else:
            p = torch.zeros(local_shape, dtype=torch.bfloat16)
            m = torch.zeros(local_shape, dtype=torch.float32)
            v = torch.zeros(local_shape, dtype=torch.float32)
        model[name] = _dtensor(p, mesh, shape)
        avg[name] = _dtensor(m, mesh, shape)
        avg_sq[name] = _dtensor(v, mesh, shape)
    return {"model": model, "optim": {"exp_avg": avg, "exp_avg_sq": avg_sq}}


def local_shards(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """Flat {dotted key: local tensor}, in a fixed order."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(local_shards(v, key + "."))
        elif isinstance(v, DTensor):
            out[key] = v.to_local()
        else:
            out[key] = v
    return out


def _byte_view(t: torch.Tensor) -> Any:
    """A numpy uint8 view of a contiguous CPU tensor's bytes (bf16 has no numpy dtype)."""
    return t.reshape(-1).view(torch.uint8).numpy()


# --------------------------------------------------------------------------- the methods
# Each save(state, dir) / load(dest_state, dir) runs on every rank; load returns what it
# produced for verification ({key: local tensor}); for in-place loads that is dest itself.


def ckptkit_save(state: dict[str, Any], d: str, rank: int) -> None:
    ckptkit.save(state, d)


def ckptkit_load(dest: dict[str, Any], d: str, rank: int) -> dict[str, torch.Tensor]:
    ckptkit.load(dest, d)
    return local_shards(dest)


def dcp_save(state: dict[str, Any], d: str, rank: int) -> None:
    dcp.save(state, storage_writer=dcp.FileSystemWriter(d))


def dcp_load(dest: dict[str, Any], d: str, rank: int) -> dict[str, torch.Tensor]:
    dcp.load(dest, storage_reader=dcp.FileSystemReader(d))
    return local_shards(dest)


def torch_save(state: dict[str, Any], d: str, rank: int) -> None:
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"rank{rank}.pt"), "wb") as f:
        torch.save(local_shards(state), f)
        f.flush()
        os.fsync(f.fileno())


def torch_load(dest: dict[str, Any], d: str, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(d, f"rank{rank}.pt"), weights_only=True)


def raw_save(state: dict[str, Any], d: str, rank: int) -> None:
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"rank{rank}.bin"), "wb") as f:
        for t in local_shards(state).values():
            _byte_view(t).tofile(f)
        f.flush()
        os.fsync(f.fileno())


def raw_load(dest: dict[str, Any], d: str, rank: int) -> dict[str, torch.Tensor]:
    out = local_shards(dest)
    with open(os.path.join(d, f"rank{rank}.bin"), "rb", buffering=0) as f:
        for t in out.values():
            view = memoryview(_byte_view(t))
            while view:
                n = f.readinto(view)
                if not n:
                    raise EOFError("raw baseline file is short")
                view = view[n:]
    return out


SAVE: dict[str, Callable[..., None]] = {"ckptkit": ckptkit_save, "dcp": dcp_save, "torch": torch_save, "raw": raw_save}
LOAD: dict[str, Callable[..., dict[str, torch.Tensor]]] = {
    "ckptkit": ckptkit_load, "dcp": dcp_load, "torch": torch_load, "raw": raw_load,
}


# --------------------------------------------------------------------------- timing


def barrier() -> None:
    dist.barrier()


def timed(fn: Callable[[], Any]) -> tuple[float, list[float], Any]:
    """Run ``fn`` on every rank between barriers: (slowest rank's seconds, every rank's seconds, result)."""
    barrier()
    t0 = time.perf_counter()
    result = fn()
    dt = time.perf_counter() - t0
    times = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(times, torch.tensor([dt], dtype=torch.float64))
    barrier()
    per_rank = [float(t.item()) for t in times]
    return max(per_rank), per_rank, result


def settle(rank: int, drop: bool) -> bool:
    """Between timed steps: flush everything to disk (and drop the page cache if asked); collective."""
    barrier()
    ok = False
    if rank == 0:
        ok = drop_page_cache() if drop else (os.sync() or False)
    flag = torch.tensor([1 if ok else 0])
    dist.broadcast(flag, 0)
    barrier()
    return bool(flag.item())


def verify(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    bad = []
    if list(expected) != list(got) and set(expected) != set(got):
        return [f"keys differ: {sorted(set(expected) ^ set(got))[:4]}"]
    for k, e in expected.items():
        g = got[k]
        if g.dtype != e.dtype or g.shape != e.shape or not torch.equal(g, e):
            bad.append(k)
    return bad


# --------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    cfg = QUICK if args.quick else FULL
    cfg = ModelConfig(
        hidden=args.hidden or cfg.hidden, ffn=args.ffn or cfg.ffn, layers=args.layers or cfg.layers, vocab=args.vocab or cfg.vocab
    )
    methods = [m for m in METHODS if m in args.methods.split(",")]
    if "raw" not in methods:
        methods.append("raw")  # the baseline every ratio needs

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, file=sys.stderr, flush=True)

    # One scratch directory under --out, named by rank 0, removed on the way out.
    os.makedirs(args.out, exist_ok=True)
    name = [tempfile.mkdtemp(prefix="bench_io-scratch-", dir=args.out) if rank == 0 else None]
    dist.broadcast_object_list(name, 0)
    scratch: str = name[0]  # type: ignore[assignment]
    try:
        t_build = time.perf_counter()
        state = build_state(cfg, mesh, rank, world, "random")
        src = local_shards(state)
        rank_bytes = sum(t.nbytes for t in src.values())
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([rank_bytes], dtype=torch.int64))
        total_bytes = int(sum(int(s.item()) for s in sizes))
        n_tensors = len(src)
        by_dtype: dict[str, int] = {}
        for t in src.values():
            by_dtype[str(t.dtype).removeprefix("torch.")] = by_dtype.get(str(t.dtype).removeprefix("torch."), 0) + t.nbytes
        say(
            f"bench_io: {world} ranks, {n_tensors} tensors per rank ({len(param_shapes(cfg))} params x "
            f"[bf16 param, fp32 exp_avg, fp32 exp_avg_sq]), Shard(0) DTensors; {total_bytes / GiB:.3f} GiB total, "
            f"{rank_bytes / MiB:.1f} MiB per rank ("
            + ", ".join(f"{k} {v / MiB:.1f} MiB" for k, v in sorted(by_dtype.items()))
            + f"); built in {time.perf_counter() - t_build:.1f}s"
        )

        # Cold reads are possible only if the page cache can be dropped; decide once, for every method.
        cold = settle(rank, drop=not args.no_drop_caches)
        say(f"bench_io: reads are {'COLD (page cache dropped before every load)' if cold else 'WARM (page cache not dropped)'}")

        # Warm-up: every code path once, on a tiny state, untimed.
        tiny = build_state(ModelConfig(hidden=64, ffn=128, layers=1, vocab=256), mesh, rank, world, "random")
        for m in methods:
            d = os.path.join(scratch, f"warmup-{m}")
            SAVE[m](tiny, d, rank)
            barrier()
            LOAD[m](build_state(ModelConfig(64, 128, 1, 256), mesh, rank, world, "zeros"), d, rank)
            barrier()
            if rank == 0:
                remove_tree(d)
        del tiny
        # And one untimed full-size raw write + delete: the first large write after a quiet
        # spell is often slow on virtual disks, and no method should pay that for the others.
        d = os.path.join(scratch, "warmup-disk")
        raw_save(state, d, rank)
        barrier()
        if rank == 0:
            remove_tree(d)

        results: dict[str, dict[str, Any]] = {
            m: {"save_s": [], "load_s": [], "save_per_rank_s": [], "load_per_rank_s": [], "verified": None, "disk_bytes": None, "files": None}
            for m in methods
        }
        for rep in range(args.reps):
            # Rotate the order each repetition so no method always runs first (or after the same neighbour).
            order = methods[rep % len(methods):] + methods[:rep % len(methods)]
            for m in order:
                d = os.path.join(scratch, f"rep{rep}-{m}")
                settle(rank, drop=False)
                t_save, per_save, _ = timed(lambda: SAVE[m](state, d, rank))
                if rep == 0 and rank == 0:
                    results[m]["disk_bytes"], results[m]["files"] = tree_bytes(d)
                dest = build_state(cfg, mesh, rank, world, "zeros") if m != "torch" else None
                settle(rank, drop=cold)
                t_load, per_load, got = timed(lambda: LOAD[m](dest, d, rank))
                if rep == 0:
                    bad = verify(src, got)
                    flags = torch.tensor([len(bad)])
                    dist.all_reduce(flags)
                    results[m]["verified"] = int(flags.item()) == 0
                    if bad:
                        print(f"bench_io: rank {rank}: {m} loaded wrong data for {len(bad)} tensors: {bad[:4]}", file=sys.stderr)
                del got, dest
                barrier()
                if rank == 0:
                    remove_tree(d)
                barrier()
                r = results[m]
                r["save_s"].append(t_save)
                r["load_s"].append(t_load)
                r["save_per_rank_s"].append(per_save)
                r["load_per_rank_s"].append(per_load)
                say(f"  rep {rep + 1}/{args.reps} {m:8s} save {t_save:7.3f}s  load {t_load:7.3f}s")
        barrier()
    finally:
        # No collective here: on an error the other ranks may be elsewhere (torchrun then
        # SIGTERMs them, which main() turns into SystemExit so this still runs).
        if rank == 0:
            remove_tree(scratch)

    if rank == 0:
        report(args, cfg, world, total_bytes, n_tensors, cold, methods, results)
    return 0 if all(r["verified"] for r in results.values()) else 1


def report(
    args: argparse.Namespace,
    cfg: ModelConfig,
    world: int,
    total_bytes: int,
    n_tensors: int,
    cold: bool,
    methods: list[str],
    results: dict[str, dict[str, Any]],
) -> None:
    for m in methods:
        r = results[m]
        for op in ("save", "load"):
            xs = r[f"{op}_s"]
            r[f"{op}_median_s"] = median(xs)
            r[f"{op}_spread"] = spread(xs)
            r[f"{op}_gib_per_s"] = total_bytes / GiB / median(xs)
    base = results["raw"]
    ref = results.get("dcp")
    for m in methods:
        r = results[m]
        for op in ("save", "load"):
            r[f"{op}_vs_raw"] = r[f"{op}_median_s"] / base[f"{op}_median_s"]
            r[f"{op}_vs_dcp"] = r[f"{op}_median_s"] / ref[f"{op}_median_s"] if ref else None

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    print()
    print(
        f"== checkpoint save/load throughput: {world} ranks, {total_bytes / GiB:.3f} GiB total "
        f"({total_bytes / world / MiB:.0f} MiB/rank, {n_tensors} tensors/rank, bf16 params + fp32 moments, Shard(0) DTensors) =="
    )
    print(
        f"median of {args.reps} reps, slowest rank, fresh directory per save, every save fsynced; "
        f"reads {'COLD (page cache dropped before every load)' if cold else 'WARM (page cache NOT dropped)'}; "
        f"disk: {args.out}"
    )
    print("ratios are time / time of the baseline (raw) or of DCP: < 1 is faster")
    headers = ["method", "save s", "GiB/s", "vs raw", "vs DCP", "spread", "load s", "GiB/s", "vs raw", "vs DCP", "spread", "on disk", "ok"]
    rows = []
    for m in methods:
        r = results[m]
        name = LABEL[m] + (" [baseline]" if m == "raw" else "")
        rows.append([
            name,
            f"{r['save_median_s']:.3f}", f"{r['save_gib_per_s']:.2f}", ratio(r["save_vs_raw"]), ratio(r["save_vs_dcp"]),
            f"{r['save_spread'] * 100:.0f}%",
            f"{r['load_median_s']:.3f}", f"{r['load_gib_per_s']:.2f}", ratio(r["load_vs_raw"]), ratio(r["load_vs_dcp"]),
            f"{r['load_spread'] * 100:.0f}%",
            f"{(r['disk_bytes'] or 0) / MiB:.0f} MiB/{r['files']}f",
            "yes" if r["verified"] else "NO",
        ])
    print(table(headers, rows))
    print("(spread = (max - min) / median over the reps; ok = loaded tensors torch.equal to the saved ones; "
          "torch.load's time includes allocating its tensors, the others load into preallocated memory)")
    if args.quick:
        print("NOTE: --quick is a smoke test; at this size fixed per-call costs dominate and the ratios mean little")
    targets: dict[str, Any] = {}
    if "ckptkit" in results:
        c = results["ckptkit"]
        print("targets (printed, not asserted):")
        for op in ("save", "load"):
            vs_raw, vs_dcp = c[f"{op}_vs_raw"], c[f"{op}_vs_dcp"]
            ok_raw = vs_raw <= TARGET_VS_RAW
            ok_dcp = vs_dcp is None or vs_dcp <= TARGET_VS_DCP
            targets[op] = {"vs_raw": vs_raw, "vs_raw_met": ok_raw, "vs_dcp": vs_dcp, "vs_dcp_met": ok_dcp if vs_dcp is not None else None}
            print(
                f"  ckptkit {op}: {vs_raw:.2f}x raw (target <= {TARGET_VS_RAW:.2f}x: {'ok' if ok_raw else 'MISSED'}), "
                + (f"{vs_dcp:.2f}x DCP (target <= {TARGET_VS_DCP:.2f}x: {'ok' if ok_dcp else 'MISSED'})" if vs_dcp is not None else "DCP not run")
            )
    out = {
        "benchmark": "bench_io",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": bool(args.quick),
        "reps": args.reps,
        "world_size": world,
        "model": asdict(cfg),
        "total_bytes": total_bytes,
        "bytes_per_rank": total_bytes // world,
        "tensors_per_rank": n_tensors,
        "baseline": "raw",
        "reads": "cold" if cold else "warm",
        "scratch_parent": os.path.abspath(args.out),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                 "ckptkit": ckptkit.__version__, "platform": platform.platform()},
        "targets": {"ckptkit_vs_raw_max": TARGET_VS_RAW, "ckptkit_vs_dcp_max": TARGET_VS_DCP, **targets},
        "methods": results,
    }
    path = os.path.join(args.out, "bench_io.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"figures written to {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~32 MiB state instead of ~1.26 GiB (smoke test)")
    ap.add_argument("--out", default="bench-out", help="scratch directory and where bench_io.json goes (default ./bench-out)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per method (default 3); the median is reported")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)} (raw always runs)")
    ap.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache before loads (warm reads)")
    ap.add_argument("--hidden", type=int, default=0, help="override the model's hidden size")
    ap.add_argument("--ffn", type=int, default=0, help="override the SwiGLU ffn size")
    ap.add_argument("--layers", type=int, default=0, help="override the layer count")
    ap.add_argument("--vocab", type=int, default=0, help="override the vocabulary size")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    return args


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\.checkpoint.*")
    torch.set_num_threads(1)
    return run_gloo_main(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
