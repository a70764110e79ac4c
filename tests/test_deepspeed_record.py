"""One record, one set of rules: the ``deepspeed`` JSON record a live save and an import both build
(``ckptkit.adapters.deepspeed_record``), and the names this release renamed.

* the rules where the importer used to be looser than the live adapter, now the adapter's for both:
  a per-group optimizer scalar must be a one-element tensor or a number (the importer kept any JSON
  value); fp16 training is refused, its dynamic loss scaler not being carried (the importer took fp16
  folders and dropped it); ``ds_config`` must be a dict (the adapter stored ``{}`` for anything else);
  a record of another format version is refused by the converters' reader too (it read any);
* the client-state rule, shared, with its one deliberate difference: a live save raises, an import
  lists what it left out;
* ``export_deepspeed(zero_stage=)`` (``stage=`` still works, warning), ``flat_layouts(zero_stage=)``,
  ``NativeFiles.zero_stage``, and the package offering every name of the first flat module.

Small native folders from tests/test_import_trust_folders.py; no process group.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.adapters import deepspeed as ds_adapter
from ckptkit.adapters.deepspeed_record import (
    FORMAT,
    Counters,
    FrameworkState,
    RecordSources,
    SavedLayout,
    build_record,
    client_state_record,
    scalar_record,
    scalar_value,
)
from ckptkit.errors import StateMismatchError
from ckptkit_converters.deepspeed import files as fmt
from ckptkit_converters.deepspeed.flat_layout import flat_layouts
from ckptkit_converters.deepspeed.importer import import_deepspeed
from ckptkit_converters.deepspeed.record import read_meta
from tests.test_import_trust_folders import deepspeed_folder

TAG = "global_step3"


def _rewrite(path: Path, change) -> None:
    """Change a ``torch.save`` file this test wrote itself (trusted here, so a plain ``torch.load``)."""
    data = torch.load(path, weights_only=False)
    change(data)
    torch.save(data, path)


def _layout(**changes) -> SavedLayout:
    fields = dict(zero_stage=2, dp=2, lp_dtype=torch.bfloat16, flat_groups=[{"group": 0, "names": ["w"], "moe": None}],
                  param_shapes={"w": (4, 3)}, optimizer_scalars=[{"step": scalar_record(torch.tensor(3.0), "s")}],
                  optimizer_state_keys=["exp_avg"], buffers=[], frozen=[], shared={}, experts={})
    return SavedLayout(**{**fields, **changes})


def _state(**changes) -> FrameworkState:
    fields = dict(param_groups=[{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}], lr_scheduler=None,
                  ds_config={"train_batch_size": 8}, client_state={}, sources=RecordSources("model.pt", "optim.pt"))
    return FrameworkState(**{**fields, **changes})


def test_scalar_rule_keeps_numbers_and_one_element_tensors_only():
    assert scalar_record(torch.tensor(3.0), "s") == {"dtype": "float32", "value": 3.0}
    assert scalar_record(7, "s") == {"dtype": None, "value": 7}
    assert scalar_record(0.5, "s") == {"dtype": None, "value": 0.5}
    back = scalar_value(scalar_record(torch.tensor(2, dtype=torch.int64), "s"))
    assert back.dtype == torch.int64 and back.item() == 2
    for bad, problem in [(torch.zeros(2), "a tensor of shape [2]"), ("three", "a builtins.str"),
                         (None, "a builtins.NoneType"), ([1], "a builtins.list"), (2**20000, "too large")]:
        with pytest.raises(StateMismatchError) as err:
            scalar_record(bad, "opt.pt: optimizer state 'step' of flat group 0")
        assert str(err.value).startswith("opt.pt: optimizer state 'step' of flat group 0") and problem in str(err.value)


def test_record_keys_and_the_rules_of_the_builder():
    record = build_record(_layout(), Counters(3, 24, 0, 6, 2), _state(client_state={"epoch": 1}))
    assert list(record) == ["format", "stage", "dp", "lp_dtype", "global_steps", "global_samples", "skipped_steps",
                            "micro_steps", "gradient_accumulation_steps", "param_groups", "optimizer_scalars",
                            "flat_groups", "param_shapes", "buffers", "frozen", "shared", "experts", "ds_config",
                            "optimizer_state_keys", "lr_scheduler", "client_state"]
    assert record["format"] == FORMAT and record["stage"] == 2 and record["lp_dtype"] == "bfloat16"
    assert record["param_groups"] == [{"lr": 0.1, "betas": [0.9, 0.99]}] and record["param_shapes"] == {"w": [4, 3]}
    assert json.loads(json.dumps(record)) == record
    with pytest.raises(StateMismatchError, match=r"^model.pt: fp16 training; the dynamic loss scaler"):
        build_record(_layout(lp_dtype=torch.float16), Counters(3, 24, 0, 6, 2), _state())
    with pytest.raises(StateMismatchError, match=r"^model.pt: ds_config is a str, not the DeepSpeed config dict"):
        build_record(_layout(), Counters(3, 24, 0, 6, 2), _state(ds_config="ds.json"))
    with pytest.raises(StateMismatchError, match=r"^optim.pt: optimizer param group 0\['lr'\] is a torch.Tensor"):
        build_record(_layout(), Counters(3, 24, 0, 6, 2), _state(param_groups=[{"lr": torch.tensor(0.1)}]))
    with pytest.raises(StateMismatchError, match=r"^model.pt: lr_scheduler\['m'\] has the key 30 \(int\)"):
        build_record(_layout(), Counters(3, 24, 0, 6, 2), _state(lr_scheduler={"m": {30: 1}}))


def test_client_state_rule_is_shared_and_names_what_it_refuses():
    kept, refused = client_state_record({"epoch": 1, "ids": {1: "a"}, 7: "x", "t": (1, 2)}, "model.pt")
    assert kept == {"epoch": 1, "t": [1, 2]}
    assert list(refused) == ["ids", "7"]
    assert str(refused["ids"]).startswith("model.pt: client state 'ids' has the key 1 (int)")
    assert str(refused["7"]) == "model.pt: client state key 7 is not a string"


def test_import_refuses_a_scalar_state_the_live_adapter_refuses(tmp_path):
    src = deepspeed_folder(tmp_path / "src")
    optim = src / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    _rewrite(optim, lambda d: d["optimizer_state_dict"]["base_optimizer_state"]["state"][0].update(step="three"))
    with pytest.raises(StateMismatchError) as err:
        import_deepspeed(src, tmp_path / "out")
    assert str(err.value).startswith(f"{optim}: optimizer state 'step' of flat group 0: a builtins.str")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_import_refuses_fp16_as_the_live_adapter_does(tmp_path):
    src = deepspeed_folder(tmp_path / "src")
    model = src / TAG / "mp_rank_00_model_states.pt"

    def to_half(data):
        for name in ("fc.weight", "fc.bias"):
            data["module"][name] = data["module"][name].half()

    _rewrite(model, to_half)
    with pytest.raises(StateMismatchError, match="fp16 training; the dynamic loss scaler's state is not") as err:
        import_deepspeed(src, tmp_path / "out")
    assert str(err.value).startswith(f"{model}: ")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_import_refuses_a_ds_config_that_is_not_a_dict(tmp_path):
    src = deepspeed_folder(tmp_path / "src", config=["train_batch_size", 8])  # type: ignore[arg-type]
    with pytest.raises(StateMismatchError, match="ds_config is a list, not the DeepSpeed config dict"):
        import_deepspeed(src, tmp_path / "out")


def test_both_readers_refuse_a_record_of_another_format(tmp_path):
    src = deepspeed_folder(tmp_path / "src")
    import_deepspeed(src, tmp_path / "good")
    adapters_reading = {k: v for k, v in ds_adapter.read_meta(tmp_path / "good").items() if k != "_tensors"}
    assert read_meta(ckptkit.open(tmp_path / "good")) == adapters_reading
    ckptkit.save({"deepspeed_engine": {"deepspeed": json.dumps({"format": FORMAT + 1})}}, tmp_path / "other")
    with pytest.raises(StateMismatchError, match=f"DeepSpeed record format {FORMAT + 1}, expected {FORMAT}"):
        read_meta(ckptkit.open(tmp_path / "other"))
    with pytest.raises(StateMismatchError, match=f"DeepSpeed record format {FORMAT + 1}, expected {FORMAT}"):
        ds_adapter.read_meta(tmp_path / "other")


def test_export_takes_zero_stage_and_the_old_stage_keyword_warns(tmp_path):
    pytest.importorskip("deepspeed")
    from ckptkit_converters.deepspeed.exporter import export_deepspeed

    import_deepspeed(deepspeed_folder(tmp_path / "src"), tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        export_deepspeed(tmp_path / "ckpt", tmp_path / "new", dp=1, zero_stage=3)
    with pytest.warns(DeprecationWarning, match=r"export_deepspeed\(stage=\.\.\.\) is deprecated .* zero_stage="):
        export_deepspeed(tmp_path / "ckpt", tmp_path / "old", dp=1, stage=3)
    new = sorted(p.relative_to(tmp_path / "new") for p in (tmp_path / "new").rglob("*") if p.is_file())
    old = sorted(p.relative_to(tmp_path / "old") for p in (tmp_path / "old").rglob("*") if p.is_file())
    assert new == old and Path(TAG, "zero_pp_rank_0_mp_rank_00_model_states.pt") in new
    assert all((tmp_path / "new" / p).read_bytes() == (tmp_path / "old" / p).read_bytes() for p in new)
    assert fmt.find_files(str(tmp_path / "new")).zero_stage == 3
    with pytest.raises(TypeError, match="got both stage= and zero_stage="):
        export_deepspeed(tmp_path / "ckpt", tmp_path / "both", dp=1, stage=3, zero_stage=3)


def test_renamed_names_still_work_for_one_release(tmp_path):
    groups = [[("a", (4, 3)), ("b", (5,))]]
    with pytest.warns(DeprecationWarning, match=r"flat_layouts\(stage=\.\.\.\) is deprecated .* pass zero_stage="):
        old = flat_layouts(groups, stage=2, dp=2)
    assert old == flat_layouts(groups, zero_stage=2, dp=2) == flat_layouts(groups, 2, 2)
    files = fmt.find_files(str(deepspeed_folder(tmp_path / "src")))
    with pytest.warns(DeprecationWarning, match="NativeFiles.stage is deprecated .* use NativeFiles.zero_stage"):
        assert files.stage == files.zero_stage == 2


@pytest.mark.parametrize("name,module", [("import_deepspeed", "importer"), ("export_deepspeed", "exporter"),
                                         ("consolidated_fp32_state_dict", "fp32"), ("export_fp32", "fp32"),
                                         ("flat_layouts", "flat_layout"), ("FlatLayout", "flat_layout"),
                                         ("read_meta", "record")])
def test_the_package_offers_what_the_first_flat_module_did(name, module):
    """``ckptkit_converters.deepspeed`` was one module; it is a package now, and each public name of
    that module still imports from it (the very object of the module that does the job)."""
    import importlib

    import ckptkit_converters.deepspeed as package

    new = importlib.import_module(f"ckptkit_converters.deepspeed.{module}")
    assert getattr(package, name) is getattr(new, name)
