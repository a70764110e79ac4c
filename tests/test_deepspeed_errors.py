"""DeepSpeed adapter and converters: refusals, in one process (no engine, no world needed)."""

from __future__ import annotations

import os

import pytest
import torch

import ckptkit
from ckptkit.adapters import deepspeed as ds_ckpt
from ckptkit.errors import CheckpointNotFoundError, ManifestError, MissingKeysError
from ckptkit_converters.deepspeed.convert import import_deepspeed
from ckptkit_converters.deepspeed.files import find_files, is_deepspeed_checkpoint, load_file
from ckptkit_converters.common.safe_unpickle import UnsafeCheckpointError


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
    with pytest.raises(ManifestError, match=r"DP ranks \[1\], expected 0..0"):
        find_files(folder)
