"""A load fails on every rank, promptly, and says "nothing restored" only when nothing was.

Found by a hunt (2026-12-06), each reproduced on gloo ranks:

* ``per_rank_on_resize="error"`` was checked after the load's first agreement, and only by the ranks
  holding a per-rank value (a pipeline stage): they raised alone, the others went into the reads and
  waited for them (every rank hung under ``restore_latest``).
* A value the saving ranks disagreed on, asked for by a rank that held none, failed the load whatever
  ``strict`` said (per-rank values and generators already followed ``strict``).
* An index only one rank needs, found damaged when that rank planned its reads (after the first
  agreement): the other ranks read into their tensors, or were marked as having begun, and
  ``restore_latest`` raised "partly overwritten" where nothing was, so every restart failed the same way.

Each case draws which ranks hold what.
"""

from __future__ import annotations

import glob
import random
import time

import pytest
import torch
import torch.distributed as dist

import ckptkit
from tests.damage import flip_byte


def save_per_rank(folder: str) -> None:
    """Two saving ranks, each with its own per-rank value, generator and a value they disagree on."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    ckptkit.save({"w": torch.full((4,), float(rank)), "pr": ckptkit.PerRank(rank), "g": g, "loss": 1.5 + rank},
                 folder)


def load_resized(folder: str, holders: list[list[str]], through_manager: bool) -> tuple[str, float]:
    """At another world size, with ``per_rank_on_resize="error"``: each rank asks for the kinds it holds."""
    rank = dist.get_rank()
    state: dict = {"w": torch.zeros(4)}
    for kind in holders[rank]:
        state.update({"pr": ckptkit.PerRank(-1)} if kind == "pr" else {"g": torch.Generator()} if kind == "g"
                     else {"loss": -1.0})
    begin = time.monotonic()
    try:
        if through_manager:
            ckptkit.CheckpointManager(folder.rsplit("/", 1)[0]).restore_latest(state)
        else:
            ckptkit.load(state, folder)
        said = "loaded"
    except ckptkit.CkptkitError as exc:
        said = type(exc).__name__
    return said, time.monotonic() - begin


@pytest.mark.parametrize("through_manager", [False, True], ids=["load", "restore_latest"])
def test_a_resize_refused_by_some_ranks_fails_every_rank_promptly(worlds, tmp_path, through_manager):
    rnd = random.Random()
    seed = rnd.randrange(10**6)
    rnd.seed(seed)
    folder = str(tmp_path / "run" / "step-0000001")
    worlds.run(2, save_per_rank, folder, timeout=60)
    holders = [rnd.sample(["pr", "g", "loss"], rnd.randrange(4)) for _ in range(3)]
    if not any(holders):
        holders[rnd.randrange(3)] = ["pr"]
    got = worlds.run(3, load_resized, folder, holders, through_manager, timeout=90)
    for rank, (said, seconds) in enumerate(got):
        assert said != "loaded" and seconds < 30, (seed, holders, got)
        if holders[rank] and not through_manager:
            assert said == "StateMismatchError", (seed, holders, got)


def save_split_value(folder: str, holders: list[bool]) -> None:
    rank = dist.get_rank()
    state: dict = {"w": torch.full((4,), float(rank))}
    if holders[rank]:
        state["loss"] = 1.5 + rank
    ckptkit.save(state, folder)


def load_split_value(folder: str, strict: bool) -> tuple[str, object, tuple[str, ...]]:
    state = {"w": torch.zeros(4), "loss": "mine"}
    try:
        result = ckptkit.load(state, folder, strict=strict)
    except ckptkit.CkptkitError as exc:
        return type(exc).__name__, state["loss"], ()
    return "loaded", state["loss"], result.missing


def test_a_value_a_rank_did_not_hold_follows_strict(worlds, tmp_path):
    holders = [True, True, False]
    random.shuffle(holders)
    folder = str(tmp_path / "ck")
    worlds.run(3, save_split_value, folder, holders, timeout=60)
    lax = worlds.run(3, load_split_value, folder, False, timeout=60)
    for rank, (said, value, missing) in enumerate(lax):
        assert said == "loaded", lax
        assert (value, missing) == ((1.5 + rank, ()) if holders[rank] else ("mine", ("loss",))), lax
    strict = worlds.run(3, load_split_value, folder, True, timeout=60)
    for rank, (said, value, _) in enumerate(strict):
        assert said == ("PeerFailureError" if holders[rank] else "MissingKeysError") and value == "mine", strict


def save_own_tensor(run: str) -> None:
    rank = dist.get_rank()
    mgr = ckptkit.CheckpointManager(run, asynchronous=None)
    mgr.save(1, {f"t{rank}": torch.full((64,), float(rank + 1))})
    mgr.close()


def restore_own_tensor(run: str, read_once: bool) -> tuple[object, bool]:
    rank = dist.get_rank()
    state = {f"t{rank}": torch.full((64,), -7.0)}
    got = ckptkit.CheckpointManager(run, asynchronous=None, load=ckptkit.LoadOptions(read_once=read_once)
                                    ).restore_latest(state)
    return got, bool(torch.all(state[f"t{rank}"] == -7.0))


@pytest.mark.parametrize("read_once", [True, False])
def test_an_index_only_one_rank_needs_damaged_restores_nothing_and_touches_nothing(worlds, tmp_path, read_once):
    run = str(tmp_path / "run")
    worlds.run(2, save_own_tensor, run, timeout=60)
    damaged = random.randrange(2)
    flip_byte(sorted(glob.glob(f"{run}/step-0000001/index/rank-{damaged:05d}-*.json"))[0], where=random.random())
    got = worlds.run(2, restore_own_tensor, run, read_once, timeout=60)
    assert got == [(None, True), (None, True)], (damaged, got)
