"""DeepSpeed adapter and converters: refusals, in one process (no engine, no world needed)."""

from __future__ import annotations

import os
import re

import pytest
import torch

import ckptkit
from ckptkit.adapters import deepspeed as ds_ckpt
from ckptkit.errors import CheckpointNotFoundError, CoverageError, ManifestError, MissingKeysError
from ckptkit_converters.deepspeed.importer import import_deepspeed
from ckptkit_converters.deepspeed.files import find_files, is_deepspeed_checkpoint, load_file
from ckptkit_converters.deepspeed.record import read_meta
from ckptkit_converters.common.safe_unpickle import UnsafeCheckpointError
from tests.test_import_trust_folders import deepspeed_folder, expp_folder

TAG = "global_step3"


class NotAllowed:
    """Any class outside torch's weights_only set and ckptkit's three DeepSpeed stand-ins."""

    def __reduce__(self):
        return (os.getcwd, ())


def _native(tmp_path, payload) -> str:
    folder = tmp_path / "ds"
    (folder / "global_step1").mkdir(parents=True)
    (folder / "latest").write_text("global_step1")
    torch.save(payload, folder / "global_step1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({"module": {}, "param_shapes": []}, folder / "global_step1" / "mp_rank_00_model_states.pt")
    return str(folder)


def test_not_a_deepspeed_checkpoint_of_ckptkit(tmp_path):
    ckptkit.save({"w": torch.ones(3)}, tmp_path / "plain")
    with pytest.raises(MissingKeysError, match="not a checkpoint of ckptkit's DeepSpeed adapter"):
        ds_ckpt.read_meta(tmp_path / "plain")


def test_native_folder_without_latest(tmp_path):
    assert not is_deepspeed_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointNotFoundError, match="no 'latest' file"):
        import_deepspeed(tmp_path, tmp_path / "out")


def test_a_pickle_naming_other_code_is_refused_before_it_runs(tmp_path):
    folder = _native(tmp_path, {"optimizer_state_dict": {"zero_stage": 2, "evil": NotAllowed()}})
    assert is_deepspeed_checkpoint(folder)
    with pytest.raises(UnsafeCheckpointError, match="optim_states.pt"):
        find_files(folder)
    assert not os.path.exists(tmp_path / "out")


def test_stand_ins_are_inert(tmp_path):
    """DeepSpeed's own globals load as ckptkit's stand-ins, without DeepSpeed code (or DeepSpeed's classes)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    path = tmp_path / "x.pt"
    torch.save({"s": LossScaler(4.0), "z": ZeroStageEnum.gradients, "f": fragment_address(numel=3, start=5)}, path)
    got = load_file(str(path))
    assert type(got["s"]).__module__ == "ckptkit_converters.deepspeed.files"
    assert got["z"] == 2 and type(got["z"]).__name__ == "ZeroStage"
    assert (got["f"].numel, got["f"].start) == (3, 5)


def test_missing_rank_files_are_named(tmp_path):
    folder = _native(tmp_path, {"optimizer_state_dict": {"zero_stage": 2}})
    os.rename(os.path.join(folder, "global_step1", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
              os.path.join(folder, "global_step1", "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    with pytest.raises(ManifestError, match=r"DP ranks \[1\], expected 0..1: missing .*global_step1/"
                                            r"zero_pp_rank_0_mp_rank_00_optim_states\.pt"):
        find_files(folder)


# ---------------------------------------------------------------- files lost from a tag folder


def test_a_lost_last_optimizer_file_is_named(tmp_path):
    """The files alone look like a complete DP-1 checkpoint; ``dp_world_size`` says a rank is missing."""
    src = deepspeed_folder(tmp_path / "src", dp=3)
    (src / TAG / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CoverageError, match=r"global_step3/zero_pp_rank_2_mp_rank_00_optim_states\.pt: missing: "
                                            r".*mp_rank_00_model_states\.pt records dp_world_size 3"):
        import_deepspeed(src, tmp_path / "out")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_lost_zero3_rank_names_both_of_its_files(tmp_path):
    src = deepspeed_folder(tmp_path / "src", stage=3, dp=2)
    for name in ("zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"):
        (src / TAG / name).unlink()
    with pytest.raises(CoverageError) as caught:
        import_deepspeed(src, tmp_path / "out")
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in str(caught.value)
    assert "zero_pp_rank_1_mp_rank_00_model_states.pt" in str(caught.value)


def test_a_lost_zero3_model_states_file_is_named(tmp_path):
    src = deepspeed_folder(tmp_path / "src", stage=3, dp=2)
    (src / TAG / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(ManifestError, match=r"missing .*global_step3/zero_pp_rank_1_mp_rank_00_model_states\.pt"):
        find_files(str(src))


def test_a_lost_zero12_model_states_file_is_named(tmp_path):
    src = deepspeed_folder(tmp_path / "src")
    (src / TAG / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"global_step3/mp_rank_00_model_states\.pt: missing"):
        find_files(str(src))


def test_latest_naming_no_folder_names_latest(tmp_path):
    """A truncated ``latest`` ("global_step3" cut to "global") names a folder that is not there: the error
    must send the user to ``latest``, not to the folder that never existed."""
    src = deepspeed_folder(tmp_path / "src")
    (src / "latest").write_text("global")
    with pytest.raises(CheckpointNotFoundError, match=r"/latest names tag 'global', which is not a folder of "):
        import_deepspeed(src, tmp_path / "out")
    with pytest.raises(CheckpointNotFoundError, match=r"the tag option \(CLI --tag\) names tag 'global_step9'"):
        import_deepspeed(src, tmp_path / "out", tag="global_step9")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- module state against param_shapes


def _edit_model_states(src, edit, name: str = "mp_rank_00_model_states.pt") -> None:
    path = src / TAG / name
    data = torch.load(path, weights_only=True)  # the test's own file
    edit(data)
    torch.save(data, path)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_parameter_missing_from_module_is_named_before_writing(tmp_path, stage):
    """Not only the first parameter: every one ``param_shapes`` lists (here the last, ``fc.bias``)."""
    src = deepspeed_folder(tmp_path / "src", stage=stage)
    name = "mp_rank_00_model_states.pt" if stage < 3 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    _edit_model_states(src, lambda d: d["module"].pop("fc.bias"), name)
    with pytest.raises(ManifestError, match=rf"{name}: module state has no tensor for 'fc.bias', "
                                            "which param_shapes lists"):
        import_deepspeed(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_buffer_missing_from_module_is_named(tmp_path):
    src = deepspeed_folder(tmp_path / "src")
    _edit_model_states(src, lambda d: d["module"].pop("scale"))
    with pytest.raises(ManifestError, match=r"module state has no tensor for 'scale', which buffer_names lists"):
        import_deepspeed(src, tmp_path / "out")


def test_a_module_tensor_of_another_shape_is_named(tmp_path):
    src = deepspeed_folder(tmp_path / "src")
    _edit_model_states(src, lambda d: d["module"].__setitem__("fc.bias", torch.ones(5)))
    with pytest.raises(ManifestError, match=r"module tensor 'fc.bias' is torch.float32 \[5\]; .* \[4\]"):
        import_deepspeed(src, tmp_path / "out")


def test_a_weight_no_table_lists_is_refused_naming_it(tmp_path):
    """DeepSpeed's strict ``load_checkpoint`` refuses an unexpected key; the import used to drop it."""
    src = deepspeed_folder(tmp_path / "src", stage=2)
    _edit_model_states(src, lambda d: d["module"].__setitem__("stray.weight", torch.ones(2)))
    with pytest.raises(ManifestError, match=r"mp_rank_00_model_states\.pt: module state holds \['stray.weight'\], "
                                            "which neither param_shapes"):
        import_deepspeed(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_zero1_module_tensor_no_table_lists_is_a_frozen_parameter(tmp_path):
    """ZeRO 1 lists no frozen parameters (DeepSpeed writes frozen_param_shapes from stage 2 on) and keeps
    every parameter whole in ``module``: an unlisted module tensor is imported as a frozen parameter, its
    own name and bytes; an unlisted entry that is not a tensor is refused by name."""
    src = deepspeed_folder(tmp_path / "src", stage=1)
    stray = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7
    quantized = torch.tensor([[-128, 0, 127]], dtype=torch.int8)  # a frozen int8 weight (QLoRA-style)
    _edit_model_states(src, lambda d: d["module"].update({"stray.weight": stray, "base.qweight": quantized}))
    import_deepspeed(src, tmp_path / "out")
    view = ckptkit.open(tmp_path / "out")
    assert {"stray.weight", "base.qweight"} <= set(read_meta(view)["frozen"])
    for name, want in (("stray.weight", stray), ("base.qweight", quantized)):
        got = view[f"model/{name}"].read()
        assert got.dtype == want.dtype and torch.equal(got, want), name
    # the consolidation: floating frozen tensors as fp32, integer ones as they are, in the dict and the file
    from safetensors.torch import load_file

    from ckptkit_converters.deepspeed.fp32 import consolidated_fp32_state_dict, export_fp32

    export_fp32(tmp_path / "out", tmp_path / "model.safetensors")
    for sd in (consolidated_fp32_state_dict(tmp_path / "out"), load_file(str(tmp_path / "model.safetensors"))):
        assert sd["base.qweight"].dtype == torch.int8 and torch.equal(sd["base.qweight"], quantized)
        assert sd["stray.weight"].dtype == torch.float32 and torch.equal(sd["stray.weight"], stray)
    src2 = deepspeed_folder(tmp_path / "src2", stage=1)
    _edit_model_states(src2, lambda d: d["module"].__setitem__("stray.count", 3))
    with pytest.raises(ManifestError, match=r"module state entry 'stray.count' is int; a ZeRO-1 module entry"):
        import_deepspeed(src2, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_tied_aliases_buffers_and_moe_experts_are_not_extra(tmp_path):
    """What DeepSpeed legitimately keeps in ``module`` besides ``param_shapes``: buffers, tied aliases
    (``shared_params``); and a MoE module without its routed experts (they have their own files)."""

    def tie(d):
        d["module"]["head.weight"] = d["module"]["fc.weight"]
        d["shared_params"] = {"head.weight": "fc.weight"}

    src = deepspeed_folder(tmp_path / "src")
    _edit_model_states(src, tie)
    import_deepspeed(src, tmp_path / "out")
    assert read_meta(ckptkit.open(tmp_path / "out"))["shared"] == {"head.weight": "fc.weight"}
    import_deepspeed(deepspeed_folder(tmp_path / "moe", moe=True), tmp_path / "moe_out")


def _zero_states(saved: dict) -> dict:
    return saved["optimizer_state_dict"]["base_optimizer_state"]["state"]


def _expp_states(saved: dict) -> dict:
    return saved["optimizer"]["state"]


FOLDERS = {"zero2": (lambda root: deepspeed_folder(root, dp=2), "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                     _zero_states, "flat group 0"),
           "expp": (expp_folder, "expp_rank_1_mp_rank_00_optim_states.pt", _expp_states, "")}
"""The ZeRO import and the expert-parallel (``expp_rank_*``, no ZeRO) one: the folder, the optimizer file damaged,
where its per-parameter states are, and what the refusal names besides the file."""


@pytest.mark.parametrize("step", [float("nan"), float("inf"), -1.0, 2.5])
@pytest.mark.parametrize("kind", list(FOLDERS))
def test_an_optimizer_step_that_is_not_a_count_is_refused(tmp_path, kind, step):
    """A NaN, infinite, negative or fractional Adam step would resume its bias correction on it (NaN losses
    from the first step): the import refuses it, naming the optimizer file, and writes nothing."""
    build, name, states, what = FOLDERS[kind]
    src = build(tmp_path / "src")
    path = src / TAG / name
    saved = torch.load(path, weights_only=False)
    for st in states(saved).values():
        st["step"] = torch.tensor(step)
    torch.save(saved, path)
    with pytest.raises(ManifestError, match=rf"{re.escape(name)}: {what}.*optimizer step .* is not a count of steps"):
        import_deepspeed(src, tmp_path / "out")
    assert not (tmp_path / "out" / "manifest.json").exists()
    import_deepspeed(build(tmp_path / "ok"), tmp_path / "fine")  # the undamaged folder imports
