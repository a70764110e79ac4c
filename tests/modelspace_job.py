"""Checkpoints saved by real 4-rank gloo worlds at several layouts, for the model-space tests.

Three checkpoints, saved once per test session (cached here, shared by
tests/test_modelspace_*.py), all with 4 KiB checksum blocks so partial reads
exercise block widening:

* ``explicit``: a hand-built state mixing every kind of piece — DTensors
  sharded on dim 0 (bf16, fp32) and on dim 1, a ZeRO flat buffer holding
  fragments of three parameters (flat ranges of whole tensors), a
  Megatron-style distributed-optimizer buffer (flat fragments of TP-local
  boxes, split unevenly over DP), a replicated 0-d tensor, values, per-rank
  values and RNG states. Full tensors are a deterministic function of the key
  (:func:`full_tensor`), so tests know every expected element.
* ``fsdp`` (fp32) and ``fsdp_tp`` (bf16, 2x2 mesh with ``_StridedShard``): the
  tiny model of tests/models.py with AdamW state after two steps; the worlds
  return every tensor in full for reference.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import ckptkit
from ckptkit.layout.box import Box

BLOCK = 4096
WORLD = 4

# key -> (shape, dtype); how each is laid out is in explicit_state()
TENSORS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "params/big": ((512, 256), torch.float32),  # DTensor Shard(0)
    "params/tall": ((257, 40), torch.bfloat16),  # DTensor Shard(0), uneven
    "params/wide": ((96, 130), torch.float32),  # DTensor Shard(1), uneven
    "zero/exp_avg/a": ((10, 6), torch.float32),  # ZeRO flat buffer
    "zero/exp_avg/b": ((7,), torch.float32),
    "zero/exp_avg/c": ((33, 17), torch.float32),
    "mega/exp_avg_sq/w": ((24, 18), torch.float32),  # flat fragments of TP boxes
    "scalar": ((), torch.float32),  # replicated 0-d
}
ZERO_KEYS = ("zero/exp_avg/a", "zero/exp_avg/b", "zero/exp_avg/c")
MEGA_KEY = "mega/exp_avg_sq/w"
MEGA_TP, MEGA_SPLIT = 2, 101  # TP boxes of 12 rows x 18 = 216 elements, split [0, 101) / [101, 216) over DP
VALUES = {"step": 7, "sched": {"lr": 0.1, "betas": (0.9, 0.95)}}


def full_tensor(key: str) -> torch.Tensor:
    """The full model-space value of an ``explicit`` tensor (same on every process)."""
    shape, dtype = TENSORS[key]
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(shape, generator=g).to(dtype)


def explicit_state(rank: int, fill: bool) -> dict[str, Any]:
    """Rank ``rank``'s state of the ``explicit`` checkpoint (zeros when not ``fill``, for loading)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))

    def value(key: str) -> torch.Tensor:
        t = full_tensor(key)
        return t if fill else torch.zeros_like(t)

    def dtensor(key: str, dim: int) -> Any:
        full = value(key)
        local = torch.chunk(full, WORLD, dim=dim)[rank].contiguous()  # DTensor's own Shard sizing
        return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=full.shape, stride=full.stride())

    buf, pieces = zero_buffer(WORLD, rank, fill)
    mega, mega_pieces = mega_buffer(rank, fill)
    return {
        "params": {"big": dtensor("params/big", 0), "tall": dtensor("params/tall", 0), "wide": dtensor("params/wide", 1)},
        "zero": ckptkit.Sharded(buf, pieces),
        "mega": ckptkit.Sharded(mega, mega_pieces),
        "scalar": value("scalar"),
        "train": {"step": VALUES["step"] if fill else 0, "sched": dict(VALUES["sched"]) if fill else {"lr": 0.0, "betas": None}},
        "loader": ckptkit.PerRank({"position": rank * 1000 + 7} if fill else None),
        "rng": torch.Generator().manual_seed(rank + 100 if fill else 0),
    }


def zero_buffer(dp: int, rank: int, fill: bool) -> tuple[torch.Tensor, list]:
    """ZeRO-1: ZERO_KEYS flattened one after another, padded to ``dp``, this rank's slice."""
    sizes = [full_tensor(k).numel() for k in ZERO_KEYS]
    per = -(-sum(sizes) // dp)
    lo, hi = rank * per, (rank + 1) * per
    buf = torch.zeros(per)
    pieces = []
    start = 0
    for key, n in zip(ZERO_KEYS, sizes):
        a, b = max(lo, start), min(hi, start + n)
        if b > a:
            shape = TENSORS[key][0]
            pieces.append(ckptkit.flat_piece(key, shape, Box.full(shape), a - start, b - start, local_start=a - lo))
            if fill:
                buf[a - lo:b - lo] = full_tensor(key).reshape(-1)[a - start:b - start]
        start += n
    return buf, pieces


def mega_buffer(rank: int, fill: bool) -> tuple[torch.Tensor, list]:
    """Megatron distributed optimizer: the TP-local box (rows split over tp=2), flattened, split over dp=2."""
    tp, dp = rank % MEGA_TP, rank // MEGA_TP
    shape = TENSORS[MEGA_KEY][0]
    rows = shape[0] // MEGA_TP
    box = Box((tp * rows, 0), (rows, shape[1]))
    a, b = (0, MEGA_SPLIT) if dp == 0 else (MEGA_SPLIT, box.numel)
    local = full_tensor(MEGA_KEY)[tp * rows:(tp + 1) * rows].reshape(-1)[a:b].clone()
    if not fill:
        local.zero_()
    return local, [ckptkit.flat_piece(MEGA_KEY, shape, box, a, b)]


def save_all(root: str) -> dict[str, Any]:
    """Save the three checkpoints under ``root``; rank 0 returns the reference tensors of the model ones."""
    from tests import models

    rank = dist.get_rank()
    options = ckptkit.SaveOptions(block_size=BLOCK)
    ckptkit.save(explicit_state(rank, fill=True), os.path.join(root, "explicit"), options=options, metadata={"run": "x"})
    refs: dict[str, Any] = {}
    for layout, dtype in (("fsdp", torch.float32), ("fsdp_tp", torch.bfloat16)):
        model, optim = models.build(layout, dtype, seed=0)
        models.train(model, optim, 2)
        ckptkit.save(models.sharded_state(model, optim), os.path.join(root, layout), options=options)
        refs[layout] = models.full_state(model, optim)
    return refs if rank == 0 else {}


def load_explicit(path: str) -> dict[str, Any]:
    """Load the ``explicit`` state (saved at 4 ranks, or its zarr round trip) at this world's layout."""
    rank = dist.get_rank()
    state = explicit_state(rank, fill=False)
    ckptkit.load(state, path)
    expected = explicit_state(rank, fill=True)
    tensors_ok = all(
        torch.equal(state["params"][k].to_local(), expected["params"][k].to_local()) for k in ("big", "tall", "wide")
    )
    return {
        "tensors_ok": tensors_ok and torch.equal(state["zero"].local, expected["zero"].local)
        and torch.equal(state["mega"].local, expected["mega"].local) and torch.equal(state["scalar"], expected["scalar"]),
        "train": state["train"],
        "loader": state["loader"].value,
        "rng_same": torch.equal(state["rng"].get_state(), expected["rng"].get_state()),
    }


_CACHE: dict[str, Any] = {}


def saved_checkpoints(worlds: Any, tmp_path_factory: Any) -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
    """``{name: (path, {key: full tensor})}`` for the three checkpoints; saved once per session."""
    if not _CACHE:
        root = str(tmp_path_factory.mktemp("modelspace"))
        refs = worlds.run(WORLD, save_all, root)[0]
        _CACHE["explicit"] = (os.path.join(root, "explicit"), {k: full_tensor(k) for k in TENSORS})
        for layout in ("fsdp", "fsdp_tp"):
            # full_state names optimizer tensors optim/<fqn>/<name>; the saved state dict nests them under "state"
            ref = {k.replace("optim/", "optim/state/", 1): v for k, v in refs[layout].items()}
            _CACHE[layout] = (os.path.join(root, layout), ref)
    return dict(_CACHE)
