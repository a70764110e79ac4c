"""DeepSpeed ZeRO engines on ckptkit: save at DP 4, resume at DP 4, 2 and 1 and at another ZeRO stage.

The jobs (tests/deepspeed_job.py) train a small MLP with odd sizes through a
real ``deepspeed.initialize`` engine in gloo worlds. Each saving run is also
the uninterrupted reference: it saves asynchronously with ckptkit at step 2
and keeps training to step 4. A resume builds a fresh engine (another DP size
and/or ZeRO stage), loads step 2 and must reproduce: the held-out loss right
after loading exactly (the weights are the same bits), the LR, counters and
client state, and the reference's losses at steps 3 and 4 — bit for bit at
the saved DP size, and within a stated tolerance where the DP size changes
the gradient all-reduce's summation order (fp32: 1e-5 relative; bf16, whose
weights round to 8 bits of mantissa after each step: 1e-3 relative).
"""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")

import torch

from tests import deepspeed_job as job

SAVE_STEP, STEPS = 2, 4
TOL = {"fp32": 1e-5, "bf16": 1e-3}
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
                         config_optimizer=cfg_opt)[0]
        out[(stage, dtype)] = (folder, ref, cfg_opt)
    return out


def check_resumed(ref: dict, got: dict, dtype: str, *, exact: bool, same_kernels: bool = True) -> None:
    """``same_kernels``: the loaded engine computes its forward like the saving one (ZeRO 1/2 vs 3 differ:
    ZeRO-3 runs linear layers through its own autograd function), so the same weights give the same loss."""
    if same_kernels:
        assert got["eval"] == ref["eval"]  # the loaded weights are the saved ones, bit for bit
    else:
        assert got["eval"] == pytest.approx(ref["eval"], rel=TOL[dtype])
    assert got["lr"] == ref["lr"]
    assert got["client"] == {"epoch": 7, "note": "x"}
    assert (got["global_steps"], got["global_samples"]) == (SAVE_STEP, SAVE_STEP * job.GLOBAL_BATCH)
    steps = range(SAVE_STEP + 1, STEPS + 1)
    if exact:
        assert [got["losses"][s] for s in steps] == [ref["losses"][s] for s in steps]
        assert got["final_eval"] == ref["final_eval"]
    else:
        for s in steps:
            assert got["losses"][s] == pytest.approx(ref["losses"][s], rel=TOL[dtype]), s
        assert got["final_eval"] == pytest.approx(ref["final_eval"], rel=TOL[dtype])


@pytest.mark.parametrize("case", CASES, ids=[f"z{s}-{d}" for s, d in CASES])
def test_async_save_committed_and_same_dp_resume_is_exact(worlds, saved, case):
    folder, ref, cfg_opt = saved[case]
    assert ref["committed"]
    got = worlds.run(4, job.resume, case[0], case[1], f"{folder}/ckptkit", from_step=SAVE_STEP, steps=STEPS,
                     config_optimizer=cfg_opt)[0]
    check_resumed(ref, got, case[1], exact=True)


@pytest.mark.parametrize("dp", [2, 1])
@pytest.mark.parametrize("case", CASES[:4], ids=[f"z{s}-{d}" for s, d in CASES[:4]])
def test_resume_at_smaller_dp(worlds, saved, case, dp):
    folder, ref, cfg_opt = saved[case]
    got = worlds.run(dp, job.resume, case[0], case[1], f"{folder}/ckptkit", from_step=SAVE_STEP, steps=STEPS,
                     config_optimizer=cfg_opt)[0]
    check_resumed(ref, got, case[1], exact=dp == 4)


def assert_same_state(saved: str, resaved: str) -> None:
    """Every model-space tensor (fp32 masters, moments, weights, buffers) of two checkpoints, bit for bit."""
    import ckptkit

    a, b = ckptkit.open(saved), ckptkit.open(resaved)
    assert sorted(a.keys()) == sorted(b.keys()) and a.keys()
    for key in a.keys():
        x, y = a[key].read(), b[key].read()
        assert x.dtype == y.dtype and torch.equal(x, y), key


@pytest.mark.parametrize("case", CASES, ids=[f"z{s}-{d}" for s, d in CASES])
def test_resume_at_another_stage_and_dp(worlds, saved, case, tmp_path):
    """ZeRO 1/2 -> 3 and 3 -> 1 at DP 2 (DeepSpeed's universal checkpoints cannot do this): the loaded
    engine's whole state, saved again, equals the checkpoint bit for bit; training continues as the
    uninterrupted run does."""
    folder, ref, cfg_opt = saved[case]
    stage = OTHER_STAGE[case[0]]
    resaved = str(tmp_path / "resaved")
    got = worlds.run(2, job.resume, stage, case[1], f"{folder}/ckptkit", from_step=SAVE_STEP, steps=STEPS,
                     config_optimizer=cfg_opt, resave=resaved)[0]
    assert_same_state(f"{folder}/ckptkit", resaved)
    check_resumed(ref, got, case[1], exact=False, same_kernels=False)


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
    continues as the uninterrupted DP-4 ZeRO-2 run does; a DP-4 job then resumes the DP-2 job's newest."""
    import os

    ref = worlds.run(4, job.checkpointer_run, 2, "fp32", str(tmp_path / "ref"), steps=8, resume=False)[0]
    root = str(tmp_path / "run")
    first = worlds.run(4, job.checkpointer_run, 2, "fp32", root, steps=6, resume=False)[0]
    assert first["losses"] == {s: ref["losses"][s] for s in range(1, 7)}
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-0000004", "step-0000006"]
    got = worlds.run(2, job.checkpointer_run, 3, "fp32", root, steps=8, resume=True)[0]
    assert got["client"] == {"last": 6} and got["start"] == 6
    for s in (7, 8):
        assert got["losses"][s] == pytest.approx(ref["losses"][s], rel=TOL["fp32"]), s
    assert got["eval"] == pytest.approx(ref["eval"], rel=TOL["fp32"])
    cont = worlds.run(4, job.checkpointer_run, 2, "fp32", root, steps=8, resume=True)[0]
    assert cont["start"] == 8 and cont["client"] == {"last": 8} and cont["eval"] == got["eval"]


@pytest.mark.parametrize("case", [(2, "fp32"), (3, "bf16")], ids=["z2-fp32", "z3-bf16"])
def test_resume_at_dp2_with_gradient_accumulation(worlds, saved, case):
    """Same global batch at DP 2 through 2 accumulation micro-steps: the accumulation boundary
    (DeepSpeed's micro-step counter) is consistent after loading."""
    folder, ref, cfg_opt = saved[case]
    got = worlds.run(2, job.resume, case[0], case[1], f"{folder}/ckptkit", from_step=SAVE_STEP, steps=STEPS,
                     config_optimizer=cfg_opt, gas=2)[0]
    check_resumed(ref, got, case[1], exact=False)
    assert got["micro_steps"] == STEPS * 2


def test_unsupported_optimizer_wrapper_is_refused(worlds, tmp_path):
    msg = worlds.run(2, job.refused_bf16_optimizer, str(tmp_path / "x"))[0]
    assert "BF16_Optimizer" in msg
