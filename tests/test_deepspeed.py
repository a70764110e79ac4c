"""DeepSpeed ZeRO engines on ckptkit: save at DP 4, resume at DP 4, 2 and 1 and at another ZeRO stage.

The jobs (tests/deepspeed_job.py) train a small MLP with odd sizes through a
real ``deepspeed.initialize`` engine in gloo worlds. Each saving run is also
the uninterrupted reference: it saves asynchronously with ckptkit at step 2
and keeps training to step 4. A resume builds a fresh engine (another DP size
and/or ZeRO stage), loads step 2 and must reproduce the LR, counters and client
state, and a reference's held-out loss right after loading, its losses at
steps 3 and 4 and its final loss, all bit for bit (==, never a tolerance):

* at the saved DP size and stage the reference is the saving run itself;
* at another DP size it is DeepSpeed's own resume there: its native save
  converted by ds_to_universal and loaded as a universal checkpoint
  (tests/deepspeed_job.py). Both runs do the same arithmetic (a DP size
  changes the gradient all-reduce's summation order, so the saving run's
  losses would be the wrong yardstick);
* at another stage (DP 2), DeepSpeed cannot load across stages, so the
  reference is its universal resume at the saving stage and DP 2. With
  ZeRO-3's own linear function off (deepspeed_job.config) every stage runs the
  same kernels, and at DP 2 each gradient element is reduced as one addition
  of two terms (order-free) and scaled by 1/2 (exact): the two stages do the
  same arithmetic, which the comparison itself checks.

test_the_reference_comparison_sees_a_lost_state shows the comparison fails
for a resume with one tensor perturbed or with a fresh optimizer.
"""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")

import torch

from tests import deepspeed_job as job

SAVE_STEP, STEPS = 2, 4
CASES = [(1, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16"), (1, "bf16"), (2, "fp32")]
OTHER_STAGE = {1: 3, 2: 3, 3: 1}


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory):
    out = {}
    for stage, dtype in CASES:
        folder = str(tmp_path_factory.mktemp(f"ds_z{stage}_{dtype}"))
        # stage 2 bf16 uses DeepSpeed's config optimizer (torch_adam), the others a torch AdamW passed in
        cfg_opt = (stage, dtype) == (2, "bf16")
        ref = worlds.run(4, job.train_and_save, stage, dtype, folder, save_step=SAVE_STEP, steps=STEPS,
                         config_optimizer=cfg_opt, universal=True)[0]
        out[(stage, dtype)] = (folder, ref, cfg_opt)
    return out


@pytest.fixture(scope="module")
def reference(worlds, saved):
    """DeepSpeed's own universal resume of saved ``case`` at DP ``dp`` (its saving stage), once per setting."""
    cache: dict = {}

    def get(case: tuple[int, str], dp: int, gas: int = 1) -> dict:
        if (case, dp, gas) not in cache:
            folder, _, cfg_opt = saved[case]
            cache[(case, dp, gas)] = worlds.run(dp, job.resume_universal, case[0], case[1], f"{folder}/universal",
                                                from_step=SAVE_STEP, steps=STEPS, config_optimizer=cfg_opt,
                                                gas=gas)[0]
        return cache[(case, dp, gas)]

    return get


def saved_runs(worlds, tmp_path_factory, prefix: str, cases, **kwargs) -> dict:
    """{case: (folder, the saving run's result)}: one saving run (tests/deepspeed_job.train_and_save) at DP 4
    per (stage, dtype) case, each in its own folder."""
    out = {}
    for stage, dtype in cases:
        folder = str(tmp_path_factory.mktemp(f"{prefix}_z{stage}_{dtype}"))
        out[(stage, dtype)] = (folder, worlds.run(4, job.train_and_save, stage, dtype, folder, save_step=SAVE_STEP,
                                                  steps=STEPS, **kwargs)[0])
    return out


def check_same_run(got: dict, want: dict) -> None:
    """A resume at step 2 against a run that does the same arithmetic: equal to the last bit."""
    assert got["lr"] == want["lr"]
    assert got["client"] == {"epoch": 7, "note": "x"}
    assert (got["global_steps"], got["global_samples"]) == (SAVE_STEP, SAVE_STEP * job.GLOBAL_BATCH)
    assert got["eval"] == want["eval"]
    steps = range(SAVE_STEP + 1, STEPS + 1)
    assert [got["losses"][s] for s in steps] == [want["losses"][s] for s in steps]
    assert got["final_eval"] == want["final_eval"]


@pytest.mark.parametrize("case", CASES, ids=[f"z{s}-{d}" for s, d in CASES])
def test_async_save_committed_and_same_dp_resume_is_exact(worlds, saved, case):
    folder, ref, cfg_opt = saved[case]
    assert ref["committed"]
    got = worlds.run(4, job.resume, case[0], case[1], f"{folder}/ckptkit", from_step=SAVE_STEP, steps=STEPS,
                     config_optimizer=cfg_opt)[0]
    check_same_run(got, ref)


@pytest.mark.parametrize("dp", [2, 1])
@pytest.mark.parametrize("case", CASES[:4], ids=[f"z{s}-{d}" for s, d in CASES[:4]])
def test_resume_at_smaller_dp(worlds, saved, reference, case, dp):
    folder, _, cfg_opt = saved[case]
    got = worlds.run(dp, job.resume, case[0], case[1], f"{folder}/ckptkit", from_step=SAVE_STEP, steps=STEPS,
                     config_optimizer=cfg_opt)[0]
    want = reference(case, dp)
    assert want["client"] == {"epoch": 7, "note": "x"} and want["global_steps"] == SAVE_STEP  # DeepSpeed's own load
    check_same_run(got, want)


def assert_same_state(saved: str, resaved: str) -> None:
    """Every model-space tensor (fp32 masters, moments, weights, buffers) of two checkpoints, bit for bit."""
    import ckptkit

    a, b = ckptkit.open(saved), ckptkit.open(resaved)
    assert sorted(a.keys()) == sorted(b.keys()) and a.keys()
    for key in a.keys():
        x, y = a[key].read(), b[key].read()
        assert x.dtype == y.dtype and torch.equal(x, y), key


@pytest.mark.parametrize("case", CASES, ids=[f"z{s}-{d}" for s, d in CASES])
def test_resume_at_another_stage_and_dp(worlds, saved, reference, case, tmp_path):
    """ZeRO 1/2 -> 3 and 3 -> 1 at DP 2 (DeepSpeed's universal checkpoints cannot do this): the loaded
    engine's whole state, saved again, equals the checkpoint bit for bit; training continues as DeepSpeed's
    own resume at the saving stage and DP 2 does (the same arithmetic: see the module docstring)."""
    folder, _, cfg_opt = saved[case]
    stage = OTHER_STAGE[case[0]]
    resaved = str(tmp_path / "resaved")
    got = worlds.run(2, job.resume, stage, case[1], f"{folder}/ckptkit", from_step=SAVE_STEP, steps=STEPS,
                     config_optimizer=cfg_opt, resave=resaved)[0]
    assert_same_state(f"{folder}/ckptkit", resaved)
    check_same_run(got, reference(case, 2))


@pytest.mark.parametrize("stage,dtype,extra", [
    (1, "fp32", {}), (2, "bf16", {}), (3, "bf16", {}),
    (2, "fp32", {"round_robin_gradients": True}),
    (1, "bf16", {"parameter_alignment": True}),
], ids=["z1", "z2-bf16", "z3-bf16", "z2-round-robin", "z1-param-alignment"])
def test_partition_facts_match_live_engines(worlds, stage, dtype, extra):
    """ckptkit/layout/zero_partition.py against DeepSpeed's own engines at DP 4, rank by rank."""
    for rank, got in enumerate(worlds.run(4, job.layout_facts, stage, dtype, extra)):
        assert got["ours"] == got["theirs"], rank


def test_checkpointer_periodic_saves_retention_and_resize(worlds, tmp_path):
    """DeepSpeedCheckpointer: async saves every 2 steps, keep 2; a DP-2 ZeRO-3 job resumes the newest and
    continues as DeepSpeed's own universal resume of the same state at DP 2 (ZeRO 2: the same arithmetic) does;
    a DP-4 job then resumes the DP-2 job's newest and evaluates its weights as that job did (the same
    kernels at every stage, and the eval is not split over DP)."""
    import os

    ref = worlds.run(4, job.checkpointer_run, 2, "fp32", str(tmp_path / "ref"), steps=8, resume=False)[0]
    root, theirs = str(tmp_path / "run"), str(tmp_path / "deepspeed")
    first = worlds.run(4, job.checkpointer_run, 2, "fp32", root, steps=6, resume=False, universal=theirs)[0]
    assert first["losses"] == {s: ref["losses"][s] for s in range(1, 7)}
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-0000004", "step-0000006"]
    got = worlds.run(2, job.checkpointer_run, 3, "fp32", root, steps=8, resume=True)[0]
    assert got["client"] == {"last": 6} and got["start"] == 6
    want = worlds.run(2, job.resume_universal, 2, "fp32", f"{theirs}/universal", from_step=6, steps=8)[0]
    assert want["client"] == {"last": 6} and want["global_steps"] == 6
    assert got["losses"] == want["losses"] and got["eval"] == want["final_eval"]
    cont = worlds.run(4, job.checkpointer_run, 2, "fp32", root, steps=8, resume=True)[0]
    assert cont["start"] == 8 and cont["client"] == {"last": 8} and cont["eval"] == got["eval"]


def test_checkpointer_resumes_the_newest_step_that_loads_when_the_newest_is_damaged(worlds, tmp_path):
    """The newest checkpoint's data fails its checksums: the restart skips it (naming it), resumes the
    step before and trains on as the first job did, saving the damaged step's number again. It used to
    load the newest step directly and fail every restart until a human moved it aside; and a save of
    that step again was refused while the damaged folder stayed committed."""
    from tests import ckpt_files
    from tests.damage import flip_byte

    root = str(tmp_path / "run")
    first = worlds.run(4, job.checkpointer_run, 2, "fp32", root, steps=6, resume=False)[0]
    for rank in range(4):
        flip_byte(str(ckpt_files.data_object(f"{root}/step-0000006", rank)), where=0.0)  # a piece starts there
    got = worlds.run(4, job.checkpointer_run, 2, "fp32", root, steps=6, resume=True)[0]
    assert got["start"] == 4 and got["client"] == {"last": 4} and got["skipped"] == ["step-0000006"]
    assert got["losses"] == {5: first["losses"][5], 6: first["losses"][6]}
    again = worlds.run(4, job.checkpointer_restore, 2, "fp32", root)[0]  # the step saved again loads
    assert again["error"] is None and again["client"] == {"last": 6} and again["step"] == 6


@pytest.mark.parametrize("case", [(2, "fp32"), (3, "bf16")], ids=["z2-fp32", "z3-bf16"])
def test_resume_at_dp2_with_gradient_accumulation(worlds, saved, reference, case):
    """Same global batch at DP 2 through 2 accumulation micro-steps: the accumulation boundary
    (DeepSpeed's micro-step counter) is consistent after loading."""
    folder, _, cfg_opt = saved[case]
    got = worlds.run(2, job.resume, case[0], case[1], f"{folder}/ckptkit", from_step=SAVE_STEP, steps=STEPS,
                     config_optimizer=cfg_opt, gas=2)[0]
    check_same_run(got, reference(case, 2, gas=2))
    assert got["micro_steps"] == STEPS * 2


def test_unsupported_optimizer_wrapper_is_refused(worlds, tmp_path):
    msg = worlds.run(2, job.refused_bf16_optimizer, str(tmp_path / "x"))[0]
    assert "BF16_Optimizer" in msg


def test_the_reference_comparison_sees_a_lost_state(worlds, saved, reference):
    """Negative controls, in one world call: the comparison with DeepSpeed's own resume at DP 2 fails for a
    resume whose fc2.weight master is scaled by 1.001 after the load and for one that did not load the
    optimizer state (a fresh Adam: the first forward agrees, the steps after it do not)."""
    case = (1, "fp32")
    want = reference(case, 2)
    got = worlds.run(2, job.controls, *case, f"{saved[case][0]}/ckptkit", from_step=SAVE_STEP, steps=STEPS)[0]
    for name in ("perturbed", "fresh_optimizer"):
        with pytest.raises(AssertionError):
            check_same_run(got[name], want)
    assert got["perturbed"]["eval"] != want["eval"]
    fresh = got["fresh_optimizer"]
    assert (fresh["eval"], fresh["losses"][SAVE_STEP + 1]) == (want["eval"], want["losses"][SAVE_STEP + 1])
    assert fresh["losses"][STEPS] != want["losses"][STEPS] and fresh["final_eval"] != want["final_eval"]


def test_checkpointer_never_resumes_past_a_newer_native_checkpoint(worlds, saved, tmp_path):
    """A job that saved natively (engine.save_checkpoint) into the folder it later gives DeepSpeedCheckpointer:
    a native tag newer than ckptkit's newest step is refused on every rank, naming it and the way on (it
    resumed the older ckptkit step, or started from scratch, before 2026-12-05); an older one changes nothing."""
    import os
    import shutil

    folder, _, _ = saved[(2, "fp32")]
    root = str(tmp_path / "run")
    worlds.run(2, job.checkpointer_run, 2, "fp32", root, steps=4, resume=False)  # ckptkit steps 2 and 4
    shutil.copytree(f"{folder}/native/global_step{SAVE_STEP}", os.path.join(root, "global_step6"))
    outs = worlds.run(2, job.checkpointer_restore, 2, "fp32", root)
    assert all(o["error"] and o["error"].startswith("ForeignCheckpointError") for o in outs), outs
    assert f"{root}/global_step6: a DeepSpeed checkpoint" in outs[0]["error"]
    assert "newest ckptkit checkpoint (step 4)" in outs[0]["error"] and "--from deepspeed --tag global_step6" \
        in outs[0]["error"]
    os.rename(os.path.join(root, "global_step6"), os.path.join(root, "global_step3"))
    got = worlds.run(2, job.checkpointer_restore, 2, "fp32", root)[0]
    assert got["error"] is None and got["step"] == 4 and got["client"] == {"last": 4}
    # the newest ckptkit step damaged: falling back to step 2 would go back past global_step3 (it did, silently,
    # until 2026-12-06); every rank refuses, naming both
    from tests.damage import flip_byte

    data = os.path.join(root, "step-0000004", "data")
    for name in os.listdir(data):
        flip_byte(os.path.join(data, name), where=0.0)
    outs = worlds.run(2, job.checkpointer_restore, 2, "fp32", root)
    assert all(o["error"] and o["error"].startswith("ForeignCheckpointError") for o in outs), outs
    assert f"{root}/global_step3: a DeepSpeed checkpoint" in outs[0]["error"] and "step-0000004" in outs[0]["error"]
    only = str(tmp_path / "native_only")
    shutil.copytree(f"{folder}/native", only)  # DeepSpeed's own folder: 'latest' and global_step2
    got = worlds.run(2, job.checkpointer_restore, 2, "fp32", only)[0]
    assert got["error"].startswith("ForeignCheckpointError") and "newer than any ckptkit checkpoint" in got["error"]
