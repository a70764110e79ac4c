"""A torchrun job for the memory tier's crash test (tests/test_memory_tier_torchrun.py).

    torchrun --nproc_per_node=4 --max-restarts=1 -m tests.memory_job RUN

4 ranks on 2 simulated nodes (a memory folder per node under RUN/mem). FSDP2 training with a
persistent checkpoint every 4 steps and a memory snapshot every step. In the first attempt,
once step 6 is protected, node 1 is lost: its memory folder is deleted and its ranks are
SIGKILLed mid-training. torchrun restarts the job; the restarted job restores the newest step
every rank can get back (from memory and the peers' copies), trains to step 8, and rank 0
writes the full state and the restore's record for the test to compare.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time

import torch
import torch.distributed as dist

import ckptkit
from ckptkit.resilience.restart import init_process_group
from tests import models

STEPS, KILL_AFTER = 8, 6


def main() -> int:
    run = sys.argv[1]
    init_process_group("gloo")  # ckptkit's: survives torchrun restarts (stale store keys)
    torch.set_num_threads(1)
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    node = rank // 2
    tier = ckptkit.MemoryTier(every_steps=1, replicas=1, root=os.path.join(run, "mem", f"node{node}"),
                              ranks_per_node=2, timeout_seconds=60)
    model, optim = models.build("fsdp", torch.float32, seed=0 if attempt == 0 else 7)
    mgr = ckptkit.CheckpointManager(os.path.join(run, "ckpt"), save=ckptkit.SavePolicy(every_steps=4), memory=tier)
    t0 = time.monotonic()
    start = 0
    if attempt > 0:  # (the state dict is only taken here: taking it initialises a fresh optimizer's state)
        state = models.sharded_state(model, optim)
        start = mgr.restore_latest(state) or 0
        models.apply_state(model, optim, state)
        info = mgr.last_restore
        record = {"step": start, "sources": list(info.sources), "seconds": info.seconds,
                  "to_first_step": time.monotonic() - t0}
    for step in range(start + 1, STEPS + 1):
        models.train(model, optim, 1, start=step)
        mgr.maybe_save(step, models.sharded_state(model, optim))
        if attempt == 0 and step == KILL_AFTER:
            mgr.wait()  # step 6 is protected on every node
            dist.barrier()
            if node == 1:
                if rank == 2:
                    shutil.rmtree(os.path.join(run, "mem", "node1"))
                dist.barrier(group=dist.new_group([2, 3]))
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                dist.new_group([2, 3])  # new_group is collective over the world
    full = models.full_state(model, optim)
    mgr.close()
    if rank == 0:
        torch.save(full, os.path.join(run, "final.pt"))
        with open(os.path.join(run, "restore.json"), "w") as f:
            json.dump(record, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
