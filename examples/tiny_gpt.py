"""A tiny GPT-style model, trained under torchrun with FSDP2 or tensor parallelism.

Used by ``examples/demo.py``; runnable on its own:

    torchrun --nproc_per_node=4 examples/tiny_gpt.py train  --ckpt runs/demo/step-20 --layout fsdp
    torchrun --nproc_per_node=2 examples/tiny_gpt.py resume --ckpt runs/demo/step-20 --layout tp
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ckptkit  # noqa: E402

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 101, 32, 4, 2, 16, 8


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hd = DIM // HEADS
        # -1 heads: under tensor parallelism each rank holds HEADS / tp of them
        q, k, v = (w(x).view(b, s, -1, hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(DIM)
        self.attn = Attention()
        self.mlp_norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.down(nn.functional.gelu(self.up(self.mlp_norm(x))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def parallelize(model: nn.Module, layout: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        plan = {"tok": RowwiseParallel(input_layouts=Replicate()), "head": ColwiseParallel(output_layouts=Replicate())}
        for i in range(LAYERS):
            for w in ("wq", "wk", "wv"):
                plan[f"blocks.{i}.attn.{w}"] = ColwiseParallel()
            plan[f"blocks.{i}.attn.wo"] = RowwiseParallel()
            plan[f"blocks.{i}.up"] = ColwiseParallel()
            plan[f"blocks.{i}.down"] = RowwiseParallel()
        parallelize_module(model, mesh, plan)
    else:
        raise SystemExit(f"unknown layout {layout!r}")
    return model


def batch(step: int) -> torch.Tensor:
    """A synthetic, learnable token stream: the same on every rank and for every layout."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    return (start + torch.arange(SEQ + 1) * 3) % VOCAB


def loss_on(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def build(layout: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = parallelize(TinyGPT(), layout)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def state_of(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> dict:
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim),
        "train": {"step": step},
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=["train", "resume"])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--layout", default="fsdp")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--report", default=None, help="write the measured losses here (JSON)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model, optim = build(args.layout)
    eval_tokens = batch(10_000)
    if args.phase == "train":
        for step in range(args.steps):
            optim.zero_grad()
            loss = loss_on(model, batch(step))
            loss.backward()
            optim.step()
            if rank == 0 and step % 5 == 0:
                print(f"[train {args.layout} x{dist.get_world_size()}] step {step:3d} loss {loss.item():.4f}", flush=True)
        with torch.no_grad():
            eval_loss = loss_on(model, eval_tokens).item()
        result = ckptkit.save(state_of(model, optim, args.steps), args.ckpt, metadata={"step": args.steps})
        if rank == 0:
            print(f"[train] saved {result.total_bytes / 1024:.0f} KiB to {args.ckpt} in {result.seconds:.3f}s; eval loss {eval_loss:.6f}")
    else:
        state = state_of(model, optim, 0)
        ckptkit.load(state, args.ckpt)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optim, state["optim"])
        with torch.no_grad():
            eval_loss = loss_on(model, eval_tokens).item()
        if rank == 0:
            print(f"[resume {args.layout} x{dist.get_world_size()}] loaded step {state['train']['step']}; eval loss {eval_loss:.6f}")
        step0 = state["train"]["step"]
        for step in range(step0, step0 + 5):
            optim.zero_grad()
            loss = loss_on(model, batch(step))
            loss.backward()
            optim.step()
        if rank == 0:
            print(f"[resume] trained 5 more steps at the new layout; loss {loss.item():.4f}")
    if rank == 0 and args.report:
        with open(args.report, "w") as f:
            json.dump({"phase": args.phase, "eval_loss": eval_loss}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
