"""DeepSpeed-MoE engines on ckptkit: save at one EP / DP size, resume at others; native MoE checkpoints
imported, consolidated and exported.

The jobs (tests/deepspeed_moe_job.py) train a model with two ``deepspeed.moe.layer.MoE`` layers
(4 experts each, top-2) through a real ``deepspeed.initialize`` engine on CPU/gloo with the expert
param groups DeepSpeed asks for. The saving run (ZeRO 2, DP 4, EP 2, so expert DP 2) is the
uninterrupted reference: it saves with ckptkit and with DeepSpeed's own ``save_checkpoint`` at
step 2 and trains on to step 4. A resume builds a fresh engine at another EP / DP size, loads step 2
and must reproduce: every model-space tensor (saved again at once: equal bit for bit), the LR,
counters and client state, and a reference's eval right after loading, losses at steps 3 and 4 and
final eval, bit for bit (==, never a tolerance). At the saved layout the reference is the saving run.
At another DP / EP size (which changes the all-reduce's summation order, so the saving run's losses
are the wrong yardstick) it is DeepSpeed's own resume at that size: its native ``load_checkpoint`` of
the checkpoint ``ckptkit convert --format deepspeed`` writes for it. DeepSpeed's loader refuses its
own checkpoint at another DP or EP size, its universal converter does not handle DeepSpeed-MoE (it
merges the per-EP-rank expert files into one: a shape error), and its fragment API fails on expert
parameters, so the state reaches DeepSpeed through ckptkit's export here; DeepSpeed's loader then
places it by its own mapping (the partition facts the export relies on are checked against live
engines in tests/test_deepspeed.py). Both runs do the same arithmetic.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

pytest.importorskip("deepspeed")

import torch

import ckptkit
from ckptkit.errors import CoverageError
from tests import deepspeed_moe_job as job

SAVE_STEP, STEPS = 2, 4
EXPERT_KEYS = [f"moe.{L}.deepspeed_moe.experts.deepspeed_experts.{p}" for L in range(job.MOE_LAYERS)
               for p in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory):
    """ZeRO 2 at DP 4 / EP 2 (and ZeRO 1 at DP 4 / EP 4; ZeRO 2 in bf16): ckptkit and native saves at step 2."""
    out = {}
    for stage, ep, dtype in [(2, 2, "fp32"), (1, 4, "fp32"), (2, 2, "bf16")]:
        folder = str(tmp_path_factory.mktemp(f"dsmoe_z{stage}_ep{ep}_{dtype}"))
        ref = worlds.run(4, job.train_and_save, stage, ep, folder, save_step=SAVE_STEP, steps=STEPS,
                         dtype=dtype)[0]
        out[stage if dtype == "fp32" else dtype] = (folder, ref)
    return out


def assert_same_state(a_path: str, b_path: str) -> None:
    a, b = ckptkit.open(a_path), ckptkit.open(b_path)
    assert sorted(a.keys()) == sorted(b.keys()) and a.keys()
    for key in a.keys():
        x, y = a[key].read(), b[key].read()
        assert x.dtype == y.dtype and torch.equal(x, y), key


@pytest.fixture(scope="module")
def resumed(worlds, saved, tmp_path_factory):
    """ckptkit's resume of saved run ``key`` at DP ``dp`` / EP ``ep`` (ZeRO 2), saved again right after the
    load: (the run's record, the re-saved folder), once per setting."""
    cache: dict = {}

    def get(key, dp: int, ep: int, gas: int = 1) -> tuple[dict, str]:
        if (key, dp, ep, gas) not in cache:
            re = str(tmp_path_factory.mktemp("resaved"))
            got = worlds.run(dp, job.resume, 2, ep, f"{saved[key][0]}/ckptkit", from_step=SAVE_STEP, steps=STEPS,
                             gas=gas, resave=re, dtype="bf16" if key == "bf16" else "fp32")[0]
            cache[(key, dp, ep, gas)] = (got, re)
        return cache[(key, dp, ep, gas)]

    return get


class References:
    """DeepSpeed's own resume (ZeRO 2) of a ckptkit checkpoint at DP ``dp`` / EP ``ep``: its native
    load_checkpoint of the folder exported for that layout (see the module docstring), once per setting; the
    exported folder is kept (:meth:`native_folder`)."""

    def __init__(self, worlds, tmp_path_factory) -> None:
        self.worlds, self.tmp_path_factory = worlds, tmp_path_factory
        self._runs: dict[tuple, dict] = {}
        self._natives: dict[tuple, str] = {}

    def __call__(self, path: str, dp: int, ep: int, gas: int = 1, dtype: str = "fp32") -> dict:
        from ckptkit_converters.deepspeed import export_deepspeed

        if (path, dp, ep, gas) not in self._runs:
            native = str(self.tmp_path_factory.mktemp("native"))
            export_deepspeed(path, native, dp=dp, ep=ep, zero_stage=2)
            self._natives[(path, dp, ep)] = native
            self._runs[(path, dp, ep, gas)] = self.worlds.run(dp, job.resume, 2, ep, native, from_step=SAVE_STEP,
                                                              steps=STEPS, gas=gas, native=True, dtype=dtype)[0]
        return self._runs[(path, dp, ep, gas)]

    def native_folder(self, path: str, dp: int, ep: int) -> str:
        """The native folder the reference run at ``dp`` / ``ep`` loaded (after that run)."""
        return self._natives[(path, dp, ep)]


@pytest.fixture(scope="module")
def reference(worlds, tmp_path_factory) -> References:
    return References(worlds, tmp_path_factory)


def same_files(a: str, b: str) -> list[str]:
    """The relative paths of every file under ``a``, after checking ``b`` holds the same files, byte for byte."""
    import filecmp

    names = sorted(os.path.relpath(os.path.join(d, f), a) for d, _, files in os.walk(a) for f in files)
    assert names == sorted(os.path.relpath(os.path.join(d, f), b) for d, _, files in os.walk(b) for f in files)
    for name in names:
        assert filecmp.cmp(os.path.join(a, name), os.path.join(b, name), shallow=False), name
    return names


def check_resumed(got: dict, want: dict) -> None:
    """A resume at step 2 against a run that does the same arithmetic: equal to the last bit."""
    assert got["lr"] == want["lr"]
    assert got["client"] == {"epoch": 7}
    assert (got["global_steps"], got["global_samples"]) == (SAVE_STEP, SAVE_STEP * job.GLOBAL_BATCH)
    assert got["eval"] == want["eval"]
    assert [got["losses"][s] for s in (3, 4)] == [want["losses"][s] for s in (3, 4)]
    assert got["final_eval"] == want["final_eval"]


def test_checkpoint_holds_stacked_experts_with_expert_rule(saved):
    """Experts in ckptkit's convention: one tensor per weight kind, [experts, ...], rule expert_axis=0;
    no per-expert (local-id) keys."""
    from ckptkit.layout.rules import PartitionRule

    folder, ref = saved[2]
    assert ref["committed"]
    view = ckptkit.open(f"{folder}/ckptkit")
    keys = set(view.keys())
    assert not [k for k in keys if ".deepspeed_experts.0." in k or ".deepspeed_experts.1." in k]
    for name in EXPERT_KEYS:
        for key in (f"model/{name}", f"optimizer/fp32/{name}", f"optimizer/exp_avg/{name}",
                    f"optimizer/exp_avg_sq/{name}"):
            assert key in keys, key
            assert view[key].shape[0] == job.EXPERTS, key
            assert view.meta_of(key).rule == PartitionRule(expert_axis=0), key
    assert view.meta_of("model/inp.weight").rule is None
    meta = json.loads(view.values["deepspeed_engine/deepspeed"])
    assert set(meta["experts"]) == set(EXPERT_KEYS)
    assert {(i["layer"], i["num_experts"], i["ep"]) for i in meta["experts"].values()} == {(0, 4, 2), (1, 4, 2)}


def test_same_layout_resume_is_exact(worlds, saved, tmp_path):
    folder, ref = saved[2]
    got = worlds.run(4, job.resume, 2, 2, f"{folder}/ckptkit", from_step=SAVE_STEP, steps=STEPS,
                     resave=str(tmp_path / "re"))[0]
    check_resumed(got, ref)
    assert_same_state(f"{folder}/ckptkit", str(tmp_path / "re"))


@pytest.mark.parametrize("dp,ep", [(4, 4), (4, 1), (2, 1), (2, 2)])
def test_resume_at_another_ep_and_dp(saved, resumed, reference, dp, ep):
    """Saved at DP 4 / EP 2 (expert DP 2); loaded at EP 4 (expert DP 1), EP 1 (experts replicated over
    the whole DP group) and DP 2: the loaded state, saved again, is the checkpoint bit for bit."""
    folder, _ = saved[2]
    got, re = resumed(2, dp, ep)
    assert_same_state(f"{folder}/ckptkit", re)
    check_resumed(got, reference(f"{folder}/ckptkit", dp, ep))
    assert got["group_names"] == ["dense", f"ep_size_{ep}"]  # not the saving job's ep_size_2


def test_zero1_ep4_resumes_at_zero2_ep2_dp2_with_accumulation(saved, resumed, reference):
    folder, _ = saved[1]
    got, re = resumed(1, 2, 2, gas=2)
    assert_same_state(f"{folder}/ckptkit", re)
    check_resumed(got, reference(f"{folder}/ckptkit", 2, 2, gas=2))


def test_bf16_resume_at_ep4_dp2(saved, resumed, reference):
    """bf16 training (fp32 masters, bf16 weights): the loaded state, saved again, is the checkpoint bit for
    bit; the losses are DeepSpeed's own resume's there, bit for bit (the same bf16 arithmetic)."""
    folder, _ = saved["bf16"]
    got, re = resumed("bf16", 2, 2)
    assert_same_state(f"{folder}/ckptkit", re)
    assert ckptkit.open(re)[f"model/{EXPERT_KEYS[0]}"].dtype == torch.bfloat16
    check_resumed(got, reference(f"{folder}/ckptkit", 2, 2, dtype="bf16"))


def test_import_native_moe_equals_adapter_save_and_resumes(worlds, saved, reference, tmp_path):
    """DeepSpeed's own MoE checkpoint (per-expert files + zero_pp_rank optimizer files) imported: every
    tensor equals ckptkit's save of the same step; it resumes at another EP / DP size as that save does
    there (the same state, the same arithmetic)."""
    from ckptkit_converters.deepspeed import import_deepspeed

    for stage in (2, 1, "bf16"):
        folder, _ = saved[stage]
        dest = str(tmp_path / f"imported{stage}")
        import_deepspeed(f"{folder}/native", dest)
        assert_same_state(f"{folder}/ckptkit", dest)
        a = json.loads(ckptkit.open(f"{folder}/ckptkit").values["deepspeed_engine/deepspeed"])
        b = json.loads(ckptkit.open(dest).values["deepspeed_engine/deepspeed"])
        for key in ("experts", "flat_groups", "param_shapes", "param_groups", "optimizer_scalars",
                    "global_steps", "lr_scheduler"):
            assert a[key] == b[key], key
    got = worlds.run(2, job.resume, 2, 1, str(tmp_path / "imported2"), from_step=SAVE_STEP, steps=STEPS)[0]
    check_resumed(got, reference(f"{saved[2][0]}/ckptkit", 2, 1))


def test_import_refuses_a_missing_expert_file(saved, tmp_path):
    from ckptkit_converters.deepspeed import import_deepspeed

    folder, _ = saved[2]
    native = str(tmp_path / "native")
    shutil.copytree(f"{folder}/native", native)
    os.remove(os.path.join(native, "global_step2", "layer_1_expert_2_mp_rank_00_model_states.pt"))
    with pytest.raises(CoverageError, match=r"expert 2 \(of 4\) of MoE layer 1"):
        import_deepspeed(native, str(tmp_path / "out"))
    assert not os.path.exists(str(tmp_path / "out" / "manifest.json"))


def test_consolidated_fp32_has_every_expert(worlds, saved, resumed, tmp_path):
    """zero_to_fp32's equivalent: one entry per global expert (ep=1 names), equal to the stacked fp32
    masters; loaded with load_state_dict into a fresh model at DP 2 / EP 1 and DP 4 / EP 4 it evaluates as
    ckptkit's load of the checkpoint there (the same weights at the same layout: bit for bit). (DeepSpeed's
    own zero_to_fp32 refuses MoE folders: it takes the per-expert files for model-states files.)"""
    from ckptkit_converters.deepspeed import (
        consolidated_fp32_state_dict,
        import_deepspeed,
    )

    folder, _ = saved[2]
    sd = consolidated_fp32_state_dict(f"{folder}/ckptkit")
    view = ckptkit.open(f"{folder}/ckptkit")
    for name in EXPERT_KEYS:
        stacked = view[f"optimizer/fp32/{name}"].read()
        stem, param = name.rsplit(".deepspeed_experts.", 1)
        for e in range(job.EXPERTS):
            assert torch.equal(sd[f"{stem}.deepspeed_experts.{e}.{param}"], stacked[e])
    assert len(sd) == 1 + 6 + len(EXPERT_KEYS) * job.EXPERTS  # buffer, dense params, 4 experts x 8 params
    import_deepspeed(f"{folder}/native", str(tmp_path / "imp"))
    sd_native = consolidated_fp32_state_dict(str(tmp_path / "imp"))
    assert sd.keys() == sd_native.keys() and all(torch.equal(sd[k], sd_native[k]) for k in sd)
    for dp, ep in [(2, 1), (4, 4)]:
        got = worlds.run(dp, job.consolidated_eval, ep, sd)[0]
        assert got["eval"] == resumed(2, dp, ep)[0]["eval"]


def test_missing_expert_piece_is_a_coverage_error_naming_the_expert(saved, tmp_path):
    """Delete the stored piece of expert 2 of one stacked tensor from the manifest: the consolidation (and
    any read) fails with a CoverageError naming the tensor and the expert, not a silent zero."""
    from ckptkit_converters.deepspeed import consolidated_fp32_state_dict

    from tests import ckpt_files

    folder, _ = saved[2]
    broken = tmp_path / "broken"
    shutil.copytree(f"{folder}/ckptkit", broken)
    key = f"optimizer/fp32/{EXPERT_KEYS[-2]}"

    def drop(doc):
        pieces = doc["tensors"][key]["layout"]["pieces"]
        keep = [p for p in pieces if p[0][0] != 2]  # [offsets, sizes, flat, writer]
        assert 0 < len(keep) < len(pieces)
        doc["tensors"][key]["layout"]["pieces"] = keep

    ckpt_files.edit_manifest(broken, drop)
    with pytest.raises(CoverageError, match=r"moe\.1\..*fc2\.weight.*expert 2 \(of 4\)"):
        consolidated_fp32_state_dict(str(broken))


@pytest.mark.parametrize("dp,ep", [(4, 4), (2, 1)])
def test_export_is_loaded_by_deepspeed_at_another_ep(saved, resumed, reference, tmp_path, dp, ep):
    """A native folder for DP/EP sizes the checkpoint was not saved at (``ckptkit convert --format deepspeed``):
    DeepSpeed's own load_checkpoint takes it and training continues as ckptkit's resume at that size does, bit
    for bit. The folder the command writes is, byte for byte, the one DeepSpeed's reference resume at that size
    loaded (test_resume_at_another_ep_and_dp): that run is DeepSpeed's resume of this folder."""
    from click.testing import CliRunner

    from ckptkit.cli.main import cli

    folder, _ = saved[2]
    out = str(tmp_path / "native")
    done = CliRunner().invoke(cli, ["convert", f"{folder}/ckptkit", out, "--format", "deepspeed",
                                    "--dp", str(dp), "--ep", str(ep)])
    assert done.exit_code == 0, done.output
    names = os.listdir(os.path.join(out, "global_step2"))
    assert sorted(n for n in names if n.startswith("layer_")) == sorted(
        f"layer_{L}_expert_{e}_mp_rank_00_model_states.pt" for L in range(2) for e in range(4))
    got = reference(f"{folder}/ckptkit", dp, ep)
    assert "global_step2/mp_rank_00_model_states.pt" in same_files(out, reference.native_folder(f"{folder}/ckptkit", dp, ep))
    check_resumed(resumed(2, dp, ep)[0], got)


def test_import_stage0_expp_checkpoint(worlds, saved, reference, tmp_path):
    """Without ZeRO, DeepSpeed-MoE writes per-EP-rank ``expp_rank_*`` optimizer files (no parameter names).
    The same training at stage 0, imported: its dense tensors are what the stage-0 engine held at the save,
    bit for bit; its experts equal the ZeRO-2 run's save bit for bit (expert gradients are reduced over expert
    DP 2 in both: one addition of two terms, whatever the order; the dense ones over DP 4, where the two
    engines' orders differ, so those are compared with the engine itself). A ZeRO-2 engine at DP 2 / EP 1
    resumes the import as DeepSpeed's own resume of it there does."""
    from ckptkit_converters.deepspeed import import_deepspeed
    from ckptkit_converters.deepspeed.files import is_deepspeed_checkpoint

    folder = str(tmp_path / "z0")
    ref0 = worlds.run(4, job.train_and_save, 0, 2, folder, save_step=SAVE_STEP, steps=STEPS)[0]
    names = os.listdir(os.path.join(folder, "native", "global_step2"))
    # one file per EP rank of the largest expert group this process has created: 2 in a fresh process,
    # 4 once an ep=4 engine was built in it (DeepSpeed's groups are process-global)
    assert {"expp_rank_0_mp_rank_00_optim_states.pt", "expp_rank_1_mp_rank_00_optim_states.pt"} <= set(names)
    assert not [n for n in names if n.startswith("zero_pp_rank_")]
    assert is_deepspeed_checkpoint(f"{folder}/native")
    import_deepspeed(f"{folder}/native", str(tmp_path / "imported"))
    zero2_folder, _ = saved[2]
    a, b = ckptkit.open(f"{zero2_folder}/ckptkit"), ckptkit.open(str(tmp_path / "imported"))
    assert sorted(a.keys()) == sorted(b.keys())
    dense = ref0["dense_state"]
    assert dense and all(k.split("/", 2)[-1] not in EXPERT_KEYS for k in dense)
    for key in a.keys():
        y = b[key].read()
        want = a[key].read() if key.split("/", 2)[-1] in EXPERT_KEYS else dense[key]
        assert y.dtype == want.dtype and torch.equal(y, want), key
    imported = str(tmp_path / "imported")
    got = worlds.run(2, job.resume, 2, 1, imported, from_step=SAVE_STEP, steps=STEPS)[0]
    check_resumed(got, reference(imported, 2, 1))


@pytest.mark.parametrize("dp,ep", [(1, 1), (2, 1), (4, 4), (8, 2)])
def test_export_then_import_is_the_identity(saved, tmp_path, dp, ep):
    """Native folders written for other DP / EP sizes (including ones never trained here) import back to
    the same model-space state, bit for bit."""
    from ckptkit_converters.deepspeed import export_deepspeed, import_deepspeed

    folder, _ = saved[2]
    export_deepspeed(f"{folder}/ckptkit", str(tmp_path / "native"), dp=dp, ep=ep)
    import_deepspeed(str(tmp_path / "native"), str(tmp_path / "back"))
    assert_same_state(f"{folder}/ckptkit", str(tmp_path / "back"))
