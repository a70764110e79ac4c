"""DTensor checkpoints across layouts and world sizes, with real gloo worlds.

Saved at 4 ranks (FSDP2 Shard(0), or FSDP2 x TP on a 2x2 mesh with
_StridedShard), loaded at 2 ranks TP, 1 rank plain, 8 ranks FSDP2 x TP and 8
ranks FSDP2: every model and AdamW tensor must come back bit-exactly.
"""

from __future__ import annotations

import pytest
import torch

import ckptkit
from tests import models

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def save_run(layout: str, dtype: str, path: str) -> dict:
    model, optim = models.build(layout, DTYPES[dtype], seed=0)
    models.train(model, optim, 3)
    state = models.sharded_state(model, optim)
    loss = models.loss_of(model, 99).item()
    ckptkit.save(state, path, metadata={"step": 3})
    return {"full": models.full_state(model, optim), "loss": loss}


def load_run(layout: str, dtype: str, path: str) -> dict:
    model, optim = models.build(layout, DTYPES[dtype], seed=123)
    models.train(model, optim, 1)  # make sure nothing from the fresh state survives
    state = models.sharded_state(model, optim)
    result = ckptkit.load(state, path)
    models.apply_state(model, optim, state)
    return {"full": models.full_state(model, optim), "loss": models.loss_of(model, 99).item(), "meta": result.meta}


@pytest.fixture
def saved(dtensor_checkpoints):
    return dtensor_checkpoints


def assert_same(expected: dict, got: dict) -> None:
    assert sorted(expected) == sorted(got)
    for k in expected:
        assert expected[k].dtype == got[k].dtype, k
        assert torch.equal(expected[k], got[k]), k


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("saved_layout", ["fsdp", "fsdp_tp"])
@pytest.mark.parametrize("target", [(2, "tp"), (1, "plain"), (8, "fsdp_tp"), (8, "fsdp"), (4, "fsdp_tp")])
def test_reshard_bit_exact(worlds, saved, saved_layout, dtype, target):
    path, ref = saved[(saved_layout, dtype)]
    world, layout = target
    results = worlds.run(world, load_run, layout, dtype, path)
    for r in results:
        assert_same(ref["full"], r["full"])
        assert r["meta"]["user"] == {"step": 3}
    # identical weights give the identical loss (layouts differ only in reduction order)
    assert results[0]["loss"] == pytest.approx(ref["loss"], rel=1e-2 if dtype == "bf16" else 1e-5)


def _layout_facts(path: str) -> dict:
    from ckptkit.engine.metadata_io import read_manifest
    from ckptkit.storage import open_store

    m = read_manifest(open_store(path))
    return {k: (t.layout.placements if hasattr(t.layout, "placements") else None) for k, t in m.tensors.items()}


def test_saved_layouts_are_recorded_as_placements(saved):
    from ckptkit.layout.grid import Shard

    facts = _layout_facts(saved[("fsdp_tp", "fp32")][0])
    # FSDP2 over a TP-sharded dim 0 is _StridedShard: recorded with its split factor
    assert facts["model/blocks.0.up.weight"] == (Shard(0, split_factor=2), Shard(0))
    assert facts["model/blocks.0.down.weight"] == (Shard(0), Shard(1))
