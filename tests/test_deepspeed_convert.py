"""Native DeepSpeed checkpoints <-> ckptkit, and consolidated fp32 weights equal to zero_to_fp32's.

A DP-4 run (tests/deepspeed_job.py) saves at step 2 both natively
(``engine.save_checkpoint``) and with ckptkit, then trains on to step 4 as the
reference. Checked here:

* native -> ckptkit (``import_deepspeed``, one process) -> ckptkit's adapter
  loads it at DP 2: same loss right after loading, the reference's next losses;
* ckptkit -> native at DP 2 (``export_deepspeed``) -> DeepSpeed's own
  ``engine.load_checkpoint`` at DP 2 (which refuses DeepSpeed's own DP-4
  checkpoint): same loss, the reference's next losses — also to another stage;
* ``consolidated_fp32_state_dict`` equals DeepSpeed's
  ``get_fp32_state_dict_from_zero_checkpoint`` tensor for tensor, bit for bit,
  from the ckptkit checkpoint and from the imported native one.
"""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")

import torch

from ckptkit.offline.view import TensorView
from ckptkit_converters.deepspeed.exporter import export_deepspeed
from ckptkit_converters.deepspeed.fp32 import consolidated_fp32_state_dict, export_fp32
from ckptkit_converters.deepspeed.importer import import_deepspeed
from ckptkit_converters.deepspeed.files import find_files
from tests import deepspeed_job as job
from tests.test_deepspeed import SAVE_STEP, STEPS, assert_same_state, check_same_run, saved_runs

CASES = [(2, "bf16"), (3, "fp32"), (1, "fp32"), (3, "bf16")]


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory):
    return saved_runs(worlds, tmp_path_factory, "dsconv", CASES, universal=True)


def universal_reference(worlds, cache: dict, folder: str, case: tuple[int, str], model: str = "mlp") -> dict:
    """DeepSpeed's own resume at DP 2 of its universal checkpoint of the saving run (its saving stage): the
    run every DP-2 resume below is compared with, bit for bit. A resume at DP 2 does the same arithmetic at
    any ZeRO stage (tests/test_deepspeed.py: the test config runs every stage's linears through F.linear, and
    a DP-2 gradient is one addition scaled by 1/2), where the saving run's DP-4 losses would differ by the
    all-reduce's order (docs/testing.md)."""
    if (folder, case) not in cache:
        cache[(folder, case)] = worlds.run(2, job.resume_universal, case[0], case[1], f"{folder}/universal",
                                           from_step=SAVE_STEP, steps=STEPS, model=model)[0]
    return cache[(folder, case)]


_REFERENCES: dict = {}


def zero_to_fp32(folder: str) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(folder)


@pytest.mark.parametrize("case", CASES, ids=[f"z{s}-{d}" for s, d in CASES])
def test_consolidated_fp32_equals_zero_to_fp32(saved, tmp_path, case):
    folder, _ = saved[case]
    theirs = zero_to_fp32(f"{folder}/native")
    imported = str(tmp_path / "imported")
    import_deepspeed(f"{folder}/native", imported)
    for ours in (consolidated_fp32_state_dict(f"{folder}/ckptkit"), consolidated_fp32_state_dict(imported)):
        assert list(ours) == list(theirs) or sorted(ours) == sorted(theirs)
        for k, v in theirs.items():
            assert ours[k].dtype == v.dtype and torch.equal(ours[k], v), k
    from safetensors.torch import load_file

    export_fp32(f"{folder}/ckptkit", tmp_path / "model.safetensors")
    written = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(written[k], v) for k, v in theirs.items()) and set(written) == set(theirs)
    # streamed under a budget smaller than the largest tensor: every read within it, the same file's tensors
    largest = max(v.numel() * v.element_size() for v in theirs.values())
    budget = largest // 3
    reads: list[int] = []
    real_read = TensorView.read

    def spied(self, index=Ellipsis):
        out = real_read(self, index)
        cast = out.is_floating_point() and out.dtype != torch.float32
        reads.append(out.numel() * (out.element_size() + (4 if cast else 0)))  # the run and its fp32 copy
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TensorView, "read", spied)
        export_fp32(imported, tmp_path / "budget.safetensors", max_memory=budget)
    assert reads and max(reads) <= budget < largest
    streamed = load_file(str(tmp_path / "budget.safetensors"))
    assert set(streamed) == set(theirs) and all(torch.equal(streamed[k], v) for k, v in theirs.items())
    assert not list(tmp_path.glob("*.partial-*"))


@pytest.mark.parametrize("case", CASES, ids=[f"z{s}-{d}" for s, d in CASES])
def test_native_import_then_resume_at_dp2(worlds, saved, tmp_path, case):
    folder, _ = saved[case]
    dest = str(tmp_path / "imported")
    result = import_deepspeed(f"{folder}/native", dest)
    assert result.tensors > 0 and find_files(f"{folder}/native").dp == 4
    got = worlds.run(2, job.resume, case[0], case[1], dest, from_step=SAVE_STEP, steps=STEPS)[0]
    check_same_run(got, universal_reference(worlds, _REFERENCES, folder, case))


@pytest.mark.parametrize("case,target_stage", [(CASES[0], 2), (CASES[1], 3), (CASES[2], 3), (CASES[3], 1)],
                         ids=["z2-bf16-to-z2", "z3-fp32-to-z3", "z1-fp32-to-z3", "z3-bf16-to-z1"])
@pytest.mark.parametrize("source", ["ckptkit", "native"])
def test_export_native_at_dp2_loads_in_deepspeed(worlds, saved, tmp_path, case, target_stage, source):
    """From the adapter's checkpoint, and the full chain native DP 4 -> ckptkit -> native DP 2."""
    folder, _ = saved[case]
    src = f"{folder}/ckptkit"
    if source == "native":
        src = str(tmp_path / "imported")
        import_deepspeed(f"{folder}/native", src)
    dest = str(tmp_path / "native_dp2")
    export_deepspeed(src, dest, dp=2, zero_stage=target_stage)
    got = worlds.run(2, job.resume_native, target_stage, case[1], dest, from_step=SAVE_STEP, steps=STEPS)[0]
    check_same_run(got, universal_reference(worlds, _REFERENCES, folder, case))


def test_native_checkpoint_at_other_dp_is_refused_by_deepspeed(worlds, saved):
    """The baseline this replaces: DeepSpeed cannot load its own DP-4 checkpoint at DP 2."""
    folder, _ = saved[CASES[1]]
    with pytest.raises(Exception, match="Automatic adjustment"):
        worlds.run(2, job.resume_native, CASES[1][0], CASES[1][1], f"{folder}/native", from_step=SAVE_STEP,
                   steps=STEPS)


def test_cli_convert_native_in_and_out(worlds, saved, tmp_path):
    """``ckptkit convert`` detects a native DeepSpeed folder (import) and writes one (--format deepspeed)."""
    from click.testing import CliRunner

    from ckptkit.cli.main import cli

    folder, _ = saved[CASES[1]]
    imported, native = str(tmp_path / "imported"), str(tmp_path / "native_dp2")
    res = CliRunner().invoke(cli, ["convert", f"{folder}/native", imported], catch_exceptions=False)
    assert res.exit_code == 0 and "ckptkit" in res.output
    res = CliRunner().invoke(cli, ["convert", imported, native, "--format", "deepspeed", "--dp", "2"])
    assert res.exit_code == 0, res.output
    got = worlds.run(2, job.resume_native, CASES[1][0], CASES[1][1], native, from_step=SAVE_STEP, steps=STEPS)[0]
    check_same_run(got, universal_reference(worlds, _REFERENCES, folder, CASES[1]))
    res = CliRunner().invoke(cli, ["convert", imported, str(tmp_path / "x"), "--format", "deepspeed"])
    assert res.exit_code != 0 and "--dp" in res.output


# ---- a tiny transformer LM with its output head tied to the embedding (one parameter, two names)
LM_CASES = [(2, "bf16"), (3, "fp32")]


@pytest.fixture(scope="module")
def saved_lm(worlds, tmp_path_factory):
    out = {}
    for stage, dtype in LM_CASES:
        folder = str(tmp_path_factory.mktemp(f"dslm_z{stage}_{dtype}"))
        out[(stage, dtype)] = (folder, worlds.run(4, job.train_and_save, stage, dtype, folder, save_step=SAVE_STEP,
                                                  steps=STEPS, model="lm", universal=True)[0])
    return out


@pytest.mark.parametrize("case", LM_CASES, ids=[f"z{s}-{d}" for s, d in LM_CASES])
def test_tied_lm_fp32_resize_and_native_export(worlds, saved_lm, tmp_path, case):
    folder, _ = saved_lm[case]
    theirs = zero_to_fp32(f"{folder}/native")
    imported = str(tmp_path / "imported")
    import_deepspeed(f"{folder}/native", imported)
    assert "head.weight" in theirs
    for ours in (consolidated_fp32_state_dict(f"{folder}/ckptkit"), consolidated_fp32_state_dict(imported)):
        assert sorted(ours) == sorted(theirs)
        assert all(torch.equal(ours[k], v) for k, v in theirs.items())
    other = 3 if case[0] < 3 else 1
    resaved = str(tmp_path / "resaved")
    got = worlds.run(2, job.resume, other, case[1], f"{folder}/ckptkit", from_step=SAVE_STEP, steps=STEPS,
                     model="lm", resave=resaved)[0]
    assert_same_state(f"{folder}/ckptkit", resaved)
    want = universal_reference(worlds, _REFERENCES, folder, case, model="lm")
    check_same_run(got, want)
    dest = str(tmp_path / "native_dp2")
    export_deepspeed(f"{folder}/ckptkit", dest, dp=2)
    got = worlds.run(2, job.resume_native, case[0], case[1], dest, from_step=SAVE_STEP, steps=STEPS, model="lm")[0]
    check_same_run(got, want)
