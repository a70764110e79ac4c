"""zarr v3 export (through tensorstore) and import back: zarr-python reads fp32 arrays, tensorstore
reads bf16, the round trip is bit-exact and reproduces layouts, values and per-rank values; the
same against a real S3 server."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import ckptkit
from ckptkit.offline import verify
from ckptkit.cli.main import cli
from ckptkit.engine.metadata_io import read_index, read_manifest
from ckptkit.layout.box import Box
from ckptkit.offline import diff
from ckptkit_converters.zarr.convert import ZarrExportOptions, export_zarr, import_zarr
from ckptkit_converters.zarr.layout import (
    choose_chunking,
    from_stored,
    node_path,
    to_stored,
)
from ckptkit.storage import open_store
from tests import modelspace_job as job
from tests.s3_server import s3_env, s3_server  # noqa: F401 - fixtures
from tests.ckpt_files import data_object, edit_manifest

ts = pytest.importorskip("tensorstore")
KiB = 1024


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory):
    return job.saved_checkpoints(worlds, tmp_path_factory)


# Small chunks and shards so these small tensors are really chunked and sharded.
SMALL = ZarrExportOptions(chunk_bytes=128 * KiB, shard_bytes=256 * KiB)


@pytest.fixture(scope="module")
def exported(saved, tmp_path_factory):
    root = tmp_path_factory.mktemp("zarr")
    out = {}
    for layout in ("explicit", "fsdp_tp"):
        dest = str(root / f"{layout}.zarr")
        result = export_zarr(saved[layout][0], dest, options=SMALL)
        assert result.tensors == len(saved[layout][1])
        out[layout] = dest
    return out


def ts_read(path: str) -> np.ndarray:
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}).result().read().result()


def manifest_doc(path: str) -> dict:
    return json.loads(read_manifest(open_store(path)).to_json_bytes())


def test_zarr_python_reads_fp32_and_tensorstore_reads_bf16(saved, exported):
    zarr = pytest.importorskip("zarr")
    ref = saved["explicit"][1]
    group = zarr.open_group(exported["explicit"], mode="r")
    attrs = group.attrs["ckptkit"]
    for key, t in ref.items():
        where = attrs["arrays"][key]["path"]
        if t.dtype == torch.float32:
            np.testing.assert_array_equal(group[where][...], t.numpy(), err_msg=key)
        else:  # bf16: zarr-python 3.1 has no bfloat16; tensorstore reads it bit-exactly
            got = ts_read(os.path.join(exported["explicit"], where))
            assert got.dtype.name == "bfloat16"
            np.testing.assert_array_equal(got.view(np.int16), t.view(torch.int16).numpy(), err_msg=key)
    # one stored piece per chunk: params/big is Shard(0) over 4 ranks = 128 rows of 1 KiB
    big = group["params/big"]
    assert big.chunks == (128, 256) and big.shards == (256, 256)
    assert group["params/wide"].chunks[1] == 33  # Shard(1): torch.chunk columns 33, 33, 33, 31
    bf16 = ts_read(os.path.join(exported["fsdp_tp"], "optim/state/out.weight/exp_avg"))
    want = saved["fsdp_tp"][1]["optim/state/out.weight/exp_avg"]
    np.testing.assert_array_equal(bf16.view(np.int16), want.view(torch.int16).numpy())


def test_round_trip_is_bit_exact_with_the_same_layouts_values_and_per_rank_values(saved, exported, tmp_path, worlds):
    path, ref = saved["explicit"]
    back = str(tmp_path / "back")
    result = import_zarr(exported["explicit"], back)
    assert result.tensors == len(ref)
    assert result.nbytes <= result.bytes_read <= result.nbytes + 4 * KiB  # flat fragments read whole rows
    assert diff(path, back).identical
    a, b = manifest_doc(path), manifest_doc(back)
    for field in ("tensors", "meshes", "values", "per_rank_keys", "world_size", "parallel"):
        assert a[field] == b[field], field
    assert b["meta"]["user"] == {"run": "x"} and b["meta"]["converted_from"]["format"] == "zarr"
    for rank in range(job.WORLD):
        assert read_index(open_store(path), read_manifest(open_store(path)), rank).values == \
            read_index(open_store(back), read_manifest(open_store(back)), rank).values
    assert verify(back).ok
    # loads at the saving layout, per-rank values and RNG states included ...
    results = worlds.run(job.WORLD, job.load_explicit, back)
    assert all(r["tensors_ok"] and r["rng_same"] for r in results)
    assert [r["loader"] for r in results] == [{"position": r * 1000 + 7} for r in range(job.WORLD)]
    # ... and at another: one process holding other flat fragments (ZeRO over 3 ranks) and whole tensors
    buf, pieces = job.zero_buffer(3, 1, fill=False)
    state = {"zero": ckptkit.Sharded(buf, pieces), "params": {"wide": torch.zeros(96, 130)}}
    ckptkit.load(state, back, strict=False)
    assert torch.equal(buf, job.zero_buffer(3, 1, fill=True)[0])
    assert torch.equal(state["params"]["wide"], ref["params/wide"])


def test_model_checkpoint_round_trip(saved, exported, tmp_path):
    path, ref = saved["fsdp_tp"]
    back = str(tmp_path / "back")
    import_zarr(exported["fsdp_tp"], back)
    assert diff(path, back).identical
    view = ckptkit.open(back)
    for key, t in ref.items():
        assert torch.equal(view[key][...], t), key


def test_special_values_round_trip_native_and_portable(tmp_path):
    zarr = pytest.importorskip("zarr")
    bits = torch.tensor([0x7FC1, 0xFFC0, 0x8000, 0x0000, 0x7F80, 0x0001, 0x3F80], dtype=torch.int32).to(torch.int16)
    state = {
        "bf16": bits.view(torch.bfloat16).repeat(5, 1),  # NaN payloads, -0.0, inf, a subnormal
        "f32": torch.tensor([float("nan"), -0.0, float("inf"), 1e-45]),
        "f8": torch.tensor([0.5, -2.0, 448.0, 0.0]).to(torch.float8_e4m3fn),
        "i64": torch.arange(-5, 5),
        "flag": torch.tensor([True, False]),
        "zeros": torch.zeros(8, 8),  # all fill-value chunks are still written
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "step": 3,
    }
    ckptkit.save(state, tmp_path / "c")
    for portable in (False, True):
        dest = tmp_path / f"z-{portable}"
        export_zarr(tmp_path / "c", dest, options=ZarrExportOptions(portable=portable, compression="zstd"))
        back = tmp_path / f"back-{portable}"
        import_zarr(dest, back)
        report = diff(tmp_path / "c", back)
        assert report.identical, [t for t in report.tensors if not t.identical]
    group = zarr.open_group(tmp_path / "z-True", mode="r")  # portable: every array readable by zarr-python
    assert sorted(k for k, _ in group.members()) == sorted(k for k in state if k != "step")
    assert group["bf16"].dtype == np.float32
    np.testing.assert_array_equal(group["bf16"][0], state["bf16"][0].float().numpy())
    assert group["scalar"][()] == 2.5


def test_partition_rules_round_trip(tmp_path):
    path = tmp_path / "c"
    ckptkit.save({"w": torch.randn(8, 4)}, path)
    edit_manifest(path, lambda m: m["tensors"]["w"].update(rule={"tp_axis": 0, "layer": 3}))  # as a rule-aware adapter would
    export_zarr(path, tmp_path / "z")
    import_zarr(tmp_path / "z", tmp_path / "back")
    assert read_manifest(open_store(str(tmp_path / "back"))).tensors["w"].rule == ckptkit.PartitionRule(tp_axis=0, layer=3)


def test_import_refuses_incomplete_or_inconsistent_exports(tmp_path):
    ckptkit.save({"w": torch.randn(8, 4), "v": torch.ones(3)}, tmp_path / "c")
    export_zarr(tmp_path / "c", tmp_path / "z")
    with pytest.raises(ckptkit.SaveError, match="is not empty"):
        export_zarr(tmp_path / "c", tmp_path / "z")
    import_zarr(tmp_path / "z", tmp_path / "back")
    with pytest.raises(ckptkit.SaveError, match="already holds a committed checkpoint"):
        import_zarr(tmp_path / "z", tmp_path / "back")
    meta_path = tmp_path / "z" / "w" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["shape"] = [8, 5]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ckptkit.ShapeMismatchError, match=r"z/w: array of tensor 'w' has shape \[8, 5\], the export records \[8, 4\]"):
        import_zarr(tmp_path / "z", tmp_path / "other")
    assert not (tmp_path / "other").exists() or not os.listdir(tmp_path / "other")
    root = tmp_path / "z" / "zarr.json"
    doc = json.loads(root.read_text())
    doc["attributes"]["ckptkit"]["version"] = 99
    root.write_text(json.dumps(doc))
    with pytest.raises(ckptkit.UnsupportedVersionError, match="version 99"):
        import_zarr(tmp_path / "z", tmp_path / "other")
    root.unlink()
    with pytest.raises(ckptkit.CheckpointNotFoundError, match="did not finish"):
        import_zarr(tmp_path / "z", tmp_path / "other")


def test_chunking_follows_the_stored_pieces():
    four = [Box((i * 128, 0), (128, 256)) for i in range(4)]
    assert choose_chunking((512, 256), 4, four, 128 * KiB, 256 * KiB) == ((128, 256), (256, 256))
    # a piece larger than the chunk limit is divided by a divisor of its rows: chunks stay aligned
    assert choose_chunking((512, 256), 4, four, 40 * KiB, 256 * KiB)[0] == (32, 256)
    # irregular pieces (uneven pipeline stages, flat fragments of the whole tensor): rows by size
    uneven = [Box((0, 0), (100, 64)), Box((100, 0), (412, 64))]
    chunk, shard = choose_chunking((512, 64), 2, uneven, 16 * KiB, 64 * KiB)
    assert chunk == (128, 64) and shard == (512, 64)
    # small pieces grow to an eighth of the chunk limit, in whole pieces
    tiny = [Box((i * 4,), (4,)) for i in range(64)]
    assert choose_chunking((256,), 4, tiny, 512, 4096) == ((16,), (256,))
    assert choose_chunking((), 4, [Box((), ())], 1 << 20, 1 << 20) == ((), ())
    assert choose_chunking((0, 3), 4, [], 1 << 20, 1 << 20) == ((1, 3), (1, 3))


def test_node_paths_and_dtype_encoding():
    assert node_path("model/layers.0.weight") == "model/layers.0.weight"
    assert node_path("optim/state/a b/__x") == "optim/state/a%20b/%5F_x"
    assert node_path("zarr.json/..") == "zarr%2Ejson/%2E%2E"
    t = torch.tensor([0x7FC1, 0x8000, 0x3F80], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for stored in ("bfloat16", "float32"):
        back = from_stored(to_stored(t, "bfloat16", stored), "bfloat16", stored)
        assert torch.equal(back.view(torch.int16), t.view(torch.int16))


def test_cli_convert_both_ways(tmp_path):
    ckptkit.save({"w": torch.randn(64, 8), "step": 2}, tmp_path / "c")
    runner = CliRunner()
    out = runner.invoke(cli, ["convert", str(tmp_path / "c"), str(tmp_path / "z"), "--format", "zarr", "--chunk-mib", "0.001"])
    assert out.exit_code == 0, out.output
    assert "converted" in out.output and "(zarr): 1 tensors" in out.output
    out = runner.invoke(cli, ["convert", str(tmp_path / "z"), str(tmp_path / "back"), "--json"])  # format inferred
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["format"] == "ckptkit"
    assert diff(tmp_path / "c", tmp_path / "back").identical
    wrong = runner.invoke(cli, ["convert", str(tmp_path / "c"), str(tmp_path / "x"), "--format", "ckptkit"])
    assert wrong.exit_code == 2 and "is not a Megatron checkpoint" in wrong.output and "a zarr group" in wrong.output


def test_s3_view_export_import_and_diff(s3_env, saved):  # noqa: F811
    zarr = pytest.importorskip("zarr")
    local, ref = saved["explicit"]
    url = f"s3://{s3_env}/run/step-0000007"
    job_state = {k: v for k, v in ref.items()}
    ckptkit.save({"params": {"big": job_state["params/big"], "tall": job_state["params/tall"]}, "step": 7}, url,
                 options=ckptkit.SaveOptions(block_size=job.BLOCK))
    view = ckptkit.open(url)
    assert torch.equal(view["params/big"][200:210, ::3], ref["params/big"][200:210, ::3])
    assert view.bytes_read <= 3 * job.BLOCK
    export_zarr(url, f"s3://{s3_env}/zarr/step-7.zarr", options=SMALL)
    import_zarr(f"s3://{s3_env}/zarr/step-7.zarr", f"s3://{s3_env}/back/step-0000007")
    assert diff(url, f"s3://{s3_env}/back/step-0000007").identical
    report = diff(local, f"s3://{s3_env}/back/step-0000007", pattern="params/*")  # local vs bucket, other layouts
    assert [t.status for t in report.tensors] == ["identical", "identical", "only_a"]
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "s3", "bucket": s3_env, "path": "zarr/step-7.zarr/params/tall/",
                                                  "endpoint": endpoint, "aws_region": "us-east-1"}}).result()
    np.testing.assert_array_equal(arr.read().result().view(np.int16), ref["params/tall"].view(torch.int16).numpy())
    store = zarr.storage.FsspecStore.from_url(f"s3://{s3_env}/zarr/step-7.zarr", read_only=True,
                                              storage_options={"endpoint_url": endpoint})
    np.testing.assert_array_equal(zarr.open_group(store, mode="r")["params/big"][...], ref["params/big"].numpy())


def test_a_damaged_source_fails_the_export_and_leaves_nothing_behind(tmp_path):
    ckptkit.save({"w": torch.randn(64, 1024)}, tmp_path / "c", options=ckptkit.SaveOptions(block_size=4096))
    with open(data_object(tmp_path / "c"), "r+b") as f:
        f.seek(100_000)
        f.write(b"\xff\xfe")
    with pytest.raises(ckptkit.CorruptCheckpointError, match="checksum mismatch"):
        export_zarr(tmp_path / "c", tmp_path / "z", options=ZarrExportOptions(chunk_bytes=16 * KiB, shard_bytes=64 * KiB))
    assert not (tmp_path / "z").exists()
