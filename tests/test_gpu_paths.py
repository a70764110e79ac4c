"""GPU-only paths: pinned staging and device-to-host snapshots. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import ckptkit
from ckptkit.engine.async_save import AsyncSaver
from ckptkit.storage import open_store

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_snapshot_of_device_tensors_uses_pinned_memory_and_is_consistent(tmp_path):
    state = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(77, device="cuda", dtype=torch.bfloat16)}
    expected = {k: v.cpu() for k, v in state.items()}
    saver = AsyncSaver()
    h = saver.save(state, open_store(str(tmp_path / "c")))
    state["w"].add_(1)  # enqueued after the snapshot copies on the same stream
    state["b"].mul_(2)
    h.wait()
    assert saver.pool.kind == "pinned"
    saver.close()
    target = {"w": torch.zeros(1024, 1024, device="cuda"), "b": torch.zeros(77, device="cuda", dtype=torch.bfloat16)}
    ckptkit.load(target, tmp_path / "c")
    assert torch.equal(target["w"].cpu(), expected["w"]) and torch.equal(target["b"].cpu(), expected["b"])


@cuda
def test_sync_save_and_load_of_device_tensors(tmp_path):
    state = {"w": torch.randn(300, 70, device="cuda")}
    ckptkit.save(state, tmp_path / "c")
    target = {"w": torch.zeros(300, 70, device="cuda")}
    ckptkit.load(target, tmp_path / "c")
    assert torch.equal(target["w"], state["w"])
