"""Megatron optimizer state into ckptkit: the record the adapter resumes from, and folders that must be refused.

The real Megatron runs (tests/test_megatron.py, ``test_megatrons_own_save_imports_with_its_optimizer_and_resumes``)
show a whole import resumes exactly. Here, without Megatron: every way a torch_dist folder's optimizer can
be incomplete or inconsistent — moments without a step, steps that disagree, a state some parameters lack,
two main copies of one parameter, a step that is not a number — is refused naming the file, with nothing
committed at DEST; a whole one imports bit for bit, padding rows and all; and a sweep over random
optimizer layouts checks the record against its definition.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.errors import ManifestError
from ckptkit_converters.megatron.importer import import_torch_dist
from ckptkit_converters.megatron.optimizer_record import STATE_NAMES, optimizer_record
from tests.conftest import trials

VOCAB, PADDED, HIDDEN = 13, 16, 4
EMB, QKV = "embedding.word_embeddings.weight", "decoder.layers.self_attention.linear_qkv.weight"
SHAPES = {EMB: (PADDED, HIDDEN), QKV: (2, 6, HIDDEN)}


def _args() -> argparse.Namespace:
    return argparse.Namespace(num_layers=2, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              make_vocab_size_divisible_by=16, padded_vocab_size=PADDED, vocab_size=VOCAB,
                              untie_embeddings_and_output_weights=False, world_size=2)


def dist_opt_common(step: Any = 3.0, groups: int = 2) -> dict[str, Any]:
    """``common.pt``'s optimizer part as DistributedOptimizer.state_dict() leaves it (the step in every group)."""
    return {"optimizer": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "step": step} for _ in range(groups)]},
            "param_state_sharding_type": "fully_reshardable",
            "grad_scaler": {"scale": torch.tensor([4096.0]), "growth_tracker": 1, "hysteresis_tracker": 2}}


def torch_dist_folder(folder: Path, states: dict[str, dict[str, torch.Tensor]], optimizer: Any,
                      model: dict[str, torch.Tensor] | None = None) -> Path:
    """A torch_dist directory with model tensors and ``optimizer.state.<state>.<key>`` tensors, written by DCP."""
    g = torch.Generator().manual_seed(0)
    model = model if model is not None else {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    flat = dict(model)
    for state, tensors in states.items():
        flat.update({f"optimizer.state.{state}.{k}": v for k, v in tensors.items()})
    dcp.save(flat, checkpoint_id=str(folder), no_dist=True)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 50_000))  # the deep-nesting cases: pickling a deep dict recurses
    try:
        torch.save({"iteration": 7, "checkpoint_version": 3.0, "args": _args(), "optimizer": optimizer,
                    "opt_param_scheduler": {"num_steps": 7, "lr_decay_style": "cosine"}}, folder / "common.pt")
    finally:
        sys.setrecursionlimit(limit)
    return folder


def adam_states(names: tuple[str, ...] = ("exp_avg", "exp_avg_sq", "param"), keys: tuple[str, ...] = (EMB, QKV),
                seed: int = 1) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {n: {k: torch.randn(SHAPES[k], generator=g) for k in keys} for n in names}


def test_a_whole_distributed_optimizer_imports_bit_exact_with_its_padding_rows_and_step(tmp_path):
    g = torch.Generator().manual_seed(5)
    model = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    states = adam_states()
    src = torch_dist_folder(tmp_path / "src", states, dist_opt_common(step=3.0), model)
    result = import_torch_dist(src, tmp_path / "out")
    view = ckptkit.open(str(tmp_path / "out"))
    want = {f"model/{k}": v for k, v in model.items()}
    for state, tensors in states.items():
        want.update({f"optimizer/{STATE_NAMES[state]}/{k}": v for k, v in tensors.items()})
    for key in list(want):  # the vocab tensors: true rows, and the padding rows beside them
        if key.endswith(EMB):
            whole = want.pop(key)
            want[key], want[key + ".vocab_padding"] = whole[:VOCAB], whole[VOCAB:]
    assert sorted(view.keys()) == sorted(want)
    for key, value in want.items():
        assert torch.equal(view[key].read(), value), key
    meta = json.loads(view.values["megatron/meta"])
    assert meta["optimizer"]["tensor_states"] == ["exp_avg", "exp_avg_sq"] and meta["optimizer"]["main"]
    assert meta["optimizer"]["scalars"] == {"step": {"dtype": "float32", "value": 3.0}}
    assert meta["optimizer"]["hyper_parameters"] == [[{"lr": 1e-3, "betas": [0.9, 0.95]}] * 2]
    assert meta["optimizer"]["grad_scalers"] == [{"scale": 4096.0, "growth_tracker": 1, "hysteresis_tracker": 2}]
    assert meta["scheduler"] == {"num_steps": 7, "lr_decay_style": "cosine"}
    assert not any(k.startswith("optimizer.state.") for k in result.skipped)


def _nested(depth: int, key: str = "optimizer") -> dict[str, Any]:
    """An optimizer dict nested ``depth`` levels: loading it builds it without recursion, and a walk over it
    must not recurse that deep (a RecursionError, not a clear refusal)."""
    inner: dict[str, Any] = {"param_groups": [{"step": 1.0}]}
    for _ in range(depth):
        inner = {key: inner}
    return inner


BAD_FOLDERS = {
    "moments-without-a-step": (adam_states(), {"optimizer": {"param_groups": [{"lr": 1e-3}]}},
                               "no step"),
    "steps-that-disagree": (adam_states(), {"optimizer": {"param_groups": [{"step": 3.0}, {"step": 4.0}]}},
                            "different steps"),
    "a-state-one-parameter-lacks": ({**adam_states(("exp_avg", "param")), **adam_states(("exp_avg_sq",), (QKV,))},
                                    dist_opt_common(), "'exp_avg_sq' is missing for 1 parameter"),
    "two-main-copies": (adam_states(("exp_avg", "exp_avg_sq", "param", "fp32_param")), dist_opt_common(),
                        "two saved main copies"),
    "a-step-that-is-a-string": (adam_states(), dist_opt_common(step="3"), "of type str"),
    "a-step-that-is-a-bool": (adam_states(), dist_opt_common(step=True), "of type bool"),
    "a-loss-scaler-field-megatron-has-not": (adam_states(), {**dist_opt_common(), "grad_scaler": {"scale": 2.0,
                                                                                                "exec": 1}},
                                             "loss scaler field 'exec'"),
    "a-loss-scale-that-is-not-a-number": (adam_states(), {**dist_opt_common(), "grad_scaler": {"scale": "big"}},
                                          "loss scale of type str"),
    "an-optimizer-dict-nested-10000-deep": (adam_states(), _nested(10_000), "nests deeper than 8"),
    "a-chain-nested-10000-deep": (adam_states(), _nested(10_000, key="0"), "nests deeper than 8"),
    "a-state-of-another-shape": ({"exp_avg": {EMB: torch.zeros(PADDED, HIDDEN + 1)}}, dist_opt_common(),
                                 "has shape"),
}


@pytest.mark.parametrize("case", sorted(BAD_FOLDERS))
def test_an_incomplete_or_inconsistent_optimizer_is_refused_naming_the_folder(tmp_path, case):
    states, optimizer, message = BAD_FOLDERS[case]
    src = torch_dist_folder(tmp_path / "src", states, optimizer)
    with pytest.raises(ManifestError, match=message) as err:
        import_torch_dist(src, tmp_path / "out")
    assert str(src) in str(err.value) or "optimizer.state." in str(err.value)
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")  # nothing committed


def test_the_cli_refuses_it_too_without_a_traceback(tmp_path):
    from click.testing import CliRunner

    from ckptkit.cli.main import cli

    states, optimizer, _ = BAD_FOLDERS["moments-without-a-step"]
    src = torch_dist_folder(tmp_path / "src", states, optimizer)
    result = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "out")])
    assert result.exit_code != 0 and "no step" in result.output and "Traceback" not in result.output


# ---------------------------------------------------------------- the record against its definition

_PARAMS = ("a", "b", "c")
_STATES = ("exp_avg", "exp_avg_sq", "main")


@st.composite
def optimizers(draw: Any) -> tuple[list[str], Any, list[float]]:
    """Imported keys (some states of some parameters) and a saved optimizer dict with steps in any of the
    places Megatron puts them (param groups, a plain optimizer's common_step, chained optimizers)."""
    keys = [f"optimizer/{s}/{p}" for s in _STATES for p in _PARAMS if draw(st.booleans())]
    keys += [f"model/{p}" for p in _PARAMS]
    steps: list[float] = []

    def one() -> dict[str, Any]:
        kind = draw(st.sampled_from(["groups", "common_step", "none", "wrapped"]))
        value = draw(st.sampled_from([1.0, 2.0, 5, 0, 2.5, -1.0, float("nan"), float("inf")]))
        if kind == "groups":
            steps.append(float(value))
            return {"param_groups": [{"lr": 0.1, "step": value}]}
        if kind == "common_step":
            steps.append(float(value))
            return {"state": {"common_step": torch.tensor(float(value))}, "param_groups": [{"lr": 0.1}]}
        if kind == "wrapped":  # Float16OptimizerWithFloat16Params: the torch optimizer under "optimizer"
            steps.append(float(value))
            return {"optimizer": {"state": {"common_step": value}, "param_groups": [{"lr": 0.1}]}}
        return {"param_groups": [{"lr": 0.1}]}

    chained = draw(st.integers(0, 2))
    optimizer = one() if chained == 0 else {str(i): one() for i in range(chained + 1)}
    return keys, optimizer, steps


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -8.0])
def test_a_loss_scale_that_is_not_finite_and_positive_is_refused(scale):
    optimizer = {"optimizer": {"state": {"common_step": 2.0}}, "grad_scaler": {"scale": torch.tensor([scale]),
                                                                               "growth_tracker": 0}}
    with pytest.raises(ManifestError, match="loss scale"):
        optimizer_record(["optimizer/exp_avg/a"], optimizer, "common.pt")
    optimizer["grad_scaler"]["scale"] = torch.tensor([4096.0])
    assert optimizer_record(["optimizer/exp_avg/a"], optimizer, "common.pt")["grad_scalers"][0]["scale"] == 4096.0


@settings(max_examples=trials(200, 2000), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(optimizers())
def test_the_record_is_its_definition(case):
    keys, optimizer, steps = case
    by_state = {s: {k.split("/")[2] for k in keys if k.startswith(f"optimizer/{s}/")} for s in _STATES}
    present = {s: p for s, p in by_state.items() if p}
    every = set().union(*present.values()) if present else set()
    moments = sorted(s for s in present if s != "main")
    if not present:
        expect: Any = None
    elif any(p != every for p in present.values()):
        expect = "missing for"
    elif any(not math.isfinite(s) or s < 0 or s != int(s) for s in steps):
        expect = "is not a count of steps"
    elif len(set(steps)) > 1:
        expect = "different steps"
    elif moments and not steps:
        expect = "no step"
    else:
        expect = {"tensor_states": moments, "main": "main" in present,
                  "scalars": {"step": {"dtype": "float32", "value": steps[0]}} if steps else {}}
    if isinstance(expect, str):
        with pytest.raises(ManifestError, match=expect):
            optimizer_record(keys, optimizer, "common.pt")
        return
    got = optimizer_record(keys, optimizer, "common.pt")
    if expect is None:
        assert got is None
    else:
        assert {k: got[k] for k in expect} == expect
        json.dumps(got)  # JSON as it is written into megatron/meta
