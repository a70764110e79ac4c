"""Megatron-core mixture-of-experts on ckptkit: save at one EP / ETP / TP / PP layout, resume at others.

The model is tests/megatron_model.py's tiny GPT with MoE on every layer: 8
routed ``SequentialMLP`` SwiGLU experts, top-2, a shared expert, and
aux-loss-free balancing (``moe_router_enable_expert_bias``: the router's
``expert_bias`` buffer is state that changes every step), trained with the
distributed optimizer, whose expert parameters live in the expert-data-
parallel group's buckets (a ChainedOptimizer of two DistributedOptimizers).

Saved at tp1pp1ep2 (dp4, edp2) after step 2, trained on to step 4 as the
reference. What runs on CPU (shared/ENVIRONMENT.md): MoE *training* at TP 1
only (TP > 1 needs sequence parallelism with Transformer Engine), so TP > 1
layouts are checked by loading, comparing the eval loss, and re-saving: every
resumed job saves again right after loading, and that checkpoint must equal
the original bit for bit in every model and optimizer tensor, whatever layout
wrote it. That also covers the reverse directions: a checkpoint written at
ep4, ep1, tp2ep2 (etp2) or tp2ep2etp1 is the original checkpoint, byte for
byte, and the chain tests load such re-saves at yet other layouts.

Every loss comparison is exact (==). At the saving layout a resume does the
saving run's arithmetic. At another layout it is compared with Megatron's own
resume there (tests/megatron_job.py: its dist_checkpointing load of its own save
of the same training state, fed the same batches): the same arithmetic, so
bit-equal on any machine, even though top-k routing can turn a last-bit
difference into a visible one. Two layouts have no such reference, because
Megatron's own load cannot go there: ep1 (one distributed optimizer where the
saving job had two, dense and expert) and the plain optimizer (which cannot
take the distributed optimizer's checkpoint). For those the first forward
after the load (eval, and the training loss of step 3) is compared exactly
with a run at the same layout and weights, and the state by the bit-exact
re-save; their later losses are not compared with anything (a bound would
rest on one machine's rounding).
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch

from tests import ckpt_files
from tests import megatron_job as job
from tests import megatron_model as mm

SAVE_STEP, STEPS = 2, 4
MOE = dict(experts=8, shared_expert=True, expert_bias=True)
SRC = mm.Layout(tp=1, pp=1, ep=2, **MOE)  # dp4: edp2 x ep2

pytestmark = pytest.mark.usefixtures("retire_megatron_world")


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory):
    """(ckptkit folder, the saving run's record, Megatron's own save of the training state, of the weights alone)."""
    folder = str(tmp_path_factory.mktemp("moe") / "ckpt")
    mfolder, weights = (str(tmp_path_factory.mktemp(f"moe_torch_dist_{k}")) for k in ("state", "model"))
    ref = worlds.run(4, job.train_and_save, SRC, folder, save_step=SAVE_STEP, steps=STEPS, megatron_folder=mfolder,
                     megatron_model_folder=weights)[0]
    return folder, ref, mfolder, weights


def assert_same_checkpoint(a_folder: str, b_folder: str) -> None:
    a, b = job.all_tensors(a_folder), job.all_tensors(b_folder)
    assert sorted(a) == sorted(b)
    experts = [k for k in a if ".experts.experts." in k]
    assert {k.split("/")[0] for k in experts} == {"model", "optimizer"}, experts
    assert any(k.endswith("router.expert_bias") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # and the same rules, whatever layout wrote it (an ep1 save must still record the expert axis)
    from ckptkit.engine.metadata_io import read_manifest
    from ckptkit.storage.url import open_store

    ra, rb = (read_manifest(open_store(f)).tensors for f in (a_folder, b_folder))
    assert {k: t.rule for k, t in ra.items()} == {k: t.rule for k, t in rb.items()}


def assert_import_equals_ours(mfolder: str, folder: str, out: str) -> list[str]:
    """Import Megatron's torch_dist save ``mfolder`` to ``out``: every model tensor, the vocab padding rows
    included (``<key>.vocab_padding``, cut out of Megatron's padded vocab tensors), equal to ckptkit's own save
    ``folder`` under the same rule."""
    from ckptkit_converters.megatron.importer import import_torch_dist

    import ckptkit

    import_torch_dist(mfolder, out, vocab_size=mm.VOCAB, make_vocab_size_divisible_by=16)
    ours, theirs = ckptkit.open(folder), ckptkit.open(out)
    keys = sorted(k for k in ours.keys() if k.startswith("model/"))
    assert any(k.endswith(".vocab_padding") for k in keys)
    assert sorted(k for k in theirs.keys() if k.startswith("model/")) == keys
    for k in keys:
        assert theirs.manifest.tensors[k].rule == ours.manifest.tensors[k].rule, k
        assert torch.equal(theirs[k].read(), ours[k].read()), k
    return keys


TRAINING_LAYOUTS = {
    "ep4": mm.Layout(tp=1, pp=1, ep=4, **MOE),  # 2 experts per rank, edp1
    "ep1": mm.Layout(tp=1, pp=1, ep=1, **MOE),  # every rank holds all 8, edp4
    "pp2ep2": mm.Layout(tp=1, pp=2, ep=2, **MOE),  # dp2 = ep2, edp1
    "ep2-plain-optimizer": mm.Layout(tp=1, pp=1, ep=2, dist_opt=False, **MOE),
}
LOAD_ONLY_LAYOUTS = {
    "tp2ep2": mm.Layout(tp=2, pp=1, ep=2, **MOE),  # Megatron's default etp = tp = 2: edp1
    "tp2ep2etp1": mm.Layout(tp=2, pp=1, ep=2, etp=1, **MOE),  # ETP independent of TP: edp2
    "tp2pp2ep2etp1": mm.Layout(tp=2, pp=2, ep=2, etp=1, **MOE),  # dp1: EP carved out of tp x dp
}
LAYOUTS = {**TRAINING_LAYOUTS, **LOAD_ONLY_LAYOUTS}
NO_MEGATRON_ROUTE = {"ep1", "ep2-plain-optimizer"}  # see the module docstring


def steps_at(name: str) -> int:
    """TP > 1: load, eval, re-save only (training there needs Transformer Engine's sequence parallelism)."""
    return STEPS if name in TRAINING_LAYOUTS else SAVE_STEP


@pytest.fixture(scope="module")
def resumed(worlds, saved, tmp_path_factory):
    """ckptkit's resume of the saved run at layout ``name`` (saving again right after the load), once per layout."""
    cache: dict = {}

    def get(name: str) -> tuple[dict, str]:
        if name not in cache:
            again = str(tmp_path_factory.mktemp("again") / "ckpt")
            got = worlds.run(4, job.resume, LAYOUTS[name], saved[0], steps=steps_at(name), save_again=again)[0]
            cache[name] = (got, again)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def reference(worlds, saved):
    """Megatron's own resume of the saved training state at layout ``name``, once per layout (where Megatron's
    load can go there; elsewhere its load of the weights alone, trained one step: the first forward)."""
    cache: dict = {}

    def get(name: str) -> dict:
        if name not in cache:
            weights_only = name in NO_MEGATRON_ROUTE
            cache[name] = worlds.run(4, job.megatron_reference, LAYOUTS[name], saved[2],
                                     steps=SAVE_STEP + 1 if weights_only else steps_at(name),
                                     weights_only=weights_only)[0]
        return cache[name]

    return get


def check(got: dict, want: dict, *, steps: int = STEPS) -> None:
    """A resume at step 2 against a run that does the same arithmetic up to ``steps``: equal to the last bit."""
    assert got["iteration"] == SAVE_STEP
    assert got["eval"] == want["eval"]
    assert [got["losses"][s] for s in range(SAVE_STEP + 1, steps + 1)] == \
        [want["losses"][s] for s in range(SAVE_STEP + 1, steps + 1)]
    if steps == STEPS:
        assert got["final_eval"] == want["final_eval"]


def check_at(got: dict, name: str, saved: tuple, reference) -> None:
    """A resume at layout ``name`` against Megatron's own resume there; where that route does not exist, its first
    forward (eval, step 3's training loss) against a run with the same weights at the same layout: Megatron's
    load of the weights at ep1, the saving run itself for the plain optimizer (the same parallel layout)."""
    if name == "ep2-plain-optimizer":
        check(got, saved[1], steps=SAVE_STEP + 1)
    elif name in NO_MEGATRON_ROUTE:
        check(got, reference(name), steps=SAVE_STEP + 1)
    else:
        check(got, reference(name), steps=steps_at(name))


def test_same_layout_resumes_bit_exact(worlds, saved, tmp_path):
    folder, ref, *_ = saved
    again = str(tmp_path / "again")
    got = worlds.run(4, job.resume, SRC, folder, steps=STEPS, save_again=again)[0]
    check(got, ref)
    assert got["rng_restored"]
    assert_same_checkpoint(folder, again)


@pytest.mark.parametrize("name", sorted(TRAINING_LAYOUTS))
def test_resumes_at_another_expert_layout(saved, resumed, reference, name):
    got, again = resumed(name)
    check_at(got, name, saved, reference)
    assert got["rng_restored"] == (name == "ep2-plain-optimizer")  # the same parallel layout: its own ranks' RNG
    assert_same_checkpoint(saved[0], again)


@pytest.mark.parametrize("name", sorted(LOAD_ONLY_LAYOUTS))
def test_loads_at_tensor_parallel_expert_layouts(saved, resumed, reference, name):
    """TP > 1: load, eval, re-save (training there needs Transformer Engine's sequence parallelism)."""
    got, again = resumed(name)
    check_at(got, name, saved, reference)
    assert_same_checkpoint(saved[0], again)


def test_checkpoints_written_at_other_layouts_resume_anywhere(worlds, saved, resumed):
    """The reverse directions: the checkpoints written right after loading at etp2 (tp2ep2), at ep4 and with the
    plain optimizer equal the original bit for bit, so resuming them at ep2 (the original layout), ep1, pp2ep2
    and ep4 with the distributed optimizer must be the original's resume there, to the last bit."""
    folder, ref, *_ = saved
    at_etp2, at_ep4, at_plain = (resumed(n)[1] for n in ("tp2ep2", "ep4", "ep2-plain-optimizer"))
    for again in (at_etp2, at_ep4, at_plain):
        assert_same_checkpoint(folder, again)
    back = worlds.run(4, job.resume, SRC, at_etp2, steps=STEPS)[0]
    check(back, ref)
    for name, written in (("ep1", at_ep4), ("pp2ep2", at_etp2), ("ep4", at_plain)):  # plain -> distributed last
        check(worlds.run(4, job.resume, TRAINING_LAYOUTS[name], written, steps=STEPS)[0], resumed(name)[0])


def test_loss_matches_megatrons_own_round_trip_at_a_new_ep(resumed, reference):
    """Megatron's dist_checkpointing saved the same training state at ep2; loaded by Megatron at ep4 it gives the
    eval ckptkit's load at ep4 gives, and the same training steps after it, bit for bit."""
    ours, theirs = resumed("ep4")[0], reference("ep4")
    assert ours["eval"] == theirs["eval"]
    assert (ours["losses"], ours["final_eval"]) == (theirs["losses"], theirs["final_eval"])


def test_model_space_of_experts(saved):
    """Experts are stacked [layers, experts, ...] under Megatron's own key, with an expert axis in the rule;
    the router, its expert bias and the shared expert are dense tensors with their own rules."""
    from ckptkit.engine.metadata_io import read_manifest
    from ckptkit.storage.url import open_store

    folder, *_ = saved
    t = read_manifest(open_store(folder)).tensors
    fc1 = t["model/decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert fc1.shape == (mm.LAYERS, 8, 2 * 48, 64)
    assert (fc1.rule.layer_axis, fc1.rule.expert_axis, fc1.rule.tp_axis, fc1.rule.fused) == (0, 1, 2, (48, 48))
    fc2 = t["model/decoder.layers.mlp.experts.experts.linear_fc2.weight"]
    assert fc2.shape == (mm.LAYERS, 8, 64, 48) and fc2.rule.tp_axis == 3 and fc2.rule.expert_axis == 1
    for state in ("exp_avg", "exp_avg_sq"):
        assert t[f"optimizer/{state}/decoder.layers.mlp.experts.experts.linear_fc1.weight"].rule == fc1.rule
    router = t["model/decoder.layers.mlp.router.weight"]
    assert router.shape == (mm.LAYERS, 8, 64) and router.rule.expert_axis is None and router.rule.tp_axis is None
    bias = t["model/decoder.layers.mlp.router.expert_bias"]
    assert bias.shape == (mm.LAYERS, 8) and not bias.rule.is_expert
    shared = t["model/decoder.layers.mlp.shared_experts.linear_fc1.weight"]
    assert shared.rule.tp_axis == 1 and not shared.rule.is_expert
    view = job.all_tensors(folder)
    assert view["model/decoder.layers.mlp.router.expert_bias"].abs().sum() > 0  # it was updated by training


def test_a_missing_expert_piece_is_refused_naming_the_expert(worlds, saved, tmp_path):
    """Delete the stored piece of one expert (expert 5 of layer 1) from the manifest: loading at any layout
    fails with a CoverageError that names the tensor and the expert, and nothing is loaded silently."""
    import shutil

    import ckptkit

    folder, *_ = saved
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    key = "model/decoder.layers.mlp.experts.experts.linear_fc2.weight"

    def drop(doc):
        pieces = doc["tensors"][key]["layout"]["pieces"]
        keep = [p for p in pieces if p[0][:2] != [1, 5]]  # [offsets, sizes, flat, writer]
        assert len(keep) == len(pieces) - 1
        doc["tensors"][key]["layout"]["pieces"] = keep

    ckpt_files.edit_manifest(broken, drop)
    with pytest.raises(ckptkit.CoverageError, match=r"linear_fc2.weight.*expert 5 \(of 8\).*layer 1 \(of 4\)"):
        ckptkit.open(str(broken))[key].read()
    err = worlds.run(4, job.load_error, TRAINING_LAYOUTS["ep4"], str(broken))
    assert any(e and "expert 5 (of 8)" in e and "linear_fc2" in e for e in err), err


def test_reshard_cli_to_another_ep_then_resume(worlds, saved, resumed, reference, tmp_path):
    """`ckptkit reshard SRC OUT --to tp1pp2ep2`: stored at the target's grid, and a job there resumes from it
    exactly as from the original."""
    from click.testing import CliRunner

    from ckptkit.cli.main import cli

    folder, *_ = saved
    out = str(tmp_path / "pp2ep2")
    dry = CliRunner().invoke(cli, ["reshard", folder, out, "--to", "tp1pp2ep2", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "world size 4" in dry.output and "experts" in dry.output, dry.output
    result = CliRunner().invoke(cli, ["reshard", folder, out, "--to", "tp1pp2ep2"])
    assert result.exit_code == 0, result.output
    direct = resumed("pp2ep2")[0]
    via = worlds.run(4, job.resume, TRAINING_LAYOUTS["pp2ep2"], out, steps=STEPS)[0]
    assert via["eval"] == direct["eval"] and via["losses"] == direct["losses"]
    check_at(via, "pp2ep2", saved, reference)


def test_inspect_shows_the_expert_axis(saved):
    from click.testing import CliRunner

    from ckptkit.cli.main import cli

    folder, *_ = saved
    import json

    result = CliRunner().invoke(cli, ["inspect", folder, "--tensor", "*experts.experts.linear_fc1*", "--json"])
    assert result.exit_code == 0, result.output
    tensors = json.loads(result.output)["tensors"]
    assert len(tensors) == 3  # the weight and its two Adam moments
    assert all(t["layout"].endswith("· 8 experts on axis 1") for t in tensors), tensors


def test_megatrons_own_moe_save_imports_equal_to_ckptkits(saved, tmp_path):
    """Megatron's dist_checkpointing save of the same MoE model (torch_dist) imports with every expert, the
    router, its expert bias and the shared expert equal to ckptkit's own save, under the same rules (the
    converter's name table and the live adapter agree)."""
    folder, _, _, weights = saved
    model_keys = assert_import_equals_ours(weights, folder, str(tmp_path / "imported"))
    assert sum(".experts.experts." in k for k in model_keys) == 2


def test_megatrons_default_dp_reshardable_moe_save_imports_as_its_model_space_form(saved, tmp_path):
    """An MoE job's ChainedOptimizer (dense and expert distributed optimizers) saved in Megatron-LM's default
    ``dp_reshardable`` form (``chained_<i>.``-prefixed buckets, the expert optimizer's per expert-data-parallel
    group) imports to exactly what its ``fully_reshardable`` save of the same state imports to: every expert's,
    the router's and the shared expert's main copy and moments, and the same record; the router's expert_bias,
    a buffer, has no optimizer state in either."""
    from ckptkit_converters.megatron.importer import import_torch_dist

    import ckptkit.adapters.megatron as mckpt

    mfolder = saved[2]
    outs = []
    for name, src in (("fully", mfolder), ("dp", job.dp_reshardable_folder(mfolder))):
        outs.append(str(tmp_path / name))
        import_torch_dist(src, outs[-1], vocab_size=mm.VOCAB, make_vocab_size_divisible_by=16)
    a, b = job.all_tensors(outs[0]), job.all_tensors(outs[1])
    assert set(a) == set(b)
    assert any(".experts.experts." in k and k.startswith("optimizer/exp_avg/") for k in a)
    assert not any(k.startswith("optimizer/") and k.endswith("expert_bias") for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert mckpt.read_meta(outs[0])[0] == mckpt.read_meta(outs[1])[0]


@pytest.mark.parametrize("name", ["ep4", "ep1", "pp2ep2"])
def test_megatrons_dp_reshardable_moe_save_at_other_expert_layouts_imports_as_the_state_it_holds(worlds, saved, tmp_path,
                                                                                                  name):
    """The state of the saved checkpoint, loaded by a job at another expert layout and saved there by Megatron in
    its default ``dp_reshardable`` form, imports to that state: every model and optimizer tensor ckptkit saved,
    bit for bit. At ep4 the expert optimizer's data-parallel groups have one rank each, at ep1 four (one
    optimizer holds every expert), at pp2ep2 the buckets are per stage: the import reads the groups of the
    layout that wrote it, not ep2's."""
    from ckptkit_converters.megatron.importer import import_torch_dist

    mfolder, out = str(tmp_path / "torch_dist"), str(tmp_path / "imported")
    worlds.run(4, job.resume_then_megatron_save, LAYOUTS[name], saved[0], mfolder, sharding="dp_reshardable")
    import_torch_dist(mfolder, out, vocab_size=mm.VOCAB, make_vocab_size_divisible_by=16)
    ours, imported = job.all_tensors(saved[0]), job.all_tensors(out)
    assert set(ours) <= set(imported)
    assert any(".experts.experts." in k and k.startswith("optimizer/exp_avg_sq/") for k in ours)
    for k in ours:
        assert ours[k].dtype == imported[k].dtype and torch.equal(ours[k], imported[k]), k
    assert all(k.startswith("optimizer/main/") for k in set(imported) - set(ours))


@pytest.mark.parametrize("name", ["ep4", "pp2ep2"])
def test_megatron_resumes_an_moe_export_with_its_chained_optimizer(worlds, saved, reference, tmp_path, name):
    """`--format megatron` of the MoE checkpoint at a new expert layout, then Megatron's own load of model and
    optimizer there: the ChainedOptimizer's two distributed optimizers (dense, expert) with their param groups
    and Adam state, the expert bias. The resumed job does what Megatron resuming its own save there does."""
    from ckptkit_converters.megatron.exporter import export_torch_dist

    layout = LAYOUTS[name]
    out = str(tmp_path / "torch_dist")
    export_torch_dist(saved[0], out, tp=layout.tp, pp=layout.pp, ep=layout.ep)
    got = worlds.run(4, job.megatron_reference, layout, out, steps=STEPS)[0]
    check(got, reference(name))


def test_the_plain_optimizer_export_of_a_chained_optimizer_resumes_in_megatron(worlds, saved, resumed, tmp_path):
    """An MoE job's optimizer is a chain (dense and expert). `--opt optimizer=plain` writes one plain entry per
    optimizer: Megatron's plain ChainedOptimizer at ep2 loads model and optimizer from it and trains on exactly as
    ckptkit's own resume at that layout does. An unknown form is refused naming both."""
    from click.testing import CliRunner

    from ckptkit.cli.main import cli

    out = tmp_path / "plain"
    result = CliRunner().invoke(cli, ["convert", saved[0], str(out), "--format", "megatron", "--to", "tp1pp1ep2",
                                      "--opt", "optimizer=plain"])
    assert result.exit_code == 0, result.output
    name = "ep2-plain-optimizer"
    got = worlds.run(4, job.megatron_reference, LAYOUTS[name], str(out), steps=STEPS)[0]
    check(got, resumed(name)[0])
    bad = CliRunner().invoke(cli, ["convert", saved[0], str(tmp_path / "bad"), "--format", "megatron", "--to",
                                   "tp1pp1ep2", "--opt", "optimizer=zero1"])
    assert bad.exit_code != 0 and "'distributed' or 'plain'" in bad.output, bad.output


@pytest.mark.parametrize("target", ["tp1pp1ep4", "tp2pp1ep2etp1"])
def test_megatron_export_at_a_new_expert_layout_loads_in_megatron(worlds, saved, resumed, reference, tmp_path, target):
    """`ckptkit reshard SRC OUT --to ...ep... --format megatron`: Megatron's own dist_checkpointing.load at
    that layout accepts it and gives the eval loss ckptkit's own load gives there, which is the eval of
    Megatron's load of its own save there (the same weights at the same layout)."""
    from click.testing import CliRunner

    from ckptkit.cli.main import cli

    folder, *_ = saved
    out = str(tmp_path / "torch_dist")
    result = CliRunner().invoke(cli, ["reshard", folder, out, "--to", target, "--format", "megatron"])
    assert result.exit_code == 0, result.output
    name = {"tp1pp1ep4": "ep4", "tp2pp1ep2etp1": "tp2ep2etp1"}[target]
    theirs = worlds.run(4, job.megatron_reference_eval, LAYOUTS[name], out)[0]
    assert theirs == resumed(name)[0]["eval"] == reference(name)["eval"]


PATTERN = dict(MOE, moe_layers=(0, 1, 1, 1))  # DeepSeek-V3's shape: dense first layer(s), MoE after


@pytest.fixture(scope="module")
def pattern_saved(worlds, tmp_path_factory):
    """Layers that differ: Megatron declares per-layer keys (``decoder.layers.<i>.``, no stacked layer axis)."""
    folder = str(tmp_path_factory.mktemp("moe_pattern") / "ckpt")
    mfolder = str(tmp_path_factory.mktemp("moe_pattern_torch_dist"))
    weights = str(tmp_path_factory.mktemp("moe_pattern_torch_dist_model"))
    layout = mm.Layout(tp=1, pp=1, ep=2, **PATTERN)
    ref = worlds.run(4, job.train_and_save, layout, folder, save_step=SAVE_STEP, steps=STEPS,
                     megatron_folder=mfolder, megatron_model_folder=weights)[0]
    return folder, ref, mfolder, weights


def test_an_moe_layer_pattern_resumes_at_other_layouts(worlds, pattern_saved, tmp_path):
    """Per-layer keys carry ``layer=i`` rules (experts: ``expert_axis=0``); resumes at ep4 and pp2ep2 equal
    Megatron's own resume of its save of the same state there and re-save the identical checkpoint;
    `reshard --to tp1pp2ep2` (the layer count read off the per-layer rules) then resume equals the direct
    resume."""
    from click.testing import CliRunner

    from ckptkit.cli.main import cli
    from ckptkit.engine.metadata_io import read_manifest
    from ckptkit.storage.url import open_store

    folder, _, mfolder, _ = pattern_saved
    t = read_manifest(open_store(folder)).tensors
    experts = t["model/decoder.layers.1.mlp.experts.experts.linear_fc1.weight"]
    assert experts.shape == (8, 96, 64) and (experts.rule.layer, experts.rule.expert_axis) == (1, 0)
    assert t["model/decoder.layers.0.mlp.linear_fc1.weight"].rule.layer == 0  # the dense first layer
    assert "model/decoder.layers.0.mlp.router.weight" not in t
    for name, layout in (("ep4", mm.Layout(tp=1, pp=1, ep=4, **PATTERN)),
                         ("pp2ep2", mm.Layout(tp=1, pp=2, ep=2, **PATTERN))):
        again = str(tmp_path / f"again-{name}")
        got = worlds.run(4, job.resume, layout, folder, steps=STEPS, save_again=again)[0]
        check(got, worlds.run(4, job.megatron_reference, layout, mfolder, steps=STEPS)[0])
        assert_same_checkpoint(folder, again)
    out = str(tmp_path / "pp2ep2")
    result = CliRunner().invoke(cli, ["reshard", folder, out, "--to", "tp1pp2ep2"])
    assert result.exit_code == 0, result.output
    via = worlds.run(4, job.resume, layout, out, steps=STEPS)[0]  # layout: pp2ep2, the loop's last
    assert via["eval"] == got["eval"] and via["losses"] == got["losses"]


def test_megatrons_save_of_an_moe_layer_pattern_imports(pattern_saved, tmp_path):
    """Per-layer keys import by name too (``layer=i`` rules from converters/megatron/names.py), every tensor
    equal to ckptkit's own save under the same rule; the torch_dist export refuses them clearly."""
    from ckptkit_converters.megatron.exporter import export_torch_dist

    from ckptkit.errors import LayoutError

    folder, _, _, weights = pattern_saved
    assert_import_equals_ours(weights, folder, str(tmp_path / "imported"))
    with pytest.raises(LayoutError, match="per-layer tensor"):
        export_torch_dist(folder, str(tmp_path / "td"), tp=1, pp=1, ep=2)


def test_checkpointer_saves_an_moe_job_and_resumes_it_at_another_ep(worlds, tmp_path):
    """MegatronCheckpointer: save every step (asynchronously, keep 2) at ep2, resume the newest at ep4."""
    root = str(tmp_path / "run")
    first = worlds.run(4, job.checkpointer_run, SRC, root, steps=3)[0]
    assert first["start"] == 0
    resumed = worlds.run(4, job.checkpointer_run, TRAINING_LAYOUTS["ep4"], root, steps=4)[0]
    assert resumed["start"] == 3 and resumed["extra"] == {"consumed_samples": 24}
    assert set(resumed["losses"]) == {4}


def test_checkpointer_resumes_the_newest_step_that_loads_when_the_newest_is_damaged(worlds, tmp_path):
    """The newest checkpoint's data fails its checksums (a bit flipped at rest): the restart skips it,
    names it, and resumes the step before, continuing exactly as the first job did from there. It used
    to load the newest step directly and fail every restart, until a human moved that step aside."""
    from tests.damage import flip_byte

    root = str(tmp_path / "run")
    first = worlds.run(4, job.checkpointer_run, SRC, root, steps=3)[0]
    for rank in range(4):
        flip_byte(str(ckpt_files.data_object(f"{root}/step-0000003", rank)), where=0.0)  # a piece starts there
    resumed = worlds.run(4, job.checkpointer_run, SRC, root, steps=3)[0]
    assert resumed["start"] == 2 and resumed["extra"] == {"consumed_samples": 16}
    assert resumed["skipped"] == ["step-0000003"] and "checksum" in resumed["skipped_why"][0]
    assert resumed["losses"] == {3: first["losses"][3]}


def test_grouped_gemm_experts_are_refused_with_the_way_out():
    """GroupedMLP needs CUDA grouped GEMM kernels, so it cannot be built here: a module of that class name
    stands in to check that the live adapter refuses it before reading any declaration."""
    from ckptkit.adapters.megatron.model_space import DataParallelSizes, ModelSpaceOptions, chunk_params
    from ckptkit.errors import StateMismatchError

    class GroupedMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight1 = torch.nn.Parameter(torch.zeros(4, 8))

    model = torch.nn.Sequential()
    model.add_module("experts", GroupedMLP())
    with pytest.raises(StateMismatchError, match="'experts' is a GroupedMLP.*import with `ckptkit convert"):
        chunk_params([model], ModelSpaceOptions(None, 128), DataParallelSizes(1))


@pytest.mark.parametrize("optimizer", ["distributed", "plain"])
def test_an_export_whose_target_builds_another_number_of_optimizers_is_refused_before_writing(saved, tmp_path,
                                                                                               optimizer):
    """The ep2 job kept its experts in a second optimizer; a Megatron job at ep 1 builds one, and its load
    refused the export's two param-group entries (``KeyError: 'optimizer'``) after the export reported
    success (found by a hunt, 2026-12-06). Refused now before anything is written; the weights alone go."""
    from ckptkit_converters.megatron.exporter import export_torch_dist

    from ckptkit.errors import LayoutError

    out = tmp_path / "torch_dist"
    with pytest.raises(LayoutError, match=r"2 Megatron optimizer\(s\).*ep 1 builds 1"):
        export_torch_dist(saved[0], str(out), tp=1, pp=1, ep=1, optimizer=optimizer)
    assert not out.exists() or not any(out.iterdir())
    export_torch_dist(saved[0], str(out), tp=1, pp=1, ep=1, weights_only=True)
    assert (out / ".metadata").exists()
