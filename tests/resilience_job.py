"""A small distributed training job under the resilience controller, for preemption and crash tests.

    torchrun --nproc_per_node=2 [--max-restarts=2] -m tests.resilience_job RUN --steps 30
        [--crash-at 13 --crash-rank 1 [--after-rollback]] [--grace 30] [--step-sleep 0.02]
        [--spikes --keep 20]

Every rank trains the same linear model on the same deterministic stream
(tests/resilience_model.py, the loop of ``rm.run``); ranks write their pid to
RUN/pids/rank-N.pid and rank 0 appends ``attempt step first_sample lr loss``
to RUN/trajectory.txt. ``--spikes`` uses ``rm.spike_policy()`` (a rollback on
the poisoned range at step 103, then a re-warm); without it the default
policy. ``--crash-at K`` kills rank ``--crash-rank`` with SIGKILL at the start
of step K in the first attempt (with ``--after-rollback``: the first time K
runs after a rollback).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import ckptkit
from ckptkit.resilience.restart import init_process_group
from tests import resilience_model as rm


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--crash-at", type=int, default=None)
    ap.add_argument("--crash-rank", type=int, default=1)
    ap.add_argument("--after-rollback", action="store_true")
    ap.add_argument("--spikes", action="store_true")
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
    mgr = ckptkit.CheckpointManager(os.path.join(args.run, "ckpt"), save=ckptkit.SavePolicy(every_steps=args.every),
                                    keep=ckptkit.RetentionPolicy(keep_last=args.keep))
    policy = rm.spike_policy() if args.spikes else ckptkit.SpikePolicy()
    ctl = ckptkit.ResilienceController(mgr, policy, batch_size=rm.BATCH, grace_seconds=args.grace)

    def crash(ctl: ckptkit.ResilienceController, step: int) -> bool:
        if (args.crash_at == step and attempt == 0 and rank == args.crash_rank
                and (not args.after_rollback or ctl.ladder.rollback_count > 0)):
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9 in the middle of a step
        return False

    def on_step(step: int, first: int, lr: float, loss: float) -> None:
        if rank == 0:
            with open(os.path.join(args.run, "trajectory.txt"), "a") as f:
                f.write(f"{attempt} {step} {first} {lr!r} {loss!r}\n")
        time.sleep(args.step_sleep)

    rm.run(ctl, model, optim, sched, steps=args.steps, stop=crash, on_step=on_step)
    ctl.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
