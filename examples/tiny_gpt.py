"""A tiny GPT-style model trained under torchrun with ckptkit's manager and resilience controller.

Used by ``examples/demo.py``; runnable on its own:

    torchrun --nproc_per_node=4 --max-restarts=1 examples/tiny_gpt.py train --run-dir runs/demo \\
        --layout fsdp --steps 60 --poison 240-300 --crash-at 45
    torchrun --nproc_per_node=2 examples/tiny_gpt.py resume --run-dir runs/demo --layout tp

The data stream is synthetic and addressed by sample index, so any restart
or rollback replays exactly the samples the run should see. ``--poison A-B``
reverses the pattern of samples [A, B), which makes the loss and gradient
norm spike; ``--crash-at S`` kills rank 1 with SIGKILL at step S on the first
attempt. ``--timings FILE`` appends JSON lines of when each attempt started,
crashed, finished restoring and ran its first step (benchmarks/bench_resilience.py).
"""

from __future__ import annotations

import time

PROCESS_START = time.time()  # before the heavy imports: a restart's cost includes them

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ckptkit  # noqa: E402
from ckptkit.resilience import DetectorConfig, Rewarm, Rollback  # noqa: E402
from ckptkit.resilience.restart import init_process_group  # noqa: E402

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


def sample(i: int, poison: tuple[int, int] | None) -> torch.Tensor:
    """Sample ``i`` of the stream: a learnable arithmetic sequence (stride +3). A poisoned sample
    runs the other way (stride -3): at every position a model that has learned the stream is
    confidently wrong, so the loss and the gradient norm jump."""
    g = torch.Generator().manual_seed(i)
    start = torch.randint(0, VOCAB, (1,), generator=g)
    stride = -3 if poison is not None and poison[0] <= i < poison[1] else 3
    return (start + torch.arange(SEQ + 1) * stride) % VOCAB


def global_batch(first: int, poison: tuple[int, int] | None) -> torch.Tensor:
    return torch.stack([sample(i, poison) for i in range(first, first + BATCH)])


def loss_on(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def eval_loss(model: nn.Module) -> float:
    with torch.no_grad():
        return loss_on(model, global_batch(10_000_000, None)).item()


def new_scheduler(optim: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 5))


def state_of(model: nn.Module, optim: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler) -> dict:
    # the scheduler's position is saved too: a resumed run must not restart its warm-up
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim),
            "sched": sched.state_dict()}


def apply(model: nn.Module, optim: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
          state: dict) -> None:
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    sched.load_state_dict(state["sched"])


def controller(run: str, async_save: bool = True) -> ckptkit.ResilienceController:
    det = DetectorConfig(window=32, warmup=8, k=6.0)
    policy = ckptkit.SpikePolicy(loss=det, grad_norm=det,
                                 rollback=Rollback(after_spikes=3, window_steps=20, steps_before=8, skip_before=2,
                                                   skip_after=6),
                                 rewarm=Rewarm(factor=0.2, steps=10))
    mgr = ckptkit.CheckpointManager(os.path.join(run, "ckpt"), save=ckptkit.SavePolicy(every_steps=10),
                                    keep=ckptkit.RetentionPolicy(keep_last=4),
                                    asynchronous=ckptkit.AsyncOptions() if async_save else None)
    # name: what `ckptkit report` titles the run with (the run folder's name, not its checkpoint subfolder)
    return ckptkit.ResilienceController(mgr, policy, batch_size=BATCH, name=os.path.basename(os.path.abspath(run)))


def note_time(args: argparse.Namespace, event: str, **extra: float) -> None:
    """Append one timing event (``--timings``); every rank may call it, each line is one write."""
    if args.timings:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        line = json.dumps({"event": event, "attempt": attempt, "rank": dist.get_rank(), "t": time.time(), **extra})
        with open(args.timings, "a") as f:
            f.write(line + "\n")


def train(args: argparse.Namespace) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = parallelize(TinyGPT(), args.layout)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = new_scheduler(optim)
    ctl = controller(args.run)
    lr = ckptkit.ScaledLR(sched, optim, ctl.lr_factor)
    state = state_of(model, optim, sched)
    if rank == 0:
        note_time(args, "start", t_process=PROCESS_START)
    t0 = time.time()
    start = ctl.resume(state)
    if start > 1:
        apply(model, optim, sched, state)
        lr.refresh()  # a re-warm or lowered LR the checkpoint predates (from the incident log)
        if rank == 0:
            note_time(args, "restored", load_s=time.time() - t0, step=start - 1)
            print(f"[attempt {attempt}] resumed from step {start - 1} at sample {ctl.sample}", flush=True)
    poison = tuple(int(x) for x in args.poison.split("-")) if args.poison else None
    for step, first in ctl.batches(lambda p: p, start):
        if step > args.steps:
            break
        if args.crash_at == step and attempt == 0 and rank == 1:
            print(f"[attempt {attempt}] rank 1 crashes (SIGKILL) at step {step}", flush=True)
            note_time(args, "crash", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        tokens = global_batch(first, poison)
        local = tokens[rank::world] if args.layout == "fsdp" else tokens  # data parallel: each rank its share
        optim.zero_grad()
        loss = loss_on(model, local)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean = mean.item() / world
        action = ctl.observe(step, loss=mean, grad_norm=grad_norm.item())
        if action.rollback:
            action.restore(state)
            apply(model, optim, sched, state)
            lr.refresh()
            if rank == 0:
                print(f"[attempt {attempt}] step {step}: {action.decision.reason} -> rolled back to step "
                      f"{ctl.step}, skipping samples {list(action.decision.skip or ())}", flush=True)
            continue
        if not action.skip_step:
            optim.step()
        elif rank == 0:
            print(f"[attempt {attempt}] step {step}: {action.decision.reason} -> optimizer step skipped", flush=True)
        lr.step()
        if rank == 0 and step % 10 == 0:
            print(f"[attempt {attempt}] step {step:3d} loss {mean:.4f} lr x{ctl.lr_factor():.2f}", flush=True)
        ctl.maybe_save(step, state_of(model, optim, sched))
        if step == start and rank == 0:
            note_time(args, "first_step", step=step)
    ctl.close()
    return eval_loss(model)


def resume(args: argparse.Namespace) -> float:
    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    model = parallelize(TinyGPT(), args.layout)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = new_scheduler(optim)
    ctl = controller(args.run, async_save=False)
    state = state_of(model, optim, sched)
    start = ctl.resume(state)
    apply(model, optim, sched, state)
    loss = eval_loss(model)
    if dist.get_rank() == 0:
        print(f"[resume {args.layout} x{dist.get_world_size()}] loaded step {start - 1}; eval loss {loss:.6f}", flush=True)
    ctl.close()
    return loss


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=["train", "resume"])
    ap.add_argument("--run-dir", dest="run", required=True)
    ap.add_argument("--layout", default="fsdp")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--poison", default=None, help="sample range A-B to corrupt")
    ap.add_argument("--crash-at", type=int, default=None)
    ap.add_argument("--report", default=None, help="write the final eval loss here (JSON)")
    ap.add_argument("--timings", default=None, help="append timing events here (JSON lines)")
    args = ap.parse_args()
    init_process_group("gloo")  # survives torchrun restarts
    torch.set_num_threads(1)
    loss = train(args) if args.phase == "train" else resume(args)
    if dist.get_rank() == 0 and args.report:
        with open(args.report, "w") as f:
            json.dump({"phase": args.phase, "eval_loss": loss}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
