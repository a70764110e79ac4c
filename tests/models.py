"""A tiny transformer-ish model and helpers to lay it out with FSDP2, TP, or both.

Sizes are deliberately awkward (vocab 37, hidden 20) so shards are uneven.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

VOCAB, DIM, HIDDEN = 37, 12, 20


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def build(layout: str, dtype: torch.dtype, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """layout: 'plain', 'fsdp', 'tp' or 'fsdp_tp' (2-D mesh: dp x tp=2)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = Net().to(dtype)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout in ("tp", "fsdp_tp"):
        tp = world if layout == "tp" else 2
        dims = (world // tp, tp)
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=("dp", "tp"))
        plan = {"emb": RowwiseParallel(input_layouts=Replicate()), "out": ColwiseParallel(output_layouts=Replicate())}
        for i in range(len(model.blocks)):
            plan[f"blocks.{i}.up"] = ColwiseParallel()
            plan[f"blocks.{i}.down"] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
        if layout == "fsdp_tp":
            for b in model.blocks:
                fully_shard(b, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
    elif layout != "plain":
        raise ValueError(layout)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optim


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (4, 6), generator=g)


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    tokens = batch(step)
    logits = model(tokens)
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens.roll(1, dims=1).reshape(-1))


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, start: int = 0) -> list[float]:
    losses = []
    for s in range(start, start + steps):
        optim.zero_grad()
        loss = loss_of(model, s)
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def sharded_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}


def apply_state(model: nn.Module, optim: torch.optim.Optimizer, state: dict) -> None:
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of model and optimizer as a full plain tensor, on every rank."""
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    out = {}
    for k, v in get_model_state_dict(model, options=opts).items():
        out[f"model/{k}"] = v.detach().clone()
    osd = get_optimizer_state_dict(model, optim, options=opts)
    for fqn, st in osd["state"].items():
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                v = v.full_tensor() if hasattr(v, "full_tensor") else v
                out[f"optim/{fqn}/{name}"] = v.detach().clone()
    return out
