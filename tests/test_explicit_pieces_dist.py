"""Explicitly declared pieces across world sizes: ZeRO-style flat buffers, replicas, per-rank values,
and failures that reach every rank instead of hanging one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ckptkit
from ckptkit.layout.box import Box

SHAPES = {"w1": (10, 6), "w2": (7,), "w3": (5, 5)}


def full_tensor(key: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(SHAPES[key], generator=g)


def zero_buffer(dp: int, rank: int, fill: bool) -> tuple[torch.Tensor, list]:
    """Rank ``rank``'s slice of the parameters flattened one after another, padded to dp."""
    order = list(SHAPES)
    sizes = [full_tensor(k).numel() for k in order]
    total = -(-sum(sizes) // dp) * dp
    per = total // dp
    lo, hi = rank * per, (rank + 1) * per
    buf = torch.zeros(per)
    pieces = []
    start = 0
    for key, n in zip(order, sizes):
        a, b = max(lo, start), min(hi, start + n)
        if b > a:
            pieces.append(ckptkit.flat_piece(f"exp_avg/{key}", SHAPES[key], Box.full(SHAPES[key]), a - start, b - start, local_start=a - lo))
            if fill:
                buf[a - lo:b - lo] = full_tensor(key).reshape(-1)[a - start:b - start]
        start += n
    return buf, pieces


def make_state(fill: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    buf, pieces = zero_buffer(world, rank, fill)
    norm = torch.arange(6, dtype=torch.float32) if fill else torch.zeros(6)
    gen = torch.Generator().manual_seed(rank + 100 if fill else 0)
    return {
        "optim": ckptkit.Sharded(buf, pieces),
        "norm": ckptkit.Sharded(norm, [ckptkit.box_piece("norm", (6,), (0,), (6,), replica=(rank, world))]),
        "loader": ckptkit.PerRank({"position": rank * 1000 + 7 if fill else -1}),
        "rng": gen,
        "step": 11 if fill else 0,
    }


def save_zero(path: str) -> int:
    ckptkit.save(make_state(fill=True), path)
    return dist.get_rank()


def load_zero(path: str, per_rank: str) -> dict:
    state = make_state(fill=False)
    if per_rank == "drop":
        del state["loader"], state["rng"]
        ckptkit.load(state, path, strict=False)
    else:
        ckptkit.load(state, path, options=ckptkit.LoadOptions(per_rank_on_resize=per_rank))
    expected, _ = zero_buffer(dist.get_world_size(), dist.get_rank(), fill=True)
    return {
        "buffer_ok": torch.equal(state["optim"].local, expected),
        "norm": state["norm"].local.tolist(),
        "loader": state["loader"].value if "loader" in state else None,
        "rng": state["rng"].initial_seed() if "rng" in state else None,
        "rng_next": torch.rand(1, generator=state["rng"]).item() if "rng" in state else None,
        "step": state["step"],
    }


def expected_rng_next(rank: int) -> float:
    return torch.rand(1, generator=torch.Generator().manual_seed(rank + 100)).item()


@pytest.fixture(scope="module")
def zero_ckpt(worlds, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("zero") / "step-1")
    worlds.run(4, save_zero, path)
    return path


def test_same_world_restores_everything_including_per_rank_values(worlds, zero_ckpt):
    results = worlds.run(4, load_zero, zero_ckpt, "error")
    for rank, r in enumerate(results):
        assert r["buffer_ok"]
        assert r["norm"] == list(range(6))
        assert r["loader"] == {"position": rank * 1000 + 7}
        assert r["rng_next"] == expected_rng_next(rank)
        assert r["step"] == 11


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_flat_fragments_reshard_to_any_dp_size(worlds, zero_ckpt, world):
    results = worlds.run(world, load_zero, zero_ckpt, "drop")
    assert all(r["buffer_ok"] for r in results)
    assert all(r["norm"] == list(range(6)) and r["step"] == 11 for r in results)


def test_per_rank_values_on_resize_error_or_skip(worlds, zero_ckpt):
    with pytest.raises(AssertionError, match="saved by 4 ranks, this job has 2; per-rank values"):
        worlds.run(2, load_zero, zero_ckpt, "error")
    results = worlds.run(2, load_zero, zero_ckpt, "skip")
    assert [r["loader"] for r in results] == [{"position": -1}, {"position": -1}]
    assert all(r["buffer_ok"] for r in results)


def replicas_written_once(path: str) -> dict:
    from ckptkit.engine.metadata_io import read_manifest
    from ckptkit.storage import open_store

    m = read_manifest(open_store(path))
    return {k: [w for _, w in t.layout.pieces] for k, t in m.tensors.items() if k == "norm"}


def test_replicated_piece_is_written_once(zero_ckpt):
    assert len(replicas_written_once(zero_ckpt)["norm"]) == 1


def failing_save(path: str, where: str) -> str:
    import ckptkit.engine.saver as saver

    rank = dist.get_rank()
    state = {"w": torch.ones(4) * rank}
    original = saver.write_pieces
    if where == "prepare" and rank == 1:
        state["bad"] = object()
    if where == "persist" and rank == 1:
        def broken(*a, **k):
            raise OSError(28, "No space left on device")
        saver.write_pieces = broken
    try:
        ckptkit.save(state, path)
    except ckptkit.SaveError as exc:
        return str(exc)
    finally:
        saver.write_pieces = original
    return "no error"


@pytest.mark.parametrize("where,message", [("prepare", "cannot store a value of type object"), ("persist", "No space left on device")])
def test_a_failure_on_one_rank_fails_every_rank_and_commits_nothing(worlds, tmp_path, where, message):
    path = str(tmp_path / "c")
    results = worlds.run(2, failing_save, path, where, timeout=60)
    assert all("rank 1" in r and message in r for r in results), results
    import os

    assert not os.path.exists(os.path.join(path, "manifest.json"))


def mismatched_load(path: str) -> str:
    state = {"w": torch.zeros(4, dtype=torch.float64 if dist.get_rank() == 1 else torch.float32)}
    try:
        ckptkit.load(state, path)
    except ckptkit.CkptkitError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def plain_save(path: str) -> None:
    ckptkit.save({"w": torch.ones(4)}, path)


def test_a_load_failure_on_one_rank_does_not_hang_the_others(worlds, tmp_path):
    path = str(tmp_path / "c")
    worlds.run(2, plain_save, path)
    results = worlds.run(2, mismatched_load, path, timeout=60)
    assert results[1].startswith("DTypeMismatchError") and "float32 in the checkpoint" in results[1]
    assert results[0].startswith("PeerFailureError") and "failed on another rank" in results[0]
    assert "rank 1: DTypeMismatchError" in results[0] and "float32 in the checkpoint" in results[0]  # named
