"""The overlapped snapshot on a CUDA GPU: the copy runs on a side stream while the next step runs.

Every test is skipped without CUDA. What they check on one GPU:

* consistency under an optimizer that starts the next step at once: ``save`` returns, the very
  next call is ``optimizer.step()`` (fused AdamW, queued on the training stream without any host
  sync), many repetitions over a large state; every checkpoint must equal, bit for bit, a clone
  of the state taken on the GPU at the save call. A wrong stream order (the step's kernels racing
  the side stream's device-to-host copies) shows up as a mismatch;
* the memory of a tensor dropped right after the save is not reused before the copy read it;
* an in-place change that bypasses the optimizer is caught (the save fails, nothing committed);
* the save call returns in a small fraction of a blocking snapshot's time (printed, and bounded
  loosely so that a regression to copying on the training thread fails).
"""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

import ckptkit
from ckptkit.engine.async_save import AsyncSaver
from ckptkit.storage import open_store

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

OVERLAP = ckptkit.AsyncOptions(snapshot="overlap")


def make_job(width: int, layers: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=True) for _ in range(layers)]).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for p in model.parameters():  # gradients that stay: every step changes every weight and moment
        p.grad = torch.randn_like(p)
    optim.step()
    return model, optim


def job_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    moments = {f"{i}.{k}": v for i, s in enumerate(optim.state.values()) for k, v in s.items() if v.dim() > 0}
    return {"model": model.state_dict(), "optim": moments}


def gpu_clone(state: dict) -> dict:
    """A clone queued on the training stream at the save call: the state as the save must see it."""
    return {g: {k: v.clone() for k, v in d.items()} for g, d in state.items()}


def assert_equals(path: str, expected: dict) -> None:
    target = {g: {k: torch.empty(v.shape, dtype=v.dtype) for k, v in d.items()} for g, d in expected.items()}
    ckptkit.load(target, path)
    for g, d in expected.items():
        for k, v in d.items():
            got, want = target[g][k].view(torch.uint8), v.cpu().view(torch.uint8)
            assert torch.equal(got, want), f"{g}/{k} differs from the state at the save call"


def committed(path: str) -> bool:
    return os.path.exists(os.path.join(path, "manifest.json"))


@pytest.mark.parametrize("width,layers,reps", [(2048, 4, 16), (8192, 4, 2)])
def test_the_next_step_starts_at_once_and_the_checkpoint_is_the_state_at_the_save(tmp_path, width, layers, reps):
    """(2048, 4): 4 x 16 MiB weights + moments (192 MiB), 16 saves; (8192, 4): 4 x 256 MiB + moments, 3 GiB, 2 saves
    (within the GPU check's 150 s for this file: every save is written, loaded back and compared)."""
    model, optim = make_job(width, layers)
    saver = AsyncSaver(options=OVERLAP)
    saver.guard(optim)
    try:
        for i in range(reps):
            state = job_state(model, optim)
            expected = gpu_clone(state)
            h = saver.save(state, open_store(str(tmp_path / f"c{i}")))
            optim.step()  # queued at once; its kernels must run after the side stream's copies
            optim.step()
            h.wait()
            torch.cuda.synchronize()
            assert_equals(h.path, expected)
            shutil.rmtree(h.path)  # keep the disk small
    finally:
        saver.close()


def test_a_save_every_step_through_the_manager(tmp_path):
    model, optim = make_job(1024, 4, seed=1)
    expected = {}
    with ckptkit.CheckpointManager(str(tmp_path), save=ckptkit.SavePolicy(every_steps=1),
                                   keep=ckptkit.RetentionPolicy(keep_last=50), asynchronous=OVERLAP,
                                   guard=optim) as mgr:
        for step in range(1, 13):
            state = job_state(model, optim)
            expected[step] = gpu_clone(state)
            assert mgr.maybe_save(step, state) is not None
            optim.step()
    torch.cuda.synchronize()
    for step, e in expected.items():
        assert_equals(str(tmp_path / f"step-{step:07d}"), e)


def test_a_tensor_dropped_after_the_save_is_not_overwritten_before_it_is_copied(tmp_path):
    saver = AsyncSaver(options=OVERLAP)
    guard = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1, device="cuda"))], lr=0.1)
    saver.guard(guard)
    try:
        for i in range(6):
            t = torch.randn(64 << 20, device="cuda")  # 256 MiB
            expected = {"s": {"t": t.clone()}}
            h = saver.save({"s": {"t": t}}, open_store(str(tmp_path / f"c{i}")))
            del t
            junk = torch.full((64 << 20,), float(i), device="cuda")  # may take the freed block
            junk.mul_(3)
            h.wait()
            torch.cuda.synchronize()
            assert_equals(h.path, expected)
            del junk
    finally:
        saver.close()


def test_an_in_place_change_bypassing_the_optimizer_is_caught(tmp_path):
    model, optim = make_job(4096, 2, seed=2)
    saver = AsyncSaver(options=OVERLAP)
    saver.guard(optim)
    try:
        h = saver.save(job_state(model, optim), open_store(str(tmp_path / "bad")))
        with torch.no_grad():
            model[1].weight.mul_(2)  # not through optim.step(): races the side stream's copy
        optim.step()
        with pytest.raises(ckptkit.SnapshotRaceError, match=r"tensor 'model/1\.weight' was changed in place"):
            h.wait()
        saver.acknowledge(h)
        assert not committed(h.path)
    finally:
        saver.close()


def test_the_save_returns_in_a_fraction_of_a_blocking_snapshot(tmp_path):
    model, optim = make_job(8192, 2, seed=3)  # 1.5 GiB of weights and moments
    times = {}
    for mode in ("blocking", "overlap"):
        saver = AsyncSaver(options=ckptkit.AsyncOptions(snapshot=mode))  # type: ignore[arg-type]
        saver.guard(optim)
        try:
            for i in range(2):  # the first allocates the pinned buffer; the second is timed
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                h = saver.save(job_state(model, optim), open_store(str(tmp_path / f"{mode}{i}")))
                if mode == "blocking":
                    h.staged.result()  # the device-to-host copies are final
                times[mode] = time.perf_counter() - t0
                optim.step()
                h.wait()
                shutil.rmtree(h.path)
        finally:
            saver.close()
    print(f"blocking snapshot {times['blocking'] * 1e3:.1f} ms, overlapped save call {times['overlap'] * 1e3:.1f} ms "
          f"({times['overlap'] / times['blocking']:.3f}x)")
    assert times["overlap"] < 0.5 * times["blocking"]
