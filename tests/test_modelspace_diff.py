"""``diff``: per-tensor differences between checkpoints of different layouts, streamed chunk by chunk."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.cli.main import cli
from ckptkit.offline import DiffOptions, diff
from ckptkit.offline.comparison import chunk_boxes
from tests import modelspace_job as job


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory):
    return job.saved_checkpoints(worlds, tmp_path_factory)


def plain_copy(path: str, tensors: dict[str, torch.Tensor], values: dict | None = None) -> str:
    """The same logical tensors saved by one process as plain tensors: a different layout."""
    state: dict = {}
    for key, t in tensors.items():
        node = state
        *parents, leaf = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = t.clone()
    state.update(values or {})
    ckptkit.save(state, path)
    return path


def explicit_values() -> dict:
    return {"train": {"step": job.VALUES["step"], "sched": dict(job.VALUES["sched"])}}


def test_a_checkpoint_equals_itself(saved):
    path, ref = saved["explicit"]
    report = diff(path, path)
    assert report.identical and not report.values
    assert [t.key for t in report.tensors] == sorted(ref)
    for t in report.tensors:
        assert t.status == "identical" and t.differing == 0
        assert t.max_abs == 0 and t.mean_abs == 0 and t.rel_norm == 0
        assert t.norm_a == pytest.approx(ref[t.key].double().norm().item())


def test_other_layout_same_values_is_identical_and_a_perturbed_copy_reports_exactly_the_perturbed(saved, tmp_path):
    path, ref = saved["explicit"]
    same = plain_copy(str(tmp_path / "same"), ref, explicit_values())
    assert diff(path, same).identical
    changed = {k: v.clone() for k, v in ref.items()}
    changed["params/big"][300, 7] += 0.5  # a DTensor Shard(0) parameter
    changed["mega/exp_avg_sq/w"][20, 3] = -changed["mega/exp_avg_sq/w"][20, 3]  # inside a flat fragment
    other = plain_copy(str(tmp_path / "changed"), changed, explicit_values())
    report = diff(path, other, options=DiffOptions(chunk_elements=1000))  # many chunks per tensor
    assert [t.key for t in report.differing()] == ["mega/exp_avg_sq/w", "params/big"]
    for t in report.differing():
        a, b = ref[t.key].double(), changed[t.key].double()
        d = (a - b).abs()
        assert t.status == "different" and t.differing == 1
        assert t.max_abs == pytest.approx(d.max().item())
        assert t.mean_abs == pytest.approx(d.mean().item())
        assert t.rel_norm == pytest.approx(((a - b).norm() / a.norm()).item())
        assert t.norm_b == pytest.approx(b.norm().item())
    assert not report.values


def test_model_checkpoints_of_different_layouts(saved, tmp_path):
    """fsdp (fp32) vs the same weights saved plainly; bf16 vs fp32 copies are dtype mismatches with stats."""
    path, ref = saved["fsdp_tp"]
    copy = plain_copy(str(tmp_path / "plain"), ref)
    report = diff(path, copy)
    assert len(report.tensors) == len(ref) and not report.differing()
    assert report.values and all(v.status == "only_a" and "param_groups" in v.key for v in report.values)
    as_fp32 = plain_copy(str(tmp_path / "fp32"), {k: v.float() for k, v in ref.items()})
    report = diff(path, as_fp32, pattern="model/*")
    assert report.tensors and all(t.status == "dtype_mismatch" and t.differing == 0 for t in report.tensors)
    assert all(t.max_abs == 0 for t in report.tensors)


def test_statistics_do_not_depend_on_the_chunk_size(saved):
    path, _ = saved["fsdp"]
    other = saved["fsdp_tp"][0]  # same model code, other dtype and layout: every tensor differs
    coarse = diff(path, other, pattern="optim/*exp_avg")
    fine = diff(path, other, pattern="optim/*exp_avg", options=DiffOptions(chunk_elements=7, prefetch=3))
    assert coarse.tensors
    for c, f in zip(coarse.tensors, fine.tensors):
        assert (c.key, c.status, c.differing) == (f.key, f.status, f.differing)
        for field in ("max_abs", "mean_abs", "rel_norm", "norm_a"):
            assert getattr(c, field) == pytest.approx(getattr(f, field), rel=1e-9), (c.key, field)


def test_missing_extra_reshaped_values_and_nan(tmp_path):
    nan = torch.tensor([1.0, float("nan"), -0.0])
    ckptkit.save({"w": torch.ones(3, 2), "only_a": torch.ones(2), "n": nan, "z": torch.zeros(2), "step": 1}, tmp_path / "a")
    ckptkit.save({"w": torch.ones(2, 3), "only_b": torch.ones(2), "n": nan.clone(), "z": -torch.zeros(2), "step": 2},
                 tmp_path / "b")
    report = diff(tmp_path / "a", tmp_path / "b")
    by = {t.key: t for t in report.tensors}
    assert by["w"].status == "shape_mismatch" and by["w"].max_abs is None
    assert by["only_a"].status == "only_a" and by["only_b"].status == "only_b"
    assert by["n"].status == "identical"  # same NaN bits
    assert by["z"].status == "different" and by["z"].differing == 2 and by["z"].max_abs == 0  # 0.0 vs -0.0
    assert [(v.key, v.a, v.b) for v in report.values] == [("step", 1, 2)]
    assert not report.identical
    doc = json.loads(json.dumps(report.to_json()))  # nan/inf statistics stay valid JSON
    assert doc["identical"] is False


json_leaves = st.one_of(st.booleans(), st.integers(-3, 3), st.sampled_from([0.0, -0.0, 1.0, 2.5, float("nan"), math.inf]),
                       st.sampled_from(["1", "", "true"]), st.none())


def same_value(a, b) -> bool:
    """Loaded values that are the same: the same type, floats by their bits (NaN is NaN, -0.0 is not 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    return a == b


@settings(max_examples=60, deadline=None)
@given(a=json_leaves, b=json_leaves)
def test_values_are_identical_only_when_they_load_the_same(tmp_path_factory, a, b):
    """``diff`` compared values with Python's ``==``: ``True``, ``1`` and ``1.0`` were one value, and
    ``0.0`` and ``-0.0``, which load differently (found by a hunt, 2026-12-06). Now a value is identical
    exactly when the two checkpoints load it as the same value."""
    root = tmp_path_factory.mktemp("values")
    ckptkit.save({"v": a}, root / "a")
    ckptkit.save({"v": b}, root / "b")
    loaded = [{"v": None}, {"v": None}]
    ckptkit.load(loaded[0], root / "a")
    ckptkit.load(loaded[1], root / "b")
    report = diff(root / "a", root / "b")
    assert (not report.values) == same_value(loaded[0]["v"], loaded[1]["v"]), (a, b, report.values)


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(0, 5), max_size=4).map(tuple), limit=st.integers(1, 40))
def test_chunk_boxes_tile_in_row_major_order(shape, limit):
    seen = []
    for box in chunk_boxes(shape, limit):
        assert box.numel <= limit or box.numel == 1
        idx = torch.arange(math.prod(shape)).reshape(shape)[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
        seen.extend(idx.reshape(-1).tolist())
    assert seen == list(range(math.prod(shape)))


def test_cli_diff_exit_codes_and_json(saved, tmp_path):
    path, ref = saved["explicit"]
    changed = {k: v.clone() for k, v in ref.items()}
    changed["zero/exp_avg/c"][0, 0] += 1
    other = plain_copy(str(tmp_path / "c"), changed, explicit_values())
    runner = CliRunner()
    same = runner.invoke(cli, ["diff", path, path])
    assert same.exit_code == 0 and "identical" in same.output
    out = runner.invoke(cli, ["diff", path, other])
    assert out.exit_code == 1, out.output
    assert "zero/exp_avg/c" in out.output and "1 of 8 tensors differ" in out.output
    assert "params/big" not in out.output  # identical ones only with --all
    doc = json.loads(runner.invoke(cli, ["diff", path, other, "--json", "--tensor", "zero/*"]).stdout)
    assert [t["key"] for t in doc["tensors"] if t["status"] != "identical"] == ["zero/exp_avg/c"]
    assert len(doc["tensors"]) == 3
    missing = runner.invoke(cli, ["diff", path, str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and "no checkpoint" in missing.output
