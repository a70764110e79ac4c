"""The optimizer in ckptkit's torch_dist export, checked without Megatron: what is written, and what is refused.

The real Megatron runs (tests/test_megatron.py, ``test_ckptkits_export_resumes_in_megatron_with_its_optimizer``
and tests/test_megatron_moe.py) show Megatron resumes an export exactly. Here, on the golden Megatron
checkpoint (tests/golden/v2/megatron): every optimizer tensor is written as stored, split and padded as
its model tensor, with the param groups, step, scheduler and content metadata Megatron's load reads; an
export imported back is the checkpoint it came from (tensors bit for bit, the same record); and every way
the optimizer record can be incomplete or hostile is refused naming the checkpoint, with nothing left at
DEST, while ``weights_only`` still exports the model. A fuzz over mutated records finds no other outcome.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.errors import CkptkitError, ManifestError
from ckptkit_converters.megatron import optimizer_export
from ckptkit_converters.megatron.exporter import export_torch_dist
from ckptkit_converters.megatron.importer import import_torch_dist
from ckptkit_converters.megatron.options import OPTIMIZER_FORMS
from ckptkit_converters.megatron.names import VOCAB_PADDING_SUFFIX
from tests.ckpt_files import edit_manifest
from tests.conftest import trials
from tests.format_samples import GOLDEN

SOURCE = GOLDEN / "megatron" / "ckpt"
META = "megatron/meta"


def _meta(folder: Path) -> dict[str, Any]:
    return json.loads(ckptkit.open(str(folder)).values[META])


def _with_record(tmp_path: Path, edit: Callable[[dict[str, Any]], Any]) -> Path:
    """A copy of the golden checkpoint whose ``megatron/meta`` optimizer record ``edit`` changed (the manifest
    resealed, so the export reaches the record)."""
    folder = tmp_path / "src"
    shutil.copytree(SOURCE, folder)

    def fix(doc: dict[str, Any]) -> None:
        meta = json.loads(doc["values"][META])
        edit(meta)
        doc["values"][META] = json.dumps(meta)

    edit_manifest(folder, fix)
    return folder


def read_torch_dist(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist directory, whole, read by DCP itself."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(folder)).read_metadata()
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
           if isinstance(m, TensorStorageMetadata)}
    dcp.load(out, checkpoint_id=str(folder), no_dist=True)
    return out


def _common(folder: Path) -> dict[str, Any]:
    return torch.load(folder / "common.pt", weights_only=True)


def _padded_like(view: Any, key: str, rows: int) -> torch.Tensor:
    """``key`` as the export must write it at ``rows`` rows: the stored rows, the saving job's padding rows
    (``<key>.vocab_padding``) after them, zero past those."""
    t = view[key].read()
    if rows == t.shape[0]:
        return t
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
    out[:t.shape[0]] = t
    pad = key + VOCAB_PADDING_SUFFIX
    if pad in view.manifest.tensors:
        p = view[pad].read()[:rows - t.shape[0]]
        out[t.shape[0]:t.shape[0] + p.shape[0]] = p
    return out


@pytest.mark.parametrize("tp, divisible", [(1, None), (2, None), (4, 8), (2, 32)])
def test_every_optimizer_tensor_is_written_as_stored(tmp_path: Path, tp: int, divisible: int | None) -> None:
    """Each model tensor ``k`` gets ``optimizer.state.{exp_avg,exp_avg_sq,param}.k`` shaped as the exported
    weight (vocabulary padded for the target, padding rows from the checkpoint), holding the stored moments, and
    as main copy the fp32 weights (the golden run trained in fp32, where Megatron's main copies are the
    weights); ``common.pt`` holds what Megatron's load reads beside them."""
    out = tmp_path / "out"
    result = export_torch_dist(SOURCE, out, tp=tp, pp=1, make_vocab_size_divisible_by=divisible)
    written, view, meta = read_torch_dist(out), ckptkit.open(str(SOURCE)), _meta(SOURCE)
    model = [k.removeprefix("model/") for k in view.manifest.tensors
             if k.startswith("model/") and not k.endswith(VOCAB_PADDING_SUFFIX)]
    opt = {k for k in written if k.startswith("optimizer.")}
    assert opt == {f"optimizer.state.{s}.{k}" for k in model for s in ("exp_avg", "exp_avg_sq", "param")}
    for k in model:
        rows = written[k].shape[0]
        for s in ("exp_avg", "exp_avg_sq"):
            got = written[f"optimizer.state.{s}.{k}"]
            assert got.dtype == torch.float32 and torch.equal(got, _padded_like(view, f"optimizer/{s}/{k}", rows)), (s, k)
        assert torch.equal(written[f"optimizer.state.param.{k}"], written[k]), k
    common = _common(out)
    groups = common["optimizer"]["optimizer"]["param_groups"]
    want = [{**{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()}, "step": 2.0}
            for g in meta["optimizer"]["hyper_parameters"][0]]
    assert groups == want and groups[0]["betas"] == (0.9, 0.999)
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert "grad_scaler" not in common["optimizer"]  # fp32 training: no loss scaler
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert common["opt_param_scheduler"] == meta["scheduler"] and common["iteration"] == meta["iteration"]
    assert not result.skipped


@pytest.mark.parametrize("form", ["distributed", "plain"])
def test_an_export_imported_back_is_the_checkpoint_it_came_from(tmp_path: Path, form: str) -> None:
    """Export at the golden checkpoint's own padding, import that torch_dist directory: every tensor (weights,
    moments, padding rows) equal bit for bit, and the optimizer record the same (step, param groups), so the
    adapter resumes the round trip as it resumes the original. For either optimizer form (the plain one:
    ``fp32_param`` main copies, the step as ``state.common_step``)."""
    out = tmp_path / "out"
    export_torch_dist(SOURCE, out, tp=2, pp=1, optimizer=form)
    main_key = "fp32_param" if form == "plain" else "param"
    assert any(k.startswith(f"optimizer.state.{main_key}.") for k in read_torch_dist(out))
    back = tmp_path / "back"
    import_torch_dist(out, back, vocab_size=30, make_vocab_size_divisible_by=8)
    ours, theirs = ckptkit.open(str(SOURCE)), ckptkit.open(str(back))
    main = {k for k in theirs.manifest.tensors if k.startswith("optimizer/main/")}
    assert set(theirs.manifest.tensors) - main == set(ours.manifest.tensors)
    for k in ours.manifest.tensors:
        assert torch.equal(ours[k].read(), theirs[k].read()), k
    for k in main:  # fp32 training: the main copies Megatron would hold are the weights
        assert torch.equal(theirs[k].read(), ours["model/" + k.removeprefix("optimizer/main/")].read()), k
    a, b = _meta(SOURCE)["optimizer"], _meta(back)["optimizer"]
    assert (b["tensor_states"], b["scalars"], b["hyper_parameters"]) == \
        (a["tensor_states"], a["scalars"], a["hyper_parameters"])


def test_an_fp16_loss_scaler_and_a_chained_optimizer_are_written_as_megatron_keeps_them(tmp_path: Path) -> None:
    """An fp16 job's scaler state goes to ``grad_scaler`` (the scale as Megatron's 1-element tensor); a
    ChainedOptimizer's parts (an MoE job's dense and expert optimizers) become one dict each, keyed by position."""
    def chained_fp16(meta: dict[str, Any]) -> None:
        groups = meta["optimizer"]["hyper_parameters"][0]
        expert = [{**g, "is_expert_parallel": True} for g in groups]
        meta["optimizer"]["hyper_parameters"] = [groups, expert]
        meta["optimizer"]["grad_scalers"] = [{"scale": 4096.0, "growth_tracker": 1, "hysteresis_tracker": 2}] * 2

    src = _with_record(tmp_path, chained_fp16)
    export_torch_dist(src, tmp_path / "out", tp=1, pp=1)
    common = _common(tmp_path / "out")["optimizer"]
    assert sorted(common) == [0, 1]
    assert [g["is_expert_parallel"] for g in common[1]["optimizer"]["param_groups"]] == [True, True]
    for part in common.values():
        scaler = part["grad_scaler"]
        assert torch.equal(scaler["scale"], torch.tensor([4096.0])) and scaler["hysteresis_tracker"] == 2


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(meta: dict[str, Any]) -> None:
        node = meta
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value
    return edit


def _drop(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    def edit(meta: dict[str, Any]) -> None:
        node = meta
        for p in path[:-1]:
            node = node[p]
        del node[path[-1]]
    return edit


O = ("optimizer",)
REFUSED: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "no_step": (_set(O + ("scalars",), {}), "holds no step"),
    "step_not_a_number": (_set(O + ("scalars", "step", "value"), "2"), "step is '2'"),
    "step_nan": (_set(O + ("scalars", "step", "value"), float("nan")), "expected a finite number"),
    "other_scalar": (_set(O + ("scalars", "momentum_step"), {"dtype": None, "value": 1}), "besides the step"),
    "no_param_groups": (_drop(O + ("hyper_parameters",)), "holds no param groups"),
    "empty_param_groups": (_set(O + ("hyper_parameters",), [[]]), "holds no param groups"),
    "group_without_wd_mult": (_drop(O + ("hyper_parameters", 0, 0, "wd_mult")), "lacks 'wd_mult'"),
    "group_not_an_object": (_set(O + ("hyper_parameters", 0, 0), [1, 2]), "expected an object"),
    "nested_hyper_parameter": (_set(O + ("hyper_parameters", 0, 0, "lr"), {"a": [1]}), "hyper-parameter 'lr'"),
    "a_state_no_tensor_has": (_set(O + ("tensor_states",), ["exp_avg", "exp_avg_sq", "momentum"]),
                              "but not ['momentum']"),
    "main_copies_missing": (_set(O + ("main",), True), "but not ['main']"),
    "state_name_with_a_dot": (_set(O + ("tensor_states",), ["exp_avg.x"]), "tensor_states are"),
    "state_named_param": (_set(O + ("tensor_states",), ["param"]), "tensor_states are"),
    "main_not_a_bool": (_set(O + ("main",), "yes"), "main is 'yes'"),
    "record_not_an_object": (_set(O, [1]), "the optimizer record is list"),
    "scaler_without_scale": (_set(O + ("grad_scalers",), [{"growth_tracker": 1}]), "a loss scaler record"),
    "scaler_scale_not_a_number": (_set(O + ("grad_scalers",), [{"scale": "big"}]), "loss scale is 'big'"),
}


@pytest.mark.parametrize("form", ["distributed", "plain"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_an_optimizer_record_that_cannot_resume_megatron_is_refused(tmp_path: Path, case: str, form: str) -> None:
    """Each is refused before anything is written, naming the checkpoint and what is wrong; the model alone still
    exports with ``weights_only``, the way out the messages name. In either optimizer form."""
    edit, why = REFUSED[case]
    src = _with_record(tmp_path, edit)
    out = tmp_path / "out"
    with pytest.raises(ManifestError) as err:
        export_torch_dist(src, out, tp=2, pp=1, optimizer=form)
    assert str(src) in str(err.value) and why in str(err.value), str(err.value)
    assert not out.exists() or not os.listdir(out)
    export_torch_dist(src, out, tp=2, pp=1, weights_only=True)
    written = read_torch_dist(out)
    assert written and not any(k.startswith("optimizer.") for k in written)
    assert "optimizer" not in _common(out)


def test_weights_only_leaves_the_optimizer_out_and_says_so(tmp_path: Path) -> None:
    result = export_torch_dist(SOURCE, tmp_path / "out", tp=1, pp=1, weights_only=True)
    assert not any(k.startswith("optimizer.") for k in read_torch_dist(tmp_path / "out"))
    assert {k for k in result.skipped} == {k for k in ckptkit.open(str(SOURCE)).manifest.tensors
                                           if k.startswith("optimizer/")}


def test_the_cli_exports_the_optimizer_unless_told_weights_only(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ckptkit.cli.main import cli

    for name, extra in (("with", []), ("without", ["--opt", "weights_only=true"])):
        out = tmp_path / name
        result = CliRunner().invoke(cli, ["convert", str(SOURCE), str(out), "--format", "megatron", "--to", "tp2pp1",
                                          *extra])
        assert result.exit_code == 0, result.output
        assert any(k.startswith("optimizer.state.") for k in read_torch_dist(out)) == (name == "with")


# ---------------------------------------------------------------- fuzz: mutated records

_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=True) | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                     max_leaves=6)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


GOLDEN_META = json.loads(ckptkit.open(str(SOURCE)).values[META])
GOLDEN_TENSORS = dict(ckptkit.open(str(SOURCE)).manifest.tensors)
MODEL_KEYS = {k.removeprefix("model/"): k for k in GOLDEN_TENSORS
              if k.startswith("model/") and not k.endswith(VOCAB_PADDING_SUFFIX)}


@settings(max_examples=trials(300, 3000), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_mutated_record_is_written_whole_or_refused_cleanly(data: st.DataObject) -> None:
    """Any field of the record replaced by any JSON value, or deleted: the export's optimizer part is built
    (then every model tensor with optimizer state has all of it, each from a tensor the checkpoint holds) or
    refused with a ManifestError naming the checkpoint; never another exception."""
    record = copy.deepcopy(GOLDEN_META["optimizer"])
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(record) if p]
        path = data.draw(st.sampled_from(paths))
        node = record
        for p in path[:-1]:
            node = node[p]
        if data.draw(st.booleans()):
            del node[path[-1]]
        else:
            node[path[-1]] = data.draw(_JSON)
    form = data.draw(st.sampled_from(OPTIMIZER_FORMS))
    try:
        sources = optimizer_export.state_sources(record, MODEL_KEYS, GOLDEN_TENSORS, "ckpt", form)
        common = optimizer_export.optimizer_common(record, "ckpt", form)
    except ManifestError as exc:
        assert "ckpt" in str(exc)
        return
    assert set(sources.values()) <= set(GOLDEN_TENSORS)
    keys = {k.split(".", 3)[3] for k in sources}
    assert {f"optimizer.state.{'fp32_param' if form == 'plain' else 'param'}.{k}" for k in keys} <= set(sources)
    if form == "plain":  # per optimizer: torch's dict, bare (no main copies) or in the mixed-precision wrapper
        entries = list(common.values()) if common and all(isinstance(k, int) for k in common) else [common]
        for entry in entries:
            inner = entry["optimizer"] if record["main"] else entry
            step = inner["state"]["common_step"]
            assert isinstance(step, torch.Tensor) and step.dim() == 0 and bool(torch.isfinite(step))
            assert all("step" not in g and "params" not in g for g in inner["param_groups"])
        return
    parts = common.values() if set(common) <= {0, 1, 2, 3} and common else [common]
    for part in parts:
        steps = {g["step"] for g in part["optimizer"]["param_groups"]}
        assert len(steps) == 1 and all(isinstance(s, float) for s in steps)


def test_a_step_beyond_float32_is_refused_not_written_as_inf() -> None:
    """Found by the test above (a step of 3.4028235677973366e+38): the plain optimizers' step is a float32
    tensor, and a step past float32's range became inf in the export."""
    record = copy.deepcopy(GOLDEN_META["optimizer"])
    record["scalars"]["step"]["value"] = 3.4028235677973366e+38
    with pytest.raises(ManifestError, match="does not fit the float32 step tensor"):
        optimizer_export.optimizer_common(record, "ckpt", "plain")


def test_a_hostile_record_never_escapes_as_another_error(tmp_path: Path) -> None:
    """End to end for the fuzz's outcomes: a record of the wrong type everywhere still ends in a CkptkitError."""
    for i, value in enumerate([None, 7, "x", [], {"tensor_states": None}]):
        src = _with_record(tmp_path / str(i), _set(O, value)) if value is not None else \
            _with_record(tmp_path / str(i), _set(O + ("scalars",), None))
        with pytest.raises(CkptkitError):
            export_torch_dist(src, tmp_path / str(i) / "out", tp=1, pp=1)
