"""The overlapped snapshot (``AsyncOptions(snapshot="overlap")``) on the CPU: ``save`` returns before any
copy, the copy runs on the persist thread, a guarded optimizer's ``step`` waits for it.

Every test trains or changes the state right after the save returns and then loads the checkpoint
back, comparing it bit for bit with a clone taken at the save call; a change that bypasses the
guard must fail that save with :class:`ckptkit.SnapshotRaceError` and commit nothing.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.engine.async_save import AsyncSaver
from ckptkit.storage import open_store

OVERLAP = ckptkit.AsyncOptions(snapshot="overlap")


class Job:
    """A small real training job: two linear layers and a flat ZeRO-style buffer (saved as a
    ``Sharded`` flat fragment), all trained by one AdamW, whose moments are saved too."""

    def __init__(self, width: int = 256, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 8)).to(dtype)
        self.flat = torch.nn.Parameter(torch.randn(3 * width, dtype=dtype))
        eps = 1e-8 if dtype == torch.float32 else 1e-3  # fp16 moments would underflow to nan with 1e-8
        self.optim = torch.optim.AdamW([*self.model.parameters(), self.flat], lr=1e-2, eps=eps)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.width = width
        self.dtype = dtype
        self.step()  # the moments exist from here on

    def step(self) -> None:
        x = torch.randn(16, self.width, generator=self.gen).to(self.dtype)
        loss = self.model(x).float().square().mean() + self.flat.float().square().sum() * 1e-3
        loss.backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)

    def state(self) -> dict:
        n = self.flat.numel()
        moments = {f"{i}.{k}": v for i, s in enumerate(self.optim.state.values()) for k, v in s.items()}
        return {
            "model": self.model.state_dict(),  # detached views: they share the parameters' version counters
            "zero": ckptkit.Sharded(self.flat.detach(), [ckptkit.flat_piece("zero", (n,), ckptkit.Box((0,), (n,)), 0, n)]),
            "optim": moments,
            "lr": self.optim.param_groups[0]["lr"],
        }


def clone(state: dict) -> dict:
    return {
        "model": {k: v.clone() for k, v in state["model"].items()},
        "zero": state["zero"].local.clone(),
        "optim": {k: v.clone() for k, v in state["optim"].items()},
        "lr": state["lr"],
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def assert_checkpoint_equals(path: str, expected: dict) -> None:
    n = expected["zero"].numel()
    target = {
        "model": {k: torch.full_like(v, -7) for k, v in expected["model"].items()},
        "zero": ckptkit.Sharded(torch.full_like(expected["zero"], -7),
                                [ckptkit.flat_piece("zero", (n,), ckptkit.Box((0,), (n,)), 0, n)]),
        "optim": {k: torch.full_like(v, -7) for k, v in expected["optim"].items()},
        "lr": 0.0,
    }
    ckptkit.load(target, path)
    for k, v in expected["model"].items():
        assert same_bits(target["model"][k], v), k
    assert same_bits(target["zero"].local, expected["zero"])
    for k, v in expected["optim"].items():
        assert same_bits(target["optim"][k], v), k
    assert target["lr"] == expected["lr"]


def committed(path: str) -> bool:
    return os.path.exists(os.path.join(path, "manifest.json"))


@pytest.fixture
def saver():
    s = AsyncSaver(options=OVERLAP)
    yield s
    s.close()


# ------------------------------------------------------------------ consistency


def test_save_returns_before_the_copy_and_an_optimizer_step_right_after_does_not_leak(saver, tmp_path):
    job = Job(width=512)
    saver.guard(job.optim)
    handles, expected = [], []
    for i in range(4):
        state = job.state()
        expected.append(clone(state))
        handles.append(saver.save(state, open_store(str(tmp_path / f"c{i}"))))
        job.step()  # at once: the hook makes it wait for the copy
        job.step()
    saver.wait()
    for h, e in zip(handles, expected):
        assert h.committed.result().rank_bytes > 0
        assert_checkpoint_equals(h.path, e)
    # the state really changed after each save: the comparison above could fail
    assert not torch.equal(expected[0]["zero"], expected[1]["zero"])


def test_save_returns_without_copying(tmp_path):
    """The save call does no copy: ``staged`` is not resolved when it returns while the persist thread
    is held busy, and the copy happens once it is free (the step waits for it)."""
    job = Job(width=256)
    saver = AsyncSaver(options=OVERLAP)
    saver.guard(job.optim)
    release = threading.Event()
    saver._executor.submit(release.wait)  # the persist thread is busy: the copy cannot have started
    try:
        expected = clone(job.state())
        h = saver.save(job.state(), open_store(str(tmp_path / "c")))
        assert not h.staged.done()
        release.set()
        job.step()
        assert h.staged.done()
        saver.wait()
        assert_checkpoint_equals(h.path, expected)
    finally:
        release.set()
        saver.close()


def test_back_to_back_saves_without_a_step_between(saver, tmp_path):
    job = Job()
    saver.guard(job.optim)
    expected = clone(job.state())
    h1 = saver.save(job.state(), open_store(str(tmp_path / "a")))
    h2 = saver.save(job.state(), open_store(str(tmp_path / "b")))  # waits for the first, reuses its buffer
    job.step()
    expected_c = clone(job.state())
    h3 = saver.save(job.state(), open_store(str(tmp_path / "c")))
    job.step()
    saver.wait()
    assert_checkpoint_equals(h1.path, expected)
    assert_checkpoint_equals(h2.path, expected)
    assert_checkpoint_equals(h3.path, expected_c)


def test_a_save_at_every_step_through_the_manager(tmp_path):
    job = Job(width=384)
    expected = {}
    with ckptkit.CheckpointManager(str(tmp_path), save=ckptkit.SavePolicy(every_steps=1),
                                   keep=ckptkit.RetentionPolicy(keep_last=20), asynchronous=OVERLAP,
                                   guard=job.optim) as mgr:
        for step in range(1, 9):
            state = job.state()
            expected[step] = clone(state)
            h = mgr.maybe_save(step, state)
            assert h is not None
            job.step()
    for step, e in expected.items():
        assert_checkpoint_equals(str(tmp_path / f"step-{step:07d}"), e)


def test_manager_maybe_save_and_restore_latest(tmp_path):
    job = Job()
    with ckptkit.CheckpointManager(str(tmp_path), save=ckptkit.SavePolicy(every_steps=3),
                                   keep=ckptkit.RetentionPolicy(keep_last=2), asynchronous=OVERLAP) as mgr:
        mgr.guard(job.optim)
        saved = {}
        for step in range(1, 11):
            job.step()
            state = job.state()
            if mgr.maybe_save(step, state) is not None:
                saved[step] = clone(state)
    assert sorted(saved) == [3, 6, 9]
    assert sorted(os.listdir(tmp_path)) >= ["step-0000006", "step-0000009"]
    assert not (tmp_path / "step-0000003").exists()  # retention ran after the overlapped commits
    other = Job(seed=5)
    target = other.state()
    with ckptkit.CheckpointManager(str(tmp_path), asynchronous=None) as mgr:
        assert mgr.restore_latest(target) == 9
    for k, v in saved[9]["model"].items():
        assert torch.equal(target["model"][k], v)
    assert torch.equal(target["zero"].local, saved[9]["zero"])


def test_save_async_with_guard_and_the_process_executor(tmp_path):
    job = Job()
    opts = ckptkit.AsyncOptions(snapshot="overlap", executor="process")
    try:
        expected = clone(job.state())
        h = ckptkit.save_async(job.state(), str(tmp_path / "a"), options=opts, guard=job.optim)
        job.step()
        expected_b = clone(job.state())
        h2 = ckptkit.save_async(job.state(), str(tmp_path / "b"), options=opts, guard=[job.optim])  # hooked once
        job.step()
        h.wait(), h2.wait()
    finally:
        ckptkit.close_async()
    assert_checkpoint_equals(h.path, expected)
    assert_checkpoint_equals(h2.path, expected_b)
    assert len(job.optim._optimizer_step_pre_hooks) == 0  # closing the saver removed its hook


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(width=st.integers(8, 300), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**16), steps=st.lists(st.integers(0, 2), min_size=2, max_size=4))
def test_random_states_and_schedules(tmp_path_factory, width, dtype, seed, steps):
    """Random widths and dtypes, and random numbers of steps between saves (0: back to back)."""
    job = Job(width=width, seed=seed, dtype=dtype)
    base = tmp_path_factory.mktemp("random")
    saver = AsyncSaver(options=OVERLAP)
    saver.guard(job.optim)
    try:
        pairs = []
        for i, n in enumerate(steps):
            pairs.append((saver.save(job.state(), open_store(str(base / f"c{i}"))), clone(job.state())))
            for _ in range(n):
                job.step()
        saver.wait()
    finally:
        saver.close()
    for h, e in pairs:
        assert_checkpoint_equals(h.path, e)


def test_the_gate_runs_before_the_optimizers_other_step_pre_hooks(saver, tmp_path):
    """A pre-hook registered earlier that changes saved state (torchtitan's MoE load balancing updates
    expert_bias in one) runs after the copy: the gate is moved first."""
    job = Job()
    bias = torch.zeros(16)

    def balance(*_: object) -> None:
        bias.add_(1)

    job.optim.register_step_pre_hook(balance)
    saver.guard(job.optim)
    state = {**job.state(), "bias": bias}
    release = threading.Event()
    saver._executor.submit(release.wait)  # the persist thread is busy: the copy starts after the step began
    timer = threading.Timer(0.3, release.set)
    timer.start()
    try:
        h = saver.save(state, open_store(str(tmp_path / "a")))
        assert not h.staged.done()
        job.step()  # its pre-hooks run while the copy has not started: the gate first, then balance
    finally:
        release.set()
        timer.cancel()
    saver.wait()
    assert torch.equal(bias, torch.ones(16))
    target = {"bias": torch.full((16,), -1.0)}
    ckptkit.load(target, h.path, strict=False)
    assert torch.equal(target["bias"], torch.zeros(16))


def test_wait_snapshot_lets_a_path_without_a_hook_change_the_state(tmp_path):
    job = Job()
    with ckptkit.CheckpointManager(str(tmp_path), asynchronous=OVERLAP, guard=job.optim) as mgr:
        expected = clone(job.state())
        h = mgr.save(1, job.state())
        mgr.wait_snapshot()  # e.g. torchtitan's maybe_wait_for_staging, before an update no guard hooks
        with torch.no_grad():
            job.flat.mul_(3)
        mgr.wait()
    assert_checkpoint_equals(h.path, expected)


# ------------------------------------------------------------- changes the guard does not see


def test_an_in_place_change_bypassing_the_guard_fails_that_save_and_commits_nothing(saver, tmp_path):
    job = Job()
    saver.guard(job.optim)
    good = clone(job.state())
    h0 = saver.save(job.state(), open_store(str(tmp_path / "good")))
    job.step()
    saver.wait()
    h = saver.save(job.state(), open_store(str(tmp_path / "bad")))
    with torch.no_grad():
        job.model[0].weight.mul_(2)  # not through the optimizer's step
    job.step()
    with pytest.raises(ckptkit.SnapshotRaceError, match=r"tensor 'model/0\.weight' was changed in place"):
        h.wait()
    saver.acknowledge(h)
    assert not committed(h.path)
    assert committed(h0.path)
    assert_checkpoint_equals(h0.path, good)  # the previous checkpoint is intact
    # the saver carries on: the next save commits
    expected = clone(job.state())
    h2 = saver.save(job.state(), open_store(str(tmp_path / "next")))
    job.step()
    saver.wait()
    assert_checkpoint_equals(h2.path, expected)


def test_a_concurrent_writer_racing_the_copy_is_caught(tmp_path):
    """Another thread writes the saved state while the background copy runs: the torn copy is
    never committed (the manager's next ``maybe_save`` raises the failure)."""
    job = Job(width=1024)
    with ckptkit.CheckpointManager(str(tmp_path), save=ckptkit.SavePolicy(every_steps=1), asynchronous=OVERLAP,
                                   guard=job.optim) as mgr:
        stop = threading.Event()
        target = job.flat

        def scribble() -> None:
            with torch.no_grad():
                while not stop.is_set():
                    target.add_(1)

        h = mgr.maybe_save(1, job.state())
        t = threading.Thread(target=scribble)
        t.start()
        try:
            with pytest.raises(ckptkit.SnapshotRaceError, match="tensor 'zero' was changed in place"):
                h.wait()
        finally:
            stop.set()
            t.join()
        with pytest.raises(ckptkit.SaveError, match="previous checkpoint save failed.*'zero'"):
            mgr.maybe_save(2, job.state())
    assert not committed(str(tmp_path / "step-0000001"))


def test_a_change_after_the_commit_does_not_touch_the_checkpoint(saver, tmp_path):
    """Once the save is committed its copy was verified final: a change before the guard's step is
    then harmless to it (the checkpoint is the state at the save call) and the step does not wait."""
    job = Job()
    saver.guard(job.optim)
    expected = clone(job.state())
    h = saver.save(job.state(), open_store(str(tmp_path / "a")))
    h.wait()  # committed; the gate is not passed yet
    with torch.no_grad():
        job.flat.add_(1)
    job.step()
    assert_checkpoint_equals(h.path, expected)
    h2 = saver.save(job.state(), open_store(str(tmp_path / "b")))
    job.step()
    saver.wait()
    assert committed(h2.path)


# ------------------------------------------------------------------ refused configurations


def test_options_are_validated():
    with pytest.raises(ckptkit.OptionsError, match="snapshot must be 'blocking' or 'overlap'"):
        ckptkit.AsyncOptions(snapshot="lazy")  # type: ignore[arg-type]
    with pytest.raises(ckptkit.OptionsError, match="cannot stage in waves"):
        ckptkit.AsyncOptions(snapshot="overlap", max_staging_bytes=1 << 20)
    ckptkit.AsyncOptions(snapshot="overlap", max_staging_bytes=1 << 20, over_budget="error")  # a hard budget is fine
    assert ckptkit.AsyncOptions().snapshot == "blocking"


def test_no_guard_is_refused_before_anything_is_written(saver, tmp_path):
    job = Job()
    with pytest.raises(ckptkit.OptionsError, match="needs a guard on this rank"):
        saver.save(job.state(), open_store(str(tmp_path / "a")))
    assert not (tmp_path / "a").exists() or not os.listdir(tmp_path / "a")


def test_a_guard_without_a_step_hook_is_refused(saver):
    class NotAnOptimizer:
        def step(self) -> None:
            pass

    with pytest.raises(ckptkit.OptionsError, match="has no register_step_pre_hook"):
        saver.guard(NotAnOptimizer())


def test_a_budget_the_state_does_not_fit_fails_clearly(tmp_path):
    job = Job()
    s = AsyncSaver(options=ckptkit.AsyncOptions(snapshot="overlap", max_staging_bytes=8192, over_budget="error"))
    s.guard(job.optim)
    try:
        with pytest.raises(ckptkit.SaveError, match="staging budget"):
            s.save(job.state(), open_store(str(tmp_path / "a")))
    finally:
        s.close()


def test_inference_tensors_are_refused(saver, tmp_path):
    job = Job()
    saver.guard(job.optim)
    with torch.inference_mode():
        frozen = torch.ones(4)
    h = saver.save({"frozen": frozen}, open_store(str(tmp_path / "a")))
    with pytest.raises(ckptkit.SaveError, match="'frozen'.*no version counter"):
        h.wait()
    saver.acknowledge(h)
    assert not committed(h.path)


def test_guards_are_harmless_in_the_blocking_mode_and_removed_on_close(tmp_path):
    job = Job()
    s = AsyncSaver()
    s.guard(job.optim)
    expected = clone(job.state())
    h = s.save(job.state(), open_store(str(tmp_path / "a")))
    job.step()
    s.close()
    assert_checkpoint_equals(h.path, expected)
    assert len(job.optim._optimizer_step_pre_hooks) == 0


# ---------------------------------------------------------------- changes no version counter of the tensor shows
def _second_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd fused":  # fused kernels move no version counter, and SGD's state has no step tensor
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, fused=True)
    if kind == "adamw fused":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=kind == "sgd foreach")


@pytest.mark.parametrize("kind", ["sgd fused", "adamw fused", "sgd foreach", "sgd single"])
def test_an_optimizer_not_named_as_a_guard_waits_for_the_copy_too(tmp_path, kind):
    """A second optimizer stepping during the copy: every torch optimizer of the process waits at the gate
    (a global step pre-hook), so the checkpoint holds the state at the save call. A fused one, which moves
    no version counter, committed its update silently (a hunt, 2026-12-06)."""
    from tests.overlap_job import copy_held_back

    torch.manual_seed(0)
    a, b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    opt_a, opt_b = torch.optim.AdamW(a.parameters(), lr=1e-2), _second_optimizer(kind, b.parameters())

    def train() -> None:
        x = torch.randn(4, 16)
        (a(x).square().mean() + b(x).square().mean()).backward()
        opt_b.step()  # the unguarded one first
        opt_a.step()
        opt_a.zero_grad()
        opt_b.zero_grad()

    def state() -> dict:
        return {"a": a.state_dict(), "b": b.state_dict(),
                "opt_b": {f"{i}.{k}": v for i, s in enumerate(opt_b.state.values()) for k, v in s.items()}}

    train()
    with copy_held_back() as held, ckptkit.CheckpointManager(
            str(tmp_path / "run"), asynchronous=ckptkit.AsyncOptions(snapshot="overlap"), guard=opt_a) as mgr:
        expected = {k: {n: t.clone() for n, t in v.items()} for k, v in state().items()}
        handle = mgr.save(1, state())
        train()
        handle.wait()
    assert held
    target = {k: {n: torch.full_like(t, -7) for n, t in v.items()} for k, v in expected.items()}
    ckptkit.load(target, handle.path)
    assert all(same_bits(target[k][n], t) for k, v in expected.items() for n, t in v.items())


def test_ckptkit_load_into_the_live_state_after_an_overlapped_save_waits_for_its_copy(tmp_path):
    """A rollback with ``ckptkit.load`` into the live tensors right after an overlapped save: the loader's
    writes move no version counter (they land through memoryviews), and the save committed the loaded
    bytes under its step (a hunt, 2026-12-06). The loader passes every pending gate first, and tells
    torch the destinations moved."""
    from tests.overlap_job import copy_held_back

    job = Job()
    with ckptkit.CheckpointManager(str(tmp_path / "run"), asynchronous=ckptkit.AsyncOptions(snapshot="overlap"),
                                   guard=job.optim) as mgr:
        mgr.save(1, job.state())
        mgr.wait()
        job.step()
        expected = clone(job.state())
        versions = [t._version for t in job.model.parameters()]
        with copy_held_back() as held:
            handle = mgr.save(2, job.state())
            ckptkit.load(job.state(), mgr.step_url(1))  # the rollback, before any guarded step
        handle.wait()
    assert held
    assert_checkpoint_equals(handle.path, expected)
    assert all(t._version > v for t, v in zip(job.model.parameters(), versions))


def dtensor_change_outside_the_guard(folder: str, through_local: bool) -> str:
    """A DTensor parameter and an EMA DTensor changed in place under no_grad right after an overlapped save:
    through the DTensors, or through their local tensors (``to_local()``, an EMA on the shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from tests.overlap_job import copy_held_back

    mesh = init_device_mesh("cpu", (1,))
    w = torch.nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Replicate()]))
    ema = distribute_tensor(torch.randn(8, 8), mesh, [Replicate()])
    opt = torch.optim.AdamW([w], lr=1e-2)
    with copy_held_back(), ckptkit.CheckpointManager(folder, asynchronous=ckptkit.AsyncOptions(snapshot="overlap"),
                                                     guard=opt) as mgr:
        handle = mgr.save(1, {"w": w, "ema": ema})
        with torch.no_grad():
            if through_local:
                ema.to_local().mul_(0.9)
            else:
                ema.mul_(0.9)
                w.mul_(2.0)
        try:
            handle.wait()
            return "committed"
        except ckptkit.SnapshotRaceError as exc:
            mgr.acknowledge(handle)
            return str(exc)


@pytest.mark.parametrize("through_local", [False, True], ids=["dtensor", "to_local"])
def test_an_in_place_change_of_a_dtensor_outside_the_guard_fails_the_save(worlds, tmp_path, through_local):
    """An in-place op on a DTensor moves the DTensor's version counter, not its local tensor's, and one on
    its local tensor the reverse: the checks watched the local one only, and no change of DTensor state was
    ever seen; the first fix watched the DTensor only, and lost the second kind (hunts, 2026-12-06)."""
    said = worlds.run(1, dtensor_change_outside_the_guard, str(tmp_path / "run"), through_local, timeout=120)[0]
    assert "was changed in place" in said and ("'w'" in said or "'ema'" in said), said
