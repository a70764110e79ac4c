"""torchtitan MoE on ckptkit: train with FSDP2 + expert parallelism (+ TP), resume at other EP / DP / TP.

The jobs (tests/torchtitan_moe_job.py) build tiny Qwen3-MoE and DeepSeek-V3 models (MLA, a dense
first layer, shared experts, ``expert_bias_E`` routing, one MTP layer) from torchtitan 0.3's own
layer builders and parallelize them with torchtitan's own parallelize functions, in real gloo
worlds; the checkpointer is ``CkptkitCheckpointManager``. Each saving run is also the
uninterrupted reference (saves every 2 steps, asynchronously, trains to step 6). A resume loads
step 4 at another layout and must give back every model and optimizer tensor bit for bit (SHA-1 in
model space), the train state, the LR schedule, exactly the samples the reference consumed at steps
5 and 6, and the reference's losses (bit for bit at the saved layout). Elsewhere EP and TP change
the reduction order, and routing can amplify a last-bit difference, so the held-out loss and the
losses must instead equal, bit for bit, a reference run at the target layout that loaded the same
step through torch's own DCP and trained on the same batches.

The expert layouts themselves: the rule ckptkit records for every tensor (with the expert axis from
the ``GroupedExperts`` module) predicts, at another EP / TP / DP degree, exactly the pieces
torchtitan's parallelize gives each rank there (gpt-oss too, whose expert biases are stacked tensors;
it is saved and loaded across layouts, not trained: its attention does not run on CPU); ``inspect`` and ``reshard --dry-run`` show the
experts; a checkpoint resharded offline to another EP degree resumes there like the original.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest

pytest.importorskip("torchtitan")

from tests import torchtitan_moe_job as job
from tests.test_torchtitan import RESUME_STEP, assert_controls_fail, assert_resumed, reference_of

WORLD = {layout: job.world_size(layout) for layout in job.LAYOUTS}
pytestmark = pytest.mark.usefixtures("torchtitan_worlds")  # shares its worlds with the next torchtitan module
# (family, saved layout) -> async mode of the saving run
SAVES = {("qwen3", "fsdp4_ep2"): "async", ("deepseek_v3", "fsdp2_tp2_ep2"): "async_process",
         ("qwen3", "fsdp2_tp2"): "async", ("qwen3", "hsdp2x2_ep2"): "async"}


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory):
    out = {}
    for (family, layout), mode in SAVES.items():
        folder = str(tmp_path_factory.mktemp("titan_moe") / "checkpoint")
        ref = worlds.run(WORLD[layout], job.train, family, layout, folder, resume_step=RESUME_STEP, async_mode=mode,
                         reference=reference_of(folder))[0]
        out[(family, layout)] = (folder, ref)
    return out


@dataclass(frozen=True)
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def cli(*args: str) -> CliResult:
    """``ckptkit ARGS`` in this process (a fresh interpreter per command only re-imported torch)."""
    from click.testing import CliRunner

    from ckptkit.cli.main import cli as command

    result = CliRunner().invoke(command, list(args), catch_exceptions=False)
    return CliResult(result.exit_code, result.stdout, result.stderr)


@pytest.mark.parametrize("source,target", [
    (("qwen3", "fsdp4_ep2"), "fsdp4_ep2"),        # same layout: bit-exact
    (("qwen3", "fsdp4_ep2"), "fsdp4_ep4"),        # more EP ranks, less EFSDP
    (("qwen3", "fsdp4_ep2"), "fsdp4"),            # EP off: experts FSDP-sharded on the dense mesh
    (("qwen3", "fsdp4_ep2"), "fsdp2_tp2"),        # EP off, TP on: experts TP-sharded
    (("qwen3", "fsdp4_ep2"), "fsdp2_ep2"),        # half the world, DP 4 -> 2 (loader positions remapped)
    (("qwen3", "fsdp4_ep2"), "hsdp2x2_ep2"),      # into HSDP: 2 replicas of FSDP 2 x EP 2
    (("qwen3", "hsdp2x2_ep2"), "fsdp4_ep4"),      # from HSDP: each replica group's experts stored once
    (("qwen3", "fsdp2_tp2"), "fsdp4_ep4"),        # from TP-sharded experts (ep 1) to EP 4
    (("deepseek_v3", "fsdp2_tp2_ep2"), "fsdp2_tp2_ep2"),
    (("deepseek_v3", "fsdp2_tp2_ep2"), "fsdp4_ep4"),
    (("deepseek_v3", "fsdp2_tp2_ep2"), "fsdp4"),
    (("deepseek_v3", "fsdp2_tp2_ep2"), "single"),
], ids=lambda v: "-".join(v) if isinstance(v, tuple) else v)
def test_resume_at_another_expert_parallel_layout(worlds, saved, source, target):
    folder, ref = saved[source]
    family, layout = source
    got = worlds.run(WORLD[target], job.resume, family, target, folder, load_step=RESUME_STEP,
                     reference=reference_of(folder))[0]
    assert_resumed(ref, got, same_layout=target == layout)
    assert any(".routed_experts." in k for k in got["loaded"]["digests"])  # the experts were compared
    assert any("expert_bias_E" in k for k in got["loaded"]["digests"])


def test_the_reference_comparison_sees_a_perturbed_tensor_and_a_fresh_optimizer(worlds, saved):
    folder, _ = saved[("qwen3", "fsdp4_ep2")]
    assert_controls_fail(worlds, 4, job.resume, "qwen3", "fsdp4_ep4", folder, load_step=RESUME_STEP,
                         reference=reference_of(folder))


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("layout", ["fsdp4_ep2", "fsdp4_ep4", "fsdp4", "fsdp2_tp2_ep2", "fsdp2_tp2"])
def test_recorded_rules_predict_torchtitans_layout_at_every_degree(worlds, family, layout):
    results = worlds.run(WORLD[layout], job.rules_predict_layout, family, layout)
    for rank, r in enumerate(results):
        assert r["wrong"] == [], (rank, r["wrong"][:3])
    rules, experts = results[0]["rules"], results[0]["expert_keys"]
    # w1, w2, w3 of 2 MoE blocks each: qwen3's 2 layers; deepseek's MoE layer (layer 0 is dense) + its MTP layer;
    # gpt_oss: two weights and two biases (both stack the experts) in each of its 2 layers
    assert len(experts) == (8 if family == "gpt_oss" else 6), experts
    if family == "gpt_oss":
        assert sum(k.endswith(("mlp1_bias_EG", "mlp2_bias_ED")) for k in experts) == 4, experts
    for key, rule in rules.items():
        is_expert = any(key.endswith(e) or f"{e}." in key for e in experts)
        assert (rule.get("expert_axis") == 0) == is_expert, (key, rule)


def test_inspect_and_dry_run_show_the_experts(saved):
    folder, _ = saved[("qwen3", "fsdp2_tp2")]  # saved at ep 1: the experts are known from the module only
    step = os.path.join(folder, f"step-{RESUME_STEP}")
    shown = cli("inspect", step, "--tensor", "model/layers.0.moe.*", "--json")
    assert shown.returncode == 0, shown.stderr
    layouts = {t["key"].rsplit(".", 1)[1]: t["layout"] for t in json.loads(shown.stdout)["tensors"]}
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
        assert layouts[name].endswith("· 8 experts on axis 0"), layouts[name]
    assert "experts" not in layouts["weight"] and "experts" not in layouts["expert_bias_E"]  # router: dense
    plan = cli("reshard", step, os.path.join(folder, "unused"), "--to", "dp4ep4", "--dry-run")
    assert plan.returncode == 0, plan.stderr
    assert "8 routed experts over ep=4 (2 per rank)" in plan.stdout, plan.stdout
    as_json = json.loads(cli("reshard", step, os.path.join(folder, "unused"), "--to", "dp4ep4", "--dry-run",
                             "--json").stdout)["plan"]
    assert as_json["unruled"] == []  # every tensor has a rule: laid out anew, none copied whole
    assert as_json["expert_parallel"]["experts_by_rank"] == {"0": [0, 1], "1": [2, 3], "2": [4, 5], "3": [6, 7]}
    assert not os.path.exists(os.path.join(folder, "unused"))


def test_a_checkpoint_resharded_offline_to_another_ep_degree_resumes_there(worlds, saved, tmp_path):
    folder, ref = saved[("qwen3", "fsdp4_ep2")]
    out = tmp_path / "checkpoint"
    done = cli("reshard", os.path.join(folder, f"step-{RESUME_STEP}"), str(out / f"step-{RESUME_STEP}"),
               "--to", "dp4ep4")
    assert done.returncode == 0, done.stderr
    refused = worlds.run(1, job.load_error, "qwen3", "single", str(out), load_step=RESUME_STEP)[0]
    assert "data loader's state is not in this checkpoint" in refused and "exclude_from_loading" in refused
    # reshard drops per-rank values (the loader positions belong to the source ranks): model and
    # optimizer resume from it exactly as from the original, the loader starts fresh on request
    got = worlds.run(4, job.resume, "qwen3", "fsdp4_ep4", str(out), load_step=RESUME_STEP,
                     exclude_from_loading=["dataloader"])[0]
    direct = worlds.run(4, job.resume, "qwen3", "fsdp4_ep4", folder, load_step=RESUME_STEP,
                        exclude_from_loading=["dataloader"])[0]
    assert got["loaded"]["digests"] == direct["loaded"]["digests"] == ref["saved"]["digests"]
    assert got["loaded"]["train_state"] == ref["saved"]["train_state"]
    assert got["losses"] == direct["losses"]


def test_a_missing_expert_piece_is_refused_naming_the_expert(worlds, saved, tmp_path):
    """Rank 1 (EP rank 1 of EFSDP rank 0: experts 4-7, first half of each) loses its piece of one expert
    weight from its index (resealed, so only coverage can tell): reading the tensor and resuming at
    another EP degree both fail, naming the tensor and the experts, instead of loading what is left."""
    import shutil

    import ckptkit
    from tests import ckpt_files

    folder, _ = saved[("qwen3", "fsdp4_ep2")]
    broken = tmp_path / "checkpoint"
    shutil.copytree(folder, broken)
    step = broken / f"step-{RESUME_STEP}"
    key = "model/layers.1.moe.routed_experts.inner_experts.w2_EDF"

    def drop(doc):
        keep = [p for p in doc["pieces"] if p[0] != key]
        assert len(keep) == len(doc["pieces"]) - 1
        doc["pieces"] = keep

    ckpt_files.edit_index(step, drop, rank=1)
    with pytest.raises(ckptkit.CkptkitError, match=r"no piece .* \(experts 4, 5 \(of 8\)\) of tensor .*w2_EDF"):
        ckptkit.open(str(step))[key][...]
    errors = worlds.run(4, job.load_error, "qwen3", "fsdp4_ep4", str(broken), load_step=RESUME_STEP)
    assert any("w2_EDF" in e and "experts 4, 5 (of 8)" in e for e in errors), errors


@pytest.mark.parametrize("source,target", [("fsdp2_tp2_ep2", "fsdp4_ep4"), ("fsdp4_ep2", "fsdp2_tp2")])
def test_gpt_oss_experts_with_biases_load_at_another_layout(worlds, tmp_path, source, target):
    """gpt-oss (not trainable on CPU here: its attention needs FlexAttention's log-sum-exp) saved after one
    optimizer step on random gradients and loaded at another EP / TP / DP layout into a model with other
    initial weights: every model and optimizer tensor, the expert-stacked biases among them, bit for bit."""
    folder = str(tmp_path / "checkpoint")
    saved = worlds.run(WORLD[source], job.save_without_training, "gpt_oss", source, folder)[0]
    assert any("mlp1_bias_EG" in k and "exp_avg" in k for k in saved)
    got = worlds.run(WORLD[target], job.load_digests, "gpt_oss", target, folder, load_step=2)[0]
    tensors = {k: v for k, v in saved.items() if k.startswith("model/") or ".exp_avg" in k}
    assert {k: got["after"].get(k) for k in tensors} == tensors
    weights = [k for k in tensors if k.startswith("model/") and "expert_bias" not in k]
    assert all(got["before"][k] != tensors[k] for k in weights)  # the fresh model's own weights differed


def test_hsdp_with_experts_stores_each_piece_once(saved):
    """Under HSDP the two replica groups hold the same dense shards and the same experts: the step is the
    size of the same model's at FSDP 4 x EP 2, not twice it."""
    from tests.test_torchtitan import folder_bytes

    hsdp = folder_bytes(os.path.join(saved[("qwen3", "hsdp2x2_ep2")][0], "step-4"))
    fsdp = folder_bytes(os.path.join(saved[("qwen3", "fsdp4_ep2")][0], "step-4"))
    assert 0.9 < hsdp / fsdp < 1.1, (hsdp, fsdp)
