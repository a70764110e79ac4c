"""Offline reshard (``ckptkit reshard --to tp4pp2``) vs raw I/O of the same bytes.

One process builds a synthetic Megatron-GPT-shaped checkpoint (stacked
layers on axis 0, fused SwiGLU fc1, padded-vocab embedding and output layer;
bf16 weights plus fp32 ``main``, ``exp_avg``, ``exp_avg_sq``; >= 2 GiB by
default, ``--quick``: ~40 MiB) directly — no training — and saves it as a
tp2pp2 job would (4 virtual ranks, explicit pieces + partition rules, through
``write_offline``). Then, ``--reps`` times each (median reported; the page
cache dropped before every run when /proc/sys/vm/drop_caches is writable,
else warm — the report says which):

  raw copy   (baseline a) a subprocess reads every data object of the source
             in 64 MiB chunks and writes it to a new file, fsyncing each file
             and the directory (ckptkit fsyncs every object it writes): the
             least any rewrite of these bytes costs on this disk
  reshard    ``python -m ckptkit.cli.main reshard SRC DST --to tp4pp2 --json``
             in a subprocess: wall time (interpreter and torch import
             included) and peak RSS (``wait4`` rusage of that child)

Ratios: reshard wall / raw-copy wall (target <= 1.5x) and peak RSS / (3 x the
largest tensor + 300 MB) (target <= 1). The result is checked once: every
tensor read through ``ckptkit.open`` equals the source's.

Baseline (b), Megatron's own path for the same change (megatron-core
``dist_checkpointing``, torch_dist backend): the same tensors declared as
Megatron ``ShardedTensor``s (benchmarks/megatron_reshard_worker.py) are saved
at the source layout by one gloo process per rank (not timed); then one gloo
process per target rank loads its target-layout ShardedTensors and saves them
to a new directory: wall time (all processes, interpreter and imports
included), each rank's in-process seconds, and peak RSS summed over the
processes (and the largest). ``--megatron-size F`` runs it at a fraction of
the layers (ckptkit re-timed at that size for the ratio); ``--no-megatron``
skips it.

``--moe``: a mixture-of-experts GPT instead (64 routed SwiGLU experts per
layer stacked ``[layers, experts, ...]`` with expert rules, a router; >= 2
GiB, ``--quick``: ~0.25 GiB), resharded ``tp1pp1ep8 -> tp2pp1ep4`` by default
(experts regrouped over EP, every expert split over the expert TP degree
Megatron defaults to, ``etp = tp``), with the same two baselines (Megatron's
workers declare the experts on its expert rank generator's coordinates).

Run: .venv/bin/python benchmarks/bench_reshard.py [--quick] [--moe] [--reps 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, ROOT)

import torch  # noqa: E402

import ckptkit  # noqa: E402
from ckptkit.engine.offline_writer import OfflineCheckpoint, write_offline  # noqa: E402
from ckptkit.layout.box import Region  # noqa: E402
from ckptkit.layout.config import ParallelConfig  # noqa: E402
from ckptkit.layout.manifest import DTYPES, TensorMeta  # noqa: E402
from ckptkit.layout.rules import PartitionRule  # noqa: E402
from ckptkit.storage.url import open_store  # noqa: E402
from common import command_vs_raw_rows, run_main, GiB, MiB, drop_page_cache, median, remove_tree, spread, table, tree_bytes, write_results  # noqa: E402

RAW_COPY = r"""
import os, sys
src, dst = sys.argv[1], sys.argv[2]
buf = bytearray(64 << 20)
view = memoryview(buf)
for dirpath, _, names in os.walk(src):
    rel = os.path.relpath(dirpath, src)
    os.makedirs(os.path.join(dst, rel), exist_ok=True)
    for name in sorted(names):
        with open(os.path.join(dirpath, name), "rb", buffering=0) as fi, \
                open(os.path.join(dst, rel, name), "wb", buffering=0) as fo:
            while True:
                n = fi.readinto(view)
                if not n:
                    break
                fo.write(view[:n])
            os.fsync(fo.fileno())
    fd = os.open(os.path.join(dst, rel), os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)
"""


@dataclass(frozen=True)
class Model:
    hidden: int
    ffn: int
    layers: int
    vocab: int
    vocab_multiple: int = 128
    experts: int = 0  # MoE: routed experts per layer (0: a dense MLP)
    moe_ffn: int = 0


def specs(m: Model) -> dict[str, tuple[tuple[int, ...], str, PartitionRule]]:
    """Every tensor's model-space shape, dtype and the rule the Megatron adapter records."""
    h, L = m.hidden, m.layers
    weights: dict[str, tuple[tuple[int, ...], PartitionRule]] = {
        "embedding.word_embeddings.weight": ((m.vocab, h), PartitionRule(tp_axis=0, vocab_multiple=m.vocab_multiple, stage=0)),
        "output_layer.weight": ((m.vocab, h), PartitionRule(tp_axis=0, vocab_multiple=m.vocab_multiple, stage=-1)),
        "decoder.layers.self_attention.linear_qkv.weight": ((L, 3 * h, h), PartitionRule(tp_axis=1, layer_axis=0)),
        "decoder.layers.self_attention.linear_proj.weight": ((L, h, h), PartitionRule(tp_axis=2, layer_axis=0)),
        "decoder.layers.mlp.linear_fc1.weight": ((L, 2 * m.ffn, h), PartitionRule(tp_axis=1, layer_axis=0, fused=(m.ffn, m.ffn))),
        "decoder.layers.mlp.linear_fc2.weight": ((L, h, m.ffn), PartitionRule(tp_axis=2, layer_axis=0)),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": ((L, h), PartitionRule(layer_axis=0)),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": ((L, h), PartitionRule(layer_axis=0)),
        "decoder.final_layernorm.weight": ((h,), PartitionRule(stage=-1)),
    }
    if m.experts:
        E, f = m.experts, m.moe_ffn
        del weights["decoder.layers.mlp.linear_fc1.weight"], weights["decoder.layers.mlp.linear_fc2.weight"]
        weights.update({
            "decoder.layers.mlp.router.weight": ((L, E, h), PartitionRule(layer_axis=0)),
            "decoder.layers.mlp.experts.experts.linear_fc1.weight": (
                (L, E, 2 * f, h), PartitionRule(tp_axis=2, layer_axis=0, expert_axis=1, fused=(f, f))),
            "decoder.layers.mlp.experts.experts.linear_fc2.weight": (
                (L, E, h, f), PartitionRule(tp_axis=3, layer_axis=0, expert_axis=1)),
        })
    out = {f"model/{k}": (s, "bfloat16", r) for k, (s, r) in weights.items()}
    for group in ("main", "exp_avg", "exp_avg_sq"):
        out.update({f"optimizer/{group}/{k}": (s, "float32", r) for k, (s, r) in weights.items()})
    return out


class _Random:
    """PieceSource: each piece filled with seeded random numbers when it is written (never the model)."""

    def __init__(self, items: list[tuple[str, Region]], dtypes: dict[str, str], seed: int) -> None:
        self._items, self._dtypes, self._seed = items, dtypes, seed
        self.bytes_read = 0

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, ref: int) -> torch.Tensor:
        key, region = self._items[ref]
        gen = torch.Generator().manual_seed(self._seed * 100003 + ref)
        dtype = torch.bfloat16 if self._dtypes[key] == "bfloat16" else torch.float32
        return torch.randn(region.box.sizes, generator=gen, dtype=torch.float32).to(dtype)


def build_source(path: str, m: Model, config: ParallelConfig) -> tuple[int, int]:
    """Write the checkpoint at ``config``; returns (logical bytes, largest tensor bytes)."""
    pieces: dict[int, list[tuple[str, Region]]] = {}
    metas: dict[str, TensorMeta] = {}
    for key, (shape, dtype, rule) in specs(m).items():
        layout = rule.evaluate(shape, config, m.layers)
        for box, cell in layout.all_boxes():
            if box.numel:
                pieces.setdefault(layout.writer_rank(cell, 0), []).append((key, Region(box)))
        metas[key] = TensorMeta(key, dtype, shape, layout, 0, rule)
    dtypes = {k: meta.dtype for k, meta in metas.items()}
    checkpoint = OfflineCheckpoint(config.world_size, metas, pieces, values={"step": 1000}, parallel=str(config),
                                   layouts=metas)
    write_offline(open_store(path), checkpoint, lambda rank, items: _Random(list(items), dtypes, rank))
    sizes = [meta.numel * DTYPES[meta.dtype] for meta in metas.values()]
    return sum(sizes), max(sizes)


# Peak RSS is measured one process removed. Linux keeps ru_maxrss across execve and, at exec,
# records the high-water mark of the memory the process had before it: a child spawned (vfork or
# fork) by this benchmark, which holds torch and has built a 2 GiB checkpoint, would report this
# process's own peak (measured: 1.1 GiB for a command whose own peak is 0.57 GiB). So a small
# torch-free interpreter starts the command and reports the command's wait4 rusage in a file.
MEASURE = r"""
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss * 1024))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def measured(cmd: list[str], rss_file: str) -> list[str]:
    """``cmd`` started through the small measuring interpreter (its peak RSS lands in ``rss_file``)."""
    return [sys.executable, "-S", "-c", MEASURE, rss_file, *cmd]


def read_rss(rss_file: str) -> int:
    with open(rss_file) as f:
        return int(f.read())


def run_child(cmd: list[str]) -> tuple[float, int, str]:
    """Run ``cmd``: (wall seconds, peak RSS bytes of that very command, stdout)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile(suffix=".rss") as rss:
        proc = subprocess.Popen(measured(cmd, rss.name), stdout=out, stderr=err)
        proc.wait()
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd[:5])} failed ({proc.returncode}): {err.read().decode()[-2000:]}")
        return wall, read_rss(rss.name), out.read().decode()


def against_raw_copy(src: str, scratch: str, reps: int, name: str, cli_args: Callable[[str], list[str]],
                     check: Callable[[str], None]) -> tuple[list[float], list[float], list[int], list[float], bool]:
    """Alternate, ``reps`` times, a raw fsynced copy of ``src`` (the baseline) and the ckptkit command
    ``cli_args(dst)`` (run with ``--json``, which prints its own ``seconds``), each from a cold page cache
    where it can be dropped; ``check(dst)`` after the command's first run. Returns the raw walls, the
    command's walls, peak RSS and inner seconds, and whether every run started cold."""
    raw_t: list[float] = []
    walls: list[float] = []
    rss: list[int] = []
    inner: list[float] = []
    cold = True
    for rep in range(reps):
        for which in ("raw", name):
            dst = os.path.join(scratch, f"{which}-{rep}")
            cold &= drop_page_cache()
            if which == "raw":
                wall, _, _ = run_child([sys.executable, "-c", RAW_COPY, src, dst])
                raw_t.append(wall)
            else:
                wall, peak, out = run_child([sys.executable, "-m", "ckptkit.cli.main", *cli_args(dst), "--json"])
                walls.append(wall)
                rss.append(peak)
                inner.append(json.loads(out)["seconds"])
                if rep == 0:
                    check(dst)
            print(f"  rep {rep} {which}: {wall:.2f}s", flush=True)
            remove_tree(dst)
    return raw_t, walls, rss, inner, cold


MEGATRON_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_reshard_worker.py")


def run_ranks(world: int, args: list[str], port: int) -> tuple[float, list[int], list[dict]]:
    """``world`` gloo processes of the Megatron worker: (wall seconds until all exited, each one's peak
    RSS from ``wait4`` (its own, or a helper process's if larger), each one's JSON line if it printed one)."""
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    rss_dir = tempfile.mkdtemp(prefix="rss-")
    t0 = time.perf_counter()
    procs, outs = [], []
    for rank in range(world):
        out = tempfile.TemporaryFile()
        cmd = measured([sys.executable, MEGATRON_WORKER, *args], os.path.join(rss_dir, str(rank)))
        procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(rank)), stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True))
        outs.append(out)
    failed = None
    while any(p.returncode is None for p in procs):
        for proc in procs:
            if proc.returncode is None and proc.poll() is not None and proc.returncode and failed is None:
                failed = proc
                for other in procs:  # one rank failed: the others would wait in a collective forever
                    if other.poll() is None:
                        os.killpg(other.pid, signal.SIGKILL)
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    rss = [read_rss(os.path.join(rss_dir, str(r))) if procs[r].returncode == 0 else 0 for r in range(world)]
    remove_tree(rss_dir)
    lines = []
    for proc, out in zip(procs, outs):
        out.seek(0)
        text = out.read().decode(errors="replace")
        out.close()
        if proc is failed:
            raise RuntimeError(f"megatron worker {' '.join(args[:1])} rank {procs.index(proc)} failed "
                               f"({proc.returncode}): {text[-3000:]}")
        lines += [json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]
    return wall, rss, lines


def megatron_model(m: Model, scale: float) -> Model:
    """The benchmark's model with its layer count scaled by ``scale`` (>= 4 layers; ``pp`` divides it)."""
    if scale >= 1:
        return m
    return Model(m.hidden, m.ffn, max(4, int(round(m.layers * scale / 4)) * 4), m.vocab, m.vocab_multiple,
                 m.experts, m.moe_ffn)


def check_equal(src: str, dst: str) -> None:
    a, b = ckptkit.open(src), ckptkit.open(dst)
    assert a.keys() == b.keys()
    for key in a.keys():
        assert torch.equal(a[key].read(), b[key].read()), key


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~40 MiB instead of >= 2 GiB (smoke test)")
    ap.add_argument("--reps", type=int, default=1, help="repetitions of each method (median reported)")
    ap.add_argument("--out", default="bench-out", help="scratch and results directory")
    ap.add_argument("--moe", action="store_true", help="a mixture-of-experts GPT (64 experts), ep8 -> tp2 ep4")
    ap.add_argument("--source", default=None, help="default tp2pp2 (--moe: tp1pp1ep8)")
    ap.add_argument("--target", default=None, help="default tp4pp2 (--moe: tp2pp1ep4)")
    ap.add_argument("--max-memory", default="1GiB")
    ap.add_argument("--no-megatron", action="store_true", help="skip baseline (b), Megatron dist_checkpointing")
    ap.add_argument("--megatron-size", type=float, default=1.0,
                    help="baseline (b) at this fraction of the layers (ckptkit re-timed at that size too)")
    args = ap.parse_args(argv)
    args.source = args.source or ("tp1pp1ep8" if args.moe else "tp2pp2")
    args.target = args.target or ("tp2pp1ep4" if args.moe else "tp4pp2")
    return args


def _layout_spec(c: ParallelConfig) -> dict:
    return {"tp": c.tp, "pp": c.pp, "dp": c.dp, "ep": c.ep, "etp": c.expert_tp}


def megatron_baseline(args: argparse.Namespace, m: Model, scratch: str, cold: bool) -> dict:
    """Baseline (b): Megatron's own change of layout, load at the source + save at the target, on
    gloo processes (one per rank of each layout), against ``ckptkit reshard`` of the same tensors."""
    sc, tc = ParallelConfig.parse(args.source), ParallelConfig.parse(args.target)
    mm = megatron_model(m, args.megatron_size)
    spec = {"hidden": mm.hidden, "ffn": mm.ffn, "layers": mm.layers, "vocab": mm.vocab, "experts": mm.experts,
            "moe_ffn": mm.moe_ffn}
    msrc, mdst = os.path.join(scratch, "meg-src"), os.path.join(scratch, "meg-dst")
    t0 = time.perf_counter()
    os.makedirs(msrc)  # dist_checkpointing.save wants an existing, empty directory
    run_ranks(sc.world_size, ["save", json.dumps({**spec, **_layout_spec(sc)}), msrc], 29500 + os.getpid() % 1000)
    stored, files = tree_bytes(msrc)
    print(f"megatron source {args.source}: {stored / GiB:.2f} GiB in {files} files, layers {mm.layers} "
          f"(saved in {time.perf_counter() - t0:.1f}s)", flush=True)
    csrc = None
    if mm != m:
        csrc = os.path.join(scratch, "ckpt-src-small")
        build_source(csrc, mm, sc)
    walls, inner, sums, maxes, ck = [], [], [], [], []
    for rep in range(args.reps):
        cold &= drop_page_cache()
        os.makedirs(mdst)
        wall, rss, lines = run_ranks(tc.world_size, ["reshard", json.dumps({**spec, **_layout_spec(tc)}), msrc,
                                                      mdst], 29500 + (os.getpid() + rep + 1) % 1000)
        walls.append(wall)
        inner.append(max(ln["seconds"] for ln in lines))
        sums.append(sum(rss))
        maxes.append(max(rss))
        print(f"  rep {rep} megatron load+save: {wall:.2f}s (in process {inner[-1]:.2f}s), RSS sum "
              f"{sums[-1] / MiB:.0f} MiB, max {maxes[-1] / MiB:.0f} MiB", flush=True)
        remove_tree(mdst)
        if csrc is not None:
            dst = os.path.join(scratch, f"ckpt-small-{rep}")
            cold &= drop_page_cache()
            w, _, _ = run_child([sys.executable, "-m", "ckptkit.cli.main", "reshard", csrc, dst, "--to", args.target,
                                 "--max-memory", args.max_memory, "--json"])
            ck.append(w)
            print(f"  rep {rep} ckptkit reshard at that size: {w:.2f}s", flush=True)
            remove_tree(dst)
    remove_tree(msrc)
    return {"megatron_layers": mm.layers, "megatron_bytes": stored, "megatron_seconds": median(walls),
            "megatron_inner_seconds": median(inner), "megatron_rss_sum": max(sums), "megatron_rss_max": max(maxes),
            "ckptkit_seconds_same_size": median(ck) if ck else None, "cold_cache": cold}


def run(args: argparse.Namespace) -> int:
    if args.moe:  # 64 experts; >= 2 GiB: 2 layers x 64 x 1.5M expert parameters at 14 bytes each (+ dense)
        m = Model(hidden=256, ffn=0, layers=4, vocab=8000, experts=64, moe_ffn=64) if args.quick else \
            Model(hidden=1024, ffn=0, layers=2, vocab=32000, experts=64, moe_ffn=512)
    else:
        m = Model(hidden=256, ffn=704, layers=4, vocab=8000) if args.quick else \
            Model(hidden=1024, ffn=2816, layers=8, vocab=32000)
    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="bench_reshard-scratch-", dir=args.out)
    try:
        src = os.path.join(scratch, "src")
        t0 = time.perf_counter()
        total, largest = build_source(src, m, ParallelConfig.parse(args.source))
        stored, files = tree_bytes(src)
        print(f"source {args.source}: {total / GiB:.2f} GiB logical, {stored / GiB:.2f} GiB in {files} files, "
              f"largest tensor {largest / MiB:.0f} MiB (built in {time.perf_counter() - t0:.1f}s)", flush=True)
        raw_t, rs_t, rs_rss, rs_inner, cold = against_raw_copy(
            src, scratch, args.reps, "reshard",
            lambda dst: ["reshard", src, dst, "--to", args.target, "--max-memory", args.max_memory],
            lambda dst: check_equal(src, dst))
        rss_target = 3 * largest + 300 * 10**6
        rows = command_vs_raw_rows("raw copy (baseline a)", raw_t, f"reshard {args.source}->{args.target}", rs_t,
                                   rs_inner, total, rs_rss)
        print(f"\npage cache: {'dropped before every run' if cold else 'warm (drop_caches not writable)'}; "
              f"reps {args.reps}, spread raw {spread(raw_t):.2f} reshard {spread(rs_t):.2f}")
        print(table(["method", "seconds", "MiB/s", "x raw", "peak RSS"], rows))
        print(f"\nwall vs raw I/O: {median(rs_t) / median(raw_t):.2f}x (target <= 1.5x); "
              f"peak RSS {max(rs_rss) / MiB:.0f} MiB vs 3 x largest tensor + 300 MB = {rss_target / MiB:.0f} MiB: "
              f"{max(rs_rss) / rss_target:.2f}x (target <= 1)")
        meg: dict = {}
        if not args.no_megatron:
            meg = megatron_baseline(args, m, scratch, cold)
            ck = meg["ckptkit_seconds_same_size"] or median(rs_t)
            print(f"\nbaseline (b), Megatron dist_checkpointing load {args.source} + save {args.target} on "
                  f"{ParallelConfig.parse(args.target).world_size} gloo processes ({meg['megatron_bytes'] / GiB:.2f} GiB, "
                  f"{meg['megatron_layers']} layers): {meg['megatron_seconds']:.2f}s wall "
                  f"({meg['megatron_inner_seconds']:.2f}s in process), peak RSS summed over ranks "
                  f"{meg['megatron_rss_sum'] / MiB:.0f} MiB (max one rank {meg['megatron_rss_max'] / MiB:.0f} MiB); "
                  f"ckptkit reshard / Megatron wall: {ck / meg['megatron_seconds']:.2f}x (target < 1)")
        write_results(args.out, "bench_reshard_moe" if args.moe else "bench_reshard", {**meg,
            "quick": args.quick, "moe": args.moe, "experts": m.experts, "source": args.source, "target": args.target, "bytes": total,
            "largest_tensor": largest, "cold_cache": cold, "reps": args.reps,
            "raw_seconds": median(raw_t), "reshard_seconds": median(rs_t), "reshard_inner_seconds": median(rs_inner),
            "wall_ratio": median(rs_t) / median(raw_t), "peak_rss": max(rs_rss), "rss_target": rss_target,
            "rss_ratio": max(rs_rss) / rss_target, "max_memory": args.max_memory,
        })
        return 0
    finally:
        remove_tree(scratch)


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
