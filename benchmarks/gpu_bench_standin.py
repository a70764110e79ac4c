"""Run ``benchmarks/gpu_bench.py``'s whole flow on the CPU, for editing it on a machine without a GPU.

Not a benchmark and not a test: "cuda" becomes the CPU inside the benchmark's own modules (their
``torch.cuda`` calls are no-ops, device="cuda" tensors are CPU tensors, nothing is pinned), DCP's stager
copies without pinning, the process group is gloo alone, and a save comes every 2 steps. Its figures
mean nothing; what it shows is that every part runs, every figure is written and the process exits,
so the next GPU machine's few minutes are not spent on a flow error. Run from the repository root:

    .venv/bin/python benchmarks/gpu_bench_standin.py --json /tmp/gpu-bench.json --sizes 0.03,0.06 --reps 1
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401  (imported before any patch below)
import torch.distributed.tensor  # noqa: F401

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_bench  # noqa: E402
import gpu_bench_dcp  # noqa: E402
import gpu_bench_loop  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402


class _Stream:
    def synchronize(self) -> None:
        pass


class _Cuda:
    """torch.cuda as the benchmark's modules see it: available, and every wait a no-op."""

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)

    is_available = staticmethod(lambda: True)
    synchronize = staticmethod(lambda *a, **k: None)
    empty_cache = staticmethod(lambda: None)
    current_stream = staticmethod(lambda *a, **k: _Stream())


def _on_cpu(fn):
    @functools.wraps(fn)
    def make(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return make


class _Torch:
    """torch as the benchmark's modules see it."""

    cuda = _Cuda()
    randn = staticmethod(_on_cpu(torch.randn))
    empty = staticmethod(_on_cpu(torch.empty))
    zeros = staticmethod(_on_cpu(torch.zeros))

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def Generator(device=None):  # noqa: N802 - torch's name
        return torch.Generator()


def _world1(tmp: str) -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)


def main() -> int:
    gpu_bench.torch = gpu_bench_dcp.torch = gpu_bench_loop.torch = _Torch()
    torch.nn.Module.cuda = lambda self, *a, **k: self  # the loop's model
    gpu_bench.world1 = _world1
    gpu_bench_loop.SAVE_EVERY = gpu_bench.SAVE_EVERY = 2
    gpu_bench_dcp.DCP._new = staticmethod(lambda: DefaultStager(StagingOptions(False, False, True, False)))
    code = gpu_bench.main(sys.argv[1:])
    gpu_bench.shut_down()
    return code


if __name__ == "__main__":
    sys.exit(main())
