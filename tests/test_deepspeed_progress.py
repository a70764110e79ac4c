"""DeepSpeed conversions report progress in bytes, both ways, with the total known up front.

The conformance suite (tests/test_format_conformance.py) checks the sample's ZeRO-2 round trip; here
every path: ZeRO 1/2/3 and DeepSpeed-MoE imports, the stage-0 MoE (``expp_rank_*``) import, and
exports at each ZeRO stage, DP size and EP size, with buffers and a tied alias. An export's total is
computed from its plan before any file is written, so it is checked against what the written files
hold: the bytes of the distinct tensors in each, read back through the converters' own loader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptkit_converters.deepspeed import files as fmt
from ckptkit_converters.deepspeed.importer import import_deepspeed
from tests.test_import_trust_folders import deepspeed_folder, expp_folder

Calls = list[tuple[int, int]]


def _well_formed(calls: Calls) -> int:
    """The total of a well-formed progress record: done never goes back, never passes the total (one
    total throughout), and ends at done == total > 0."""
    assert calls, "progress was never called"
    dones = [d for d, _ in calls]
    assert dones == sorted(dones), dones
    assert len({t for _, t in calls}) == 1, calls
    done, total = calls[-1]
    assert done == total > 0, calls
    return total


def _stored_bytes(obj: Any, seen: set[tuple[int, int, tuple[int, ...], torch.dtype]]) -> int:
    """Bytes of the distinct tensors in a loaded file (a tied alias loads as a second tensor on the
    same storage, and is counted once, as it is stored once)."""
    if isinstance(obj, torch.Tensor):
        ident = (obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape), obj.dtype)
        if obj.numel() == 0 or ident in seen:
            return 0
        seen.add(ident)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_stored_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_stored_bytes(v, seen) for v in obj)
    return 0


def _folder_bytes(folder: Path) -> int:
    return sum(_stored_bytes(fmt.load_file(str(p)), set()) for p in sorted(folder.rglob("*.pt")))


def _tie(src: Path) -> None:
    """Give the ZeRO-1/2 folder ``src`` a tied alias, as DeepSpeed saves one (two names, one tensor)."""
    path = src / "global_step3" / fmt.MODEL_STATES_12
    data = torch.load(path, weights_only=True)  # the test's own file
    data["module"]["head.weight"] = data["module"]["fc.weight"]
    data["shared_params"] = {"head.weight": "fc.weight"}
    torch.save(data, path)


@pytest.mark.parametrize("make", [
    lambda p: deepspeed_folder(p, stage=1), lambda p: deepspeed_folder(p, stage=2, dp=3),
    lambda p: deepspeed_folder(p, stage=3), lambda p: deepspeed_folder(p, moe=True), expp_folder],
    ids=["z1", "z2-dp3", "z3", "moe", "expp"])
def test_import_reports_every_byte_it_writes(tmp_path: Path, make) -> None:
    calls: Calls = []
    result = import_deepspeed(make(tmp_path / "src"), tmp_path / "out",
                              progress=lambda done, total: calls.append((done, total)))
    assert _well_formed(calls) == result.nbytes


@pytest.mark.parametrize("stage,dp,target", [(2, 2, 1), (2, 2, 2), (1, 2, 3), (3, 2, 3), (3, 2, 2), (2, 2, 4)])
def test_export_total_is_what_the_native_files_hold(tmp_path: Path, stage: int, dp: int, target: int) -> None:
    pytest.importorskip("deepspeed")
    from ckptkit_converters.deepspeed.exporter import export_deepspeed

    src = deepspeed_folder(tmp_path / "src", stage=stage, dp=dp)
    if stage < 3:
        _tie(src)
    import_deepspeed(src, tmp_path / "ckpt")
    for zero_stage in (1, 2, 3):
        calls: Calls = []
        dest = tmp_path / f"native_z{zero_stage}"
        export_deepspeed(tmp_path / "ckpt", dest, dp=target, zero_stage=zero_stage,
                         progress=lambda done, total: calls.append((done, total)))
        assert _well_formed(calls) == _folder_bytes(dest), (zero_stage, calls)
        assert len(calls) == len(list(dest.rglob("*.pt")))  # one report per file written


@pytest.mark.parametrize("dp,ep", [(2, 2), (4, 2), (2, 1)])
def test_moe_export_counts_the_expert_files(tmp_path: Path, dp: int, ep: int) -> None:
    pytest.importorskip("deepspeed")
    from ckptkit_converters.deepspeed.exporter import export_deepspeed

    import_deepspeed(deepspeed_folder(tmp_path / "src", moe=True), tmp_path / "ckpt")
    calls: Calls = []
    dest = tmp_path / "native"
    export_deepspeed(tmp_path / "ckpt", dest, dp=dp, ep=ep, progress=lambda done, total: calls.append((done, total)))
    assert list(dest.rglob("layer_0_expert_*_mp_rank_00_model_states.pt"))
    assert _well_formed(calls) == _folder_bytes(dest)
