"""Read-once loads: a dp4 load of replicated weights, with ``LoadOptions(read_once=True)`` vs
every rank reading what it needs itself (``read_once=False``, the baseline), on local disk
(page cache dropped before every load when root) and through a local S3 server (moto).

State (``--params`` P, default 135M: ~1.26 GiB stored): bf16 weights (2P bytes) held by every
rank, the data-parallel replicas, stored once; two fp32 Adam moments (8P bytes) split in row
blocks over the 4 ranks. A load needs 2P (weights) + 2P (own moments) per rank; the unique bytes
are the stored 10P.

Per load: wall time of the slowest rank (from a barrier to its load returning), and the bytes
read from storage, counted at the store by a wrapper around it on every rank. Methods rotate every
repetition. Prints per backend: median time, GiB read in all / unique bytes, and the ratio to the
baseline.

Run: torchrun --nproc_per_node=4 benchmarks/bench_read_once.py [--quick] [--out DIR] [--reps N]
(or benchmarks/run_all.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import GiB, drop_page_cache, exit_on_sigterm, median, remove_tree, table, write_results  # noqa: E402

SCRATCH_PREFIX = "bench_read_once-scratch-"


def build_state(params: int, fill: bool) -> dict:
    import ckptkit

    rank, world = dist.get_rank(), dist.get_world_size()
    cols = 4096
    rows = params // cols // world * world
    g = torch.Generator().manual_seed(3)
    weights = (torch.randn(rows, cols, generator=g) if fill else torch.zeros(rows, cols)).to(torch.bfloat16)
    mine = rows // world
    state: dict = {"model": {"w": weights}, "optim": {}}
    for name in ("exp_avg", "exp_avg_sq"):
        local = torch.full((mine, cols), float(rank + 1)) if fill else torch.zeros(mine, cols)
        state["optim"][name] = ckptkit.Sharded(local, [ckptkit.box_piece(f"optim/{name}", (rows, cols),
                                                                          (rank * mine, 0), (mine, cols))])
    return state


def timed_load(path: str, read_once: bool, params: int, cold: bool) -> tuple[float, int, bool]:
    import ckptkit
    from ckptkit.engine.collective import resolve_comm
    from ckptkit.engine.loader import load_state
    from ckptkit.engine.state import flatten_state
    from ckptkit.storage.counting import CountingStore
    from ckptkit.storage.url import open_store

    state = build_state(params, fill=False)
    if cold and dist.get_rank() == 0:
        drop_page_cache()
    dist.barrier()
    t0 = time.perf_counter()
    store = CountingStore(open_store(path))
    load_state(flatten_state(state), store, resolve_comm(), options=ckptkit.LoadOptions(read_once=read_once))
    seconds = time.perf_counter() - t0
    want = build_state(params, fill=True)
    ok = torch.equal(state["model"]["w"], want["model"]["w"]) and all(
        torch.equal(state["optim"][k].local, want["optim"][k].local) for k in want["optim"])
    return seconds, store.nbytes, ok


def run(args: argparse.Namespace) -> int:
    exit_on_sigterm()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    import ckptkit

    params = 20_000_000 if args.quick else args.params
    scratch = tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=args.out) if rank == 0 else None
    scratch = [scratch]
    dist.broadcast_object_list(scratch, src=0)
    server = None
    endpoint = [None]
    if rank == 0 and not args.no_s3:
        from moto_process import CREDENTIALS, MotoProcess

        os.environ.update(CREDENTIALS)
        server = MotoProcess(os.path.join(scratch[0], "moto.log"))
        endpoint = [(server.endpoint, server.new_bucket())]
    dist.broadcast_object_list(endpoint, src=0)
    paths = {"local disk": os.path.join(scratch[0], "ckpt")}
    if endpoint[0] is not None:
        from moto_process import CREDENTIALS

        os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint[0][0])
        paths["S3 (moto)"] = f"s3://{endpoint[0][1]}/ckpt"
    results: dict = {}
    try:
        for where, path in paths.items():
            ckptkit.save(build_state(params, fill=True), path)
            per: dict[str, list[tuple[float, int]]] = {"read_once=False": [], "read_once=True": []}
            for rep in range(args.reps):
                order = ["read_once=False", "read_once=True"] if rep % 2 == 0 else ["read_once=True", "read_once=False"]
                for name in order:
                    seconds, nbytes, ok = timed_load(path, name.endswith("True"), params, where == "local disk")
                    gathered = [None] * world
                    dist.all_gather_object(gathered, (seconds, nbytes, ok))
                    if not all(g[2] for g in gathered):
                        raise SystemExit(f"{where} {name}: loaded values differ from the saved ones")
                    per[name].append((max(g[0] for g in gathered), sum(g[1] for g in gathered)))
            results[where] = dict(per)
    finally:
        if server is not None:
            server.stop()
        if rank == 0:
            remove_tree(scratch[0])
    if rank == 0:
        report(results, params, args)
    dist.destroy_process_group()
    return 0


def report(results: dict, params: int, args: argparse.Namespace) -> None:
    unique = 10 * (params // 4096 // 4 * 4 * 4096)  # the stored bytes: 2P of weights, 8P of moments
    rows = []
    for where, r in results.items():
        base = median([t for t, _ in r["read_once=False"]])
        for name in ("read_once=False", "read_once=True"):
            times = [t for t, _ in r[name]]
            read = median([b for _, b in r[name]])
            rows.append([where, name + (" (baseline)" if name.endswith("False") else ""), f"{median(times):.2f}",
                         f"{read / GiB:.2f}", f"{read / unique:.2f}x", f"{median(times) / base:.2f}"])
    print(f"\ndp4 load of {unique / GiB:.2f} GiB stored (weights replicated on every rank), {args.reps} reps, "
          "median of the slowest rank")
    print(table(["storage", "method", "seconds", "GiB read (all ranks)", "vs unique bytes", "time vs baseline"], rows))
    write_results(args.out, "bench_read_once", {"params": params, "unique_bytes": unique, "reps": args.reps,
                                                 "results": results})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--params", type=int, default=135_000_000)
    ap.add_argument("--no-s3", action="store_true")
    return ap.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(run(parse_args()))
