"""A damaged or hostile zarr export: every file tensorstore would open is checked first.

The conformance suite damages one file per role of a tiny export; these pin the rest of the
mechanism (converters/zarr/nodes.py): chunk keys follow the array's own grid and key encoding;
a missing shard in the middle of a multi-shard array is named, with its tensor; a link that stays
inside the folder is followed while a node or chunk folder linked outside is refused; a FIFO shard
fails at once; an all-zero array still has every chunk written (so refusing missing chunks never
refuses ckptkit's own exports); and on S3, where nothing is checked beforehand, a missing chunk is
a read error (``fill_missing_data_reads`` off), never the fill value.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.offline import diff
from ckptkit.storage import open_store
from tests.s3_server import s3_env, s3_server  # noqa: F401 - fixtures

pytest.importorskip("tensorstore")

from ckptkit_converters.zarr.convert import ZarrExportOptions, export_zarr, import_zarr  # noqa: E402
from ckptkit_converters.zarr.nodes import chunk_keys  # noqa: E402

# 64 x 16 float32 rows of 64 bytes: inner chunks of 4 rows, shards of 16 rows -> shards c/0/0 .. c/3/0
SMALL = ZarrExportOptions(chunk_bytes=256, shard_bytes=1024, threads=1)
SHARDS = [f"c/{i}/0" for i in range(4)]


def _export(tmp_path: Path, tensor: torch.Tensor | None = None) -> tuple[Path, Path]:
    """A checkpoint with one 64 x 16 array ``model/w`` (and a 0-d one), exported with four shards."""
    w = torch.randn(64, 16, generator=torch.Generator().manual_seed(3)) if tensor is None else tensor
    ckptkit.save({"model": {"w": w, "s": torch.tensor(1.5)}}, tmp_path / "c")
    export_zarr(tmp_path / "c", tmp_path / "z", options=SMALL)
    return tmp_path / "c", tmp_path / "z"


def _nothing_committed(dest: Path) -> bool:
    return not (dest / "manifest.json").exists()


# ---------------------------------------------------------------- chunk keys from the metadata


def _meta(shape: list[int], chunk: list[int], encoding: dict | None = None) -> dict:
    meta = {"shape": shape, "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}}}
    if encoding is not None:
        meta["chunk_key_encoding"] = encoding
    return meta


def test_chunk_keys_follow_the_grid_and_the_key_encoding():
    # ragged last chunk along both dimensions: ceil(5/2) x ceil(3/2)
    assert list(chunk_keys(_meta([5, 3], [2, 2]), "w")) == ["c/0/0", "c/0/1", "c/1/0", "c/1/1", "c/2/0", "c/2/1"]
    dotted = {"name": "default", "configuration": {"separator": "."}}
    assert list(chunk_keys(_meta([4], [2], dotted), "w")) == ["c.0", "c.1"]
    assert list(chunk_keys(_meta([2, 2], [1, 2], {"name": "v2"}), "w")) == ["0.0", "1.0"]
    assert list(chunk_keys(_meta([], []), "w")) == ["c"]  # 0-d: one chunk, named ``c``
    assert list(chunk_keys(_meta([], [], {"name": "v2"}), "w")) == ["0"]
    assert list(chunk_keys(_meta([0, 4], [1, 4]), "w")) == []  # no element, no chunk


def test_chunk_keys_refuse_what_they_cannot_enumerate():
    with pytest.raises(ckptkit.ManifestError, match="w/zarr.json: chunk grid .* is not a regular grid"):
        list(chunk_keys({"shape": [4], "chunk_grid": {"name": "rectilinear", "configuration": {"chunk_shape": [2]}}},
                        "w/zarr.json"))
    with pytest.raises(ckptkit.ManifestError, match="chunk key encoding .* is not one of zarr v3's"):
        list(chunk_keys(_meta([4], [2], {"name": "custom"}), "w/zarr.json"))
    with pytest.raises(ckptkit.ManifestError, match="without a readable shape"):
        list(chunk_keys({"shape": [4]}, "w/zarr.json"))


# ---------------------------------------------------------------- local sources


def test_a_missing_shard_is_named_with_its_tensor_and_nothing_is_committed(tmp_path):
    _, z = _export(tmp_path)
    assert all((z / "model" / "w" / s).is_file() for s in SHARDS)
    (z / "model" / "w" / "c" / "2" / "0").unlink()
    dest = tmp_path / "back"
    with pytest.raises(ckptkit.CorruptCheckpointError,
                       match=r"model/w/c/2/0: chunk 'c/2/0' of the array of tensor 'model/w' is missing"):
        import_zarr(z, dest)
    assert _nothing_committed(dest)


def test_an_all_zero_array_has_every_chunk_written_and_round_trips(tmp_path):
    """tensorstore would skip chunks equal to the fill value; the export stores them, so the
    import's refusal of missing chunks (inner chunks of a shard included) never trips on it."""
    c, z = _export(tmp_path, torch.zeros(64, 16))
    assert sorted(str(p.relative_to(z / "model" / "w")) for p in (z / "model" / "w" / "c").rglob("*")
                  if p.is_file()) == SHARDS
    import_zarr(z, tmp_path / "back")
    assert diff(c, tmp_path / "back").identical


def test_links_that_stay_inside_the_folder_are_followed(tmp_path):
    c, z = _export(tmp_path)
    shard = z / "model" / "w" / "c" / "1" / "0"
    (z / "spare").mkdir()
    shutil.move(shard, z / "spare" / "shard")
    shard.symlink_to(Path("..", "..", "..", "..", "spare", "shard"))
    import_zarr(z, tmp_path / "back")
    assert diff(c, tmp_path / "back").identical


@pytest.mark.parametrize("folder", ["model/w", "model/w/c", "model"], ids=["node", "chunk-folder", "parent-group"])
def test_a_folder_linked_outside_is_refused_before_anything_is_read(tmp_path, folder):
    _, z = _export(tmp_path)
    inside = z / folder
    outside = tmp_path / "elsewhere"
    shutil.move(inside, outside)  # the same bytes, but outside: following the link is the fault
    inside.symlink_to(outside)
    dest = tmp_path / "back"
    with pytest.raises(ckptkit.UnsafePathError, match=f"{z}/model/.*outside the store's root"):
        import_zarr(z, dest)
    assert _nothing_committed(dest)


def test_a_fifo_shard_fails_at_once(tmp_path):
    _, z = _export(tmp_path)
    fifo = z / "model" / "w" / "c" / "3" / "0"
    fifo.unlink()
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            import_zarr(z, tmp_path / "back")
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - judged below
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(20)
    if worker.is_alive():  # release a reader stuck opening the FIFO, so no thread stays behind
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(20)
        pytest.fail("the import hung opening a FIFO shard")
    assert isinstance(outcome[0], ckptkit.CorruptCheckpointError), outcome
    assert "model/w/c/3/0 is a FIFO" in str(outcome[0])
    assert _nothing_committed(tmp_path / "back")


# ---------------------------------------------------------------- S3: the read reports a missing chunk


def test_s3_a_missing_chunk_is_a_read_error_not_the_fill_value(s3_env, s3_server, tmp_path):  # noqa: F811
    c, _ = _export(tmp_path)
    url = f"s3://{s3_env}/z"
    export_zarr(c, url, options=SMALL)
    s3_server.client().delete_object(Bucket=s3_env, Key="z/model/w/c/2/0")
    with pytest.raises(ckptkit.CorruptCheckpointError, match=r"z/model/w: reading .* of the array of tensor 'model/w' "
                                                             r"failed: .*missing"):
        import_zarr(url, f"s3://{s3_env}/back")
    assert not open_store(f"s3://{s3_env}/back").exists("manifest.json")
