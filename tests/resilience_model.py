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


# ----------------------------------------------------------------------------------------------
# A training loop under the resilience controller, shared by the in-process tests and the
# torchrun job (tests/resilience_job.py), so a distributed run can be compared with an
# uninterrupted one step by step.

def spike_policy():
    """A policy that rolls back on the poisoned range: 3 spikes -> back >= 30 steps, skip the data
    from 5 steps before the first spike to 40 after the last, re-warm from 0.1x over 20 steps."""
    import ckptkit
    from ckptkit.resilience import DetectorConfig, Rewarm, Rollback

    det = DetectorConfig(window=64, warmup=16, k=6.0)
    return ckptkit.SpikePolicy(loss=det, grad_norm=det,
                               rollback=Rollback(after_spikes=3, steps_before=30, skip_before=5, skip_after=40),
                               rewarm=Rewarm(factor=0.1, steps=20))


def train_step(model: nn.Module, optim: torch.optim.Optimizer, batch: tuple) -> tuple[float, float]:
    xs, ys, _ = batch
    optim.zero_grad()
    loss = nn.functional.mse_loss(model(xs), ys)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    return loss.item(), grad_norm.item()


KILLED: list = []  # the loops of jobs "killed" in this process


def run(ctl, model: nn.Module, optim: torch.optim.Optimizer, sched, *, steps: int, stop=None,
        on_step=None) -> bool:
    """Resume under ``ctl`` and train to ``steps``; False if ``stop(ctl, step)`` said so at a step's start
    (the job is gone as SIGKILL would leave it; an exception from ``stop`` is an error in the step).

    ``on_step(step, first_sample, lr, loss)`` sees every trained step (lr: the one the optimizer
    step used), in the order they ran; a rollback or restart runs some step numbers again.
    ``stop`` is where a test ends the job as a crash would (the torchrun job kills itself there).
    """
    import ckptkit

    init_optimizer_state(model, optim)
    lr = ckptkit.ScaledLR(sched, optim, ctl.lr_factor)
    state = state_of(model, optim, sched)
    start = ctl.resume(state)
    if start > 1:
        optim.load_state_dict(state["optim"])
        lr.load_state_dict(state["sched"])  # and the controller's factor (a re-warm under way) on top
    batches = ctl.batches(get_batch, start)
    for step, batch in batches:
        if step > steps:
            break
        if stop is not None and stop(ctl, step):
            KILLED.append(batches)  # as after SIGKILL no code runs: not even the generator's cleanup
            return False
        loss, grad_norm = train_step(model, optim, batch)
        action = ctl.observe(step, loss=loss, grad_norm=grad_norm)
        if action.rollback:
            action.restore(state)
            optim.load_state_dict(state["optim"])
            lr.load_state_dict(state["sched"])
            continue
        used = optim.param_groups[0]["lr"]
        if not action.skip_step:
            optim.step()
        lr.step()
        if on_step is not None:
            on_step(step, batch[2], used, loss)
        state = state_of(model, optim, sched)
        ctl.maybe_save(step, state)
        if ctl.should_stop:
            break
    return True


def final(records: list[tuple]) -> list[tuple]:
    """The steps that shaped the final model: a step number run again replaces what followed it."""
    out: dict[int, tuple] = {}
    for rec in records:
        for s in [s for s in out if s >= rec[0]]:
            del out[s]
        out[rec[0]] = rec
    return [out[s] for s in sorted(out)]
