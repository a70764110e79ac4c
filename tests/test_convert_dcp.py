"""DCP checkpoints into and out of ckptkit, against real torch.distributed.checkpoint.

DCP checkpoints are written by ``dcp.save`` in a 4-rank gloo world (FSDP2, FSDP2 x TP) and
DCP's own load is the reference at every other layout; exports are read by plain ``dcp.load``
(one process and a 2-rank world). The load path's trust boundary is attacked directly: pickles
that would run ``os.system``/``exec``/``subprocess`` are refused before anything runs.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import pickle
import subprocess
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

import ckptkit
from ckptkit.offline import verify
from ckptkit.cli.main import cli
from ckptkit.engine.metadata_io import read_index, read_manifest
from ckptkit.layout.manifest import ExplicitLayout
from ckptkit.layout.values import join_key
from ckptkit.offline import diff
from ckptkit.storage import open_store
from ckptkit_converters.dcp.convert import DcpImportOptions, export_dcp, import_dcp, read_dcp_metadata
from ckptkit_converters.dcp.keys import import_keys, value_leaves
from ckptkit_converters.common.safe_unpickle import UnsafeCheckpointError, load_dcp_metadata
from tests import dcp_job
from tests import modelspace_job as msjob
from tests.s3_server import s3_env, s3_server  # noqa: F401 - fixtures

LAYOUTS = {"fsdp": "fp32", "fsdp_tp": "bf16"}


@pytest.fixture(autouse=True)
def _quiet_single_process_dcp():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@pytest.fixture(scope="module")
def dcp_saved(worlds, tmp_path_factory):
    """{layout: (DCP dir, its ckptkit import)}: saved by dcp.save at 4 ranks, imported once."""
    root = tmp_path_factory.mktemp("dcp")
    out = {}
    for layout, dtype in LAYOUTS.items():
        src, dst = str(root / f"{layout}-dcp"), str(root / f"{layout}-ckptkit")
        worlds.run(4, dcp_job.save_dcp, layout, dtype, src)
        result = import_dcp(src, dst)
        assert result.format == "ckptkit" and result.skipped == ()
        out[layout] = (src, dst)
    return out


@pytest.fixture(scope="module")
def ck_saved(worlds, tmp_path_factory):
    return msjob.saved_checkpoints(worlds, tmp_path_factory)


def _empty(path) -> bool:
    """Nothing at ``path``: a failed conversion leaves no checkpoint and no leftovers."""
    return not os.path.exists(path) or not os.listdir(path)


def flat_dcp_load(path: str) -> dict:
    """Every item of a DCP checkpoint, loaded by plain dcp.load in this process (keys: DCP's)."""
    ckpt = read_dcp_metadata(open_store(path))
    state: dict = {f: torch.empty(t.shape, dtype=getattr(torch, t.dtype)) for f, t in ckpt.tensors.items()}
    state.update({f: None for f in ckpt.items})
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


# ---------------------------------------------------------------- import


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("target", [(2, "tp"), (1, "plain")])
def test_imported_dcp_loads_at_other_layouts_exactly_as_dcp_does(worlds, dcp_saved, layout, target):
    src, imported = dcp_saved[layout]
    world, target_layout = target
    if world == 1:
        results = [dcp_job.load_both(target_layout, LAYOUTS[layout], src, imported)]
    else:
        results = worlds.run(world, dcp_job.load_both, target_layout, LAYOUTS[layout], src, imported)
    for r in results:
        assert r["compared"] >= 20 and r["mismatch"] == []
        assert r["train"] == dcp_job.TRAIN


def test_import_keeps_dcp_sharding_keys_and_values(dcp_saved):
    src, imported = dcp_saved["fsdp_tp"]
    manifest = read_manifest(open_store(imported))
    assert manifest.world_size == 4
    ckpt = read_dcp_metadata(open_store(src))
    files = {f"__{r}_0.distcp": r for r in range(4)}
    for fqn, t in ckpt.tensors.items():  # keys: the planner's paths joined with "/"
        key = join_key(ckpt.paths[fqn])
        meta = manifest.tensors[key]
        assert isinstance(meta.layout, ExplicitLayout) and meta.shape == t.shape
        # every DCP chunk is a piece, written by the rank whose file held it
        assert sorted((r.box.offsets, w) for r, w in meta.layout.pieces) == \
            sorted((c.box.offsets, files[c.blob.file]) for c in t.chunks if c.box.numel)
    assert "model/blocks.0.up.weight" in manifest.tensors and "optim/state/blocks.0.up.weight/exp_avg" in manifest.tensors
    view = ckptkit.open(imported)
    assert view.values["train/betas"] == (0.9, 0.95) and view.values["train/step"] == 2
    assert view.values["optim/param_groups"][0]["lr"] == 1e-2  # one value, as ckptkit.save stores it
    assert view.meta["converted_from"]["format"] == "dcp" and view.meta["converted_from"]["keys"] == "planner_data"
    assert verify(imported).ok


def test_key_mapping_round_trips():
    tensors = {"model.layers.0.w": ("model", "layers.0.w"), "x.0": ("x", 0)}
    groups = [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["a", "b"]}, {"lr": 0.2, "empty": {}}]
    values = {}
    for key, value in (("optim/param_groups", groups), ("train/step", 3), ("train/none", None)):
        for path, leaf in value_leaves(key, value):
            values[".".join(map(str, path))] = (path, leaf)
    assert values["optim.param_groups.1.empty"] == (("optim", "param_groups", 1, "empty"), {})
    assert values["optim.param_groups.0.params"][1] == ["a", "b"]  # a flat list is one DCP item
    keys, back = import_keys(tensors, values, "test")
    assert keys == {"model.layers.0.w": "model/layers.0.w", "x.0": "x/0"}
    assert back == {"optim/param_groups": groups, "train/step": 3, "train/none": None}


# ---------------------------------------------------------------- export


def test_export_loads_with_plain_dcp_load_in_one_process(ck_saved, tmp_path):
    path, ref = ck_saved["explicit"]
    out = str(tmp_path / "dcp")
    result = export_dcp(path, out)
    assert result.format == "dcp" and result.tensors == len(ref)
    assert result.skipped == ("loader", "rng")  # per-rank values have no DCP form
    assert sorted(os.listdir(out)) == [".metadata"] + [f"__{r}_0.distcp" for r in range(msjob.WORLD)]
    state: dict = {"train": {"step": 0, "sched": {"lr": 0.0, "betas": None}}}
    for key, t in ref.items():
        node = state
        *parents, leaf = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = torch.zeros_like(t)
    dcp.load(state, checkpoint_id=out, no_dist=True)
    assert state["train"] == {"step": 7, "sched": {"lr": 0.1, "betas": (0.9, 0.95)}}
    for key, t in ref.items():
        node = state
        for p in key.split("/"):
            node = node[p]
        assert node.dtype == t.dtype and torch.equal(node, t), key
    # flat fragments were written as the boxes they decompose into, by the rank that stored them
    ckpt = read_dcp_metadata(open_store(out))
    mega = ckpt.tensors["mega.exp_avg_sq.w"]
    assert len(mega.chunks) > 2 and {c.blob.file for c in mega.chunks} == {f"__{r}_0.distcp" for r in range(4)}


def test_export_loads_into_dtensors_in_a_2_rank_world(worlds, ck_saved, tmp_path):
    explicit, model = str(tmp_path / "explicit"), str(tmp_path / "model")
    export_dcp(ck_saved["explicit"][0], explicit)
    for r in worlds.run(2, dcp_job.load_explicit_export, explicit):
        assert r["mismatch"] == [] and r["train"] == {"step": 7, "sched": {"lr": 0.1, "betas": (0.9, 0.95)}}
    path, ref = ck_saved["fsdp_tp"]
    export_dcp(path, model)
    for full in worlds.run(2, dcp_job.load_model_export, "tp", "bf16", model):
        got = {k.replace("optim/", "optim/state/", 1): v for k, v in full.items()}
        assert dcp_job.compare(got, ref) == []


def test_round_trip_dcp_ckptkit_dcp_is_exact(dcp_saved, tmp_path):
    src, imported = dcp_saved["fsdp_tp"]
    back = str(tmp_path / "back")
    export_dcp(imported, back)
    assert dcp_job.compare(flat_dcp_load(src), flat_dcp_load(back)) == []
    a, b = read_dcp_metadata(open_store(src)), read_dcp_metadata(open_store(back))
    assert a.paths == b.paths and sorted(a.items) == sorted(b.items)
    for fqn, t in a.tensors.items():  # same chunks, in the same ranks' files
        def chunks(t):
            return sorted((c.box.offsets, c.box.sizes, c.blob.file) for c in t.chunks)

        assert chunks(t) == chunks(b.tensors[fqn])


@pytest.mark.parametrize("name", ["explicit", "fsdp"])
def test_round_trip_ckptkit_dcp_ckptkit_diff_is_zero(ck_saved, tmp_path, name):
    path, _ = ck_saved[name]
    export_dcp(path, tmp_path / "dcp")
    import_dcp(tmp_path / "dcp", tmp_path / "back")
    report = diff(path, tmp_path / "back")
    assert report.identical, [t for t in report.tensors if not t.identical] + list(report.values)


def test_export_refuses_non_empty_targets_and_colliding_keys(tmp_path):
    ckptkit.save({"a": {"b.c": torch.ones(2)}, "a.b": {"c": torch.zeros(2)}}, tmp_path / "c")
    with pytest.raises(ckptkit.LayoutError, match=r"keys 'a.b/c' and 'a/b.c' would both be DCP key 'a.b.c'"):
        export_dcp(tmp_path / "c", tmp_path / "d")
    assert not (tmp_path / "d").exists()
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "x").write_text("x")
    with pytest.raises(ckptkit.SaveError, match="is not empty"):
        export_dcp(tmp_path / "c", tmp_path / "e")


# ---------------------------------------------------------------- what is never trusted


class _Evil:
    """Unpickling it would run ``fn(*args)``: what a malicious checkpoint does."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payloads(marker: str) -> dict[str, object]:
    return {
        "os.system": _Evil(os.system, f"touch {marker}"),
        "builtins.exec": _Evil(builtins.exec, f"open({marker!r}, 'w').close()"),
        "subprocess.call": _Evil(subprocess.call, ["touch", marker]),
    }


@pytest.mark.parametrize("kind", ["os.system", "builtins.exec", "subprocess.call", "nested"])
def test_malicious_metadata_is_refused_and_never_runs(tmp_path, kind):
    src = tmp_path / "dcp"
    dcp.save({"w": torch.ones(4, 3)}, checkpoint_id=str(src), no_dist=True)
    marker = str(tmp_path / "pwned")
    if kind == "nested":  # a real Metadata with the payload deep inside
        md = pickle.loads((src / ".metadata").read_bytes())  # our own file: trusted here
        md.planner_data = {"w": ("w",), "x": _payloads(marker)["os.system"]}
        (src / ".metadata").write_bytes(pickle.dumps(md))
        refused = "posix.system" if os.name == "posix" else "nt.system"
    else:
        (src / ".metadata").write_bytes(pickle.dumps(_payloads(marker)[kind]))
        refused = {"os.system": "posix.system", "builtins.exec": "builtins.exec", "subprocess.call": "subprocess.call"}[kind]
    with pytest.raises(UnsafeCheckpointError, match=rf"{src}/\.metadata: refusing to unpickle global {refused}"):
        import_dcp(src, tmp_path / "out")
    assert not os.path.exists(marker)
    assert not (tmp_path / "out").exists()
    out = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "out")])
    assert out.exit_code == 2 and f"refusing to unpickle global {refused}" in out.output
    assert not os.path.exists(marker)


def test_build_on_a_class_is_refused():
    def text(s: str) -> bytes:  # SHORT_BINUNICODE
        return b"\x8c" + bytes([len(s)]) + s.encode()

    # STACK_GLOBAL Metadata (the class), then BUILD (None, {"__reduce__": 1}) aimed at the class itself
    payload = (b"\x80\x04" + text("torch.distributed.checkpoint.metadata") + text("Metadata") + b"\x93"
               + b"N}" + text("__reduce__") + b"K\x01s\x86b.")
    with pytest.raises(UnsafeCheckpointError, match="refusing to set attributes on 'Metadata'"):
        load_dcp_metadata(payload, "x/.metadata")
    from torch.distributed.checkpoint.metadata import Metadata

    assert "__reduce__" not in vars(Metadata)


def test_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path):
    src = tmp_path / "dcp"
    dcp.save({"w": torch.ones(4, 3)}, checkpoint_id=str(src), no_dist=True)
    md = pickle.loads((src / ".metadata").read_bytes())
    for info in md.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (src / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(ckptkit.UnsafePathError, match=r"item 'w': object key '../../etc/passwd' is not a plain relative path"):
        import_dcp(src, tmp_path / "out")
    assert _empty(tmp_path / "out")


def test_non_tensor_items_that_do_not_decode_safely_fail_or_are_skipped(tmp_path):
    marker = str(tmp_path / "pwned")
    src = str(tmp_path / "dcp")
    dcp.save({"w": torch.arange(12.0).reshape(4, 3), "train": {"step": 5},
              "extra": {"hook": _payloads(marker)["os.system"], "ids": {1, 2}}}, checkpoint_id=src, no_dist=True)
    with pytest.raises(UnsafeCheckpointError, match=r"2 non-tensor item\(s\) do not decode safely: 'extra.hook', 'extra.ids'") as info:
        import_dcp(src, tmp_path / "out")
    assert "posix.system" in str(info.value) and "--skip-unsafe-items" in str(info.value)
    assert not os.path.exists(marker) and not (tmp_path / "out").exists()
    result = import_dcp(src, tmp_path / "out", options=DcpImportOptions(skip_unsafe_items=True))
    assert result.skipped == ("extra.hook", "extra.ids") and not os.path.exists(marker)
    view = ckptkit.open(tmp_path / "out")
    assert view.values == {"train/step": 5} and torch.equal(view["w"][...], torch.arange(12.0).reshape(4, 3))
    assert view.meta["converted_from"]["skipped"] == ["extra.hook", "extra.ids"]


def test_a_tensor_blob_that_is_not_a_plain_tensor_is_refused(tmp_path):
    marker = str(tmp_path / "pwned")
    src = tmp_path / "dcp"
    dcp.save({"w": torch.ones(4, 3), "v": torch.ones(5)}, checkpoint_id=str(src), no_dist=True)
    data = src / "__0_0.distcp"
    size = data.stat().st_size
    buf = io.BytesIO()
    torch.save(_payloads(marker)["os.system"], buf)
    with open(data, "ab") as f:  # append a torch.save archive of the payload ...
        f.write(buf.getvalue())
    md = pickle.loads((src / ".metadata").read_bytes())
    for index, info in md.storage_data.items():  # ... and point tensor 'w' at it
        if index.fqn == "w":
            info.offset, info.length = size, len(buf.getvalue())
    (src / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError,
                       match=r"__0_0\.distcp \(chunk \[0, 0\] of 'w'\): refused by torch.load\(weights_only=True\).*posix.system"):
        import_dcp(src, tmp_path / "out")
    assert not os.path.exists(marker) and _empty(tmp_path / "out")


def test_truncated_or_damaged_data_fails_clearly_and_leaves_no_checkpoint(tmp_path):
    src = tmp_path / "dcp"
    dcp.save({"a": torch.randn(64, 64), "b": torch.randn(64, 64)}, checkpoint_id=str(src), no_dist=True)
    ckpt = read_dcp_metadata(open_store(str(src)))
    data = src / "__0_0.distcp"
    whole = data.read_bytes()
    data.write_bytes(whole[:-100])
    with pytest.raises(ckptkit.CorruptCheckpointError,
                       match=rf"__0_0\.distcp is truncated: {len(whole) - 100} bytes, \.metadata records data up to byte {len(whole)}"):
        import_dcp(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # damage inside the second chunk's archive: found mid-import, after the first chunk was written
    second = max(ckpt.tensors.values(), key=lambda t: t.chunks[0].blob.offset).chunks[0].blob
    damaged = bytearray(whole)
    damaged[second.offset + second.length - 30:second.offset + second.length] = b"\0" * 30
    data.write_bytes(bytes(damaged))
    with pytest.raises(ckptkit.CorruptCheckpointError, match=r"not a readable torch.save archive"):
        import_dcp(src, tmp_path / "out", options=DcpImportOptions(read_ahead=0, threads=1))
    assert _empty(tmp_path / "out")
    # a committed destination is never touched
    data.write_bytes(whole)
    ckptkit.save({"x": torch.ones(1)}, tmp_path / "committed")
    with pytest.raises(ckptkit.SaveError, match="already holds a committed checkpoint"):
        import_dcp(src, tmp_path / "committed")
    assert ckptkit.open(tmp_path / "committed").keys() == ["x"]
    with pytest.raises(ckptkit.CheckpointNotFoundError, match=r"has no \.metadata"):
        import_dcp(tmp_path / "committed", tmp_path / "other")


# ---------------------------------------------------------------- CLI and S3


def test_cli_convert_dcp_both_ways(tmp_path):
    src = str(tmp_path / "dcp")
    dcp.save({"model": {"w": torch.randn(8, 4)}, "train": {"step": 3}}, checkpoint_id=src, no_dist=True)
    runner = CliRunner()
    out = runner.invoke(cli, ["convert", src, str(tmp_path / "ck"), "--json"])  # a DCP source is detected
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["format"] == "ckptkit"
    assert ckptkit.open(tmp_path / "ck").values == {"train/step": 3}
    out = runner.invoke(cli, ["convert", str(tmp_path / "ck"), str(tmp_path / "back"), "--format", "dcp"])
    assert out.exit_code == 0, out.output
    assert "(dcp): 1 tensors" in out.output
    assert dcp_job.compare(flat_dcp_load(src), flat_dcp_load(str(tmp_path / "back"))) == []
    wrong = runner.invoke(cli, ["convert", src, str(tmp_path / "x"), "--format", "dcp"])
    assert wrong.exit_code == 2 and "is already a DCP checkpoint" in wrong.output


def test_s3_import_from_a_local_dcp_directory(s3_env, dcp_saved, tmp_path):  # noqa: F811
    src, imported = dcp_saved["fsdp"]
    url = f"s3://{s3_env}/titan/step-0000002"
    result = import_dcp(src, url, options=DcpImportOptions(block_size=4096))
    assert result.destination == url
    assert diff(imported, url).identical
    manifest = read_manifest(open_store(url))
    assert read_index(open_store(url), manifest, 0).block == 4096
    export_dcp(url, tmp_path / "back")
    assert dcp_job.compare(flat_dcp_load(src), flat_dcp_load(str(tmp_path / "back"))) == []
