"""DTensor checkpoints across layouts and world sizes, with real gloo worlds.

Saved at 4 ranks (FSDP2 Shard(0), or FSDP2 x TP on a 2x2 mesh with
_StridedShard), loaded at 2 ranks TP, 1 rank plain, 8 ranks FSDP2 x TP and 8
ranks FSDP2: every model and AdamW tensor must come back bit-exactly, and the
loaded model's loss is the loss of the same weights loaded at the same layout
by torch's own DCP (``dcp.save`` beside the ckptkit save, ``dcp.load`` at the
target): bit for bit, the same arithmetic (the saving layout's loss would
differ by its reduction order).
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
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": state["model"]}, checkpoint_id=f"{path}-dcp")  # the reference route of load_run
    return {"full": models.full_state(model, optim), "loss": loss}


def load_run(layout: str, dtype: str, path: str, reference: bool = False) -> dict:
    """Load ``path`` at ``layout``; ``reference``: also the loss of a fresh model given the same weights by
    torch's own DCP at ``layout`` (:func:`dcp_loss`)."""
    model, optim = models.build(layout, DTYPES[dtype], seed=123)
    models.train(model, optim, 1)  # make sure nothing from the fresh state survives
    state = models.sharded_state(model, optim)
    result = ckptkit.load(state, path)
    models.apply_state(model, optim, state)
    out = {"full": models.full_state(model, optim), "loss": models.loss_of(model, 99).item(), "meta": result.meta}
    if reference:
        out["dcp_loss"] = dcp_loss(layout, dtype, f"{path}-dcp")
    return out


def dcp_loss(layout: str, dtype: str, dcp_path: str) -> float:
    """The loss at ``layout`` of a fresh model loaded by ``dcp.load`` from save_run's DCP checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model, _ = models.build(layout, DTYPES[dtype], seed=7)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=dcp_path)
    set_model_state_dict(model, state["model"])
    return models.loss_of(model, 99).item()


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
    results = worlds.run(world, load_run, layout, dtype, path, reference=True)
    for r in results:
        assert_same(ref["full"], r["full"])
        assert r["meta"]["user"] == {"step": 3}
        # identical weights at the identical layout: the identical loss (not the saving layout's: another
        # layout reduces in another order)
        assert r["loss"] == r["dcp_loss"]


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
