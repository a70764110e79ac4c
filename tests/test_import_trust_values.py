"""One rule for the non-tensor records of DeepSpeed, imported or saved live: kept exactly, or refused
by name — never turned into strings (``ckptkit.layout.values.json_ready``).

The DeepSpeed importer used to write what it could not store as ``str(value)`` (param groups, the LR
scheduler's state, ``ds_config``) and ``{1: x}`` as ``{"1": x}``, while the live adapter refused the
same values. Now both build the record with ``ckptkit.adapters.deepspeed_record.build_record``, which
calls ``json_ready``:

* hypothesis builds JSON-like values with, sometimes, a part JSON cannot hold exactly (a tensor, a set,
  bytes, a complex, a ``Counter`` with int keys, a dict with int or tuple keys, a dtype, a lone
  surrogate) and puts it in the scheduler state, the config or a param group of a native folder;
  the import either keeps it exactly (read back from the checkpoint) or fails with one line naming the
  file and the key path of the first part it cannot keep — the path the test computes on its own;
* client-state entries that cannot be kept are listed as skipped, never stored as strings;
* the rule itself, as the adapters call it.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptkit.adapters import deepspeed as ds_adapter
from ckptkit.adapters import deepspeed_record
from ckptkit.errors import StateMismatchError
from ckptkit.layout.values import json_ready
from ckptkit_converters.deepspeed import record as ds_converter_record
from ckptkit_converters.deepspeed.importer import import_deepspeed
from tests.conftest import trials
from tests.test_import_trust_folders import deepspeed_folder

TAG = "global_step3"
SETTINGS = settings(max_examples=trials(25, 300), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

POISON = [torch.tensor(0.5), {1, 2}, b"\x00bytes", bytearray(b"ba"), complex(1, 2), Counter({30: 1}),
          {1: "int key"}, {("a",): 1}, torch.float32, "\ud800", {True: 1}, {None: 0}]
_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=8))
_json = st.recursive(_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner, inner),
                                                    st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                     max_leaves=12)
VALUES = st.recursive(st.one_of(_leaf, st.sampled_from(POISON)),
                      lambda inner: st.one_of(st.lists(inner, max_size=3),
                                              st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                      max_leaves=10) | _json


def first_bad(value: Any, path: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
    """The test's own reading of the rule: the key path of the first part JSON cannot keep exactly."""
    if value is None or isinstance(value, (bool, int, float)):
        return None
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, (list, tuple)):
        return next((p for i, v in enumerate(value) if (p := first_bad(v, (*path, i))) is not None), None)
    if type(value) in (dict, OrderedDict):
        for k, v in value.items():
            if not isinstance(k, str):
                return path
            if (p := first_bad(v, (*path, k))) is not None:
                return p
        return None
    return path


def same(a: Any, b: Any) -> bool:
    """Equal as JSON keeps them: tuples are lists, nan equals nan."""
    if isinstance(a, tuple):
        a = list(a)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _where(src: Path, place: str) -> str:
    if place == "param_group":
        return f"{src}/{TAG}/zero_pp_rank_0_mp_rank_00_optim_states.pt: optimizer param group 0['extra']"
    if place == "ds_config":
        return f"{src}/{TAG}/mp_rank_00_model_states.pt: ds_config['user']"
    return f"{src}/{TAG}/mp_rank_00_model_states.pt: lr_scheduler"


def _read(meta: dict[str, Any], place: str) -> Any:
    if place == "param_group":
        return meta["param_groups"][0]["extra"]
    return meta["ds_config"]["user"] if place == "ds_config" else meta["lr_scheduler"]


_seen = {"kept": 0, "refused": 0}


@SETTINGS
@given(value=VALUES, place=st.sampled_from(["lr_scheduler", "ds_config", "param_group"]))
def test_imported_records_are_kept_exactly_or_refused_by_key_path(tmp_path_factory, value, place):
    root = tmp_path_factory.mktemp("values")
    src, out = root / "src", root / "out"
    if value is None and place == "lr_scheduler":
        value = {"none": None}  # a scheduler-less engine saves None: fine, but the case says nothing
    deepspeed_folder(src, scheduler=value if place == "lr_scheduler" else None,
                     config={"train_batch_size": 8, "zero_optimization": {"stage": 2}, "user": value}
                     if place == "ds_config" else None,
                     group_extra={"extra": value} if place == "param_group" else None)
    bad = first_bad(value)
    if bad is None:
        import_deepspeed(src, out)
        assert same(value, _read(ds_adapter.read_meta(out), place))
        _seen["kept"] += 1
        return
    with pytest.raises(StateMismatchError) as err:
        import_deepspeed(src, out)
    message = str(err.value)
    at = _where(src, place) + "".join(f"[{ascii(p) if len(ascii(p)) <= 60 else ascii(p)[:50] + '...'}]" for p in bad)
    assert message.startswith(at + " ") and "\n" not in message, (message, at)
    assert not (out / "manifest.json").exists()
    _seen["refused"] += 1


def test_the_sweep_saw_both_outcomes():
    """Runs after the sweep (same module, in order): both branches above were exercised."""
    assert _seen["kept"] > 0 and _seen["refused"] > 0, _seen


def test_client_state_that_json_cannot_keep_is_skipped_not_stringified(tmp_path):
    deepspeed_folder(tmp_path / "src")
    path = tmp_path / "src" / TAG / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=False)
    state.update(ids={1: "a"}, when=torch.tensor(3), note="kept", nested={"a": [1, (2, 3)]})
    torch.save(state, path)
    result_meta = import_deepspeed(tmp_path / "src", tmp_path / "out")
    assert result_meta.format == "ckptkit"
    meta = ds_adapter.read_meta(tmp_path / "out")
    assert meta["client_state"] == {"epoch": 1, "note": "kept", "nested": {"a": [1, [2, 3]]}}
    import ckptkit

    assert ckptkit.open(tmp_path / "out").meta["converted_from"]["skipped_client_state"] == ["ids", "when"]


def test_one_rule_for_the_adapter_and_the_importer():
    """Both writers of the record go through one builder, which applies ``json_ready`` to these records."""
    assert ds_adapter.build_record is deepspeed_record.build_record
    assert ds_converter_record.build_record is deepspeed_record.build_record
    assert deepspeed_record.json_ready is json_ready
    assert json_ready({"betas": (0.9, 0.99), "lr": float("inf"), "name": "x"}, "pg") == \
        {"betas": [0.9, 0.99], "lr": float("inf"), "name": "x"}
    for bad, where in [({"milestones": Counter({30: 1})}, "sched['milestones'] has the key 30 (int)"),
                       ({"lr": torch.tensor(0.1)}, "sched['lr'] is a torch.Tensor"),
                       ([{"a": {2, 3}}], "sched[0]['a'] is a builtins.set"),
                       ({"k": "\udcff"}, "sched['k'] is a string that is not valid Unicode")]:
        with pytest.raises(StateMismatchError) as err:
            json_ready(bad, "sched")
        assert str(err.value).startswith(where), str(err.value)
    deep: Any = 1
    for _ in range(200):
        deep = [deep]
    with pytest.raises(StateMismatchError, match="nests deeper than"):
        json_ready(deep, "sched")
