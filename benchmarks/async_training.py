"""Part 2 of bench_async: the step-time overhead of checkpointing inside a real training loop.

A small language model under FSDP2 trains in blocks of steps with and without
a CheckpointManager (thread and process executors), the variants rotated every
round; see bench_async.py's docstring for the method. Also holds the small
collective helpers both parts use.
"""

from __future__ import annotations

import argparse
import gc
import math
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import ckptkit
from bench_io import barrier
from common import median, spread


def gather_floats(values: list[float]) -> list[list[float]]:
    """Every rank's ``values`` (same length on every rank), as [rank][i]."""
    mine = torch.tensor(values, dtype=torch.float64)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [o.tolist() for o in out]


def agree_ok(ok: bool) -> bool:
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    return int(flag.item()) == 0


CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> float:
    """CPU time of this process (every thread) plus its helper processes (the ckptkit writer,
    DCP's checkpoint daemon: our live multiprocessing children, read from /proc)."""
    total = time.process_time()
    for child in multiprocessing.active_children():
        try:
            with open(f"/proc/{child.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime
        except (OSError, ValueError, IndexError):
            pass
    return total


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    s = sorted(xs)
    return float(s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))])




@dataclass(frozen=True)
class TrainConfig:
    hidden: int
    layers: int
    vocab: int
    batch: int  # per rank
    seq: int


TRAIN_FULL = TrainConfig(hidden=320, layers=2, vocab=2048, batch=2, seq=16)  # ~3.0M params
TRAIN_QUICK = TrainConfig(hidden=64, layers=1, vocab=256, batch=2, seq=8)


class MLPBlock(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    """Token embedding, residual MLP blocks, final norm, untied head: a GPT without attention."""

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(MLPBlock(cfg.hidden) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def _leaves(obj: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_leaves(v, f"{prefix}{k}."))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_leaves(v, f"{prefix}{i}."))
    else:
        out[prefix.rstrip(".")] = obj
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def state_is_live(old: dict[str, Any], new: dict[str, Any]) -> tuple[bool, str]:
    """Whether a state dict built earlier still holds the live tensors: same keys, every tensor on the
    same storage and equal to a freshly built one, every other value equal."""
    a, b = _leaves(old), _leaves(new)
    if set(a) != set(b):
        return False, f"keys differ: {sorted(set(a) ^ set(b))[:4]}"
    for k, v in b.items():
        if isinstance(v, torch.Tensor):
            o = a[k]
            if not isinstance(o, torch.Tensor) or _local(o).data_ptr() != _local(v).data_ptr():
                return False, f"{k}: not the same storage"
            if not torch.equal(_local(o), _local(v)):
                return False, f"{k}: values differ"
        elif a[k] != v:
            return False, f"{k}: {a[k]!r} != {v!r}"
    return True, f"{sum(isinstance(v, torch.Tensor) for v in b.values())} tensors and {sum(not isinstance(v, torch.Tensor) for v in b.values())} values are the live ones"


def fsdp_job(cfg: TrainConfig, mesh: Any, rank: int) -> tuple[int, Callable[[], None], Callable[[], dict[str, Any]]]:
    """The benchmarks' training job: TinyLM under FSDP2 (per block and at the root) with AdamW, the same
    initial weights on every rank, synthetic tokens per rank. Returns (parameters, one training step,
    the state dict to checkpoint)."""
    n_params, train_step, make_state, _ = fsdp_job_with_optimizer(cfg, mesh, rank)
    return n_params, train_step, make_state


def fsdp_job_with_optimizer(cfg: TrainConfig, mesh: Any,
                            rank: int) -> tuple[int, Callable[[], None], Callable[[], dict[str, Any]], Any]:
    """:func:`fsdp_job`, and its optimizer (the overlapped snapshot's guard)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # same initial weights on every rank
    model = TinyLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1000 + rank)

    def train_step() -> None:
        idx = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
        logits = model(idx)
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    def make_state() -> dict[str, Any]:
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}

    return n_params, train_step, make_state, optim


def part_training(args: argparse.Namespace, mesh: Any, rank: int, world: int, scratch: str, say: Callable[[str], None]) -> dict[str, Any]:
    cfg = TRAIN_QUICK if args.quick else TRAIN_FULL
    cfg = TrainConfig(
        hidden=args.train_hidden or cfg.hidden, layers=args.train_layers or cfg.layers, vocab=args.train_vocab or cfg.vocab,
        batch=args.train_batch or cfg.batch, seq=args.train_seq or cfg.seq,
    )
    K = args.every or (5 if args.quick else 20)
    steps = max(K, (args.steps or K) // K * K)  # a multiple of K: every save has K-1 steps after it in its block
    rounds = args.rounds or (3 if args.quick else 18)

    n_params, train_step, make_state, optim = fsdp_job_with_optimizer(cfg, mesh, rank)

    warm = 3 if args.quick else 10
    for _ in range(warm):  # the optimizer state exists from the first step on
        train_step()
    cached = make_state()
    train_step()
    train_step()
    live, why = state_is_live(cached, make_state())
    live = agree_ok(live)
    say(
        f"bench_async part 2: TinyLM {n_params / 1e6:.2f}M params ({asdict(cfg)}), FSDP2 over {world} ranks, AdamW; "
        f"state dict {'built ONCE (its tensors are the live ones: ' + why + ')' if live else 'rebuilt per save (' + why + ')'}"
    )

    variants = [v for v in ("none", "ckptkit-thread", "ckptkit-process", "ckptkit-overlap")
                if v == "none" or v in args.variants.split(",")]
    managers: dict[str, Any] = {}
    for v in variants[1:]:
        overlap = v == "ckptkit-overlap"
        managers[v] = ckptkit.CheckpointManager(
            os.path.join(scratch, f"train-{v}"), save=ckptkit.SavePolicy(every_steps=K),
            keep=ckptkit.RetentionPolicy(keep_last=2),
            asynchronous=ckptkit.AsyncOptions(executor="thread" if overlap else v.removeprefix("ckptkit-"),  # type: ignore[arg-type]
                                              snapshot="overlap" if overlap else "blocking"),
            guard=optim if overlap else None,
        )
    step_counter = [0]

    def run_block(v: str, n: int) -> dict[str, Any]:
        """``n`` steps of variant ``v``, starting at a multiple of K. Collective."""
        mgr = managers.get(v)
        base = step_counter[0]
        times: list[float] = []
        blocked: list[float] = []
        save_steps: list[int] = []
        barrier()
        c_start = cpu_seconds()
        t_start = time.perf_counter()
        for j in range(n):
            t0 = time.perf_counter()
            train_step()
            if mgr is not None:
                g = base + j
                if live:
                    h = mgr.maybe_save(g, cached)
                else:
                    h = mgr.save(g, make_state()) if mgr.should_save(g) else None
                if h is not None:
                    blocked.append(h.blocked_seconds)
                    save_steps.append(j)
            times.append(time.perf_counter() - t0)
        wall = time.perf_counter() - t_start
        t_tail = time.perf_counter()
        if mgr is not None:
            mgr.wait()
        tail = time.perf_counter() - t_tail
        cpu = cpu_seconds() - c_start  # the steps and everything the block's saves cost, to the commit
        step_counter[0] += n
        per_rank_times = gather_floats(times)
        step_max = [max(per_rank_times[r][j] for r in range(world)) for j in range(n)]
        walls = gather_floats([wall, tail, cpu])
        blk = gather_floats(blocked) if blocked else []
        barrier()
        return {
            "steps": n,
            "wall_s": max(w[0] for w in walls),
            "tail_wait_s": max(w[1] for w in walls),
            "cpu_s": sum(w[2] for w in walls),  # all ranks and their helper processes together
            "step_s": step_max,
            "saves": len(save_steps),
            "save_steps": save_steps,
            "blocked_s": [max(blk[r][i] for r in range(world)) for i in range(len(save_steps))] if blk else [],
        }

    results: dict[str, Any] = {v: {"blocks": []} for v in variants}
    # Warm-up: a block of each variant (first save: plan, staging buffer, writer process).
    for v in variants:
        run_block(v, K)
    for rnd in range(rounds):
        order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
        for v in order:
            results[v]["blocks"].append(run_block(v, steps))
        say(
            f"  round {rnd + 1}/{rounds}: mean step "
            + ", ".join(f"{v} {results[v]['blocks'][-1]['wall_s'] / steps * 1e3:.1f} ms" for v in variants)
        )
    final_live = agree_ok(state_is_live(cached, make_state())[0]) if live else False
    for mgr in managers.values():
        mgr.close()
    gc.collect()
    barrier()

    base_blocks = results["none"]["blocks"]
    thirds = [range(i * rounds // 3, (i + 1) * rounds // 3) for i in range(3)] if rounds >= 3 else [range(rounds)]
    for v in variants:
        blocks = results[v]["blocks"]
        all_steps = [s for b in blocks for s in b["step_s"]]
        r = results[v]
        r["round_mean_step_s"] = [b["wall_s"] / b["steps"] for b in blocks]
        r["mean_step_s"] = sum(b["wall_s"] for b in blocks) / sum(b["steps"] for b in blocks)
        r["p50_step_s"] = percentile(all_steps, 50)
        r["p99_step_s"] = percentile(all_steps, 99)
        r["max_step_s"] = max(all_steps)
        r["round_spread"] = spread(r["round_mean_step_s"])
        r["round_cv"] = statistics.pstdev(r["round_mean_step_s"]) / statistics.fmean(r["round_mean_step_s"])
        r["saves"] = sum(b["saves"] for b in blocks)
        blocked = [x for b in blocks for x in b["blocked_s"]]
        r["blocked_median_s"] = median(blocked) if blocked else None
        r["blocked_max_s"] = max(blocked) if blocked else None
        save_step_times = [b["step_s"][j] for b in blocks for j in b["save_steps"]]
        r["save_step_median_s"] = median(save_step_times) if save_step_times else None
        r["tail_wait_median_s"] = median([b["tail_wait_s"] for b in blocks])
        r["cpu_per_step_s"] = sum(b["cpu_s"] for b in blocks) / sum(b["steps"] for b in blocks)
    base_mean = results["none"]["mean_step_s"]
    for v in variants:
        r = results[v]
        r["overhead"] = r["mean_step_s"] / base_mean - 1
        r["round_overhead"] = [
            b["wall_s"] / b["steps"] / (bb["wall_s"] / bb["steps"]) - 1 for b, bb in zip(r["blocks"], base_blocks)
        ]
        r["overhead_median_of_rounds"] = median(r["round_overhead"])
        # the paired per-round overheads' mean and its 95% confidence half-width (normal approximation)
        ro = r["round_overhead"]
        r["overhead_mean_of_rounds"] = statistics.fmean(ro)
        r["overhead_ci95"] = 1.96 * statistics.stdev(ro) / math.sqrt(len(ro)) if len(ro) > 1 else None
        r["third_overhead"] = [
            sum(r["blocks"][i]["wall_s"] for i in t) / sum(base_blocks[i]["wall_s"] for i in t) - 1 for t in thirds
        ]
        r["excess_per_save_s"] = (r["mean_step_s"] - base_mean) * K if v != "none" else None
        r["extra_cpu_per_save_s"] = (
            (r["cpu_per_step_s"] - results["none"]["cpu_per_step_s"]) * K if v != "none" else None
        )
    return {
        "model": asdict(cfg),
        "params": n_params,
        "every_steps": K,
        "keep_last": 2,
        "steps_per_block": steps,
        "rounds": rounds,
        "state_built_once": live,
        "state_live_check": why,
        "state_live_at_end": final_live,
        "variants": results,
    }
