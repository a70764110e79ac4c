"""ckptkit.catalog: listing, describing and verifying real checkpoints written by ckptkit.save.

Checkpoints are written by the real save path: in this process (world of
one), by several ranks played by threads over an in-memory communicator
(so pieces are spread over ranks and indexes), and once by a real gloo
world with DTensors (a sharded grid layout). Damage is then done to the
files on disk the way storage damages them: a flipped byte, a truncated
object, a rewritten index, a lost object.
"""

from __future__ import annotations

import subprocess
import sys
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit
from tests.ckpt_files import data_object, edit_manifest, index_file, object_key
from ckptkit import offline as catalog
from ckptkit.engine import read_session
from ckptkit.engine.saver import save_state
from ckptkit.errors import CheckpointNotFoundError
from ckptkit.layout.manifest import DTYPES, IndexRef, Manifest, sha256_hex
from ckptkit.storage import LocalStore, open_store

BLOCK = 4096


# ---------------------------------------------------------------- writing checkpoints


class ThreadComm:
    """The save collectives for ranks played by threads of this process."""

    def __init__(self, rank: int, shared: dict[str, Any]) -> None:
        self.rank, self.world_size, self.shared = rank, shared["world"], shared

    def _exchange(self, obj: Any) -> list[Any]:
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = obj
        barrier.wait()
        out = list(slots)
        barrier.wait()
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        return self._exchange(obj)

    def gather(self, obj: Any) -> list[Any] | None:
        out = self._exchange(obj)
        return out if self.rank == 0 else None

    def broadcast(self, obj: Any) -> Any:
        return self._exchange(obj)[0]

    def any_flags(self, flags: list[bool]) -> list[bool]:
        return [any(f) for f in zip(*self._exchange(flags))]


def save_world(states: list[dict[str, Any]], path: Path, metadata: dict[str, Any] | None = None) -> None:
    """Save ``states[r]`` as rank ``r`` of a world of ``len(states)`` ranks (threads)."""
    shared = {"world": len(states), "slots": [None] * len(states), "barrier": threading.Barrier(len(states))}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            save_state(states[rank], open_store(path), ThreadComm(rank, shared), block=BLOCK,
                       metadata=metadata)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)
            shared["barrier"].abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(states))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


def single_state() -> dict[str, Any]:
    """Both layout kinds in one rank: plain tensors (grid) and a Sharded box + flat piece (explicit)."""
    torch.manual_seed(0)
    local = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    emb = ckptkit.Sharded(local, [
        ckptkit.box_piece("emb", (4, 6), (0, 0), (2, 6)),
        ckptkit.flat_piece("emb", (4, 6), ckptkit.Box((2, 0), (2, 6)), 0, 12, local_start=12),
    ])
    return {
        "w": torch.randn(5, 7),
        "b": torch.zeros(3, dtype=torch.bfloat16),
        "big": torch.randn(64, 50),  # 12800 bytes: four checksum blocks of 4096
        "emb": emb,
        "count": torch.tensor(3, dtype=torch.int64),
        "step": 7,
        "rng": torch.Generator().manual_seed(1),
    }


def save_single(path: Path, metadata: dict[str, Any] | None = None) -> Path:
    ckptkit.save(single_state(), path, metadata=metadata, options=ckptkit.SaveOptions(block_size=BLOCK))
    return path


def two_rank_states() -> list[dict[str, Any]]:
    """Replicated plain tensors (one writer each) plus an explicit tensor whose pieces two ranks hold."""
    torch.manual_seed(1)
    shared = {"w": torch.randn(16, 16), "b": torch.randn(40, dtype=torch.float16)}
    full = torch.arange(48, dtype=torch.int32).reshape(8, 6)
    states = []
    for rank in range(2):
        rows = full[4 * rank:4 * rank + 4].clone()
        if rank == 0:
            pieces = [ckptkit.box_piece("e", (8, 6), (0, 0), (4, 6))]
        else:
            pieces = [ckptkit.flat_piece("e", (8, 6), ckptkit.Box((4, 0), (4, 6)), 0, 24)]
        states.append({**{k: v.clone() for k, v in shared.items()}, "e": ckptkit.Sharded(rows, pieces),
                       "pos": ckptkit.PerRank(rank * 10)})
    return states


def save_two(path: Path) -> Path:
    save_world(two_rank_states(), path, metadata={"step": 200})
    return path


def index_of(path: Path, rank: int = 0) -> dict[str, Any]:
    return json.loads(index_file(path, rank).read_text())


def piece_of(path: Path, tensor: str, rank: int = 0) -> list[Any]:
    return next(p for p in index_of(path, rank)["pieces"] if p[0] == tensor)


def rewrite_index(path: Path, rank: int, doc: dict[str, Any]) -> None:
    """Replace an index and re-sign it in the manifest, as a buggy writer (not storage damage) would."""
    data = json.dumps(doc, separators=(",", ":")).encode()
    key = object_key(path, rank, "index")
    (path / key).write_bytes(data)
    manifest = Manifest.from_json_bytes((path / "manifest.json").read_bytes(), "test")
    manifest.indexes[rank] = IndexRef(rank, key, len(data), sha256_hex(data))
    (path / "manifest.json").write_bytes(manifest.to_json_bytes())


@pytest.fixture
def single(tmp_path: Path) -> Path:
    return save_single(tmp_path / "step-0000100", metadata={"step": 100})


@pytest.fixture
def two(tmp_path: Path) -> Path:
    return save_two(tmp_path / "two")


# ---------------------------------------------------------------- static properties


def test_manifest_dtype_sizes_are_torch_sizes():
    for name, size in DTYPES.items():
        assert size == getattr(torch, name).itemsize, name


def test_listing_describing_and_verifying_import_neither_torch_nor_pickle(single: Path):
    """ls, inspect and verify work on metadata and raw bytes: no torch (nor any framework), no pickle."""
    code = (
        "import sys, ckptkit.offline.listing as l, ckptkit.offline.description as d, ckptkit.offline.verification as v\n"
        f"l.list_checkpoints({str(single.parent)!r}); d.describe({str(single)!r}); assert v.verify({str(single)!r}).ok\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pickle', 'numpy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


# ---------------------------------------------------------------- list_checkpoints


def test_list_checkpoints_committed_uncommitted_empty_and_sorted(tmp_path: Path):
    run = tmp_path / "run"
    save_single(run / "step-20")
    save_single(run / "step-3")
    save_single(run / "final", metadata={"step": 99})
    shutil.copytree(run / "step-3", run / "step-10")
    (run / "step-10" / "manifest.json").unlink()
    (run / "step-40").mkdir()
    (run / "notes.txt").write_text("not a checkpoint")
    (run / "logs").mkdir()
    (run / "logs" / "train.log").write_text("loss 1.0")

    infos = catalog.list_checkpoints(str(run))
    assert [i.name for i in infos] == ["step-3", "step-10", "step-20", "step-40", "final", "logs"]
    by = {i.name: i for i in infos}
    assert [by[n].step for n in ("step-3", "step-10", "final")] == [3, 10, 99]  # final: from metadata
    assert by["step-20"].committed and by["step-20"].world_size == 1 and by["step-20"].reason is None
    assert by["step-20"].total_bytes == sum(f.stat().st_size for f in (run / "step-20").rglob("*") if f.is_file())
    assert by["step-20"].created and by["step-20"].created.startswith("20")
    assert not by["step-10"].committed and "no manifest.json" in (by["step-10"].reason or "")
    assert by["step-10"].total_bytes == sum(f.stat().st_size for f in (run / "step-10").rglob("*") if f.is_file())
    assert by["step-10"].world_size is None
    assert not by["step-40"].committed and by["step-40"].reason == "empty directory"
    assert not by["logs"].committed and by["logs"].step is None and "not a checkpoint" in (by["logs"].reason or "")
    json.dumps([i.to_json() for i in infos])


def test_list_checkpoints_of_a_checkpoint_and_of_nothing(tmp_path: Path, single: Path):
    assert [(i.name, i.step, i.committed) for i in catalog.list_checkpoints(str(single))] == [("step-0000100", 100, True)]
    (single / "manifest.json").write_text("{not json")
    (info,) = catalog.list_checkpoints(str(single))
    assert not info.committed and "unreadable" in (info.reason or "") and "not valid JSON" in (info.reason or "")
    (tmp_path / "empty-run-dir").mkdir()
    assert catalog.list_checkpoints(str(tmp_path / "empty-run-dir")) == []
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint or run directory"):
        catalog.list_checkpoints(str(tmp_path / "missing"))


# ---------------------------------------------------------------- describe


def test_describe_single_rank_both_layout_kinds(single: Path):
    d = catalog.describe(str(single))
    t = {x.key: x for x in d.tensors}
    assert sorted(t) == ["b", "big", "count", "emb", "w"]
    assert (t["w"].dtype, t["w"].shape, t["w"].numel, t["w"].nbytes) == ("float32", (5, 7), 35, 140)
    assert (t["b"].dtype, t["b"].nbytes) == ("bfloat16", 6)
    assert (t["count"].shape, t["count"].numel, t["count"].nbytes) == ((), 1, 8)
    assert t["w"].layout_kind == "grid" and t["w"].layout == "grid mesh (rank=1) [Replicate]" and t["w"].mesh == "m0"
    assert t["emb"].layout_kind == "explicit" and t["emb"].layout == "explicit: 2 pieces from 1 rank"
    assert t["emb"].mesh is None and t["emb"].stored_pieces == 2
    assert d.world_size == 1 and [(m.name, m.dims, m.ranks) for m in d.meshes] == [("m0", ("rank",), (0,))]
    (r0,) = d.ranks
    assert (r0.rank, r0.index, r0.pieces) == (0, object_key(single, 0, "index"), 6)
    assert r0.nbytes == 140 + 6 + 12800 + 96 + 8 == d.total_bytes
    assert r0.value_keys == ("rng",) and d.per_rank_keys == ("rng",) and d.values == ("step",)
    assert d.meta["user"] == {"step": 100}
    assert json.loads(json.dumps(d.to_json()))["tensors"][0]["key"] == "b"
    assert [x.key for x in d.select("b*").tensors] == ["b", "big"]


def test_describe_two_ranks_pieces_per_rank(two: Path):
    d = catalog.describe(str(two))
    assert d.world_size == 2
    t = {x.key: x for x in d.tensors}
    assert t["e"].layout == "explicit: 2 pieces from 2 ranks" and t["e"].dtype == "int32"
    assert t["w"].layout == "grid mesh (replica=2, rank=1) [Replicate, Replicate]"
    assert [(m.dims, m.shape, m.ranks) for m in d.meshes] == [(("replica", "rank"), (2, 1), (0, 1))]
    # the replicated tensors are balanced over the two ranks: each writes one of them plus its half of "e"
    pieces = {r.rank: r for r in d.ranks}
    assert {pieces[0].pieces, pieces[1].pieces} == {2}
    assert sorted([pieces[0].nbytes, pieces[1].nbytes]) == sorted([1024 + 96, 80 + 96])
    assert pieces[0].value_keys == pieces[1].value_keys == ("pos",)


def test_describe_reads_no_data_object(single: Path):
    shutil.rmtree(single / "data")
    assert len(catalog.describe(str(single)).tensors) == 5


# ---------------------------------------------------------------- verify


def test_verify_good_checkpoints_and_progress(single: Path, two: Path):
    seen: list[tuple[int, int]] = []
    report = catalog.verify(str(single), lambda done, total: seen.append((done, total)))
    assert report.ok and report.found and report.problems == ()
    stored = sum(p[6] for p in index_of(single)["pieces"])
    assert (report.tensors, report.pieces, report.objects, report.bytes_checked) == (5, 6, 1, stored)
    assert seen[-1] == (stored, stored) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    report = catalog.verify(str(two), threads=1)
    assert report.ok and (report.tensors, report.pieces, report.objects) == (3, 4, 2)
    assert json.loads(json.dumps(report.to_json()))["ok"] is True


def test_verify_reads_in_bounded_chunks_across_block_boundaries(single: Path, monkeypatch: pytest.MonkeyPatch):
    reads: list[int] = []
    original = LocalStore.read_into

    def spy(self: LocalStore, key: str, offset: int, out: memoryview) -> None:
        reads.append(len(out))
        original(self, key, offset, out)

    monkeypatch.setattr(LocalStore, "read_into", spy)
    monkeypatch.setattr(read_session, "CHECK_CHUNK", 1000)  # smaller than a block: CRCs continue across reads
    assert catalog.verify(str(single)).ok
    assert max(reads) == 1000 and len(reads) > 13
    entry = piece_of(single, "big")
    with open(single / entry[4], "r+b") as f:
        f.seek(entry[5] + 9000)
        byte = f.read(1)
        f.seek(entry[5] + 9000)
        f.write(bytes([byte[0] ^ 1]))
    (problem,) = catalog.verify(str(single)).problems
    assert problem.kind == "checksum" and problem.tensor == "big" and "1 of 4 blocks" in problem.message
    lo = entry[5] + 8192
    assert f"first at bytes [{lo}, {lo + 4096})" in problem.message


def test_verify_flipped_byte_names_tensor_file_and_rank(two: Path):
    for rank in range(2):
        if any(p[0] == "w" for p in index_of(two, rank)["pieces"]):
            writer = rank
    entry = piece_of(two, "w", writer)
    path = two / entry[4]
    data = bytearray(path.read_bytes())
    data[entry[5] + 17] ^= 0x40
    path.write_bytes(bytes(data))
    report = catalog.verify(str(two))
    assert not report.ok
    (problem,) = report.problems
    assert (problem.kind, problem.tensor, problem.rank, problem.file) == ("checksum", "w", writer, entry[4])
    assert "'w'" in problem.message and f"rank {writer}" in problem.message


def test_verify_truncated_object(single: Path):
    path = data_object(single)
    entry = piece_of(single, "emb")
    os.truncate(path, entry[5] + 10)
    report = catalog.verify(str(single))
    kinds = [p.kind for p in report.problems]
    assert kinds == ["object"], report.problems
    msg = report.problems[0].message
    assert "truncated" in msg and f"{entry[5] + 10} bytes" in msg and "'emb'" in msg
    assert report.bytes_checked == sum(p[6] for p in index_of(single)["pieces"] if p[0] != "emb")


def test_verify_missing_object(two: Path):
    data_object(two, 1).unlink()
    report = catalog.verify(str(two))
    (problem,) = report.problems
    assert problem.kind == "object" and problem.rank == 1 and "missing" in problem.message and "'e'" in problem.message


def test_verify_tampered_index_fails_its_digest(two: Path):
    path = index_file(two, 1)
    path.write_bytes(path.read_bytes().replace(b'"rank":1', b'"rank": 1'))
    report = catalog.verify(str(two))
    assert report.problems[0].kind == "index" and report.problems[0].rank == 1
    assert "does not match the manifest's digest" in report.problems[0].message
    assert object_key(two, 1, "index") in report.problems[0].message
    # what rank 1 wrote cannot be vouched for: named per tensor, not silently skipped
    blind = [p for p in report.problems[1:] if p.kind == "coverage"]
    assert {p.tensor for p in blind} >= {"e"} and all(p.rank == 1 and "unreadable" in p.message for p in blind)
    assert report.objects == 1  # only rank 0's object could be checked


def test_verify_index_missing_a_piece_and_holding_a_stranger(two: Path):
    doc = index_of(two, 0)
    dropped = doc["pieces"].pop(0)
    extra = list(dropped)  # the dropped piece's bytes, now claimed by a tensor the manifest lacks
    extra[0] = "ghost"
    doc["pieces"].append(extra)
    rewrite_index(two, 0, doc)
    report = catalog.verify(str(two))
    by_kind = {p.kind: p for p in report.problems}
    assert by_kind["unknown-tensor"].tensor == "ghost" and by_kind["unknown-tensor"].rank == 0
    missing = [p for p in report.problems if p.kind == "coverage" and p.tensor == dropped[0]]
    assert any("should be stored by rank 0" in p.message for p in missing)
    assert any("hold 0 elements" in p.message for p in missing)


def test_verify_wrong_byte_count_and_explicit_hole(single: Path):
    doc = index_of(single)
    for p in doc["pieces"]:
        if p[0] == "w":
            p[6] -= 4  # claims 34 elements' bytes for a 35-element box
            p[7] = p[7][:1]
    rewrite_index(single, 0, doc)
    edit_manifest(single, lambda m: m["tensors"]["emb"]["layout"]["pieces"].pop())  # forgets the flat piece
    report = catalog.verify(str(single))
    piece = [p for p in report.problems if p.kind == "piece"]
    assert len(piece) == 1 and piece[0].tensor == "w" and "expected 140" in piece[0].message
    holes = [p for p in report.problems if p.kind == "coverage" and p.tensor == "emb"]
    assert any("some elements are missing" in p.message for p in holes)


def test_verify_uncommitted_and_missing_are_reported_not_raised(tmp_path: Path, single: Path):
    (single / "manifest.json").unlink()
    report = catalog.verify(str(single))
    assert report.found and not report.ok and [p.kind for p in report.problems] == ["uncommitted"]
    report = catalog.verify(str(tmp_path / "nope"))
    assert not report.found and not report.ok and report.problems[0].kind == "missing"
    (tmp_path / "a-file").write_text("x")
    report = catalog.verify(str(tmp_path / "a-file"))
    assert not report.found and "no checkpoint at" in report.problems[0].message
    (single / "manifest.json").write_text('{"format": "ckptkit", "version": 99}')
    (problem,) = catalog.verify(str(single)).problems
    assert problem.kind == "manifest" and "version 99" in problem.message


# ---------------------------------------------------------------- a sharded grid layout (real DTensors)


def save_dtensors(path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    full = torch.randn(10, 6)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "v": distribute_tensor(full.t().contiguous(), mesh, [Shard(1)])}
    ckptkit.save(state, path, options=ckptkit.SaveOptions(block_size=BLOCK))


def test_sharded_grid_layout_described_and_verified(worlds, tmp_path: Path):
    path = tmp_path / "dt"
    worlds.run(2, save_dtensors, str(path))
    d = catalog.describe(str(path))
    t = {x.key: x for x in d.tensors}
    assert t["w"].layout == "grid mesh (dp=2) [Shard(0)]" and t["v"].layout == "grid mesh (dp=2) [Shard(1)]"
    assert [(r.pieces, r.nbytes) for r in d.ranks] == [(2, 5 * 6 * 4 * 2), (2, 5 * 6 * 4 * 2)]
    assert catalog.verify(str(path)).ok
    doc = index_of(path, 1)
    doc["pieces"] = [p for p in doc["pieces"] if p[0] != "v"]
    rewrite_index(path, 1, doc)
    report = catalog.verify(str(path))
    assert [(p.kind, p.tensor, p.rank) for p in report.problems] == [("coverage", "v", 1), ("coverage", "v", None)]
    assert "piece {'box': [[0, 5], [6, 5]]} should be stored by rank 1" in report.problems[0].message
    assert "hold 30 elements, its shape [6, 10] has 60" in report.problems[1].message
