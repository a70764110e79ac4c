"""Which of a framework's own checkpoint folders a resume counts as newer (ckptkit/adapters/foreign_steps.py).

The distributed refusals are tested through each adapter (tests/test_torchtitan.py, test_deepspeed.py,
test_megatron_convert.py); here the naming rules, on a real local folder: Megatron's ``iter_N`` and its
``release`` (iteration 0), DeepSpeed's ``global_stepN``, DCP's ``step-N`` only with its ``.metadata``."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


FOREIGN_NAMES = {"dcp": (DCP, "step-{}"), "deepspeed": (DEEPSPEED, "global_step{}"), "megatron": (MEGATRON, "iter_{:07d}")}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(sorted(FOREIGN_NAMES)), ours=st.sets(st.integers(1, 12), min_size=1, max_size=5),
       data=st.data())
def test_a_resume_never_falls_back_past_a_foreign_checkpoint(tmp_path_factory, kind, ours, data):
    """The whole class, through the one resume every framework checkpointer makes (``restore_newest``):
    random ckptkit steps, some damaged, and a framework's own checkpoints at random steps in the same
    folder. Whatever the mix, the resume returns the newest ckptkit step that loads, and only if no
    foreign checkpoint is newer than it; otherwise every foreign one it would go back past is refused by
    name. Until 2026-12-06 only the newest ckptkit step was compared with them: a damaged newest step
    made the fallback go back past a foreign checkpoint below it without a word."""
    from ckptkit import CheckpointManager, CorruptCheckpointError, ForeignCheckpointError, load
    from ckptkit.adapters.foreign_steps import restore_newest
    from tests.damage import flip_byte

    spec, pattern = FOREIGN_NAMES[kind]
    root = tmp_path_factory.mktemp("run")
    damaged = data.draw(st.sets(st.sampled_from(sorted(ours))), label="damaged")
    foreign = data.draw(st.sets(st.integers(0, 13), max_size=3), label="foreign")
    mgr = CheckpointManager(str(root))
    for step in sorted(ours):
        mgr.save(step, {"w": torch.full((8,), float(step))})
    mgr.wait()
    for step in damaged:
        flip_byte(str(next((root / f"step-{step:07d}" / "data").iterdir())), where=0.0)
    for step in foreign:
        folder = root / pattern.format(step)
        folder.mkdir()
        if spec.marker:
            (folder / spec.marker).write_bytes(b"")
    got: list[float] = []

    def load_into(url: str) -> str:
        state = {"w": torch.zeros(8)}
        load(state, url)
        got.append(float(state["w"][0]))
        return url

    good = [s for s in ours if s not in damaged]
    newest_good = max(good, default=None)
    floor = max(foreign, default=-1)
    expect_ok = newest_good is not None and newest_good >= floor
    try:
        out = restore_newest(CheckpointManager(str(root)), spec, load_into)
    except ForeignCheckpointError as exc:
        assert not expect_ok and foreign, (ours, damaged, foreign, str(exc))
        assert f"{root}/{pattern.format(floor)}:" in str(exc), str(exc)
    except CorruptCheckpointError as exc:  # every step damaged, none foreign: the state is partly overwritten
        assert not foreign and not good, (ours, damaged, str(exc))
    else:
        assert expect_ok, (ours, damaged, foreign, out)
        assert out is not None and out[0] == newest_good and got[-1] == float(newest_good)
    mgr.close()
