"""Hugging Face safetensors export (``ckptkit convert --format hf``) of an MoE model vs a raw write.

One process builds a synthetic torchtitan-style Qwen3-MoE checkpoint directly (no training):
bf16 weights under ``model/`` with torchtitan's names (``layers.N.moe.routed_experts.inner_experts
.w1_EFD`` ``[E, F, D]`` ... with 64 routed experts per layer, the router, q/k norms, an embedding
and an output projection; >= 2 GiB by default, ``--quick``: ~50 MiB), written through
``write_offline`` with one stored piece per expert. Then, ``--reps`` times each (median reported;
the page cache dropped before every run when /proc/sys/vm/drop_caches is writable, else warm —
the report says which):

  raw write  (baseline) a subprocess writes the same number of bytes, from one 64 MiB buffer, into
             as many files as the export writes shards, fsyncing each (ckptkit fsyncs every shard):
             the least any writer of these bytes costs on this disk
  hf export  ``python -m ckptkit.cli.main convert SRC OUT --format hf --hf-config config.json --json``
             in a subprocess: wall time (interpreter and torch import included) and peak RSS
             (``wait4`` rusage of that very command, measured one process removed as
             benchmarks/bench_reshard.py explains)

  hf export --max-memory 32MiB
             the same export under a memory budget: every HF tensor written in slabs of rows
             (converters/hf/slabs.py); the files must be the unbudgeted export's, byte for byte

Ratios: export wall / raw-write wall, and peak RSS / (2 x the largest checkpoint tensor + 300 MB)
(target <= 1: the export streams one expert slice at a time, never a shard or a stacked tensor);
under the budget, peak RSS / (the budget + 300 MiB for the interpreter, torch and ckptkit: ``--quick``'s
export peaks at about 280 MiB) (target <= 1: no tensor is held whole).
The result is checked once: every HF tensor of layer 0 and the embedding against the source,
read through ``ckptkit.open``.

Run: .venv/bin/python benchmarks/bench_hf_export.py [--quick] [--reps 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from math import prod

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, ROOT)

import torch
from bench_reshard import run_child
from common import (
    command_vs_raw_rows,
    GiB,
    MiB,
    drop_page_cache,
    quick_reps_out_args,
    run_main,
    median,
    remove_tree,
    spread,
    table,
    tree_bytes,
    write_results,
)

from ckptkit.engine.offline_writer import OfflineCheckpoint, write_offline
from ckptkit.layout.box import Box, Region
from ckptkit.layout.manifest import DTYPES
from ckptkit.storage.url import open_store

RAW_WRITE = r"""
import os, sys
dst, total, files = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(dst)
buf = memoryview(bytearray(os.urandom(1 << 20)) * 64)
per = -(-total // files)
for i in range(files):
    left = min(per, total - i * per)
    with open(os.path.join(dst, f"part-{i:05d}"), "wb", buffering=0) as fo:
        while left > 0:
            n = fo.write(buf[:min(left, len(buf))])
            left -= n
        os.fsync(fo.fileno())
fd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
os.fsync(fd)
os.close(fd)
"""


@dataclass(frozen=True)
class Model:
    dim: int
    layers: int
    vocab: int
    experts: int
    moe_ffn: int
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 128


def specs(m: Model) -> dict[str, tuple[int, ...]]:
    """Every tensor of the torchtitan Qwen3-MoE state (``model/`` keys) and its shape."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    out = {"tok_embeddings.weight": (m.vocab, m.dim), "norm.weight": (m.dim,), "lm_head.weight": (m.vocab, m.dim)}
    for layer in range(m.layers):
        p = f"layers.{layer}."
        out.update({
            p + "attention.qkv_linear.wq.weight": (q, m.dim), p + "attention.qkv_linear.wk.weight": (kv, m.dim),
            p + "attention.qkv_linear.wv.weight": (kv, m.dim), p + "attention.wo.weight": (m.dim, q),
            p + "attention.q_norm.weight": (m.head_dim,), p + "attention.k_norm.weight": (m.head_dim,),
            p + "attention_norm.weight": (m.dim,), p + "ffn_norm.weight": (m.dim,),
            p + "moe.router.gate.weight": (m.experts, m.dim), p + "moe.expert_bias_E": (m.experts,),
            p + "moe.routed_experts.inner_experts.w1_EFD": (m.experts, m.moe_ffn, m.dim),
            p + "moe.routed_experts.inner_experts.w3_EFD": (m.experts, m.moe_ffn, m.dim),
            p + "moe.routed_experts.inner_experts.w2_EDF": (m.experts, m.dim, m.moe_ffn),
        })
    return {"model/" + k: s for k, s in out.items()}


@dataclass(frozen=True)
class _Spec:
    dtype: str
    shape: tuple[int, ...]


class _Random:
    """PieceSource: each piece filled with seeded random numbers when it is written (never the model)."""

    def __init__(self, items: list[tuple[str, Region]]) -> None:
        self._items = items
        self.bytes_read = 0

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, ref: int) -> torch.Tensor:
        _, region = self._items[ref]
        gen = torch.Generator().manual_seed(ref)
        return torch.randn(region.box.sizes, generator=gen, dtype=torch.float32).to(torch.bfloat16)


def build_source(path: str, m: Model) -> tuple[int, int]:
    """Write the checkpoint (one piece per expert of each stacked tensor); (logical bytes, largest tensor)."""
    shapes = specs(m)
    tensors = {k: _Spec("bfloat16", s) for k, s in shapes.items()}
    items: list[tuple[str, Region]] = []
    for key, shape in shapes.items():
        if key.endswith(("_EFD", "_EDF")):
            items += [(key, Region(Box((e, 0, 0), (1, *shape[1:])))) for e in range(shape[0])]
        else:
            items.append((key, Region(Box(tuple(0 for _ in shape), shape))))
    write_offline(open_store(path), OfflineCheckpoint(1, tensors, {0: items}, values={"step": 1000}),
                  lambda rank, its: _Random(list(its)))
    sizes = [prod(s) * DTYPES["bfloat16"] for s in shapes.values()]
    return sum(sizes), max(sizes)


def check_equal(src: str, dst: str, m: Model) -> None:
    """Layer 0's HF tensors (every expert) and the embedding equal the source's slices."""
    from safetensors import safe_open

    import ckptkit

    view = ckptkit.open(src)
    with open(os.path.join(dst, "model.safetensors.index.json")) as f:
        index = json.load(f)["weight_map"]
    inner = "model/layers.0.moe.routed_experts.inner_experts."
    want = {"model.embed_tokens.weight": view["model/tok_embeddings.weight"][...]}
    for e in (0, m.experts // 2, m.experts - 1):
        x = f"model.layers.0.mlp.experts.{e}."
        want[x + "gate_proj.weight"] = view[inner + "w1_EFD"][e]
        want[x + "up_proj.weight"] = view[inner + "w3_EFD"][e]
        want[x + "down_proj.weight"] = view[inner + "w2_EDF"][e]
    for name, t in want.items():
        with safe_open(os.path.join(dst, index[name]), framework="pt") as f:
            if not torch.equal(f.get_tensor(name), t):
                raise AssertionError(f"{name} differs from the source")
    experts = [n for n in index if ".mlp.experts." in n]
    if len(experts) != 3 * m.experts * m.layers:
        raise AssertionError(f"{len(experts)} expert tensors exported, expected {3 * m.experts * m.layers}")


BUDGET = 32 * MiB


def same_files(a: str, b: str) -> None:
    """The budgeted export's files are the unbudgeted one's, byte for byte (the benchmark stops otherwise)."""
    names = sorted(os.listdir(a))
    if names != sorted(os.listdir(b)):
        raise SystemExit(f"the budgeted export wrote {sorted(os.listdir(b))}, the unbudgeted {names}")
    for n in names:
        with open(os.path.join(a, n), "rb") as fa, open(os.path.join(b, n), "rb") as fb:
            while True:
                x, y = fa.read(1 << 24), fb.read(1 << 24)
                if x != y:
                    raise SystemExit(f"{n} differs between the budgeted and the unbudgeted export")
                if not x:
                    break


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return quick_reps_out_args(__doc__, "~50 MiB instead of >= 2 GiB (smoke test)", argv)


def run(args: argparse.Namespace) -> int:
    # >= 2 GiB: 4 layers x 3 x 64 experts x 768 x 2048 bf16 (2.25 GiB) + attention, embedding, output
    m = Model(dim=256, layers=2, vocab=8000, experts=64, moe_ffn=128, heads=4, kv_heads=2, head_dim=64) \
        if args.quick else Model(dim=2048, layers=4, vocab=32000, experts=64, moe_ffn=768)
    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="bench_hf_export-scratch-", dir=args.out)
    try:
        src = os.path.join(scratch, "src")
        t0 = time.perf_counter()
        total, largest = build_source(src, m)
        stored, files = tree_bytes(src)
        print(f"source: {total / GiB:.2f} GiB logical, {stored / GiB:.2f} GiB in {files} files, {m.layers} layers x "
              f"{m.experts} experts, largest tensor {largest / MiB:.0f} MiB (built in {time.perf_counter() - t0:.1f}s)",
              flush=True)
        config = os.path.join(scratch, "config.json")
        with open(config, "w") as f:
            json.dump({"model_type": "qwen3_moe", "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads,
                       "head_dim": m.head_dim, "hidden_size": m.dim, "vocab_size": m.vocab,
                       "num_hidden_layers": m.layers, "num_experts": m.experts, "tie_word_embeddings": False}, f)
        raw_t, hf_t, hf_rss, hf_inner, hf_bytes, shards = [], [], [], [], 0, 1
        b_t, b_rss, b_inner = [], [], []
        cold = True
        for rep in range(args.reps):
            for name in ("hf", "budget", "raw"):  # the export first: the raw write needs its shard count
                dst = os.path.join(scratch, f"{name}-{rep}")
                cold &= drop_page_cache()
                if name == "raw":
                    wall, _, _ = run_child([sys.executable, "-c", RAW_WRITE, dst, str(hf_bytes), str(shards)])
                    raw_t.append(wall)
                else:
                    cmd = [sys.executable, "-m", "ckptkit.cli.main", "convert", src, dst, "--format", "hf",
                           "--hf-config", config, "--json"] + (["--max-memory", str(BUDGET)] if name == "budget" else [])
                    wall, rss, out = run_child(cmd)
                    result = json.loads(out)
                    (hf_t if name == "hf" else b_t).append(wall)
                    (hf_rss if name == "hf" else b_rss).append(rss)
                    (hf_inner if name == "hf" else b_inner).append(result["seconds"])
                    if name == "hf":
                        hf_bytes, _ = tree_bytes(dst)
                        shards = sum(n.endswith(".safetensors") for n in os.listdir(dst))
                    if rep == 0 and name == "hf":
                        check_equal(src, dst, m)
                    if rep == 0 and name == "budget":
                        same_files(os.path.join(scratch, f"hf-{rep}"), dst)
                print(f"  rep {rep} {name}: {wall:.2f}s", flush=True)
                if name != "hf":
                    remove_tree(dst)
            remove_tree(os.path.join(scratch, f"hf-{rep}"))
        rss_target = 2 * largest + 300 * 10**6
        rows = command_vs_raw_rows("raw write (baseline)", raw_t, f"hf export ({shards} shards)", hf_t, hf_inner,
                                   hf_bytes, hf_rss)
        rows += command_vs_raw_rows("raw write (baseline)", raw_t, f"hf export --max-memory {BUDGET // MiB}MiB", b_t,
                                    b_inner, hf_bytes, b_rss)[1:]
        budget_target = BUDGET + 300 * MiB  # the interpreter, torch and ckptkit: --quick's export peaks at ~280 MiB
        print(f"\npage cache: {'dropped before every run' if cold else 'warm (drop_caches not writable)'}; "
              f"reps {args.reps}, spread raw {spread(raw_t):.2f} export {spread(hf_t):.2f}")
        print(table(["method", "seconds", "MiB/s", "x raw", "peak RSS"], rows))
        print(f"\nexport wall vs raw write: {median(hf_t) / median(raw_t):.2f}x; peak RSS {max(hf_rss) / MiB:.0f} MiB "
              f"vs 2 x largest tensor + 300 MB = {rss_target / MiB:.0f} MiB: {max(hf_rss) / rss_target:.2f}x "
              f"(target <= 1)")
        print(f"under --max-memory {BUDGET // MiB}MiB: wall {median(b_t) / median(raw_t):.2f}x raw, "
              f"{median(b_t) / median(hf_t):.2f}x the unbudgeted export; peak RSS {max(b_rss) / MiB:.0f} MiB vs the "
              f"budget + 300 MiB = {budget_target / MiB:.0f} MiB: {max(b_rss) / budget_target:.2f}x (target <= 1); "
              f"{max(b_rss) / max(hf_rss):.2f}x the unbudgeted export's")
        write_results(args.out, "bench_hf_export", {
            "quick": args.quick, "experts": m.experts, "layers": m.layers, "bytes": total, "hf_bytes": hf_bytes,
            "shards": shards, "largest_tensor": largest, "cold_cache": cold, "reps": args.reps,
            "raw_seconds": median(raw_t), "export_seconds": median(hf_t), "export_inner_seconds": median(hf_inner),
            "wall_ratio": median(hf_t) / median(raw_t), "peak_rss": max(hf_rss), "rss_target": rss_target,
            "rss_ratio": max(hf_rss) / rss_target,
            "budget": BUDGET, "budget_seconds": median(b_t), "budget_peak_rss": max(b_rss),
            "budget_rss_ratio": max(b_rss) / budget_target,
        })
        return 0
    finally:
        remove_tree(scratch)


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
