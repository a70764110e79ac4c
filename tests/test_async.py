"""Asynchronous saves in one process: consistency, one save in flight, failures, budgets."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

import pytest
import torch

import ckptkit
from ckptkit.engine.async_save import AsyncSaver
from ckptkit.storage import open_store


def zero_buffer(local: torch.Tensor) -> ckptkit.Sharded:
    """A ZeRO-style flat buffer holding one fragment each of two parameters."""
    n = local.numel() // 3
    return ckptkit.Sharded(local, [
        ckptkit.flat_piece("zero/a", (n, 2), ckptkit.Box((0, 0), (n, 2)), 0, 2 * n),
        ckptkit.flat_piece("zero/b", (n,), ckptkit.Box((0,), (n,)), 0, n, local_start=2 * n),
    ])


def make_state(n: int = 256) -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(n, n, generator=g),
        "h": torch.randn(n, dtype=torch.bfloat16, generator=g),
        "zero": zero_buffer(torch.randn(3 * n, generator=g)),
        "step": 1,
    }


def snapshot_values(state: dict) -> dict:
    return {"w": state["w"].clone(), "h": state["h"].clone(), "zero": state["zero"].local.clone(), "step": state["step"]}


def assert_loads_as(path, expected: dict) -> None:
    target = {
        "w": torch.zeros_like(expected["w"]),
        "h": torch.zeros_like(expected["h"]),
        "zero": zero_buffer(torch.zeros_like(expected["zero"])),
        "step": 0,
    }
    ckptkit.load(target, path)
    assert torch.equal(target["w"], expected["w"])
    assert torch.equal(target["h"], expected["h"])
    assert torch.equal(target["zero"].local, expected["zero"])
    assert target["step"] == expected["step"]


@pytest.fixture
def saver():
    """An AsyncSaver closed after the test. ``close`` raises a background failure nobody has
    seen yet, so a save that failed unnoticed fails the test that made it (as an error in its
    teardown); a test that expects a failure must wait for it and assert it itself."""
    s = AsyncSaver()
    yield s
    s.close()


def test_state_mutated_right_after_save_async_does_not_leak(saver, tmp_path):
    state = make_state()
    expected = []
    handles = []
    for i in range(5):
        state["step"] = i
        expected.append(snapshot_values(state))
        handles.append(saver.save(state, open_store(str(tmp_path / f"c{i}"))))
        # the trainer changes everything in place the moment save returns
        state["w"].mul_(-1).add_(i)
        state["h"].add_(1)
        state["zero"].local.add_(7)
        state["step"] = 1000 + i
    saver.wait()
    for i, h in enumerate(handles):
        assert h.staged.done() and h.committed.result().total_bytes > 0
        assert_loads_as(tmp_path / f"c{i}", expected[i])


def test_one_save_in_flight_and_plan_and_buffer_reuse(saver, tmp_path, held_writes):
    state = make_state()
    h1 = saver.save(state, open_store(str(tmp_path / "c1")))
    plan, buf = saver._plans.copy(), saver.pool._buffer
    assert not h1.done()  # persist is held at the gate
    threading.Timer(0.3, held_writes.set).start()
    h2 = saver.save(state, open_store(str(tmp_path / "c2")))  # waits for h1 before snapshotting
    assert h1.done() and h1.committed.exception() is None
    assert saver._plans == plan and saver.pool._buffer is buf  # no replanning, same staging memory
    assert h2.wait().total_bytes == h1.wait().total_bytes


def test_skip_policy_drops_the_new_save_while_one_persists(tmp_path, held_writes):
    gate = held_writes
    mgr = ckptkit.CheckpointManager(str(tmp_path), save=ckptkit.SavePolicy(every_steps=1), asynchronous=ckptkit.AsyncOptions(on_busy="skip"))
    state = make_state()
    assert mgr.maybe_save(1, state) is not None
    assert mgr.maybe_save(2, state) is None  # skipped, training did not wait
    gate.set()
    mgr.close()
    assert [r.name for r in mgr.records() if r.committed] == ["step-0000001"]


def test_staging_budget_fails_clearly(tmp_path):
    """over_budget="error" (the default stages in waves instead: tests/test_async_waves.py)."""
    saver = AsyncSaver(options=ckptkit.AsyncOptions(max_staging_bytes=1024, over_budget="error"))
    with pytest.raises(ckptkit.SaveError, match="does not fit the staging budget of 1024 bytes"):
        saver.save(make_state(), open_store(str(tmp_path / "c")))
    saver.close()
    assert not (tmp_path / "c").exists()


def test_process_executor_round_trip(tmp_path):
    saver = AsyncSaver(options=ckptkit.AsyncOptions(executor="process"))
    state = make_state()
    expected = snapshot_values(state)
    saver.save(state, open_store(str(tmp_path / "c")))
    state["w"].add_(1)
    saver.close()
    assert_loads_as(tmp_path / "c", expected)


@pytest.mark.parametrize("options", [
    ckptkit.AsyncOptions(executor="process"),
    ckptkit.AsyncOptions(executor="process", max_staging_bytes=64 * 1024, over_budget="waves"),
], ids=["whole", "waves"])
def test_a_dead_writer_process_fails_its_save_and_the_next_save_starts_a_new_one(tmp_path, options):
    """The writer process killed (the OOM killer's choice: it maps the whole staging buffer) while a
    save waits for it, and again between saves: that save fails naming it, nothing of it is left
    and the previous checkpoint stands; every later save used to fail the same way, forever."""
    import signal

    mgr = ckptkit.CheckpointManager(str(tmp_path / "run"), save=ckptkit.SavePolicy(every_steps=1), asynchronous=options)
    state = make_state()
    mgr.save(1, state)
    mgr.wait()
    first = snapshot_values(state)
    writer = mgr._saver._writer
    os.kill(writer._proc.pid, signal.SIGSTOP)  # it cannot take the next save's request (or windows)...
    killer = threading.Timer(0.5, os.kill, (writer._proc.pid, signal.SIGKILL))  # ...and dies holding it
    killer.start()
    state["w"].add_(1)
    with pytest.raises(ckptkit.SaveError, match="writer (process )?died"):
        handle = mgr.save(2, state)  # in waves the step itself waits for the writer: it fails here
        try:
            handle.committed.result(timeout=60)
        finally:
            mgr.acknowledge(handle)
    killer.join()
    for step in (3, 4):
        state["w"].add_(1)
        state["step"] = step
        expected = snapshot_values(state)
        mgr.save(step, state)
        mgr.wait()
        assert_loads_as(tmp_path / "run" / f"step-{step:07d}", expected)
        dying = mgr._saver._writer._proc
        os.kill(dying.pid, signal.SIGKILL)  # between saves: the next one starts another
        dying.join(timeout=30)
    mgr.close()
    assert sorted(os.listdir(tmp_path / "run")) == ["step-0000001", "step-0000003", "step-0000004"]
    assert_loads_as(tmp_path / "run" / "step-0000001", first)


@pytest.fixture
def small_disk(tmp_path):
    """A real 6 MiB filesystem (tmpfs), so 'disk full' is the kernel's ENOSPC, not a mock."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_disk_full_during_persist_is_raised_next_call_and_keeps_the_previous(small_disk):
    state = make_state(256)  # ~0.3 MiB
    saver = AsyncSaver()
    saver.save(state, open_store(str(small_disk / "ok"))).wait()
    good = snapshot_values(state)
    big = {"w": torch.randn(1500, 1500), "step": 2}  # ~9 MiB: does not fit
    h = saver.save(big, open_store(str(small_disk / "full")))
    assert h.staged.done()
    with pytest.raises(ckptkit.SaveError, match="No space left on device|no space left on device"):
        saver.save(big, open_store(str(small_disk / "next")))
    assert not (small_disk / "full" / "manifest.json").exists()
    saver.close()
    assert_loads_as(small_disk / "ok", good)


def test_permission_denied_during_persist_is_raised_by_wait(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(run)], capture_output=True).returncode:
        pytest.skip("chattr is not available")
    try:
        saver = AsyncSaver()
        saver.save(make_state(), open_store(str(run / "c")))
        with pytest.raises(ckptkit.SaveError, match="[Oo]peration not permitted|[Pp]ermission denied"):
            saver.wait()
        saver.close()
    finally:
        subprocess.run(["chattr", "-i", str(run)], capture_output=True)
    assert not os.path.exists(run / "c" / "manifest.json")


def test_save_async_refuses_on_busy_skip_up_front(tmp_path):
    """``save_async`` always waits for the previous save (it returns a handle); with ``on_busy="skip"``
    a second call died on a bare AssertionError (None under ``python -O``). Refused, naming the way."""
    with pytest.raises(ckptkit.OptionsError, match="CheckpointManager"):
        ckptkit.save_async({"w": torch.ones(4)}, str(tmp_path / "a"), options=ckptkit.AsyncOptions(on_busy="skip"))
    assert not (tmp_path / "a").exists()
