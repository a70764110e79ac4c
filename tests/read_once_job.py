"""A 4-rank job (plain processes, no launcher that would stop the survivors) for the read-once test
of a reader killed mid-load: rank 1 dies while it holds bytes the others wait for; every other rank
writes the error its load raised to RUN/rank-N.txt.

    RANK=r WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m tests.read_once_job RUN
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

import ckptkit
from ckptkit.engine import read_once
from tests import test_read_once as t


def main() -> int:
    run = sys.argv[1]
    dist.init_process_group("gloo")
    path = os.path.join(run, "ckpt")
    t.save(path)
    dist.barrier()
    if dist.get_rank() == 1:
        def die(*a, **k):
            os._exit(3)  # a reader dies mid-load, before sending what it read
        read_once._window = die
    try:
        t.load(path, True)
        text = "loaded"
    except ckptkit.CkptkitError as exc:
        text = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(run, f"rank-{dist.get_rank()}.txt"), "w") as f:
        f.write(text)
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
