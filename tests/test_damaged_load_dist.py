"""Damage that only some ranks read: every rank fails the load, and no rank is left waiting.

Each of 4 real gloo ranks saves its own rows of a tensor (and, at another key, a block every rank
reads), so a damaged piece of rank k's data is read by rank k alone at the same layout. Before
ckptkit agreed on the outcome of the reads, the ranks that read nothing damaged returned from
``load`` and the trainer's next collective hung forever (found with a torchtitan MoE checkpoint
missing one expert's piece, tests/test_torchtitan_moe.py). Here every damage kind is tried on
every writer rank: the load must raise a CkptkitError on all 4 ranks (the reader of the damage
names it), the world must still run a collective afterwards, and an undamaged copy must load.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist

import ckptkit
from tests import ckpt_files

ROWS = 4
COLS = 64


def _state(fill: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    local = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + 1000 * rank if fill \
        else torch.zeros(ROWS, COLS)
    piece = ckptkit.box_piece("rows", (world * ROWS, COLS), (rank * ROWS, 0), (ROWS, COLS))
    return {"rows": ckptkit.Sharded(local, [piece]), "step": 7}


def save(path: str) -> None:
    ckptkit.save(_state(True), path)


def load_then_collective(path: str) -> dict:
    """Load, then an all-reduce: a rank that returned while another failed would hang in it."""
    state = _state(False)
    error = None
    try:
        ckptkit.load(state, path)
    except ckptkit.CkptkitError as exc:
        error = f"{type(exc).__name__}: {exc}"
    alive = torch.ones(1)
    dist.all_reduce(alive)
    ok = error is None and torch.equal(state["rows"].local, _state(True)["rows"].local)
    return {"error": error, "alive": int(alive.item()), "ok": ok}


def _flip_data(ckpt, rank):
    data = ckpt_files.data_object(ckpt, rank)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))


def _truncate_data(ckpt, rank):
    data = ckpt_files.data_object(ckpt, rank)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 3])


def _delete_data(ckpt, rank):
    ckpt_files.data_object(ckpt, rank).unlink()


def _drop_index_entry(ckpt, rank):
    ckpt_files.edit_index(ckpt, lambda d: d.__setitem__("pieces", [p for p in d["pieces"] if p[0] != "rows"]),
                          rank=rank)


def _corrupt_index(ckpt, rank):
    ckpt_files.index_file(ckpt, rank).write_text("{ not json")


DAMAGE = {"flip a data byte": (_flip_data, "crc"), "truncate the data object": (_truncate_data, ""),
          "delete the data object": (_delete_data, ""), "drop the index entry": (_drop_index_entry, "no piece"),
          "corrupt the index": (_corrupt_index, "index")}


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("damaged") / "ckpt")
    worlds.run(4, save, path)
    return path


def test_an_undamaged_copy_loads_on_every_rank(worlds, saved):
    assert all(r["ok"] and r["alive"] == 4 for r in worlds.run(4, load_then_collective, saved, timeout=60))


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("writer", [0, 1, 2, 3])
def test_damage_read_by_one_rank_fails_every_rank_without_a_hang(worlds, saved, tmp_path, damage, writer):
    broken = tmp_path / "ckpt"
    shutil.copytree(saved, broken)
    hurt, words = DAMAGE[damage]
    hurt(broken, writer)
    results = worlds.run(4, load_then_collective, str(broken), timeout=60)
    assert all(r["alive"] == 4 for r in results)  # nobody stuck: the collective after the load ran
    assert all(r["error"] is not None and not r["ok"] for r in results), results
    assert words.lower() in results[writer]["error"].lower(), results[writer]["error"]
    for rank, r in enumerate(results):
        if rank != writer and "on another rank" in r["error"]:
            assert r["error"].startswith("PeerFailureError"), r["error"]
