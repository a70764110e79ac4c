"""Rank-side functions of the DCP converter tests (run in real gloo worlds, see tests/worlds.py).

* :func:`save_dcp`: the tiny model of tests/models.py with AdamW state, saved
  by ``torch.distributed.checkpoint.save`` (FSDP2 ``Shard(0)``, or FSDP2 x TP
  with ``_StridedShard``), plus replicated training values as torchtitan
  keeps them.
* :func:`load_both`: at another layout, DCP's own load of the DCP checkpoint
  (the reference: DCP reshards exactly on CPU) and ``ckptkit.load`` of its
  import, compared tensor by tensor on every rank.
* :func:`load_model_export` / :func:`load_explicit_export`: ``dcp.load`` of an
  exported ckptkit checkpoint into DTensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptkit
from tests import models
from tests import modelspace_job as msjob

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TRAIN = {"step": 2, "tokens": 4096, "name": "titan", "betas": (0.9, 0.95)}


def _state(layout: str, dtype: str, seed: int) -> tuple[Any, Any, dict[str, Any]]:
    model, optim = models.build(layout, DTYPES[dtype], seed=seed)
    models.train(model, optim, 1)  # AdamW state exists, and differs from the checkpoint's
    empty = {"step": 0, "tokens": 0, "name": "", "betas": None}
    return model, optim, {**models.sharded_state(model, optim), "train": empty}


def save_dcp(layout: str, dtype: str, path: str) -> None:
    model, optim = models.build(layout, DTYPES[dtype], seed=0)
    models.train(model, optim, 2)
    dcp.save({**models.sharded_state(model, optim), "train": dict(TRAIN)}, checkpoint_id=path)


def local_leaves(state: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a state dict: DTensors as their local tensors, values as they are."""
    if isinstance(state, dict):
        out: dict[str, Any] = {}
        for k, v in state.items():
            out.update(local_leaves(v, f"{prefix}{k}/"))
        return out
    if isinstance(state, list) and any(isinstance(v, (dict, torch.Tensor)) for v in state):
        out = {}
        for i, v in enumerate(state):
            out.update(local_leaves(v, f"{prefix}{i}/"))
        return out
    if isinstance(state, torch.Tensor):
        state = state.to_local() if hasattr(state, "to_local") else state
        return {prefix.rstrip("/"): state.detach().clone()}
    return {prefix.rstrip("/"): state}


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys whose leaves differ (tensors bit for bit, dtype included; values by equality)."""
    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                bad.append(k)
        elif x != y:
            bad.append(k)
    return bad


def load_both(layout: str, dtype: str, dcp_path: str, ckptkit_path: str) -> dict[str, Any]:
    """DCP's load of ``dcp_path`` vs ckptkit's load of its import, at ``layout`` on this world."""
    _, _, ref = _state(layout, dtype, seed=123)
    dcp.load(ref, checkpoint_id=dcp_path)
    _, _, got = _state(layout, dtype, seed=321)
    ckptkit.load(got, ckptkit_path)
    a, b = local_leaves(ref), local_leaves(got)
    return {"compared": sum(isinstance(v, torch.Tensor) for v in a.values()), "mismatch": compare(a, b),
            "train": got["train"]}


def load_model_export(layout: str, dtype: str, path: str) -> dict[str, torch.Tensor]:
    """``dcp.load`` of an exported model checkpoint at ``layout``; every tensor back in full."""
    model, optim, state = _state(layout, dtype, seed=123)
    state.pop("train")
    dcp.load(state, checkpoint_id=path)
    models.apply_state(model, optim, state)
    return models.full_state(model, optim)


def load_explicit_export(path: str) -> dict[str, Any]:
    """``dcp.load`` of the exported ``explicit`` checkpoint (tests/modelspace_job.py) into DTensors
    sharded on dim 0 over this world — flat ZeRO and distributed-optimizer fragments included."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    state: dict[str, Any] = {"train": {"step": 0, "sched": {"lr": 0.0, "betas": None}}}
    expected: dict[str, torch.Tensor] = {}
    for key, (shape, dtype) in msjob.TENSORS.items():
        node = state
        *parents, leaf = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        full = msjob.full_tensor(key)
        if not shape:
            node[leaf] = torch.zeros((), dtype=dtype)
            expected[key] = full
            continue
        local = torch.chunk(full, world, dim=0)[rank].contiguous()
        node[leaf] = DTensor.from_local(torch.zeros_like(local), mesh, [Shard(0)], run_check=False,
                                        shape=full.shape, stride=full.stride())
        expected[key] = local
    dcp.load(state, checkpoint_id=path)
    got = local_leaves(state)
    return {"mismatch": compare({k: got[k] for k in expected}, expected), "train": state["train"]}
