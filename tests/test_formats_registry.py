"""The converter registry (ckptkit_converters.registry) and the ``ckptkit.formats`` entry points.

* the installed package registers megatron, deepspeed, dcp, zarr and hf, detected in that order
  (a Megatron torch_dist directory is a DCP checkpoint too), and loading them imports no torch;
* ``registry.convert`` is one table: imports, exports, a foreign source to another format through
  a temporary import, identity conversions refused, each exporter's requirements checked first;
* every direction returns a ``ConvertResult``;
* ``ckptkit.reshard`` and ``ckptkit reshard`` take a foreign source through the entry points;
* a plugin's ``priority`` orders detection; a format registered twice counts once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

import ckptkit
from ckptkit.cli.main import cli
from ckptkit.engine.offline_writer import ConvertResult
from ckptkit.errors import CkptkitError, LayoutError
from ckptkit.layout.config import ParallelConfig
from ckptkit.offline import formats
from ckptkit_converters import registry
from ckptkit_converters.hf.exporter import HFExportResult
from ckptkit_converters.dcp.options import DcpExportOptions
from ckptkit_converters.megatron.options import MegatronExportOptions
from ckptkit_converters.registry import ConvertOptions, convert
from ckptkit_converters.zarr.options import ZarrExportOptions


def _dcp(path: Path) -> str:
    torch.manual_seed(0)
    dcp.save({"model": {"w": torch.randn(8, 4), "b": torch.randn(3)}, "train": {"step": 3}},
             checkpoint_id=str(path), no_dist=True)
    return str(path)


def test_installed_entry_points_in_detection_order_and_cheap():
    assert [f.name for f in formats.source_formats()] == ["megatron", "deepspeed", "dcp", "zarr", "hf"]
    assert [f.name for f in registry.formats()] == ["megatron", "deepspeed", "dcp", "zarr", "hf"]
    code = ("import sys; from ckptkit.offline.formats import source_formats; n = [f.name for f in source_formats()]; "
            "print(n, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.strip() == "['megatron', 'deepspeed', 'dcp', 'zarr', 'hf'] False"


def test_detection(tmp_path: Path):
    src = _dcp(tmp_path / "dcp")
    assert registry.detect(src).name == "dcp" and formats.detect_format(src).name == "dcp"
    ckptkit.save({"w": torch.ones(2)}, tmp_path / "ck")
    assert registry.detect(tmp_path / "ck") is None and registry.detect(tmp_path / "nowhere") is None
    # a torch_dist directory is DCP plus metadata.json: Megatron is asked first
    (Path(src) / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    assert registry.detect(src).name == "megatron" and formats.detect_format(src).name == "megatron"
    ds = tmp_path / "ds"
    (ds / "global_step1").mkdir(parents=True)
    (ds / "latest").write_text("global_step1")
    (ds / "global_step1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    assert registry.detect(ds).name == "deepspeed"
    legacy = tmp_path / "legacy" / "iter_0000002" / "mp_rank_00"
    legacy.mkdir(parents=True)
    (tmp_path / "legacy" / "latest_checkpointed_iteration.txt").write_text("2")
    assert registry.detect(tmp_path / "legacy").name == "megatron"
    assert registry.detect(f"file://{tmp_path / 'legacy'}").name == "megatron"


def test_the_table_both_ways_and_through_a_temporary_import(tmp_path: Path):
    src = _dcp(tmp_path / "dcp")
    imported = convert(src, tmp_path / "ck")  # detected: -> ckptkit
    assert type(imported).__name__ == "DcpConvertResult" and isinstance(imported, ConvertResult)
    assert imported.format == "ckptkit" and ckptkit.open(tmp_path / "ck").values == {"train/step": 3}
    zarr = convert(tmp_path / "ck", tmp_path / "z", to_format="zarr", target_options=ZarrExportOptions(chunk_bytes=64))
    assert isinstance(zarr, ConvertResult) and zarr.format == "zarr"
    chained = convert(src, tmp_path / "z2", to_format="zarr")  # DCP -> (temporary ckptkit) -> zarr
    assert chained.source == src and chained.format == "zarr"
    assert convert(tmp_path / "z2", tmp_path / "back").format == "ckptkit"
    assert ckptkit.diff(tmp_path / "ck", tmp_path / "back").identical


def test_impossible_directions_fail_before_reading(tmp_path: Path):
    src = _dcp(tmp_path / "dcp")
    ckptkit.save({"w": torch.ones(2)}, tmp_path / "ck")
    with pytest.raises(CkptkitError, match="is already a DCP checkpoint"):
        convert(src, tmp_path / "x", to_format="dcp")
    with pytest.raises(CkptkitError, match="is not .*a zarr group"):
        convert(tmp_path / "ck", tmp_path / "x", to_format="ckptkit")
    with pytest.raises(CkptkitError, match="no conversion to 'onnx'"):
        convert(tmp_path / "ck", tmp_path / "x", to_format="onnx")
    missing = tmp_path / "not-there"
    with pytest.raises(CkptkitError, match="head counts"):
        convert(missing, tmp_path / "x", to_format="hf")
    with pytest.raises(CkptkitError, match=r"needs dp, .*--dp N"):
        convert(missing, tmp_path / "x", to_format="deepspeed")
    with pytest.raises(CkptkitError, match=r"needs the target layout.*--to"):
        convert(missing, tmp_path / "x", to_format="megatron")
    with pytest.raises(LayoutError, match="writes no context parallelism"):
        convert(src, tmp_path / "x", to_format="megatron",
                target_options=MegatronExportOptions(layout=ParallelConfig.parse("tp1pp2cp2")))
    with pytest.raises(CkptkitError, match="takes DeepSpeedExportOptions options, not DcpExportOptions"):
        convert(tmp_path / "ck", tmp_path / "x", to_format="deepspeed", target_options=DcpExportOptions())
    assert not (tmp_path / "x").exists()


def test_every_direction_returns_a_convert_result():
    assert issubclass(HFExportResult, ConvertResult)
    from ckptkit_converters.dcp.convert import DcpConvertResult
    from ckptkit_converters.megatron.files import MegatronConvertResult

    assert issubclass(DcpConvertResult, ConvertResult) and issubclass(MegatronConvertResult, ConvertResult)
    assert set(registry.targets()) == {"ckptkit", "zarr", "dcp", "hf", "deepspeed", "megatron"}
    assert all(isinstance(f, formats.Format) for f in registry.formats())


def test_reshard_takes_a_foreign_source_through_the_entry_points(tmp_path: Path):
    src = _dcp(tmp_path / "dcp")
    result = ckptkit.reshard(src, tmp_path / "out", ParallelConfig.parse("tp1pp1"))
    assert result.source == src and ckptkit.open(tmp_path / "out").values == {"train/step": 3}
    want = ckptkit.open(tmp_path / "out")["model/w"].read()
    plan = ckptkit.plan_reshard(src, ParallelConfig.parse("tp1pp1"))
    assert plan.dry_run and plan.plan.world_size == 1
    res = CliRunner().invoke(cli, ["reshard", src, str(tmp_path / "cli"), "--to", "tp1pp1", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["source"] == src
    assert torch.equal(ckptkit.open(tmp_path / "cli")["model/w"].read(), want)


class _Fake:
    def __init__(self, name: str, priority: int | None, hit: bool) -> None:
        self.name, self.hit = name, hit
        if priority is not None:
            self.priority = priority

    def detect(self, url, storage_options=None):
        return self.hit

    def import_to(self, source, dest, options, storage_options=None):
        raise AssertionError("not called")


def test_plugin_priority_and_duplicates(monkeypatch: pytest.MonkeyPatch):
    """Plugins of the first contract (import only) still load, wrapped, with a DeprecationWarning."""
    fakes = {"a-late": _Fake("late", None, True), "b-early": _Fake("early", 5, True),
             "c-dup": _Fake("early", 1, True), "d-notaformat": object()}
    eps = [SimpleNamespace(name=k, value=f"x:{k}", load=lambda v=v: v) for k, v in fakes.items()]
    monkeypatch.setattr(formats, "entry_points", lambda group: eps if group == formats.ENTRY_POINT_GROUP else [])
    with pytest.warns(DeprecationWarning, match="first contract"):
        names = [(f.name, formats.priority_of(f)) for f in formats.source_formats()]
    assert names == [("early", 5), ("late", formats.DEFAULT_PRIORITY)]
    with pytest.warns(DeprecationWarning):
        assert formats.detect_format("anything").name == "early"
    assert formats.description_of(fakes["a-late"]) == "a late checkpoint"
    # the registry adds the built-in formats when they are not registered (an uninstalled source tree)
    with pytest.warns(DeprecationWarning):
        listed = [f.name for f in registry.formats()]
    assert listed == ["early", "megatron", "deepspeed", "dcp", "zarr", "hf", "late"]


def test_the_first_api_still_works_and_names_the_new_one(tmp_path: Path):
    """``convert(options=ConvertOptions(...))`` maps onto the formats' own options, with a warning."""
    src = _dcp(tmp_path / "dcp")
    with pytest.warns(DeprecationWarning, match="source_options= and target_options="):
        convert(src, tmp_path / "ck")
        convert(src, tmp_path / "ck0", options=ConvertOptions(imports=formats.ImportOptions(
            extra={"skip_unsafe_items": True})))
    with pytest.warns(DeprecationWarning):
        old = convert(tmp_path / "ck", tmp_path / "z-old", to_format="zarr",
                      options=ConvertOptions(chunk_bytes=64, compression="zstd"))
    new = convert(tmp_path / "ck", tmp_path / "z-new", to_format="zarr",
                  target_options=ZarrExportOptions(chunk_bytes=64, compression="zstd"))
    assert old.tensors == new.tensors and old.nbytes == new.nbytes
    old_doc, new_doc = (json.loads((tmp_path / z / "zarr.json").read_text()) for z in ("z-old", "z-new"))
    for doc in (old_doc, new_doc):  # the export's wall-clock time: the two exports may straddle a second
        assert doc["attributes"]["ckptkit"].pop("exported")
    assert old_doc == new_doc
    with pytest.warns(DeprecationWarning, match="MegatronExportOptions"):
        assert registry.check_megatron_target(ParallelConfig.parse("tp2pp1")).tp == 2


def test_options_from_text_follow_each_fields_type():
    from ckptkit_converters.deepspeed.options import DeepSpeedExportOptions

    assert formats.parse_options(MegatronExportOptions, {"layout": "tp2pp2", "make_vocab_size_divisible_by": "64"},
                                 what="x") == {"layout": ParallelConfig.parse("tp2pp2"),
                                               "make_vocab_size_divisible_by": 64}
    assert formats.parse_options(ZarrExportOptions, {"portable": "yes", "compression": "zstd"}, what="x") == {
        "portable": True, "compression": "zstd"}
    assert formats.parse_options(DeepSpeedExportOptions, {"zero_stage": "none"}, what="x") == {"zero_stage": None}
    with pytest.raises(CkptkitError, match="the megatron export: layout: "):
        formats.parse_options(MegatronExportOptions, {"layout": "tpx"}, what="the megatron export")
    with pytest.raises(CkptkitError, match="the deepspeed export: dp is an integer, got 'eight'"):
        formats.parse_options(DeepSpeedExportOptions, {"dp": "eight"}, what="the deepspeed export")
    with pytest.raises(CkptkitError, match=r"has no option 'stage' \(its options: dp, zero_stage, ep, tag\)"):
        formats.parse_options(DeepSpeedExportOptions, {"stage": "2"}, what="the deepspeed export")
