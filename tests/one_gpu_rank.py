"""A one-rank process group for the GPU checks (tests/test_gpu_*.py): the world a single-GPU job runs in.

Deterministic algorithms are on while it lives (the checks compare resumed runs bit for bit), and a
group this helper created is destroyed on the way out; one that already existed is left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch


@contextlib.contextmanager
def one_rank_group(store_dir: Path, *, device: str = "cuda") -> Iterator[None]:
    """Rank 0 of a world of 1 (gloo for CPU tensors, NCCL for CUDA ones), rendezvous through a file in
    ``store_dir``; ``device="cpu"`` runs the same check on the CPU (how its logic is tried without a GPU)."""
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    own = not dist.is_initialized()
    if own:
        store = dist.FileStore(str(store_dir / "s"), 1)
        dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        if own:
            dist.destroy_process_group()
