"""Megatron torch_dist and legacy checkpoints <-> ckptkit, against real Megatron-core on gloo.

The tiny GPT (tests/megatron_model.py: GQA, SwiGLU, padded vocab) trains two
steps at tp2pp2 in a 4-rank world, untied and tied, and is saved by Megatron's
own ``dist_checkpointing.save`` (torch_dist) and in the legacy per-rank layout
(tests/megatron_convert_job.py). The reference is Megatron's own
``dist_checkpointing.load`` of the torch_dist checkpoint into a tp1pp1 model.
Checked here:

* both imports give every model-space tensor equal (bit for bit) to the
  reference, the vocab padding rows apart (``<key>.vocab_padding``), the
  name-table partition rules, and ``megatron/meta`` (with the optimizer record
  where the plain optimizer's state was imported);
* exports at tp1pp4 and tp4pp1 load with Megatron's ``dist_checkpointing.load``
  into models built there, with the eval loss of Megatron's own checkpoint
  loaded at that layout (the trained padding rows came along), bit for bit:
  the same weights at the same layout. Losses are never
  compared across layouts (another TP split rounds differently): the trained
  model and its torch_dist checkpoint are tied by Megatron's reload at the
  saving layout, which evaluates exactly as the trained model did;
* what Megatron-LM's ``args`` record is read: with ``args.vocab_size`` set (a run given
  ``--vocab-size``), both imports, ``ckptkit convert``, ``ckptkit.reshard`` and
  ``ckptkit reshard --format megatron`` need no flags; without it, the error names vocab_size;
* pickles naming anything outside the allow-lists are refused before they run;
  bad inputs fail naming the file, tensor or rank folder;
* ``ckptkit convert`` in both directions.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

pytest.importorskip("megatron.core")

import torch
from click.testing import CliRunner

import ckptkit
from ckptkit.cli.main import cli
from ckptkit.errors import CkptkitError, CorruptCheckpointError, LayoutError
from ckptkit.layout.config import ParallelConfig
from ckptkit.offline.formats import MissingImportOptions
from ckptkit_converters.megatron import names as names
from ckptkit_converters.megatron.importer import import_legacy, import_torch_dist
from ckptkit_converters.megatron.exporter import export_torch_dist
from ckptkit_converters.megatron.files import META_KEY
from ckptkit_converters.common.safe_unpickle import UnsafeCheckpointError
from tests import megatron_convert_job as job
from tests.malicious_pickle import RunsOnLoad

VOCAB = 250


def mm_padded_rows() -> int:
    return -(-VOCAB // 32) * 32  # divisible_by 16 x tp 2
TIED = [False, True]


pytestmark = pytest.mark.usefixtures("retire_megatron_world")


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory):
    """{tied: (folder, result)}: trained and saved at tp2pp2 by Megatron, imported both ways."""
    out = {}
    for tied in TIED:
        folder = str(tmp_path_factory.mktemp(f"megatron_{'tied' if tied else 'untied'}"))
        result = worlds.run(4, job.train_and_save, folder, tied)[0]
        import_torch_dist(f"{folder}/torch_dist", f"{folder}/ck_td", vocab_size=VOCAB)
        skipped = import_legacy(f"{folder}/legacy", f"{folder}/ck_legacy", vocab_size=VOCAB).skipped
        # tied: the distributed optimizer's distrib_optim.pt is imported; untied: the fp32 optimizer is not
        assert skipped == (() if tied else
                           ("optimizer: the fp32 optimizer's state (no main copies to check which parameter each "
                            "moment belongs to) is not imported; the weights are",))
        out[tied] = (folder, result)
    return out


def _split_vocab(key: str, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """A Megatron tensor as ckptkit stores it: a vocab tensor's true rows, and its padding rows apart."""
    if key.split("/")[-1] not in names.VOCAB_TENSORS:
        return {key: v}
    return {key: v[:VOCAB], key + names.VOCAB_PADDING_SUFFIX: v[VOCAB:]}


def _expected(ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: t for key, v in ref.items() for k, t in _split_vocab(f"model/{key}", v).items()}


def _check_bucket_state(view, expected: dict[str, torch.Tensor]) -> None:
    """The dp_reshardable import holds every weight's main copy (fp32 training: the weight itself, vocabulary
    padding rows too) and both moments, trained (tests/test_megatron.py compares them with Megatron's
    model-space form of the same state bit for bit)."""
    for key in [k for k in expected if k.startswith("model/")]:
        name = key[len("model/"):]
        expected[f"optimizer/main/{name}"] = expected[key]
        for state in ("exp_avg", "exp_avg_sq"):
            got = view[f"optimizer/{state}/{name}"].read()
            assert got.shape == expected[key].shape and (name.endswith(names.VOCAB_PADDING_SUFFIX) or got.any()), name
            expected[f"optimizer/{state}/{name}"] = got


@pytest.mark.parametrize("kind", ["ck_td", "ck_legacy"])
@pytest.mark.parametrize("tied", TIED, ids=["untied", "tied"])
def test_import_equals_megatron_load(saved, tied, kind):
    folder, result = saved[tied]
    assert result["reload_loss"] == result["loss"]  # Megatron's checkpoint is the trained model (same layout)
    expected = _expected(result["tensors"])
    if kind == "ck_td":  # Megatron's plain optimizer state, model space (the untied run)
        for k, v in result["optimizer"].items():
            state, key = k[len("optimizer.state."):].split(".", 1)
            expected.update(_split_vocab(f"optimizer/{state}/{key}", v))
        assert (len(result["optimizer"]) == 2 * len(result["tensors"])) == (not tied)
        assert tied or result["optimizer"]["optimizer.state.exp_avg.output_layer.weight"].abs().sum() > 0
    view = ckptkit.open(f"{folder}/{kind}")
    if tied:  # the distributed optimizer: Megatron-LM's default dp_reshardable buckets (torch_dist) and its
        # legacy distrib_optim.pt, placed by two independent walks, hold the same state bit for bit
        _check_bucket_state(view if kind == "ck_td" else ckptkit.open(f"{folder}/ck_td"), expected)
    assert sorted(view.keys()) == sorted(expected)
    assert ("model/output_layer.weight" in expected) == (not tied)
    for key, want in expected.items():
        got = view[key].read()
        assert got.dtype == want.dtype and torch.equal(got, want), key
        name = key[len("model/"):] if key.startswith("model/") else key.split("/", 2)[2]
        want_rule = None if name.endswith(names.VOCAB_PADDING_SUFFIX) else names.rule_for(name, divisible_by=16, ffn=96)
        assert view.manifest.tensors[key].rule == want_rule, key
    assert ("model/embedding.word_embeddings.weight.vocab_padding" in expected) and mm_padded_rows() > VOCAB
    meta = json.loads(view.values[META_KEY])
    optimizer = meta.pop("optimizer")
    scheduler = meta.pop("scheduler")
    assert meta == {"format": 1, "iteration": job.STEPS, "num_layers": 4, "vocab_size": VOCAB,
                    "make_vocab_size_divisible_by": 16, "tied": tied,
                    "layout": {"tp": 2, "pp": 2, "dp": 1, "vpp": None},
                    "source": "torch_dist" if kind == "ck_td" else "legacy"}
    # the plain optimizer's state resumes (its step from common.pt's common_step), and so does the tied run's
    # distributed optimizer (dp_reshardable buckets or distrib_optim.pt, its step from each group's param
    # groups, main copies too); the untied legacy files' fp32 optimizer is not imported: no record, no resume
    if kind == "ck_td" or tied:
        assert optimizer == {"tensor_states": ["exp_avg", "exp_avg_sq"], "main": tied,
                             "scalars": {"step": {"dtype": "float32", "value": float(job.STEPS)}},
                             "hyper_parameters": optimizer["hyper_parameters"], "grad_scalers": []}
        assert optimizer["hyper_parameters"][0][0]["betas"] == [0.9, 0.999]
    else:
        assert optimizer is None
    assert (scheduler is not None) == (kind == "ck_legacy")  # the legacy files carry opt_param_scheduler
    assert scheduler is None or scheduler["num_steps"] == job.STEPS
    rule = view.manifest.tensors["model/decoder.layers.mlp.linear_fc1.weight"].rule
    assert rule.fused == (96, 96) and rule.tp_axis == 1 and rule.layer_axis == 0


@pytest.mark.parametrize("tied", TIED, ids=["untied", "tied"])
def test_weights_only_imports_leave_the_optimizer_out_and_list_it(saved, tmp_path, tied):
    """Both forms, both imports: the model exactly as the full import holds it, no optimizer record, and what
    was left out listed (the plain optimizer's model-space state, the distributed optimizer's buckets)."""
    folder, _ = saved[tied]
    runner = CliRunner()
    for src, full in ((f"{folder}/torch_dist", f"{folder}/ck_td"), (f"{folder}/legacy", f"{folder}/ck_legacy")):
        out = str(tmp_path / os.path.basename(full))
        res = runner.invoke(cli, ["convert", src, out, "--vocab-size", str(VOCAB), "--opt", "weights_only=true",
                                  "--json"])
        assert res.exit_code == 0, res.output
        result = json.loads(res.output)
        assert result["meta"]["optimizer"] is None
        got, want = ckptkit.open(out), ckptkit.open(full)
        assert sorted(got.keys()) == sorted(k for k in want.keys() if not k.startswith("optimizer/"))
        assert all(torch.equal(got[k].read(), want[k].read()) for k in got.keys())
        if full.endswith("ck_td"):
            left = [k for k in result["skipped"] if k.startswith("optimizer.")]
            assert left and all(".distributed." in k for k in left) == tied, left
        else:
            assert result["skipped"] == ["optimizer: not imported (weights_only)"]


@pytest.mark.parametrize("target", [(1, 4), (4, 1)], ids=["tp1pp4", "tp4pp1"])
@pytest.mark.parametrize("tied", TIED, ids=["untied", "tied"])
def test_export_loads_in_megatron(worlds, saved, tmp_path, tied, target):
    folder, _ = saved[tied]
    tp, pp = target
    dest = str(tmp_path / f"tp{tp}pp{pp}")
    src = f"{folder}/ck_legacy" if tied else f"{folder}/ck_td"  # both imports feed an export
    out = export_torch_dist(src, dest, tp=tp, pp=pp)
    assert out.meta["layout"]["tp"] == tp and os.path.exists(f"{dest}/.metadata")
    ours = worlds.run(4, job.load_and_eval, dest, tp, pp, tied)[0]
    # Megatron's own checkpoint at the same layout: the imports kept its trained padding rows, and the
    # padding does not grow here (250 rows pad to 256 at tp 1, 2 and 4), so the export holds them all
    theirs = worlds.run(4, job.load_and_eval, f"{folder}/torch_dist", tp, pp, tied)[0]
    assert ours == theirs


def test_export_refuses_bad_layouts(saved, tmp_path):
    folder, _ = saved[False]
    with pytest.raises(LayoutError, match="do not split evenly over pp=3"):
        export_torch_dist(f"{folder}/ck_td", str(tmp_path / "x"), tp=1, pp=3)
    with pytest.raises(LayoutError, match="does not split over tp=3"):
        export_torch_dist(f"{folder}/ck_td", str(tmp_path / "y"), tp=3, pp=1)
    assert not os.path.exists(tmp_path / "y") or not os.listdir(tmp_path / "y")


# ---------------------------------------------------------------- trust


def test_malicious_common_pt_refused(saved, tmp_path):
    folder, _ = saved[False]
    src = str(tmp_path / "evil_td")
    shutil.copytree(f"{folder}/torch_dist", src)
    marker = str(tmp_path / "pwned")
    torch.save({"iteration": 2, "args": RunsOnLoad(marker)}, f"{src}/common.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"common\.pt.*system"):
        import_torch_dist(src, str(tmp_path / "out"), vocab_size=VOCAB)
    assert not os.path.exists(marker) and not os.path.exists(tmp_path / "out" / "manifest.json")


def test_malicious_legacy_file_refused(saved, tmp_path):
    folder, _ = saved[False]
    src = str(tmp_path / "evil_legacy")
    shutil.copytree(f"{folder}/legacy", src)
    marker = str(tmp_path / "pwned")
    path = f"{src}/iter_{job.STEPS:07d}/mp_rank_01_001/model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["rng_state"] = [RunsOnLoad(marker)]
    torch.save(state, path)
    with pytest.raises(UnsafeCheckpointError, match=r"mp_rank_01_001/model_optim_rng\.pt.*system"):
        import_legacy(src, str(tmp_path / "out"), vocab_size=VOCAB)
    assert not os.path.exists(marker)


def test_malicious_metadata_refused(saved, tmp_path):
    import pickle

    folder, _ = saved[False]
    src = str(tmp_path / "evil_meta")
    shutil.copytree(f"{folder}/torch_dist", src)
    marker = str(tmp_path / "pwned")
    with open(f"{src}/.metadata", "wb") as f:
        pickle.dump(RunsOnLoad(marker), f)
    with pytest.raises(UnsafeCheckpointError, match="system"):
        import_torch_dist(src, str(tmp_path / "out"), vocab_size=VOCAB)
    assert not os.path.exists(marker)


# ---------------------------------------------------------------- bad input


def test_bad_inputs_name_the_culprit(saved, tmp_path):
    folder, _ = saved[False]
    with pytest.raises(LayoutError, match=r"embedding\.word_embeddings\.weight.*256 rows.*vocab_size 100"):
        import_torch_dist(f"{folder}/torch_dist", str(tmp_path / "a"), vocab_size=100)
    with pytest.raises(LayoutError, match=r"embedding\.word_embeddings\.weight.*vocab_size 300"):
        import_legacy(f"{folder}/legacy", str(tmp_path / "b"), vocab_size=300)
    with pytest.raises(LayoutError, match="disagrees"):
        import_torch_dist(f"{folder}/torch_dist", str(tmp_path / "c"), vocab_size=VOCAB,
                          make_vocab_size_divisible_by=128)
    # a rank folder missing
    src = str(tmp_path / "legacy_missing")
    shutil.copytree(f"{folder}/legacy", src)
    shutil.rmtree(f"{src}/iter_{job.STEPS:07d}/mp_rank_01_000")
    with pytest.raises(CkptkitError, match="mp_rank_01_000"):
        import_legacy(src, str(tmp_path / "d"), vocab_size=VOCAB)
    # a tensor the name table does not know
    src = str(tmp_path / "legacy_unknown")
    shutil.copytree(f"{folder}/legacy", src)
    path = f"{src}/iter_{job.STEPS:07d}/mp_rank_00_001/model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["model"]["decoder.layers.0.mlp.mystery_gate.weight"] = torch.zeros(4, 64)
    torch.save(state, path)
    with pytest.raises(LayoutError, match=r"mp_rank_00_001.*decoder\.layers\.0\.mlp\.mystery_gate\.weight"):
        import_legacy(src, str(tmp_path / "e"), vocab_size=VOCAB)
    # a truncated data file
    src = str(tmp_path / "td_truncated")
    shutil.copytree(f"{folder}/torch_dist", src)
    with open(f"{src}/__1_0.distcp", "r+b") as f:
        f.truncate(100)
    with pytest.raises(CorruptCheckpointError, match="__1_0.distcp"):
        import_torch_dist(src, str(tmp_path / "f"), vocab_size=VOCAB)
    for name in "abcdef":
        assert not os.path.exists(tmp_path / name / "manifest.json")


# ---------------------------------------------------------------- CLI


def test_cli_convert_megatron(worlds, saved, tmp_path):
    folder, _ = saved[False]
    runner = CliRunner()
    res = runner.invoke(cli, ["convert", f"{folder}/torch_dist", str(tmp_path / "x")])
    assert res.exit_code != 0 and "--vocab-size" in res.output
    for src, name in ((f"{folder}/torch_dist", "td"), (f"{folder}/legacy", "legacy")):
        res = runner.invoke(cli, ["convert", src, str(tmp_path / name), "--vocab-size", str(VOCAB), "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.output)["meta"]["source"] == ("torch_dist" if name == "td" else "legacy")
    res = runner.invoke(cli, ["convert", str(tmp_path / "td"), str(tmp_path / "out"), "--format", "megatron"])
    assert res.exit_code != 0 and "--to" in res.output
    res = runner.invoke(cli, ["convert", str(tmp_path / "legacy"), str(tmp_path / "out"), "--format", "megatron",
                              "--to", "tp2pp2"])
    assert res.exit_code == 0, res.output
    loss = worlds.run(4, job.load_and_eval, str(tmp_path / "out"), 2, 2, False)[0]
    assert loss == worlds.run(4, job.load_and_eval, f"{folder}/torch_dist", 2, 2, False)[0]


# ---------------------------------------------------------------- facts read from args


def _with_vocab_in_args(src: str, dest: str, files: list[str]) -> str:
    """A copy of ``src`` whose ``args`` (in each of ``files``) record ``vocab_size``, as Megatron-LM
    saves them after a run given ``--vocab-size`` (the Namespace rewritten, nothing else)."""
    shutil.copytree(src, dest)
    for rel in files:
        path = os.path.join(dest, rel)
        state = torch.load(path, weights_only=False)
        assert state["args"].vocab_size is None and state["args"].padded_vocab_size == 256
        state["args"].vocab_size = VOCAB
        torch.save(state, path)
    return dest


def test_facts_recorded_in_args_are_read(worlds, saved, tmp_path):
    folder, _ = saved[False]
    runner = CliRunner()
    # without args.vocab_size the import asks for exactly that, by name (the padding multiple is read)
    with pytest.raises(MissingImportOptions, match=r"args do not record vocab_size.*--vocab-size") as err:
        import_torch_dist(f"{folder}/torch_dist", str(tmp_path / "none"))
    assert err.value.missing == ("vocab_size",)
    res = runner.invoke(cli, ["reshard", f"{folder}/torch_dist", str(tmp_path / "none2"), "--to", "tp1pp1"])
    assert res.exit_code == 2 and "vocab_size" in res.stderr and "--vocab-size" in res.stderr
    assert "--divisible-by" not in res.stderr and len(res.stderr.strip().splitlines()) == 1

    td = _with_vocab_in_args(f"{folder}/torch_dist", str(tmp_path / "td"), ["common.pt"])
    it = f"iter_{job.STEPS:07d}"
    legacy = _with_vocab_in_args(f"{folder}/legacy", str(tmp_path / "legacy"),
                                 [f"{it}/mp_rank_{t:02d}_{p:03d}/model_optim_rng.pt" for t in range(2) for p in range(2)])
    r = import_torch_dist(td, str(tmp_path / "ck_td"))
    assert r.meta["vocab_size"] == VOCAB and r.meta["make_vocab_size_divisible_by"] == 16
    assert ckptkit.diff(f"{folder}/ck_td", str(tmp_path / "ck_td")).identical
    import_legacy(legacy, str(tmp_path / "ck_legacy"))
    assert ckptkit.diff(f"{folder}/ck_legacy", str(tmp_path / "ck_legacy")).identical
    with pytest.raises(LayoutError, match="--vocab-size 100 disagrees with the checkpoint's vocab_size 250"):
        import_torch_dist(td, str(tmp_path / "bad"), vocab_size=100)
    res = runner.invoke(cli, ["convert", td, str(tmp_path / "cli_td"), "--json"])  # no flags needed
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["meta"]["vocab_size"] == VOCAB
    # the ckptkit.formats entry point: reshard takes the Megatron directory itself
    out = ckptkit.reshard(td, tmp_path / "tp1pp1", ParallelConfig.parse("tp1pp1"))
    assert out.source == td and ckptkit.open(tmp_path / "tp1pp1").manifest.parallel == "tp1pp1dp1"
    assert ckptkit.diff(f"{folder}/ck_td", str(tmp_path / "tp1pp1")).identical
    # Megatron at tp2pp2 -> Megatron at tp4pp1, one command; Megatron loads it there
    res = runner.invoke(cli, ["reshard", td, str(tmp_path / "mlm_tp4"), "--to", "tp4pp1", "--format", "megatron"])
    assert res.exit_code == 0, res.output
    assert "as Megatron torch_dist for tp4pp1" in res.output
    ours = worlds.run(4, job.load_and_eval, str(tmp_path / "mlm_tp4"), 4, 1, False)[0]
    theirs = worlds.run(4, job.load_and_eval, f"{folder}/torch_dist", 4, 1, False)[0]
    assert ours == theirs


@pytest.mark.parametrize("tied", TIED, ids=["untied", "tied"])
def test_hf_export_from_tp2pp2_equals_the_tp1_reference_and_loads_in_transformers(saved, tmp_path, tied):
    """The path a Megatron user takes to Hugging Face: the tp2pp2 torch_dist folder straight to HF
    (``convert --format hf``; the registry imports it to model space on the fly), against the HF export of
    Megatron's own tp1pp1 load of the same checkpoint, saved as one whole tensor per key: the same HF
    tensors bit for bit. transformers' LlamaForCausalLM loads it with no key missing, unexpected or of
    another shape."""
    transformers = pytest.importorskip("transformers")
    from ckptkit_converters.hf.options import HFExportOptions
    from ckptkit_converters.megatron.options import MegatronImportOptions
    from ckptkit_converters.registry import convert
    from tests.test_convert_hf_moe import load_export

    folder, result = saved[tied]
    config = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 96,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": tied}
    (tmp_path / "config.json").write_text(json.dumps(config))
    target = HFExportOptions(config=str(tmp_path / "config.json"))
    got = convert(f"{folder}/torch_dist", tmp_path / "hf", to_format="hf",
                  source_options=MegatronImportOptions(vocab_size=VOCAB), target_options=target)
    assert got.family == "megatron_llama"
    ckptkit.save({"model": dict(result["tensors"])}, str(tmp_path / "tp1"))
    convert(str(tmp_path / "tp1"), tmp_path / "hf_ref", to_format="hf", target_options=target)
    ours, reference = load_export(tmp_path / "hf"), load_export(tmp_path / "hf_ref")
    assert sorted(ours) == sorted(reference) and ("lm_head.weight" in ours) == (not tied)
    for key, want in reference.items():
        assert ours[key].dtype == want.dtype and torch.equal(ours[key], want), key
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    _, info = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32,
                                                           output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


def test_checkpointer_never_resumes_past_a_newer_megatron_checkpoint(worlds, saved, tmp_path):
    """MegatronCheckpointer given the folder Megatron-LM saved into (``iter_NNNNNNN`` and its tracker): it held
    no ckptkit checkpoint, so restore_latest returned None and training started from scratch; now every rank
    refuses, naming the iteration and the way on (``ckptkit convert --from megatron``)."""
    import tests.megatron_model as mm
    from tests import megatron_job

    folder, _ = saved[False]
    root = str(tmp_path / "mlm")
    shutil.copytree(f"{folder}/legacy", root)
    errors = worlds.run(2, megatron_job.checkpointer_restore_error, mm.Layout(), root)
    it = f"iter_{job.STEPS:07d}"
    assert all(e is not None and e.startswith("ForeignCheckpointError") for e in errors), errors
    assert f"{root}/{it}: a Megatron checkpoint, newer than any ckptkit checkpoint" in errors[0]
    assert f"ckptkit convert {root}/{it} DST --from megatron" in errors[0]
    # the way on it names takes that folder (Megatron-LM's args record no vocab_size here: the flag it asks for)
    res = CliRunner().invoke(cli, ["convert", f"{root}/{it}", str(tmp_path / "dst"), "--from", "megatron",
                                   "--vocab-size", str(VOCAB)])
    assert res.exit_code == 0, res.output
    assert ckptkit.diff(f"{folder}/ck_legacy", str(tmp_path / "dst")).identical
    # Megatron-LM's released checkpoint (tracker "release", loaded as iteration 0) alone: refused too, not a
    # silent start from scratch (beside a ckptkit step it is older: tests/test_foreign_steps.py)
    release = str(tmp_path / "released")
    os.makedirs(release)
    shutil.copytree(f"{root}/{it}", f"{release}/release")
    errors = worlds.run(2, megatron_job.checkpointer_restore_error, mm.Layout(), release)
    assert all(e is not None and e.startswith("ForeignCheckpointError") for e in errors), errors
    assert f"{release}/release: a Megatron checkpoint, newer than any ckptkit checkpoint" in errors[0]
