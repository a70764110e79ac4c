"""Staging in waves (AsyncOptions.over_budget="waves"): a snapshot larger than the staging budget.

A waves save must be the one-shot save, byte for byte (data, index, manifest apart from the
attempt id, the time and the hashes of what names the attempt), with either executor, across
gloo worlds, to local files and to S3 (a real moto server); its staging must stay within the
budget (peak RSS, measured by the kernel); and a failure in the middle of the waves must commit
nothing and leave the previous checkpoint alone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit
from ckptkit.engine.async_save import AsyncSaver
from ckptkit.engine.waves import WaveSchedule, copy_elements
from ckptkit.errors import OptionsError, StorageError
from ckptkit.storage import open_store
from ckptkit.storage.local import LocalStore
from tests.peak_memory import section, zygote
from tests.s3_server import s3_env, s3_server  # noqa: F401 - fixtures

BUDGET = 64 << 10  # 32 KiB windows: the state below needs ~14 of them


def make_state(rank: int = 0, world: int = 1) -> dict[str, Any]:
    """Many small tensors of several dtypes, one larger than the whole budget, a strided view, a
    strided box of a local tensor larger than the budget (this rank's rows of ``boxed``) and, alone,
    a ZeRO-style flat buffer (their pieces cross window edges by byte range)."""
    g = torch.Generator().manual_seed(3)
    boxed = torch.randn(120 * world, 300, generator=g)[120 * rank:120 * (rank + 1)].clone()
    state: dict[str, Any] = {f"small/{i}": torch.randn(i * 7 + 1, generator=g) for i in range(60)}
    state.update({f"half/{i}": torch.randn(33 + i, generator=g).to(torch.bfloat16) for i in range(20)})
    state["big"] = torch.randn(200, 160, generator=g)  # 125 KiB: about twice the budget
    state["strided"] = torch.randn(96, 130, generator=g).t()
    state["boxed"] = ckptkit.Sharded(boxed, [ckptkit.box_piece("boxed", (120 * world, 280), (120 * rank, 0), (120, 280),
                                                                local_offsets=(0, 10))])
    local = torch.randn(3 * 4000, generator=g)
    if world > 1:  # every rank holding all of it would overlap
        return state
    state["zero"] = ckptkit.Sharded(local, [
        ckptkit.flat_piece("zero/a", (4000, 2), ckptkit.Box((0, 0), (4000, 2)), 0, 8000),
        ckptkit.flat_piece("zero/b", (4000,), ckptkit.Box((0,), (4000,)), 0, 4000, local_start=8000),
    ])
    state["step"] = 7
    return state


def zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, ckptkit.Sharded):
            out[k] = ckptkit.Sharded(torch.zeros_like(v.local), v.pieces)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = 0
    return out


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k, v in a.items():
        if k == "boxed":  # only its columns 10:290 are a piece
            assert torch.equal(v.local[:, 10:290], b[k].local[:, 10:290]), k
        elif isinstance(v, ckptkit.Sharded):
            assert torch.equal(v.local, b[k].local), k
        elif isinstance(v, torch.Tensor):
            assert v.dtype == b[k].dtype and torch.equal(v, b[k]), k
        else:
            assert v == b[k], k


def _strip(obj: Any) -> Any:
    """A manifest without what differs between two saves of the same state: the time and the
    hashes of the indexes (which name the attempt)."""
    if isinstance(obj, dict):
        return {k: ([e[:3] for e in v] if k == "indexes" else _strip(v))  # (rank, key, size, sha256)
                for k, v in obj.items() if k not in ("created", "manifest_sha256")}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def normalized(path: str | Path) -> dict[str, Any]:
    """Every file of a checkpoint, its attempt id replaced by ``A``; the manifest as stripped JSON."""
    root = Path(path)
    attempt = json.loads((root / "manifest.json").read_bytes())["attempt"]
    out: dict[str, Any] = {}
    for f in sorted(root.rglob("*")):
        if f.is_file():
            data = f.read_bytes().replace(attempt.encode(), b"A")
            name = str(f.relative_to(root)).replace(attempt, "A")
            out[name] = _strip(json.loads(data)) if name == "manifest.json" else data
    return out


def save_twice(state: dict[str, Any], run: str, executor: str, budget: int) -> tuple[int, int]:
    """One-shot to ``run/one``, waves to ``run/waves`` (the state changed right after the waves save
    returns, as a trainer would); the waves pool's size and the one-shot's. The one-shot save uses
    the thread executor (both executors write a one-shot snapshot with the same function), so a
    process-executor test spawns one writer process, not two."""
    sizes = []
    for name, options in (("one", ckptkit.AsyncOptions()),
                          ("waves", ckptkit.AsyncOptions(executor=executor, max_staging_bytes=budget))):
        saver = AsyncSaver(options=options)
        try:
            handle = saver.save(state, open_store(os.path.join(run, name)))
            assert handle is not None and handle.staged.done()
            if name == "waves":  # every byte is staged by now: changing the state cannot leak in
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        v.add_(1)
            handle.wait()
            sizes.append(saver.pool.nbytes)
        finally:
            saver.close()
    return sizes[0], sizes[1]


@pytest.mark.parametrize("executor", ["thread"])  # the process executor: in the gloo world below
def test_waves_equal_a_one_shot_save(tmp_path, executor):
    state, expected = make_state(), make_state()
    one, waves = save_twice(state, str(tmp_path), executor, BUDGET)
    assert waves <= BUDGET < one  # the waves' buffer: the budget, not the state
    assert normalized(tmp_path / "one") == normalized(tmp_path / "waves")
    loaded = zeros_like_state(expected)
    ckptkit.load(loaded, str(tmp_path / "waves"))
    assert_same_state(expected, loaded)


def test_copy_elements_takes_any_range_of_a_strided_view():
    src = torch.arange(5 * 6 * 7, dtype=torch.float64).reshape(5, 6, 7)[1:4, ::2, 2:6]
    flat = src.contiguous().reshape(-1)
    for e0, e1 in [(0, flat.numel()), (3, 4), (5, 29), (4, 8), (0, 1), (17, 36), (10, 10)]:
        dst = torch.full((e1 - e0,), -1.0, dtype=torch.float64)
        copy_elements(dst, src, e0, e1)
        assert torch.equal(dst, flat[e0:e1]), (e0, e1)


def test_schedule_windows_cover_the_object_through_two_slots():
    s = WaveSchedule.for_budget(100_000, BUDGET)
    assert s.window == 32 << 10 and s.count == 4 and s.buffer_bytes == BUDGET
    spans = [s.span(j) for j in range(s.count)]
    assert spans[0][0] == 0 and spans[-1][1] == 100_000
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert [base for *_, base in spans] == [0, s.window, 0, s.window]


def test_options():
    assert ckptkit.AsyncOptions().over_budget == "waves"
    assert ckptkit.AsyncOptions(max_staging_bytes=1024, over_budget="error").max_staging_bytes == 1024
    with pytest.raises(OptionsError, match="over_budget must be 'waves' or 'error'"):
        ckptkit.AsyncOptions(over_budget="spill")  # type: ignore[arg-type]
    with pytest.raises(OptionsError, match="too small to stage in waves"):
        ckptkit.AsyncOptions(max_staging_bytes=4096)


class FailingStore(LocalStore):
    """A real local store whose data object write fails at its ``fail_at``-th chunk (a window)."""

    fail_at = 3

    def write_object(self, key, chunks):
        def counted():
            for n, chunk in enumerate(chunks, 1):
                if n == self.fail_at and key.startswith("data/"):
                    raise StorageError(f"injected failure writing {key} at chunk {n}")
                yield chunk
        return super().write_object(key, counted())


def test_a_failure_in_the_middle_of_the_waves_commits_nothing(tmp_path):
    state = make_state()
    saver = AsyncSaver(options=ckptkit.AsyncOptions(max_staging_bytes=BUDGET))
    saver.save(state, open_store(str(tmp_path / "good"))).wait()
    handle = saver.save(state, FailingStore(str(tmp_path / "bad")))
    assert handle is not None and handle.staged.done()
    with pytest.raises(ckptkit.SaveError, match="injected failure"):
        saver.wait()  # raised once, then forgotten
    assert not (tmp_path / "bad" / "manifest.json").exists()
    assert not list((tmp_path / "bad").rglob("*.bin"))  # the failed attempt's partial object is removed
    saver.save(state, open_store(str(tmp_path / "after"))).wait()  # the hand-off recovered
    saver.close()
    for name in ("good", "after"):
        loaded = zeros_like_state(state)
        ckptkit.load(loaded, str(tmp_path / name))
        assert_same_state(state, loaded)


# ------------------------------------------------------------------------ the memory bound

STATE_MIB = 192
BOUND_BUDGET = 8 << 20
SLACK = 48 << 20  # what a child faults in again after the fork (see tests/peak_memory.py), and more


def waves_save_rss(path: str, budget: int) -> dict[str, int]:
    """In a fresh child: a state of STATE_MIB, saved in waves; the save's peak RSS above its start."""
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(STATE_MIB << 16, generator=g) for i in range(4)}  # 4 x 48 MiB
    saver = AsyncSaver(options=ckptkit.AsyncOptions(max_staging_bytes=budget))
    with section("save") as entry:
        saver.save(state, open_store(path)).wait()
    saver.close()
    return {"rss": entry["rss"], "pool": saver.pool.nbytes}


def test_waves_keep_the_staging_within_the_budget(tmp_path):
    measured = zygote().run(waves_save_rss, str(tmp_path / "c"), BOUND_BUDGET, timeout=120)
    out = measured.result
    assert out["pool"] <= BOUND_BUDGET
    # a one-shot save of this state would add STATE_MIB of staging: the bound is far below it
    assert out["rss"] <= BOUND_BUDGET + SLACK, f"peak RSS {out['rss'] / 2**20:.1f} MiB"


# ------------------------------------------------------------------------ gloo worlds

def waves_in_a_world(run: str, executor: str) -> bool:
    """On every rank: the state of :func:`make_state` (replicated, so written once in the world)
    plus DTensors sharded by rows and by columns; saved one-shot and in waves. Rank 0 compares the
    two checkpoints; every rank loads the waves one back."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(5)
    rows, cols = torch.randn(96 * world, 100, generator=g), torch.randn(50, 64 * world, generator=g)

    def fresh(zero: bool) -> dict[str, Any]:
        state = make_state(dist.get_rank(), world)
        state = zeros_like_state(state) if zero else state
        state["rows"] = distribute_tensor(torch.zeros_like(rows) if zero else rows, mesh, [Shard(0)])
        state["cols"] = distribute_tensor(torch.zeros_like(cols) if zero else cols, mesh, [Shard(1)])
        return state

    save_twice(fresh(False), run, executor, BUDGET)
    dist.barrier()
    same = dist.get_rank() != 0 or normalized(os.path.join(run, "one")) == normalized(os.path.join(run, "waves"))
    loaded, expected = fresh(True), fresh(False)
    ckptkit.load(loaded, os.path.join(run, "waves"))
    for key in ("rows", "cols"):
        assert torch.equal(loaded.pop(key).to_local(), expected.pop(key).to_local()), key
    assert_same_state(expected, loaded)
    return same


@pytest.mark.parametrize("size,executor", [(2, "process"), (4, "thread")])
def test_waves_in_gloo_worlds_equal_a_one_shot_save(worlds, tmp_path, size, executor):
    assert worlds.run(size, waves_in_a_world, str(tmp_path / "run"), executor, timeout=120)[0] is True


class HoldingStore(LocalStore):
    """A real local store that declares it may hold every chunk until the object is written."""

    streams_writes = False


def test_a_store_that_holds_chunks_is_refused_clearly(tmp_path):
    saver = AsyncSaver(options=ckptkit.AsyncOptions(max_staging_bytes=BUDGET))
    handle = saver.save(make_state(), HoldingStore(str(tmp_path / "c")))
    assert handle is not None and handle.staged.done()
    with pytest.raises(ckptkit.SaveError, match="needs a store that streams writes"):
        saver.wait()
    saver.close()
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_waves_to_s3_equal_a_one_shot_save(s3_env, s3_server):  # noqa: F811
    """The S3 store streams each window into its multipart part buffer (a real moto server)."""
    state, expected = make_state(), make_state()
    client = s3_server.client()
    bodies = []
    for name, options in (("one", ckptkit.AsyncOptions()), ("waves", ckptkit.AsyncOptions(max_staging_bytes=BUDGET))):
        saver = AsyncSaver(options=options)
        saver.save(state, open_store(f"s3://{s3_env}/{name}")).wait()
        saver.close()
        listed = client.list_objects_v2(Bucket=s3_env, Prefix=f"{name}/data/")["Contents"]
        bodies.append(client.get_object(Bucket=s3_env, Key=listed[0]["Key"])["Body"].read())
    assert bodies[0] == bodies[1]
    loaded = zeros_like_state(expected)
    ckptkit.load(loaded, f"s3://{s3_env}/waves")
    assert_same_state(expected, loaded)


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_save_started_the_moment_the_previous_one_commits_is_never_aborted(tmp_path, executor):
    """A done-callback on the handle (logging, an upload trigger) delays the persist thread after the handle
    resolved; the next save, started at once, resets the wave channel and stages into it. The previous
    save's persist thread aborted the channel after resolving, in a ``finally``, and killed that save
    ("staging in waves was abandoned"; found by a hunt, 2026-12-06)."""
    import time

    from ckptkit.storage import open_store

    saver = AsyncSaver(options=ckptkit.AsyncOptions(max_staging_bytes=64 << 10, executor=executor))
    state = {"w": torch.randn(200, 160)}  # 125 KiB through a 64 KiB budget: waves
    try:
        for i in range(3):
            state["w"] += 1
            handle = saver.save(state, open_store(str(tmp_path / f"s{i}")), step=i)
            handle.committed.add_done_callback(lambda _: time.sleep(0.3))
            handle.wait()
        saver.wait()
    finally:
        saver.close()
    for i in range(3):
        assert ckptkit.verify(str(tmp_path / f"s{i}")).ok
