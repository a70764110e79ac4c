"""Planning and manifest merge for a simulated 16,384-rank job, on one core, no I/O.

A 70B-class GPT (80 layers, hidden 8192, SwiGLU, GQA, vocab 128256) at
tp8 pp16 dp128. Every logical tensor has a partition rule; the optimizer
moments are stored either

* ``rules``: sharded over data parallelism by rule (ZeRO-3 / FSDP style boxes), or
* ``distopt``: as Megatron's distributed optimizer holds them, flat fragments of
  each model-parallel rank's flattened buffer cut into 128 equal DP ranges,
  declared piece by piece (``Sharded`` / explicit layout).

Measured, separately:
  per-rank planning time (what each rank does before writing; ranks run it in parallel),
  rank 0's merge of all 16,384 reports into the manifest, and its serialization,
  a loading rank's metadata work at a *different* layout (tp8 pp8 dp256): parse the
  manifest, match its targets, parse the indexes it needs, plan its reads.
Targets: merge <= 5 s; a loading rank's metadata <= 1 s.

Run: .venv/bin/python benchmarks/bench_plan_scale.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckptkit.layout.box import Region  # noqa: E402
from ckptkit.layout.config import ParallelConfig  # noqa: E402
from ckptkit.layout.index import Index, IndexEntry  # noqa: E402
from ckptkit.layout.manifest import IndexRef, Manifest, sha256_hex  # noqa: E402
from ckptkit.layout.pieces import LocalBox, LocalFlat, Piece  # noqa: E402
from ckptkit.layout.rules import PartitionRule  # noqa: E402
from ckptkit.plan.load_plan import Target, match_sources, plan_reads  # noqa: E402
from ckptkit.plan.merge import RankReport, merge_reports  # noqa: E402
from ckptkit.plan.save_plan import ExplicitDecl, GridDecl, index_object_key, plan_save  # noqa: E402

BF16, FP32 = ("bfloat16", 2), ("float32", 4)


def gpt_params(layers: int, h: int, ffn: int, vocab: int, heads: int, groups: int) -> list[tuple[str, tuple[int, ...], PartitionRule]]:
    hd = h // heads
    qkv = (heads + 2 * groups) * hd
    out = [("embedding.word_embeddings.weight", (vocab, h), PartitionRule(tp_axis=0, vocab_multiple=128, stage=0))]
    for i in range(layers):
        p = f"decoder.layers.{i}."
        out += [
            (p + "self_attention.linear_qkv.layer_norm_weight", (h,), PartitionRule(layer=i)),
            (p + "self_attention.linear_qkv.weight", (qkv, h), PartitionRule(tp_axis=0, layer=i)),
            (p + "self_attention.linear_qkv.bias", (qkv,), PartitionRule(tp_axis=0, layer=i)),
            (p + "self_attention.linear_proj.weight", (h, h), PartitionRule(tp_axis=1, layer=i)),
            (p + "self_attention.linear_proj.bias", (h,), PartitionRule(layer=i)),
            (p + "mlp.linear_fc1.layer_norm_weight", (h,), PartitionRule(layer=i)),
            (p + "mlp.linear_fc1.weight", (2 * ffn, h), PartitionRule(tp_axis=0, fused=(ffn, ffn), layer=i)),
            (p + "mlp.linear_fc2.weight", (h, ffn), PartitionRule(tp_axis=1, layer=i)),
        ]
    out += [
        ("decoder.final_layernorm.weight", (h,), PartitionRule(stage=-1)),
        ("output_layer.weight", (vocab, h), PartitionRule(tp_axis=0, vocab_multiple=128, stage=-1)),
    ]
    return out


class Job:
    """Every rank's declarations for one layout, evaluated from the rules."""

    def __init__(self, config: ParallelConfig, params, optimizer: str, layers: int) -> None:
        self.config = config
        self.layers = layers
        self.optimizer = optimizer
        self.params = [(k, s, r, r.evaluate(s, config, layers)) for k, s, r in params]
        self.params_rules = {k: r for k, _, r in params}
        self.mesh = config.mesh()
        if optimizer == "rules":
            self.opt = []
            for k, s, r in params:
                rr = PartitionRule(**{**r.__dict__, "dp_axis": 0})
                for m in ("exp_avg", "exp_avg_sq"):
                    self.opt.append((f"optimizer.{m}.{k}", s, rr, rr.evaluate(s, config, layers)))
        self._buffers: dict[tuple[int, int], list] = {}
        # Simulation shortcut (not part of what is measured): the tensors each pipeline
        # stage holds, so building 16k ranks' declarations does not scan every tensor.
        self._stage_params = {st: self._on_stage(self.params, st) for st in range(config.pp)}
        self._stage_opt = {st: self._on_stage(getattr(self, "opt", []), st) for st in range(config.pp)}

    @staticmethod
    def _on_stage(entries: list, stage: int) -> list:
        return [e for e in entries if all(i != 0 or idx == stage for i, idx in e[3]._on)]

    def _buffer(self, pp: int, tp: int) -> tuple[list, int]:
        """Megatron dist-opt style: the model-parallel rank's local params, flattened and padded."""
        key = (pp, tp)
        if key not in self._buffers:
            coord_base = (pp, 0, 0, tp)  # the dense mesh: pp, dp, cp, tp
            items = []
            pos = 0
            for k, s, _, layout in self.params:
                held = layout.local_pieces(coord_base)
                if held is None:
                    continue
                local_shape, pieces = held
                n = 1
                for x in local_shape:
                    n *= x
                tp_replicated = self.params_rules[k].tp_axis is None
                items.append((k, s, local_shape, pieces, pos, tp_replicated))
                pos += n
            dp = self.config.dp
            total = -(-pos // dp) * dp
            self._buffers[key] = (items, total)
        return self._buffers[key]

    def decls(self, rank: int) -> tuple[list[GridDecl], list[ExplicitDecl]]:
        coord = self.mesh.coordinate(rank)
        grid = []
        ref = 0
        for k, s, r, layout in self._stage_params[coord[0]]:
            held = layout.local_pieces(coord)
            if held is None:
                continue
            grid.append(GridDecl(ref, k, *BF16, held[0], layout, coord, r))
            ref += 1
        explicit = []
        if self.optimizer == "rules":
            for k, s, r, layout in self._stage_opt[coord[0]]:
                held = layout.local_pieces(coord)
                if held is None:
                    continue
                grid.append(GridDecl(ref, k, *FP32, held[0], layout, coord, r))
                ref += 1
        else:
            pp, dp_rank, tp = coord[0], coord[1], coord[3]  # the dense mesh: pp, dp, cp, tp
            items, total = self._buffer(pp, tp)
            per = total // self.config.dp
            lo, hi = dp_rank * per, (dp_rank + 1) * per
            for m in ("exp_avg", "exp_avg_sq"):
                pieces = []
                for k, s, local_shape, boxes, start, tp_replicated in items:
                    # TP-replicated params (norms) sit at the same buffer offsets on every TP
                    # rank, so their fragments are identical replicas (Megatron's replica_id)
                    replica = (tp, self.config.tp) if tp_replicated and self.config.tp > 1 else None
                    # each held box of the local param is contiguous in the local tensor (row slabs)
                    row = 1
                    for x in local_shape[1:]:
                        row *= x
                    for local_off, box in boxes:
                        b_lo = start + (local_off[0] * row if local_off else 0)
                        b_hi = b_lo + box.numel
                        a, b = max(lo, b_lo), min(hi, b_hi)
                        if b > a:
                            pieces.append(
                                Piece(f"optimizer.{m}.{k}", s, Region(box, (a - b_lo, b - b_lo)), LocalFlat(a - lo), replica)
                            )
                explicit.append(ExplicitDecl(ref, "float32", 4, (per,), tuple(pieces)))
                ref += 1
        return grid, explicit


def timed(fn, *a, **kw):
    t = time.perf_counter()
    out = fn(*a, **kw)
    return out, time.perf_counter() - t


def run(optimizer: str, quick: bool) -> dict:
    if quick:
        cfg, target_cfg, layers = ParallelConfig.parse("tp2pp2dp4"), ParallelConfig.parse("tp2pp1dp8"), 4
        params = gpt_params(layers, 256, 512, 1000, 8, 2)
    else:
        cfg, target_cfg, layers = ParallelConfig.parse("tp8pp16dp128"), ParallelConfig.parse("tp8pp8dp256"), 80
        params = gpt_params(layers, 8192, 28672, 128256, 64, 8)
    job = Job(cfg, params, optimizer, layers)
    world = cfg.world_size
    n_logical = len(params) * 3
    # --- every rank plans; rank 0 merges ------------------------------------------------
    reports = []
    plan_times = []
    indexes: dict[int, bytes] = {}
    t_sim = time.perf_counter()
    for rank in range(world):
        grid, explicit = job.decls(rank)
        t = time.perf_counter()
        plan = plan_save(rank, grid, explicit)
        plan_times.append(time.perf_counter() - t)
        entries = [IndexEntry(i.tensor, i.region, i.object, i.offset, i.nbytes, (0,) * max(1, -(-i.nbytes // (4 << 20)))) for i in plan.items]
        data = Index(rank, 4 << 20, dict(plan.objects), entries).to_json_bytes()
        indexes[rank] = data
        ref = IndexRef(rank, index_object_key(rank), len(data), sha256_hex(data))
        reports.append(RankReport(rank, ref, plan.grid_reports, plan.explicit_reports, plan.rotation_digest))
    t_sim = time.perf_counter() - t_sim
    manifest, t_merge = timed(merge_reports, reports, world_size=world, values={}, meta={}, parallel=str(cfg), where="sim")
    blob, t_ser = timed(manifest.to_json_bytes)
    # --- a loading rank at another layout -------------------------------------------------
    tjob = Job(target_cfg, params, optimizer, layers)
    load_rank = world // 2 + 3
    tgrid, texplicit = tjob.decls(load_rank)
    t0 = time.perf_counter()
    parsed = Manifest.from_json_bytes(blob, "sim")
    t_parse = time.perf_counter() - t0
    targets = []
    for ref, d in enumerate(tgrid):
        held = d.layout.local_pieces(d.coord)
        for lo, box in held[1]:
            if not box.is_empty():
                targets.append(Target(ref, d.key, Region(box), d.local_shape, LocalBox(lo)))
    for e in texplicit:
        for p in e.pieces:
            targets.append(Target(len(targets), p.tensor, p.region, e.local_shape, p.local))
    t1 = time.perf_counter()
    ops = match_sources(targets, parsed.tensors, "sim")
    writers = {op.writer for op in ops}
    t_match = time.perf_counter() - t1
    t2 = time.perf_counter()
    lookup = {}
    index_bytes = 0
    for w in writers:
        index_bytes += len(indexes[w])
        idx = Index.from_json_bytes(indexes[w], "sim")
        lookup[w] = {(e.tensor, e.region.key()): e for e in idx.entries}
    t_index = time.perf_counter() - t2
    dtypes = {k: (2 if t.dtype == "bfloat16" else 4) for k, t in parsed.tensors.items()}
    t3 = time.perf_counter()
    requests = plan_reads(ops, lambda op: lookup[op.writer][(op.tensor, op.source.key())], lambda k: dtypes[k], lambda r: 4 << 20)
    t_reads = time.perf_counter() - t3
    loader_total = t_parse + t_match + t_index + t_reads
    return {
        "scenario": optimizer,
        "saved_at": str(cfg),
        "loaded_at": str(target_cfg),
        "ranks": world,
        "logical_tensors": n_logical,
        "plan_per_rank_s_mean": sum(plan_times) / len(plan_times),
        "plan_per_rank_s_max": max(plan_times),
        "merge_s": t_merge,
        "manifest_serialize_s": t_ser,
        "manifest_bytes": len(blob),
        "rank0_total_s": t_merge + t_ser,
        "loader_manifest_parse_s": t_parse,
        "loader_match_s": t_match,
        "loader_indexes": len(writers),
        "loader_index_bytes": index_bytes,
        "loader_index_parse_s": t_index,
        "loader_read_plan_s": t_reads,
        "loader_read_requests": len(requests),
        "loader_total_s": loader_total,
        "simulation_setup_s": t_sim,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--scenario", choices=["rules", "distopt", "both"], default="both")
    args = ap.parse_args(argv)
    scenarios = ["rules", "distopt"] if args.scenario == "both" else [args.scenario]
    results = [run(s, args.quick) for s in scenarios]
    print("\n== planning and manifest merge at scale (one core, no I/O) ==")
    for r in results:
        print(
            f"[{r['scenario']}] {r['ranks']} ranks {r['saved_at']} -> load at {r['loaded_at']}, {r['logical_tensors']} logical tensors\n"
            f"  per-rank plan: mean {r['plan_per_rank_s_mean'] * 1e3:.2f} ms, max {r['plan_per_rank_s_max'] * 1e3:.2f} ms\n"
            f"  rank 0 merge {r['merge_s']:.2f} s + serialize {r['manifest_serialize_s']:.2f} s = {r['rank0_total_s']:.2f} s "
            f"(target <= 5 s: {'ok' if r['rank0_total_s'] <= 5 else 'MISSED'}); manifest {r['manifest_bytes'] / 2**20:.2f} MiB\n"
            f"  loading rank: parse {r['loader_manifest_parse_s']:.3f} s, match {r['loader_match_s']:.3f} s, "
            f"{r['loader_indexes']} indexes ({r['loader_index_bytes'] / 2**10:.0f} KiB) {r['loader_index_parse_s']:.3f} s, "
            f"read plan {r['loader_read_plan_s']:.3f} s ({r['loader_read_requests']} reads) = {r['loader_total_s']:.3f} s "
            f"(target <= 1 s: {'ok' if r['loader_total_s'] <= 1 else 'MISSED'})\n"
            f"  (simulating all ranks' plans took {r['simulation_setup_s']:.1f} s; not a target)"
        )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "plan_scale.json"), "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
