"""Object-store throughput: ckptkit (native and tensorstore engines) vs raw s3fs vs DCP over fsspec.

Everything runs in one process against a real S3-compatible server: moto in
server mode, started by this script as a *separate* process on 127.0.0.1 (it
is CPU-heavy Python; in-process it would compete with the client for the
GIL) and stopped at the end. Nothing is mocked: every request is HTTP.
Fake credentials and ``AWS_ENDPOINT_URL`` are set in the environment, which
is how every client below finds the server.

The state is a small GPT's training state as plain CPU tensors: bf16
parameters plus two fp32 Adam moments per parameter (78 tensors), sized to
``--mib`` (default 256 MiB; ``--quick``: 32 MiB), randomly generated once.
For each method and each of ``--reps`` repetitions (default 3; the method
order rotates every repetition):

    save to a fresh prefix -> load into freshly allocated, zeroed destinations
    -> verify (torch.equal, every tensor, every repetition) -> delete the prefix

Save and load are timed separately (wall clock); the report gives the median,
the spread ((max - min) / median) and MiB/s of the tensor bytes. Methods on
``s3://bucket/prefix``:

  native       ckptkit.save / ckptkit.load with the default io engine
               (ckptkit/storage/s3.py: s3fs's aiobotocore client, multipart parts
               of S3Store.PART_SIZE with S3Store.MAX_CONCURRENCY in flight; reads
               of at most load_plan.MAX_REQUEST bytes, LoadOptions.io_threads in flight)
  tensorstore  the same calls with storage_options={"io_engine": "tensorstore"}
               (tensorstore's s3 kvstore driver moves the data object)
  dcp          torch.distributed.checkpoint.save / load with FsspecWriter /
               FsspecReader (s3fs through fsspec; defaults: one file per rank,
               thread_count=1, or --dcp-threads), no process group
  raw          (baseline) the same tensor bytes as ONE object, like ckptkit's one
               data object per rank: joined into one buffer and written with
               s3fs pipe_file(chunksize=PART_SIZE, max_concurrency=MAX_CONCURRENCY)
               (a multipart upload with ckptkit's part size and concurrency);
               read back with s3fs cat_ranges in MAX_REQUEST-sized ranges,
               io_threads in flight, copied into one preallocated buffer

and on the local ``file`` scheme (a scratch directory under ``--out``), ckptkit
native vs ckptkit tensorstore (tensorstore's file kvstore driver), with the
page cache dropped before every load when /proc/sys/vm/drop_caches is
writable (cold reads), else warm; the report says which.

ckptkit and DCP times include everything their calls do (opening the store,
metadata, manifest/commit); raw s3fs reuses one S3FileSystem (a baseline).
Every code path runs once untimed on a tiny state (0.55 MiB, 24 tensors)
first; then ``--reps`` timed save/load rounds of that tiny state give each
method's fixed per-call cost (reported as "tiny save/load ms"). Ratios are
*throughput* ratios, method MiB/s / reference MiB/s: > 1 means faster.
Targets (printed, not asserted): ckptkit >= 0.8x raw s3fs, ckptkit > DCP.

Run: .venv/bin/python benchmarks/bench_s3.py [--quick | --mib N] [--reps 3] [--out DIR]
(or benchmarks/run_all.py, which runs it as a plain single-process script).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # noqa: E402

import ckptkit  # noqa: E402
from ckptkit.options import LoadOptions  # noqa: E402
from ckptkit.plan.load_plan import MAX_REQUEST  # noqa: E402
from ckptkit.storage.s3 import MAX_CONCURRENCY, PART_SIZE  # noqa: E402
from common import exit_on_sigterm, MiB, drop_page_cache, median, remove_tree, spread, table, tree_bytes  # noqa: E402
from gpt_shapes import ModelConfig, param_shapes  # noqa: E402
from moto_process import CREDENTIALS, MotoProcess  # noqa: E402

S3_METHODS = ("native", "tensorstore", "dcp", "raw")
FILE_METHODS = ("native", "tensorstore")
LABEL = {
    "native": "ckptkit native",
    "tensorstore": "ckptkit tensorstore",
    "dcp": "DCP FsspecWriter/Reader",
    "raw": "raw s3fs pipe/cat_ranges",
}
ENGINE_OPTIONS: dict[str, dict[str, Any]] = {"native": {}, "tensorstore": {"io_engine": "tensorstore"}}
TARGET_VS_RAW = 0.8  # ckptkit throughput >= 0.8x raw s3fs
TARGET_VS_DCP = 1.0  # ckptkit faster than DCP over fsspec
BYTES_PER_PARAM = 2 + 4 + 4  # bf16 parameter, fp32 exp_avg, fp32 exp_avg_sq
IO_THREADS = LoadOptions().io_threads


# --------------------------------------------------------------------------- the server


# --------------------------------------------------------------------------- the state


# A 0.55 MiB state of 24 tensors: its save/load time is (nearly) each method's fixed per-call cost.
TINY = ModelConfig(hidden=64, ffn=128, layers=1, vocab=256)


def _round64(x: float) -> int:
    return max(64, int(round(x / 64)) * 64)


def config_for(target_bytes: int, layers: int = 4) -> ModelConfig:
    """A GPT whose bf16 params + fp32 moments come to about ``target_bytes``: hidden from the
    size (vocab ~16x hidden, ffn 2.75x hidden), then the vocabulary trimmed to hit the size."""
    params = target_bytes / BYTES_PER_PARAM
    h = _round64(math.sqrt(params / (layers * 12.25 + 16)))
    f = _round64(2.75 * h)
    per_layer = 4 * h * h + 3 * f * h + 2 * h
    vocab = _round64((params - layers * per_layer - h) / h)
    return ModelConfig(hidden=h, ffn=f, layers=layers, vocab=vocab)


def build_state(cfg: ModelConfig, fill: str, seed: int = 1234) -> dict[str, Any]:
    """{"model": {name: bf16}, "optim": {"exp_avg"|"exp_avg_sq": {name: fp32}}}: random, or zeroed destinations."""
    gen = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    avg: dict[str, torch.Tensor] = {}
    avg_sq: dict[str, torch.Tensor] = {}
    for name, shape in param_shapes(cfg):
        if fill == "random":
            model[name] = torch.randn(shape, generator=gen).to(torch.bfloat16)
            avg[name] = torch.randn(shape, generator=gen).mul_(1e-3)
            avg_sq[name] = torch.rand(shape, generator=gen).mul_(1e-6)
        else:
            model[name] = torch.zeros(shape, dtype=torch.bfloat16)
            avg[name] = torch.zeros(shape, dtype=torch.float32)
            avg_sq[name] = torch.zeros(shape, dtype=torch.float32)
    return {"model": model, "optim": {"exp_avg": avg, "exp_avg_sq": avg_sq}}


def flat(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """{dotted key: tensor}, in a fixed order."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _byte_view(t: torch.Tensor) -> Any:
    """A numpy uint8 view of a contiguous CPU tensor's bytes (bf16 has no numpy dtype)."""
    return t.reshape(-1).view(torch.uint8).numpy()


@dataclass
class RawDest:
    """The raw baseline's destination: one preallocated byte buffer, and typed views of it per tensor."""

    buf: torch.Tensor
    views: dict[str, torch.Tensor]


def raw_dest(src: dict[str, torch.Tensor]) -> RawDest:
    total = sum(t.nbytes for t in src.values())
    buf = torch.zeros(total, dtype=torch.uint8)
    views, pos = {}, 0
    for k, t in src.items():
        views[k] = buf[pos:pos + t.nbytes].view(t.dtype).view(t.shape)
        pos += t.nbytes
    return RawDest(buf, views)


# --------------------------------------------------------------------------- the methods
# save(state, url) / load(dest, url) -> {key: tensor} of what the load produced.


class Methods:
    def __init__(self, dcp_threads: int) -> None:
        import s3fs

        # The baseline's one, reused client (no per-call session setup: the cheapest way to use s3fs).
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
        self.dcp_threads = dcp_threads

    # ckptkit, either engine, any scheme
    def ckptkit_save(self, engine: str, state: dict[str, Any], url: str) -> None:
        ckptkit.save(state, url, storage_options=dict(ENGINE_OPTIONS[engine]))

    def ckptkit_load(self, engine: str, dest: Any, url: str) -> dict[str, torch.Tensor]:
        ckptkit.load(dest, url, storage_options=dict(ENGINE_OPTIONS[engine]))
        return flat(dest)

    # torch.distributed.checkpoint over fsspec (s3fs)
    def dcp_save(self, state: dict[str, Any], url: str) -> None:
        dcp.save(state, storage_writer=FsspecWriter(url, thread_count=self.dcp_threads), no_dist=True)

    def dcp_load(self, dest: Any, url: str) -> dict[str, torch.Tensor]:
        dcp.load(dest, storage_reader=FsspecReader(url), no_dist=True)
        return flat(dest)

    # raw s3fs: the same bytes, one object, ckptkit's part size / request size / concurrency
    def raw_save(self, state: dict[str, Any], url: str) -> None:
        data = b"".join(_byte_view(t) for t in flat(state).values())
        self.fs.pipe_file(f"{url}/data", data, chunksize=PART_SIZE, max_concurrency=MAX_CONCURRENCY)

    def raw_load(self, dest: RawDest, url: str) -> dict[str, torch.Tensor]:
        total = dest.buf.numel()
        starts = list(range(0, total, MAX_REQUEST))
        ends = [min(s + MAX_REQUEST, total) for s in starts]
        parts = self.fs.cat_ranges([f"{url}/data"] * len(starts), starts, ends, batch_size=IO_THREADS)
        out = _byte_view(dest.buf)
        for s, e, part in zip(starts, ends, parts):
            if isinstance(part, BaseException):
                raise part
            if len(part) != e - s:
                raise RuntimeError(f"raw s3fs read of bytes [{s}, {e}) returned {len(part)} bytes")
            out[s:e] = memoryview(part)
        return dest.views

    def save_fn(self, method: str) -> Callable[[dict[str, Any], str], None]:
        if method in ENGINE_OPTIONS:
            return lambda state, url: self.ckptkit_save(method, state, url)
        return {"dcp": self.dcp_save, "raw": self.raw_save}[method]

    def load_fn(self, method: str) -> Callable[[Any, str], dict[str, torch.Tensor]]:
        if method in ENGINE_OPTIONS:
            return lambda dest, url: self.ckptkit_load(method, dest, url)
        return {"dcp": self.dcp_load, "raw": self.raw_load}[method]


def new_dest(method: str, cfg: ModelConfig, src: dict[str, torch.Tensor]) -> Any:
    return raw_dest(src) if method == "raw" else build_state(cfg, "zeros")


def verify(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], what: str) -> None:
    """Every tensor bit-identical to the saved one; raise (the benchmark fails) if not."""
    if set(expected) != set(got):
        raise RuntimeError(f"{what}: loaded keys differ: {sorted(set(expected) ^ set(got))[:4]}")
    bad = [k for k, e in expected.items() if got[k].dtype != e.dtype or got[k].shape != e.shape or not torch.equal(got[k], e)]
    if bad:
        raise RuntimeError(f"{what}: LOADED WRONG DATA for {len(bad)} of {len(expected)} tensors, e.g. {bad[:4]}")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


# --------------------------------------------------------------------------- the run


def _empty_result() -> dict[str, Any]:
    return {"save_s": [], "load_s": [], "tiny_save_s": [], "tiny_load_s": [], "verified": None, "stored_bytes": None, "objects": None}


def run_scheme(
    scheme: str,
    methods: list[str],
    m: Methods,
    cfg: ModelConfig,
    state: dict[str, Any],
    src: dict[str, torch.Tensor],
    reps: int,
    location: Callable[[str], str],
    stored: Callable[[str], tuple[int, int]],
    remove: Callable[[str], None],
    before_load: Callable[[], None],
) -> dict[str, dict[str, Any]]:
    """Warm up every method on a tiny state (untimed), time ``reps`` rounds of it (the fixed
    per-call cost), then ``reps`` timed save/load/verify/delete rounds of the real state."""
    results = {meth: _empty_result() for meth in methods}
    tiny = build_state(TINY, "random", seed=7)
    tiny_src = flat(tiny)
    for rep in range(-1, reps):  # -1: the untimed warm-up
        for meth in methods:
            name = f"tiny{rep}-{meth}" if rep >= 0 else f"warmup-{meth}"
            t_save, _ = timed(lambda: m.save_fn(meth)(tiny, location(name)))
            dest = new_dest(meth, TINY, tiny_src)
            before_load()
            t_load, got = timed(lambda: m.load_fn(meth)(dest, location(name)))
            verify(tiny_src, got, f"{scheme} {meth} tiny state, {'warm-up' if rep < 0 else f'rep {rep + 1}'}")
            remove(name)
            if rep >= 0:
                results[meth]["tiny_save_s"].append(t_save)
                results[meth]["tiny_load_s"].append(t_load)
    for rep in range(reps):
        order = methods[rep % len(methods):] + methods[:rep % len(methods)]
        for meth in order:
            name = f"rep{rep}-{meth}"
            url = location(name)
            gc.collect()
            t_save, _ = timed(lambda: m.save_fn(meth)(state, url))
            r = results[meth]
            if rep == 0:
                r["stored_bytes"], r["objects"] = stored(name)
            dest = new_dest(meth, cfg, src)
            before_load()
            t_load, got = timed(lambda: m.load_fn(meth)(dest, url))
            verify(src, got, f"{scheme} {meth} rep {rep + 1}")
            r["verified"] = True
            del got, dest
            remove(name)
            r["save_s"].append(t_save)
            r["load_s"].append(t_load)
            print(f"  {scheme:4s} rep {rep + 1}/{reps} {meth:12s} save {t_save:7.3f}s  load {t_load:7.3f}s", file=sys.stderr, flush=True)
    return results


def summarize(results: dict[str, dict[str, Any]], total_bytes: int, ref: str | None, dcp_ref: str | None) -> None:
    for r in results.values():
        for op in ("save", "load"):
            xs = r[f"{op}_s"]
            r[f"{op}_median_s"] = median(xs)
            r[f"{op}_spread"] = spread(xs)
            r[f"{op}_mib_per_s"] = total_bytes / MiB / median(xs)
            r[f"tiny_{op}_median_s"] = median(r[f"tiny_{op}_s"])
    for r in results.values():
        for op in ("save", "load"):
            for tag, other in (("raw", ref), ("dcp", dcp_ref)):
                # throughput ratio: > 1 is faster than the reference
                r[f"{op}_x_{tag}"] = results[other][f"{op}_median_s"] / r[f"{op}_median_s"] if other in results else None


def faster_engine(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """native vs tensorstore, per op and for save+load: the winner and by how much (time ratio)."""
    out: dict[str, Any] = {}
    for op in ("save", "load", "save+load"):
        if op == "save+load":
            a = results["native"]["save_median_s"] + results["native"]["load_median_s"]
            b = results["tensorstore"]["save_median_s"] + results["tensorstore"]["load_median_s"]
        else:
            a, b = results["native"][f"{op}_median_s"], results["tensorstore"][f"{op}_median_s"]
        winner = "native" if a <= b else "tensorstore"
        out[op] = {"faster": winner, "by": max(a, b) / min(a, b), "native_s": a, "tensorstore_s": b}
    return out


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def print_table(results: dict[str, dict[str, Any]], methods: list[str], with_refs: bool) -> None:
    headers = ["method", "save s", "MiB/s", "spread"] + (["x raw", "x DCP"] if with_refs else [])
    headers += ["load s", "MiB/s", "spread"] + (["x raw", "x DCP"] if with_refs else [])
    headers += ["tiny save ms", "tiny load ms", "stored", "ok"]
    rows = []
    for meth in methods:
        r = results[meth]
        row = [LABEL[meth] + (" [baseline]" if meth == "raw" else "")]
        for op in ("save", "load"):
            row += [f"{r[f'{op}_median_s']:.3f}", f"{r[f'{op}_mib_per_s']:.1f}", f"{r[f'{op}_spread'] * 100:.0f}%"]
            if with_refs:
                row += [ratio(r[f"{op}_x_raw"]), ratio(r[f"{op}_x_dcp"])]
        row += [f"{r['tiny_save_median_s'] * 1e3:.0f}", f"{r['tiny_load_median_s'] * 1e3:.0f}"]
        row += [f"{(r['stored_bytes'] or 0) / MiB:.1f} MiB/{r['objects']}", "yes" if r["verified"] else "NO"]
        rows.append(row)
    print(table(headers, rows))


def report(args: argparse.Namespace, cfg: ModelConfig, total_bytes: int, n_tensors: int, cold: bool,
           endpoint: str, s3: dict[str, dict[str, Any]], local: dict[str, dict[str, Any]]) -> dict[str, Any]:
    summarize(s3, total_bytes, "raw", "dcp")
    summarize(local, total_bytes, None, None)
    engines = {"s3": faster_engine(s3), "file": faster_engine(local)}
    mib = total_bytes / MiB

    print()
    print(f"== object-store save/load throughput: {mib:.1f} MiB state ({n_tensors} tensors: bf16 params + fp32 Adam moments, "
          f"hidden {cfg.hidden}, ffn {cfg.ffn}, {cfg.layers} layers, vocab {cfg.vocab}), one process ==")
    print(f"median of {args.reps} reps, fresh prefix per save, every load verified (torch.equal); "
          f"ratios are throughput / the reference's throughput: > 1 is faster")
    print(f"\n-- s3:// on moto server ({endpoint}, separate process); raw s3fs: {PART_SIZE // MiB} MiB parts, "
          f"{MAX_CONCURRENCY} in flight; reads of {MAX_REQUEST // MiB} MiB, {IO_THREADS} in flight; DCP thread_count={args.dcp_threads}")
    print_table(s3, list(S3_METHODS), with_refs=True)
    print(f"\n-- file:// (local scratch under {os.path.abspath(args.out)}); reads "
          f"{'COLD (page cache dropped before every load)' if cold else 'WARM (page cache not dropped)'}")
    print_table(local, list(FILE_METHODS), with_refs=False)
    print("(spread = (max - min) / median over the reps; tiny = median save/load time of a 0.55 MiB, 24-tensor state: "
          "the fixed cost of one call; stored = bytes/objects under the prefix after a save; "
          "ok = every rep's load torch.equal to the saved tensors)")

    print("\nfaster engine per scheme (ckptkit native vs tensorstore; by = slower time / faster time):")
    for scheme, e in engines.items():
        print("  " + f"{scheme:5s} " + ", ".join(f"{op} {v['faster']} ({v['by']:.2f}x)" for op, v in e.items()))

    targets: dict[str, Any] = {}
    print("targets (printed, not asserted):")
    for engine in ("native", "tensorstore"):
        c = s3[engine]
        for op in ("save", "load"):
            x_raw, x_dcp = c[f"{op}_x_raw"], c[f"{op}_x_dcp"]
            ok_raw, ok_dcp = x_raw >= TARGET_VS_RAW, x_dcp > TARGET_VS_DCP
            targets[f"{engine}_{op}"] = {"x_raw": x_raw, "x_raw_met": ok_raw, "x_dcp": x_dcp, "x_dcp_met": ok_dcp}
            print(f"  s3 ckptkit {engine:11s} {op}: {x_raw:.2f}x raw s3fs throughput (target >= {TARGET_VS_RAW:.2f}x: "
                  f"{'ok' if ok_raw else 'MISSED'}), {x_dcp:.2f}x DCP (target > {TARGET_VS_DCP:.2f}x: {'ok' if ok_dcp else 'MISSED'})")
    if total_bytes < 128 * MiB:
        print("NOTE: a small state (--quick) is a smoke test: fixed per-call costs dominate and the ratios mean little")
    print("NOTE: the server is moto (Python) on this machine, sharing its CPUs with the client: the numbers compare "
          "client stacks under identical conditions, not what a real object store would deliver")
    print("NOTE: the tensorstore engine writes each data object with ONE PUT (tensorstore's s3 driver has no multipart "
          "upload); native, raw and DCP use multipart uploads, whose completion moto handles slowly. On AWS a single PUT "
          "is capped at 5 GiB and is one stream, so a faster tensorstore save here does not carry over to real S3")

    try:
        import importlib.metadata as md

        versions = {p: md.version(p) for p in ("s3fs", "fsspec", "aiobotocore", "tensorstore", "moto")}
    except Exception:  # noqa: BLE001 - informational only
        versions = {}
    return {
        "benchmark": "bench_s3",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": bool(args.quick),
        "reps": args.reps,
        "model": asdict(cfg),
        "total_bytes": total_bytes,
        "tensors": n_tensors,
        "ratios": "throughput / reference throughput (> 1 is faster)",
        "s3": {
            "server": "moto server, separate process on 127.0.0.1",
            "baseline": "raw",
            "raw_part_size": PART_SIZE, "raw_max_concurrency": MAX_CONCURRENCY,
            "raw_read_request": MAX_REQUEST, "raw_read_concurrency": IO_THREADS,
            "dcp_thread_count": args.dcp_threads,
            "methods": s3,
        },
        "file": {"reads": "cold" if cold else "warm", "scratch_parent": os.path.abspath(args.out), "methods": local},
        "faster_engine": engines,
        "targets": {"ckptkit_x_raw_min": TARGET_VS_RAW, "ckptkit_x_dcp_above": TARGET_VS_DCP, **targets},
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                 "ckptkit": ckptkit.__version__, "platform": platform.platform(), **versions},
    }


def run(args: argparse.Namespace) -> int:
    target = (32 if args.quick else args.mib) * MiB
    cfg = config_for(target)
    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="bench_s3-scratch-", dir=args.out)
    server: MotoProcess | None = None
    try:
        t0 = time.perf_counter()
        state = build_state(cfg, "random")
        src = flat(state)
        total_bytes = sum(t.nbytes for t in src.values())
        print(f"bench_s3: {len(src)} tensors, {total_bytes / MiB:.1f} MiB (hidden {cfg.hidden}, ffn {cfg.ffn}, "
              f"{cfg.layers} layers, vocab {cfg.vocab}); built in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)

        os.environ.update(CREDENTIALS)
        server = MotoProcess(os.path.join(scratch, "moto.log"))
        os.environ["AWS_ENDPOINT_URL"] = server.endpoint
        bucket = server.new_bucket()
        print(f"bench_s3: moto server pid {server.proc.pid} at {server.endpoint}, bucket {bucket}", file=sys.stderr, flush=True)
        methods = Methods(args.dcp_threads)

        def s3_stored(name: str) -> tuple[int, int]:
            objs = server.objects(bucket, name + "/")
            return sum(s for _, s in objs), len(objs)

        s3 = run_scheme(
            "s3", list(S3_METHODS), methods, cfg, state, src, args.reps,
            location=lambda name: f"s3://{bucket}/{name}",
            stored=s3_stored,
            remove=lambda name: server.delete_prefix(bucket, name + "/"),
            before_load=lambda: None,
        )

        cold = not args.no_drop_caches and drop_page_cache()
        local_root = os.path.join(scratch, "file")
        os.makedirs(local_root)
        local = run_scheme(
            "file", list(FILE_METHODS), methods, cfg, state, src, args.reps,
            location=lambda name: os.path.join(local_root, name),
            stored=lambda name: tree_bytes(os.path.join(local_root, name)),
            remove=lambda name: remove_tree(os.path.join(local_root, name)),
            before_load=(lambda: drop_page_cache() and None) if cold else (lambda: os.sync()),
        )
        endpoint = server.endpoint
    except BaseException:
        if server is not None and server.proc.poll() is not None:
            print(f"bench_s3: the moto server died (exit {server.proc.returncode}); its log ends:\n{server.log_tail()}", file=sys.stderr)
        raise
    finally:
        if server is not None:
            server.stop()
        remove_tree(scratch)

    out = report(args, cfg, total_bytes, len(src), cold, endpoint, s3, local)
    path = os.path.join(args.out, "bench_s3.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"figures written to {path}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~32 MiB state instead of --mib (smoke test)")
    ap.add_argument("--mib", type=int, default=256, help="state size in MiB (default 256)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per method (default 3); the median is reported")
    ap.add_argument("--out", default="bench-out", help="local scratch directory and where bench_s3.json goes (default ./bench-out)")
    ap.add_argument("--dcp-threads", type=int, default=1, help="FsspecWriter thread_count for DCP (default 1, its default)")
    ap.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache before local loads (warm reads)")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    if args.mib < 1:
        ap.error("--mib must be >= 1")
    if args.dcp_threads < 1:
        ap.error("--dcp-threads must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\.checkpoint.*")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
