"""Which of a framework's own checkpoint folders a resume counts as newer (ckptkit/adapters/foreign_steps.py).

The distributed refusals are tested through each adapter (tests/test_torchtitan.py, test_deepspeed.py,
test_megatron_convert.py); here the naming rules, on a real local folder: Megatron's ``iter_N`` and its
``release`` (iteration 0), DeepSpeed's ``global_stepN``, DCP's ``step-N`` only with its ``.metadata``."""

from __future__ import annotations

import os

import pytest

from ckptkit.adapters.foreign_steps import DCP, DEEPSPEED, MEGATRON, steps_after
from ckptkit.storage.local import LocalStore


@pytest.fixture
def folder(tmp_path):
    for name in ("iter_0000005", "iter_0000012", "release", "iter_x", "iteration_7", "global_step9",
                 "global_step", "step-3", "step-8", "release2"):
        os.makedirs(tmp_path / name)
    (tmp_path / "step-8" / ".metadata").write_bytes(b"")
    return LocalStore(str(tmp_path))


@pytest.mark.parametrize("latest, want", [(None, ["release", "iter_0000005", "iter_0000012"]),
                                          (0, ["iter_0000005", "iter_0000012"]), (5, ["iter_0000012"]),
                                          (12, [])])
def test_megatron_iterations_and_its_release_folder(folder, latest, want):
    assert steps_after(folder, MEGATRON, latest) == want


def test_deepspeed_tags_and_dcp_steps_with_their_metadata(folder):
    assert steps_after(folder, DEEPSPEED, None) == ["global_step9"]
    assert steps_after(folder, DEEPSPEED, 9) == []
    assert steps_after(folder, DCP, None) == ["step-8"]  # step-3 has no .metadata: ckptkit's own (uncommitted)
    assert steps_after(folder, DCP, 8) == []
