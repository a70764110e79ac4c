"""Frozen parameters (``requires_grad=False``, in no ZeRO optimizer group) through the DeepSpeed adapter.

Fine-tuning runs freeze embeddings or whole blocks; such a parameter has no fp32 master and no
optimizer state, so the adapter saves it from the module itself (ZeRO 1/2: the whole tensor, the same
on every rank; ZeRO 3: each rank's padded partition). A save that dropped it, or a load that skipped
it, would hand back a model whose frozen weights are the fresh engine's. Every resume here builds its
engine with other frozen values (another seed) than the saving run's, so:

* at the saving DP size and stage the resumed run's losses must equal the saving run's, bit for bit,
  and its loss before the load must not (the control that the seeds differ in what is computed);
* at DP 2 and another ZeRO stage the loaded engine, saved again at once, equals the checkpoint in
  model space bit for bit, and its first loss equals the saving run's at the save (a forward of the
  whole batch on the same weights; the stages compute it alike, tests/deepspeed_job.py);
* the stored frozen tensors hold exactly the values they were frozen at (rounded to the training dtype);
* the consolidated fp32 model equals DeepSpeed's ``zero_to_fp32`` of the same run's native save, key
  for key; frozen parameters come out as fp32, where zero_to_fp32 keeps their training dtype (equal
  values: a bf16 value is exact in fp32). At ZeRO 1 zero_to_fp32 leaves them out (DeepSpeed records
  ``frozen_param_shapes`` only from stage 2 on); ours has them, with the values they were frozen at;
* the native import takes them at every stage (at ZeRO 1 from the module tensors no table lists, at
  ZeRO 3 from every rank's ``frozen_param_fragments``) and gives the adapter's checkpoint bit for bit; a
  ZeRO-3 fragment of the wrong size or dtype is refused naming the rank's file and the parameter;
* the native export carries them at every stage (DeepSpeed's own ``load_checkpoint`` evaluates as the
  saving run did).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("deepspeed")

import torch

import ckptkit
from ckptkit.adapters.deepspeed import model_key
from ckptkit.errors import StateMismatchError
from ckptkit_converters.deepspeed.exporter import export_deepspeed
from ckptkit_converters.deepspeed.fp32 import consolidated_fp32_state_dict
from ckptkit_converters.deepspeed.importer import import_deepspeed
from tests import deepspeed_job as job
from tests.test_deepspeed import SAVE_STEP, STEPS, assert_same_state, check_same_run, saved_runs
from tests.test_deepspeed_convert import zero_to_fp32

CASES = [(1, "fp32"), (2, "bf16"), (3, "bf16")]
IDS = [f"z{s}-{d}" for s, d in CASES]
OTHER_STAGE = {1: 3, 2: 3, 3: 1}
SAVED_SEED, FRESH_SEED = 7, 99


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory):
    return saved_runs(worlds, tmp_path_factory, "ds_frozen", CASES, frozen_seed=SAVED_SEED)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_same_dp_resume_restores_the_frozen_parameters(worlds, saved, case):
    folder, ref = saved[case]
    assert ref["committed"]
    got = worlds.run(4, job.resume, case[0], case[1], f"{folder}/ckptkit", from_step=SAVE_STEP, steps=STEPS,
                     frozen_seed=FRESH_SEED)[0]
    assert got["eval_before"] != ref["eval"]  # the fresh engine's frozen values are not the saved ones
    check_same_run(got, ref)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_resume_at_dp2_and_another_stage_keeps_the_frozen_parameters(worlds, saved, case, tmp_path):
    folder, ref = saved[case]
    resaved = str(tmp_path / "resaved")
    got = worlds.run(2, job.resume, OTHER_STAGE[case[0]], case[1], f"{folder}/ckptkit", from_step=SAVE_STEP,
                     steps=STEPS, frozen_seed=FRESH_SEED, resave=resaved)[0]
    assert_same_state(f"{folder}/ckptkit", resaved)
    assert got["eval"] == ref["eval"] != got["eval_before"]
    assert all(torch.isfinite(torch.tensor(loss)) for loss in got["losses"].values())


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_stored_frozen_tensors_hold_their_values(saved, case):
    folder, _ = saved[case]
    view = ckptkit.open(f"{folder}/ckptkit")
    lp = torch.bfloat16 if case[1] == "bf16" else torch.float32
    for name, value in job.frozen_values(SAVED_SEED).items():
        stored = view[model_key(name)].read()
        assert stored.dtype == lp and torch.equal(stored, value.to(lp)), name


def assert_equals_zero_to_fp32(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor],
                               lp: torch.dtype) -> None:
    assert set(job.FROZEN) <= set(ours)
    for name, value in job.frozen_values(SAVED_SEED).items():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], value.to(lp).float()), name
    assert sorted(ours) == sorted({*theirs, *job.FROZEN})
    for k, v in theirs.items():
        if k in job.FROZEN:  # zero_to_fp32 keeps a frozen parameter's training dtype; ours is fp32, same value
            assert ours[k].dtype == torch.float32 and torch.equal(ours[k], v.float()), k
        else:
            assert ours[k].dtype == v.dtype and torch.equal(ours[k], v), k


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_consolidated_fp32_and_native_import(saved, case, tmp_path):
    folder, _ = saved[case]
    lp = torch.bfloat16 if case[1] == "bf16" else torch.float32
    theirs = zero_to_fp32(f"{folder}/native")
    assert set(job.FROZEN).isdisjoint(theirs) if case[0] == 1 else set(job.FROZEN) <= set(theirs)
    assert_equals_zero_to_fp32(consolidated_fp32_state_dict(f"{folder}/ckptkit"), theirs, lp)
    imported = str(tmp_path / "imported")
    import_deepspeed(f"{folder}/native", imported)
    assert_equals_zero_to_fp32(consolidated_fp32_state_dict(imported), theirs, lp)
    assert_same_state(f"{folder}/ckptkit", imported)


@pytest.mark.parametrize("case,target", [(CASES[0], 1), (CASES[1], 2), (CASES[2], 2), (CASES[2], 3), (CASES[0], 3)],
                         ids=["z1-to-z1", "z2-bf16-to-z2", "z3-bf16-to-z2", "z3-bf16-to-z3", "z1-to-z3"])
def test_native_export_carries_frozen_parameters_and_deepspeed_loads_them(worlds, saved, tmp_path, case, target):
    """ckptkit -> native DeepSpeed at DP 2: the frozen parameters go in the module at ZeRO 1/2 (and at ZeRO
    2 in frozen_param_shapes / frozen_param_fragments, as DeepSpeed writes them); at ZeRO 3 each rank's
    file holds its padded partition in frozen_param_fragments. DeepSpeed's own load_checkpoint into an
    engine with other frozen values evaluates as the saving run did (a forward of the whole batch on the
    same weights); zero_to_fp32 of the export sees them from ZeRO 2 on."""
    folder, ref = saved[case]
    native = str(tmp_path / "native")
    export_deepspeed(f"{folder}/ckptkit", native, dp=2, zero_stage=target)
    got = worlds.run(2, job.resume_native, target, case[1], native, from_step=SAVE_STEP, steps=STEPS,
                     frozen_seed=FRESH_SEED)[0]
    assert got["eval"] == ref["eval"] and got["global_steps"] == SAVE_STEP
    if target >= 2:
        lp = torch.bfloat16 if case[1] == "bf16" else torch.float32
        theirs = zero_to_fp32(native)
        for name, value in job.frozen_values(SAVED_SEED).items():
            assert torch.equal(theirs[name].float(), value.to(lp).float()), name


@pytest.mark.parametrize("damage", ["short", "dtype", "missing"])
def test_a_damaged_zero3_frozen_fragment_is_refused_naming_the_file(saved, tmp_path, damage):
    import shutil

    from ckptkit.errors import ManifestError
    from ckptkit_converters.deepspeed.files import find_files, load_file

    folder, _ = saved[(3, "bf16")]
    src = str(tmp_path / "native")
    shutil.copytree(f"{folder}/native", src)
    files = find_files(src)
    path = files.model[1]
    data = load_file(path)
    frag = data["frozen_param_fragments"]
    if damage == "short":
        frag["fc1.weight"] = frag["fc1.weight"][:-1].clone()
    elif damage == "dtype":
        frag["fc1.weight"] = frag["fc1.weight"].float()
    else:
        del frag["fc1.weight"]
    torch.save(data, path)
    with pytest.raises(ManifestError, match=r"zero_pp_rank_1_mp_rank_00_model_states\.pt: "
                                            r"frozen_param_fragments\['fc1\.weight'\] is"):
        import_deepspeed(src, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out" / "manifest.json")


def test_zero3_frozen_partitions_read_only_their_rows_and_equal_the_whole_cut(tmp_path):
    """The export's per-rank partition of a frozen parameter (read row range only) equals the cut of the
    whole flattened tensor, for shapes of 0 to 3 dims, sizes smaller than dp, and every rank."""
    from types import SimpleNamespace

    from ckptkit_converters.deepspeed.exporter import _frozen_partitions3

    gen = torch.Generator().manual_seed(3)
    tensors = {"a": torch.randn((), generator=gen), "b": torch.randn(5, generator=gen),
               "c": torch.randn(7, 3, generator=gen), "d": torch.randn(2, 3, 4, generator=gen).to(torch.bfloat16),
               "e": torch.randn(1, 11, generator=gen)}
    ckptkit.save({"model": tensors}, str(tmp_path / "ck"))
    view = ckptkit.open(str(tmp_path / "ck"))
    for dp in (1, 2, 3, 4, 8, 13):
        plan = SimpleNamespace(meta={"frozen": list(tensors)}, dp=dp)
        for r in range(dp):
            got = _frozen_partitions3(plan, view, r)
            for n, t in tensors.items():
                flat = t.reshape(-1)
                p = -(-flat.numel() // dp)
                want = torch.zeros(p, dtype=t.dtype)
                lo, hi = min(r * p, flat.numel()), min((r + 1) * p, flat.numel())
                want[:hi - lo] = flat[lo:hi]
                assert got[n].dtype == t.dtype and torch.equal(got[n], want), (n, dp, r)
