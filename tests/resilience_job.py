"""A small distributed training job under the resilience controller, for preemption and crash tests.

    torchrun --nproc_per_node=2 [--max-restarts=2] -m tests.resilience_job RUN --steps 30
        [--crash-at 13 --crash-rank 1] [--grace 30] [--step-sleep 0.02]

Every rank trains the same linear model on the same deterministic stream
(tests/resilience_model.py); ranks write their pid to RUN/pids/rank-N.pid and
rank 0 appends ``attempt step first_sample`` to RUN/trajectory.txt.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import ckptkit
from ckptkit.resilience.restart import init_process_group
from tests import resilience_model as rm


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--crash-at", type=int, default=None)
    ap.add_argument("--crash-rank", type=int, default=1)
    ap.add_argument("--grace", type=float, default=30.0)
    ap.add_argument("--step-sleep", type=float, default=0.02)
    args = ap.parse_args()
    init_process_group("gloo")  # survives torchrun restarts (stale store keys)
    torch.set_num_threads(1)
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    os.makedirs(os.path.join(args.run, "pids"), exist_ok=True)
    with open(os.path.join(args.run, "pids", f"rank-{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    model, optim, sched = rm.build()
    rm.init_optimizer_state(model, optim)
    mgr = ckptkit.CheckpointManager(os.path.join(args.run, "ckpt"), every_steps=args.every, keep_last=3)
    ctl = ckptkit.ResilienceController(mgr, batch_size=rm.BATCH, grace_seconds=args.grace)
    state = rm.state_of(model, optim, sched)
    start = ctl.resume(state)
    optim.load_state_dict(state["optim"])
    sched.load_state_dict(state["sched"])
    for step, batch in ctl.batches(rm.get_batch, start):
        if step > args.steps:
            break
        if args.crash_at == step and attempt == 0 and rank == args.crash_rank:
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9 in the middle of a step
        xs, ys, first = batch
        optim.zero_grad()
        loss = nn.functional.mse_loss(model(xs), ys)
        loss.backward()
        action = ctl.observe(step, loss=loss.item())
        if not action.skip_step:
            optim.step()
        sched.step()
        if rank == 0:
            with open(os.path.join(args.run, "trajectory.txt"), "a") as f:
                f.write(f"{attempt} {step} {first}\n")
        state = rm.state_of(model, optim, sched)
        ctl.maybe_save(step, state)
        time.sleep(args.step_sleep)
        if ctl.should_stop:
            break
    ctl.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
