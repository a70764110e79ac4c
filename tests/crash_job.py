"""A 2-rank training job that checkpoints every step, for the kill -9 tests.

    python -m tests.crash_job RUN_DIR PID_DIR [--world 2] [--steps 400]

Every rank writes its pid to PID_DIR/rank-N.pid, then trains: the state at
step s is a deterministic function of s (``expected_values``), so any
checkpoint can be checked for exactly the right bytes after a crash.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

N = 4 << 20  # float32 elements of each rank's half of "x": 16 MiB per rank


def expected_values(step: int, world: int) -> dict[str, torch.Tensor]:
    x = torch.arange(N * world, dtype=torch.float32).mul_(1e-3).add_(step)
    rep = torch.full((1024,), float(step), dtype=torch.bfloat16)
    return {"x": x, "rep": rep}


def state_for(rank: int, world: int, step: int) -> dict:
    import ckptkit

    vals = expected_values(step, world)
    local = vals["x"][rank * N:(rank + 1) * N].clone()
    return {
        "x": ckptkit.Sharded(local, [ckptkit.box_piece("x", (N * world,), (rank * N,), (N,))]),
        "rep": vals["rep"],
        "step": step,
    }


def worker(rank: int, world: int, run: str, pid_dir: str, steps: int, port: int) -> None:
    import ckptkit

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    with open(os.path.join(pid_dir, f"rank-{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    state = state_for(rank, world, 0)
    with ckptkit.CheckpointManager(run, save=ckptkit.SavePolicy(every_steps=1), keep=ckptkit.RetentionPolicy(keep_last=3)) as mgr:
        for step in range(1, steps + 1):
            fresh = state_for(rank, world, step)
            state["x"].local.copy_(fresh["x"].local)  # "training" updates the state in place
            state["rep"].copy_(fresh["rep"])
            state["step"] = step
            mgr.maybe_save(step, state)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("pid_dir")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    mp.start_processes(worker, args=(args.world, args.run, args.pid_dir, args.steps, args.port),
                       nprocs=args.world, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
