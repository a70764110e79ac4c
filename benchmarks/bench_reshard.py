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

Baseline (b), Megatron's own dist_checkpointing load + save at the target
layout, is not implemented yet (see docs/benchmarks.md).

Run: .venv/bin/python benchmarks/bench_reshard.py [--quick] [--reps 1] [--out DIR]
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
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, ROOT)

import torch  # noqa: E402

import ckptkit  # noqa: E402
from ckptkit.engine.offline_writer import write_offline  # noqa: E402
from ckptkit.layout.box import Region  # noqa: E402
from ckptkit.layout.config import ParallelConfig  # noqa: E402
from ckptkit.layout.manifest import DTYPES, TensorMeta  # noqa: E402
from ckptkit.layout.rules import PartitionRule  # noqa: E402
from ckptkit.storage.url import open_store  # noqa: E402
from common import GiB, MiB, drop_page_cache, median, remove_tree, spread, table, tree_bytes, write_results  # noqa: E402

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


def specs(m: Model) -> dict[str, tuple[tuple[int, ...], str, PartitionRule]]:
    """Every tensor's model-space shape, dtype and the rule the Megatron adapter records."""
    h, L = m.hidden, m.layers
    weights = {
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
    write_offline(open_store(path), world_size=config.world_size, tensors=metas, pieces=pieces,
                  source=lambda rank, items: _Random(list(items), dtypes, rank), values={"step": 1000},
                  parallel=str(config), layouts=metas)
    sizes = [meta.numel * DTYPES[meta.dtype] for meta in metas.values()]
    return sum(sizes), max(sizes)


def run_child(cmd: list[str]) -> tuple[float, int, str]:
    """Run ``cmd``: (wall seconds, peak RSS bytes of that very child from ``wait4``, stdout)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd[:5])} failed ({proc.returncode}): {err.read().decode()[-2000:]}")
        return wall, usage.ru_maxrss * 1024, out.read().decode()


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
    ap.add_argument("--source", default="tp2pp2")
    ap.add_argument("--target", default="tp4pp2")
    ap.add_argument("--max-memory", default="1GiB")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    m = Model(hidden=256, ffn=704, layers=4, vocab=8000) if args.quick else Model(hidden=1024, ffn=2816, layers=8, vocab=32000)
    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="bench_reshard-scratch-", dir=args.out)
    try:
        src = os.path.join(scratch, "src")
        t0 = time.perf_counter()
        total, largest = build_source(src, m, ParallelConfig.parse(args.source))
        stored, files = tree_bytes(src)
        print(f"source {args.source}: {total / GiB:.2f} GiB logical, {stored / GiB:.2f} GiB in {files} files, "
              f"largest tensor {largest / MiB:.0f} MiB (built in {time.perf_counter() - t0:.1f}s)", flush=True)
        raw_t, rs_t, rs_rss, rs_inner = [], [], [], []
        cold = True
        for rep in range(args.reps):
            for name in ("raw", "reshard"):
                dst = os.path.join(scratch, f"{name}-{rep}")
                cold &= drop_page_cache()
                if name == "raw":
                    wall, _, _ = run_child([sys.executable, "-c", RAW_COPY, src, dst])
                    raw_t.append(wall)
                else:
                    env_cmd = [sys.executable, "-m", "ckptkit.cli.main", "reshard", src, dst, "--to", args.target,
                               "--max-memory", args.max_memory, "--json"]
                    wall, rss, out = run_child(env_cmd)
                    rs_t.append(wall)
                    rs_rss.append(rss)
                    rs_inner.append(json.loads(out)["seconds"])
                    if rep == 0:
                        check_equal(src, dst)
                print(f"  rep {rep} {name}: {wall:.2f}s", flush=True)
                remove_tree(dst)
        rss_target = 3 * largest + 300 * 10**6
        rows = [
            ["raw copy (baseline a)", f"{median(raw_t):.2f}", f"{total / MiB / median(raw_t):.0f}", "1.00", "-"],
            [f"reshard {args.source}->{args.target}", f"{median(rs_t):.2f}", f"{total / MiB / median(rs_t):.0f}",
             f"{median(rs_t) / median(raw_t):.2f}", f"{max(rs_rss) / MiB:.0f} MiB"],
            ["  (inside the command)", f"{median(rs_inner):.2f}", f"{total / MiB / median(rs_inner):.0f}",
             f"{median(rs_inner) / median(raw_t):.2f}", ""],
        ]
        print(f"\npage cache: {'dropped before every run' if cold else 'warm (drop_caches not writable)'}; "
              f"reps {args.reps}, spread raw {spread(raw_t):.2f} reshard {spread(rs_t):.2f}")
        print(table(["method", "seconds", "MiB/s", "x raw", "peak RSS"], rows))
        print(f"\nwall vs raw I/O: {median(rs_t) / median(raw_t):.2f}x (target <= 1.5x); "
              f"peak RSS {max(rs_rss) / MiB:.0f} MiB vs 3 x largest tensor + 300 MB = {rss_target / MiB:.0f} MiB: "
              f"{max(rs_rss) / rss_target:.2f}x (target <= 1)")
        write_results(args.out, "bench_reshard", {
            "quick": args.quick, "source": args.source, "target": args.target, "bytes": total,
            "largest_tensor": largest, "cold_cache": cold, "reps": args.reps,
            "raw_seconds": median(raw_t), "reshard_seconds": median(rs_t), "reshard_inner_seconds": median(rs_inner),
            "wall_ratio": median(rs_t) / median(raw_t), "peak_rss": max(rs_rss), "rss_target": rss_target,
            "rss_ratio": max(rs_rss) / rss_target, "max_memory": args.max_memory,
        })
        return 0
    finally:
        remove_tree(scratch)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run_all stops us: clean the scratch directory
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
