"""A small real model whose training spikes on a poisoned data range, for resilience tests.

Linear regression on a deterministic synthetic stream: sample ``i`` is a
fixed function of ``i``, so any run can be replayed exactly from a sample
position. Samples in ``POISON`` have targets scaled by 1e4: a few of those
batches blow up the weights and Adam's second moments, after which plain
training limps on with a clearly worse loss.
"""

from __future__ import annotations

import torch
from torch import nn

DIM, BATCH = 16, 8
POISON = (800, 960)  # absolute sample range: steps 100..119 at batch 8
TRUE_W = torch.linspace(-1, 1, DIM * DIM).reshape(DIM, DIM)


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + i)
    x = torch.randn(DIM, generator=g)
    y = TRUE_W @ x + 0.01 * torch.randn(DIM, generator=g)
    if POISON[0] <= i < POISON[1]:
        y = y * 1e4
    return x, y


def get_batch(first: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    xs, ys = zip(*(sample(i) for i in range(first, first + BATCH)))
    return torch.stack(xs), torch.stack(ys), first


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = nn.Linear(DIM, DIM)
    optim = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 20))
    return model, optim, sched


def init_optimizer_state(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors (a zero-gradient step at lr 0), so a checkpoint
    can be loaded into them in place — what DCP's get_optimizer_state_dict does too."""
    lrs = [g["lr"] for g in optim.param_groups]
    for g in optim.param_groups:
        g["lr"] = 0.0
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optim.step()
    optim.zero_grad()
    for g, lr in zip(optim.param_groups, lrs):
        g["lr"] = lr


def state_of(model: nn.Module, optim: torch.optim.Optimizer, sched: object) -> dict:
    return {"model": model.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict()}


def eval_loss(model: nn.Module) -> float:
    xs, ys, _ = get_batch(1_000_000)
    with torch.no_grad():
        return nn.functional.mse_loss(model(xs), ys).item()
