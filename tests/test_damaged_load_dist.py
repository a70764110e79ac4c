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
    # blocks every rank holds (written once, read once in the job and sent to the others): the load
    # shares bytes, in several windows when the window is small
    common = {f"b{i}": torch.arange(COLS, dtype=torch.float32) * (i + 1) if fill else torch.zeros(COLS)
              for i in range(6)}
    return {"rows": ckptkit.Sharded(local, [piece]), "common": common, "step": 7}


def save(path: str) -> None:
    ckptkit.save(_state(True), path)


def load_then_collective(path: str, window: int | None = None) -> dict:
    """Load, then an all-reduce: a rank that returned while another failed would hang in it.
    ``window``: the bytes read-once moves per window (its agreement, an all-gather, comes once per window)."""
    import ckptkit.engine.read_once as read_once

    state = _state(False)
    error = None
    defaults = dict(read_once.read_once.__kwdefaults__)
    if window is not None:
        read_once.read_once.__kwdefaults__["window"] = window
    try:
        ckptkit.load(state, path)
    except ckptkit.CkptkitError as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        read_once.read_once.__kwdefaults__.update(defaults)
    alive = torch.ones(1)
    dist.all_reduce(alive)
    want = _state(True)
    ok = error is None and torch.equal(state["rows"].local, want["rows"].local) and all(
        torch.equal(state["common"][k], want["common"][k]) for k in want["common"])
    return {"error": error, "alive": int(alive.item()), "ok": ok}


def _flip_data(ckpt, rank):
    _flip_piece(ckpt, rank, "rows")


def _flip_piece(ckpt, rank, tensor):
    """Flip the first byte of ``tensor``'s piece that ``rank`` wrote (its offset from the index)."""
    import json

    entry = next(p for p in json.loads(ckpt_files.index_file(ckpt, rank).read_text())["pieces"] if p[0] == tensor)
    data = ckpt_files.data_object(ckpt, rank)
    raw = bytearray(data.read_bytes())
    raw[entry[5]] ^= 0x40
    data.write_bytes(bytes(raw))


def _writer_of(ckpt, tensor) -> int:
    import json

    for rank in range(4):
        if any(p[0] == tensor for p in json.loads(ckpt_files.index_file(ckpt, rank).read_text())["pieces"]):
            return rank
    raise AssertionError(tensor)


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


@pytest.mark.parametrize("window", [None, 64])
def test_an_undamaged_copy_loads_on_every_rank(worlds, saved, window):
    assert all(r["ok"] and r["alive"] == 4 for r in worlds.run(4, load_then_collective, saved, window, timeout=60))


@pytest.mark.parametrize("window", [None, 64], ids=["one window", "windows of 64 bytes"])
@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("writer", [0, 1, 2, 3])
def test_damage_read_by_one_rank_fails_every_rank_without_a_hang(worlds, saved, tmp_path, damage, writer, window):
    """With windows of 64 bytes the shared blocks move in several windows, each with its agreement: a
    damaged piece that one rank read alone used to fail that rank before the windows, and the load hung
    (the ranks paired different collectives; 2026-12-06)."""
    broken = tmp_path / "ckpt"
    shutil.copytree(saved, broken)
    hurt, words = DAMAGE[damage]
    hurt(broken, writer)
    results = worlds.run(4, load_then_collective, str(broken), window, timeout=60)
    assert all(r["alive"] == 4 for r in results)  # nobody stuck: the collective after the load ran
    assert all(r["error"] is not None and not r["ok"] for r in results), results
    assert words.lower() in results[writer]["error"].lower(), results[writer]["error"]
    for rank, r in enumerate(results):
        if rank != writer and "on another rank" in r["error"]:
            assert r["error"].startswith("PeerFailureError"), r["error"]


@pytest.mark.parametrize("window", [None, 64, 256], ids=["one window", "windows of 64 bytes", "windows of 256 bytes"])
@pytest.mark.parametrize("block", ["b0", "b3", "b5"])
def test_damage_in_bytes_every_rank_reads_fails_every_rank_without_a_hang(worlds, saved, tmp_path, block, window):
    """A block every rank needs, read by one rank and sent to the others, with its first byte flipped:
    the reader finds it (and reads it again from storage), the receivers find it in what they got."""
    broken = tmp_path / "ckpt"
    shutil.copytree(saved, broken)
    _flip_piece(broken, _writer_of(broken, f"common/{block}"), f"common/{block}")
    results = worlds.run(4, load_then_collective, str(broken), window, timeout=60)
    assert all(r["alive"] == 4 for r in results)
    assert all(r["error"] is not None and not r["ok"] for r in results), results
    assert any("checksum mismatch" in r["error"] and f"common/{block}" in r["error"] for r in results), results
