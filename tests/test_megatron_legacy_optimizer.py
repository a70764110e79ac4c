"""A legacy Megatron checkpoint's optimizer, imported and resumed, against real Megatron-core on gloo.

Megatron-LM's legacy save (tests/megatron_legacy_job.py) keeps megatron-core's own ``optimizer.state_dict()``
in every rank file: for the mixed-precision optimizer torch's Adam state numbered by parameter and the main
copies by param group; for the distributed one the param groups, with its state in ``distrib_optim.pt``
(``save_parameter_state``: flat grad buffers, gathered over DP). The same trained state is saved by ckptkit's
live adapter, which names every tensor. Checked:

* the import holds every weight, moment and main copy the adapter saved, bit for bit, with the same
  optimizer record (step, loss scaler): bf16 at tp2pp2 with virtual chunks and a tied embedding (the last
  stage's copy has its own optimizer state, not stored), fp16 at tp2 x dp2 (with a fused Adam's step
  kept in the param groups too), and the distributed optimizer in bf16 at pp2 x dp2 with virtual chunks
  and biases (whose sizes leave padding between parameters in the buffers) and in fp16 at tp2 x dp2 (its
  loss scaler in the rank file). tests/test_megatron_convert.py adds fp32 at tp2pp2, equal to the
  torch_dist ``dp_reshardable`` import of the same state;
* resuming the import at another layout trains exactly as resuming the adapter's checkpoint there, and at
  the saving layout exactly as the uninterrupted run; ``ckptkit reshard LEGACY OUT --format megatron`` goes on
  to torch_dist, where Megatron's own load resumes exactly as the adapter does;
* what is not imported is listed as skipped (the fp32 optimizer: tests/test_megatron_convert.py;
  ``weights_only``), and a resume of such an import refuses to start a fresh optimizer silently; a legacy
  MoE save is refused before anything is written, naming its first expert tensor;
* hostile and damaged optimizer dicts and ``distrib_optim.pt`` files (main copies in another order or one
  element off, a parameter missing from its group, padding that is not zero, elements past the last
  parameter, wrong shapes, dtypes and steps, rank files that disagree, a missing or linked-out file, a
  pickle that would run code, and a seeded fuzz of random damage to either file) are refused naming the
  file, or import exactly what the undamaged file does: never another parameter's state, never a crash of
  another kind.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any, Callable

import pytest

pytest.importorskip("megatron.core")

import torch

import ckptkit
from ckptkit.errors import CkptkitError, ManifestError
from ckptkit_converters.common.safe_unpickle import UnsafeCheckpointError
from ckptkit_converters.megatron.files import META_KEY
from ckptkit_converters.megatron.importer import import_legacy
from tests import megatron_job as mjob
from tests import megatron_legacy_job as job
from tests import megatron_model as mm
from tests.malicious_pickle import RunsOnLoad

pytestmark = pytest.mark.usefixtures("retire_megatron_world")

CASES = {
    "bf16_tp2pp2vpp2": (mm.Layout(tp=2, pp=2, vpp=2, dist_opt=False, bf16=True, tied=True),
                        mm.Layout(tp=1, pp=2, dist_opt=False, bf16=True, tied=True)),
    "fp16_tp2dp2": (mm.Layout(tp=2, pp=1, dist_opt=False, fp16=True),
                    mm.Layout(tp=1, pp=1, dist_opt=True, fp16=True)),
    "bf16_distributed_pp2vpp2dp2": (mm.Layout(tp=1, pp=2, vpp=2, dist_opt=True, bf16=True, bias=True),
                                    mm.Layout(tp=2, pp=1, dist_opt=False, bf16=True, bias=True)),
    "fp16_distributed_tp2dp2": (mm.Layout(tp=2, pp=1, dist_opt=True, fp16=True),
                                mm.Layout(tp=1, pp=2, dist_opt=True, fp16=True)),
}
"""name -> (the saving layout, another layout the import is resumed at)."""
STEPS = 4


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory):
    """{case: (folder, uninterrupted run)}, each imported at ``folder/imported``."""
    out = {}
    for name, (layout, _) in CASES.items():
        folder = str(tmp_path_factory.mktemp(f"legacy_{name}"))
        run = worlds.run(4, job.train_and_save, layout, folder, steps=STEPS)[0]
        result = import_legacy(f"{folder}/legacy", f"{folder}/imported", vocab_size=mm.VOCAB)
        assert result.skipped == ()
        out[name] = (folder, run)
    return out


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    view = ckptkit.open(folder)
    return {k: view[k].read() for k in view.keys() if k.startswith(("model/", "optimizer/"))}


def _meta(folder: str) -> dict[str, Any]:
    return json.loads(ckptkit.open(folder).values[META_KEY])


@pytest.mark.parametrize("case", list(CASES))
def test_the_import_holds_what_the_adapter_saved(saved, case):
    folder, _ = saved[case]
    want, got = _tensors(f"{folder}/adapter"), _tensors(f"{folder}/imported")
    assert sorted(got) == sorted(want)
    assert {k.split("/")[1] for k in got if k.startswith("optimizer/")} == {"exp_avg", "exp_avg_sq", "main"}
    for key, t in want.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key].view(torch.uint8), t.view(torch.uint8)), key
    mine, theirs = _meta(f"{folder}/imported")["optimizer"], _meta(f"{folder}/adapter")["optimizer"]
    for field in ("tensor_states", "main", "scalars"):
        assert mine[field] == theirs[field], field
    assert mine["grad_scalers"] == [s for s in theirs["grad_scalers"] if s is not None]  # the adapter: None for bf16
    assert mine["scalars"]["step"]["value"] == job.STEPS
    assert bool(mine["grad_scalers"]) == CASES[case][0].fp16


@pytest.mark.parametrize("case", list(CASES))
def test_the_import_resumes_as_the_adapters_checkpoint_and_as_the_run(worlds, saved, case):
    folder, run = saved[case]
    layout, other = CASES[case]
    from_import = worlds.run(4, mjob.resume, other, f"{folder}/imported", steps=STEPS)[0]
    from_adapter = worlds.run(4, mjob.resume, other, f"{folder}/adapter", steps=STEPS)[0]
    for field in ("eval", "losses", "final_eval", "loss_scale", "iteration"):
        assert from_import[field] == from_adapter[field], field
    assert from_import["iteration"] == job.STEPS
    same = worlds.run(4, mjob.resume, layout, f"{folder}/imported", steps=STEPS)[0]
    assert same["losses"] == run["losses"] and same["loss_scale"] == run["loss_scale"]
    fresh = worlds.run(4, mjob.resume, layout, f"{folder}/imported", steps=STEPS, load_optimizer=False)[0]
    assert fresh["losses"] != run["losses"]  # the control: the moments matter to these losses


def test_a_fused_adams_step_in_the_param_groups_imports_alike(saved, tmp_path):
    """Apex's and Transformer Engine's FusedAdam keep the step in each param group, not per parameter."""
    folder, _ = saved["fp16_tp2dp2"]

    def fused(s: dict[str, Any]) -> None:
        inner = s["optimizer"]["optimizer"]
        steps = {float(st.pop("step")) for st in inner["state"].values()}
        assert len(steps) == 1
        for group in inner["param_groups"]:
            group["step"] = next(iter(steps))
    src = str(tmp_path / "src")
    shutil.copytree(f"{folder}/legacy", src)
    for rank in ("mp_rank_00", "mp_rank_01"):
        path = os.path.join(src, "iter_0000002", rank, "model_optim_rng.pt")
        state = torch.load(path, weights_only=False)
        fused(state)
        torch.save(state, path)
    import_legacy(src, tmp_path / "out", vocab_size=mm.VOCAB)
    assert ckptkit.diff(f"{folder}/imported", str(tmp_path / "out")).identical
    assert _meta(str(tmp_path / "out"))["optimizer"]["scalars"] == _meta(f"{folder}/imported")["optimizer"]["scalars"]


def test_weights_only_leaves_the_optimizer_out_and_says_so(worlds, saved, tmp_path):
    folder, _ = saved["bf16_tp2pp2vpp2"]
    result = import_legacy(f"{folder}/legacy", tmp_path / "w", vocab_size=mm.VOCAB, weights_only=True)
    assert result.skipped == ("optimizer: not imported (weights_only)",)
    assert not any(k.startswith("optimizer/") for k in ckptkit.open(tmp_path / "w").keys())
    assert _meta(str(tmp_path / "w"))["optimizer"] is None
    assert ckptkit.open(tmp_path / "w").manifest.meta["converted_from"]["skipped"] == list(result.skipped)
    err = worlds.run(4, mjob.load_error, CASES["bf16_tp2pp2vpp2"][0], str(tmp_path / "w"))[0]
    assert err is not None and "no optimizer state record" in err


# ---------------------------------------------------------------- damaged and hostile rank files

RANK0 = os.path.join("iter_0000002", "mp_rank_00_000", "model_optim_rng.pt")
DISTRIB0 = os.path.join("iter_0000002", "mp_rank_00_000", "distrib_optim.pt")


def _rewrite(src: str, dest: str, change: Callable[[dict[str, Any]], None], rank_file: str = RANK0) -> str:
    """A copy of the legacy save root with one rank file changed (the test's own file: a plain torch.load)."""
    shutil.copytree(src, dest)
    path = os.path.join(dest, rank_file)
    state = torch.load(path, weights_only=False)
    change(state)
    torch.save(state, path)
    return dest


def _same_shape_pair(state: dict[str, Any]) -> tuple[int, int, int]:
    """(group, j, k): two parameters of one group with one shape (and different values)."""
    for g, mains in enumerate(state["optimizer"]["fp32_from_fp16_params"]):
        for j in range(len(mains)):
            for k in range(j + 1, len(mains)):
                if mains[j].shape == mains[k].shape and not torch.equal(mains[j], mains[k]):
                    return g, j, k
    raise AssertionError("no two parameters of one shape")


def _swap_mains(s: dict[str, Any]) -> None:
    g, j, k = _same_shape_pair(s)
    mains = s["optimizer"]["fp32_from_fp16_params"][g]
    mains[j], mains[k] = mains[k], mains[j]


def _drop_a_parameter(s: dict[str, Any]) -> None:  # a frozen parameter, or a custom group: counts differ
    s["optimizer"]["optimizer"]["param_groups"][0]["params"].pop()
    s["optimizer"]["fp32_from_fp16_params"][0].pop()


def _state_of(s: dict[str, Any], j: int = 0) -> dict[str, Any]:
    inner = s["optimizer"]["optimizer"]
    return inner["state"][inner["param_groups"][0]["params"][j]]


def _second_index_repeats_first(s: dict[str, Any]) -> None:
    params = s["optimizer"]["optimizer"]["param_groups"][0]["params"]
    params[1] = params[0]


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(s: dict[str, Any]) -> None:
        node = s
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value(node[path[-1]]) if callable(value) else value
    return change


DAMAGE = {
    "main copies in another order": (_swap_mains, "its main copy is not the weight"),
    "a parameter missing from its group": (_drop_a_parameter, "param group 0 (wd_mult 1.0) holds"),
    "a moment of another shape": (lambda s: _state_of(s).update(exp_avg=_state_of(s)["exp_avg"][:-1]),
                                  "exp_avg is torch.float32"),
    "a bf16 moment": (lambda s: _state_of(s).update(exp_avg_sq=_state_of(s)["exp_avg_sq"].bfloat16()),
                      "exp_avg_sq is torch.bfloat16"),
    "no state for an index": (lambda s: s["optimizer"]["optimizer"]["state"].clear(), "no state saved"),
    "an index listed twice": (_second_index_repeats_first, "listed twice"),
    "two steps": (lambda s: _state_of(s, 1).update(step=torch.tensor(7.0)), "steps [2.0, 7.0]"),
    "a step that is a string": (lambda s: _state_of(s).update(step="2"), "step is a str"),
    "an lr_mult group": (_set(("optimizer", "optimizer", "param_groups", 0, "lr_mult"), 2.0),
                         "not one of Megatron's standard weight-decay groups"),
    "two weight-decay groups": (_set(("optimizer", "optimizer", "param_groups", 1, "wd_mult"), 1.0),
                                "param groups with wd_mult [1.0, 1.0]"),
    "main copies of another group count": (lambda s: s["optimizer"]["fp32_from_fp16_params"].pop(),
                                           "fp32_from_fp16_params holds 1 group(s), the optimizer 2"),
    "a string for the optimizer": (_set(("optimizer",), "adam"), "'optimizer' is a str"),
    "no param groups": (lambda s: s["optimizer"]["optimizer"].pop("param_groups"), "not torch's optimizer state"),
    "one rank file without an optimizer": (lambda s: s.pop("optimizer"), "the rank files disagree on the optimizer"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_optimizer_is_refused_naming_the_file(saved, tmp_path, damage):
    folder, _ = saved["bf16_tp2pp2vpp2"]
    change, words = DAMAGE[damage]
    src = _rewrite(f"{folder}/legacy", str(tmp_path / "src"), change)
    with pytest.raises(ManifestError) as exc:
        import_legacy(src, tmp_path / "out", vocab_size=mm.VOCAB)
    assert words in str(exc.value)
    assert "mp_rank_00_000" in str(exc.value)
    with pytest.raises(CkptkitError):  # nothing committed
        ckptkit.open(tmp_path / "out")
    # weights_only is the way on: the weights alone, as the undamaged file gives them
    import_legacy(src, tmp_path / "w", vocab_size=mm.VOCAB, weights_only=True)
    model = {k: v for k, v in _tensors(f"{folder}/imported").items() if k.startswith("model/")}
    got = _tensors(str(tmp_path / "w"))
    assert sorted(got) == sorted(model) and all(torch.equal(got[k], model[k]) for k in model)


def _padding_index(flat: dict[str, Any]) -> int:
    """An element of a grad buffer that is padding: zero in all three states (no trained element is)."""
    zero = (flat["param"] == 0) & (flat["exp_avg"] == 0) & (flat["exp_avg_sq"] == 0)
    return int(zero.nonzero()[0])


def _buffer(s: dict[str, Any], i: int = 0) -> dict[str, Any]:
    return next(iter(s[i].values()))


def _longer_buffer(s: dict[str, Any]) -> None:
    flat = _buffer(s)
    for k in ("param", "exp_avg", "exp_avg_sq"):
        flat[k] = torch.cat([flat[k], torch.zeros(64)])
    flat["numel_unpadded"] += 64


def _two_steps(s: dict[str, Any]) -> None:
    groups = s["optimizer"]["optimizer"]["param_groups"]
    groups[-1]["step"] = 7


DISTRIB_DAMAGE = {
    "main copies one element off": (DISTRIB0, lambda s: _buffer(s).update(param=_buffer(s)["param"].roll(1)),
                                    "is not where Megatron's layout puts it"),
    "padding that is not zero": (DISTRIB0, lambda s: _buffer(s)["exp_avg"].__setitem__(_padding_index(_buffer(s)), 1e-3),
                                 "is not where Megatron's layout puts it"),
    "a state one element short": (DISTRIB0, lambda s: _buffer(s).update(exp_avg=_buffer(s)["exp_avg"][:-1]),
                                  "state 'exp_avg' is torch.float32"),
    "elements after the last parameter": (DISTRIB0, _longer_buffer, "64 element(s) after its last parameter"),
    "the form before February 2024": (DISTRIB0, lambda s: s.pop("buckets_coalesced"), "not a coalesced"),
    "a grad buffer too many": (DISTRIB0, lambda s: s.update({2: s[0]}), "grad buffers"),
    "param groups with two steps": (RANK0, _two_steps, "steps"),
}


@pytest.mark.parametrize("damage", list(DISTRIB_DAMAGE))
def test_a_damaged_distrib_optim_is_refused_naming_the_file(saved, tmp_path, damage):
    folder, _ = saved["bf16_distributed_pp2vpp2dp2"]
    rank_file, change, words = DISTRIB_DAMAGE[damage]
    src = _rewrite(f"{folder}/legacy", str(tmp_path / "src"), change, rank_file)
    with pytest.raises(ManifestError) as exc:
        import_legacy(src, tmp_path / "out", vocab_size=mm.VOCAB)
    assert words in str(exc.value) and os.path.join("mp_rank_00_000", os.path.basename(rank_file)) in str(exc.value)
    with pytest.raises(CkptkitError):
        ckptkit.open(tmp_path / "out")
    import_legacy(src, tmp_path / "w", vocab_size=mm.VOCAB, weights_only=True)  # the way on


def test_a_missing_or_linked_distrib_optim_is_refused(saved, tmp_path):
    folder, _ = saved["bf16_distributed_pp2vpp2dp2"]
    src = str(tmp_path / "src")
    shutil.copytree(f"{folder}/legacy", src)
    os.remove(os.path.join(src, DISTRIB0))
    with pytest.raises(ManifestError, match="without the distrib_optim.pt beside it"):
        import_legacy(src, tmp_path / "out", vocab_size=mm.VOCAB)
    outside = tmp_path / "elsewhere.pt"  # a link out of the checkpoint: never opened
    shutil.copy(os.path.join(folder, "legacy", DISTRIB0), outside)
    os.symlink(outside, os.path.join(src, DISTRIB0))
    with pytest.raises(CkptkitError, match="distrib_optim.pt"):
        import_legacy(src, tmp_path / "out", vocab_size=mm.VOCAB)


def test_a_malicious_distrib_optim_runs_nothing(saved, tmp_path):
    folder, _ = saved["bf16_distributed_pp2vpp2dp2"]
    marker = str(tmp_path / "pwned")
    src = _rewrite(f"{folder}/legacy", str(tmp_path / "src"), lambda s: s.update(extra=RunsOnLoad(marker)), DISTRIB0)
    with pytest.raises(UnsafeCheckpointError, match=r"mp_rank_00_000/distrib_optim\.pt.*system"):
        import_legacy(src, tmp_path / "out", vocab_size=mm.VOCAB)
    assert not os.path.exists(marker)


def test_steps_that_differ_between_rank_files_are_refused(saved, tmp_path):
    folder, _ = saved["bf16_tp2pp2vpp2"]

    def later(s: dict[str, Any]) -> None:
        for st in s["optimizer"]["optimizer"]["state"].values():
            st["step"] = torch.tensor(3.0)
    src = _rewrite(f"{folder}/legacy", str(tmp_path / "src"), later)
    with pytest.raises(ManifestError, match=r"different steps \[2.0, 3.0\]"):
        import_legacy(src, tmp_path / "out", vocab_size=mm.VOCAB)


# ---------------------------------------------------------------- fuzz: random damage, never wrong bytes

def _nodes(obj: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into the saved optimizer dict (containers and leaves)."""
    out = [path]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _nodes(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _nodes(v, (*path, i))
    return out


def _at(obj: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def _junk(rng: random.Random, old: Any, path: tuple[Any, ...]) -> Any:
    """A damaged value for the node at ``path``. Moments' values and the order of a group's indices are not
    damaged (they are the file's claim: nothing in it checks them, and Megatron's own load takes them as they
    are), but the moments' shapes and dtypes are, and so are the main copies' values, which the weights check."""
    choices: list[Any] = [None, "x", 3, -1, 2.5, [], {}, True]
    if isinstance(old, torch.Tensor) and old.dim() > 0:
        choices += [old.double(), old.bfloat16(), old.reshape(-1)[:-1].clone(), old.unsqueeze(0).clone()]
        if "fp32_from_fp16_params" in path or "param" in path:  # the main copies
            choices.append(old + 0.25)
    if isinstance(old, list) and old:  # shorter, longer; not reordered (an index list is the file's claim)
        choices += [old[:-1], old + old[-1:]]
    if isinstance(old, int) and not isinstance(old, bool):
        choices += [old + 1, old + 10_000, -old - 1]
    return rng.choice(choices)


FUZZED = {"optimizer": ("bf16_tp2pp2vpp2", RANK0, "optimizer"),
          "distrib_optim": ("bf16_distributed_pp2vpp2dp2", DISTRIB0, None)}
"""What the fuzz damages: (case, file, the item of it damaged: None, the whole file)."""


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("target", list(FUZZED))
def test_random_damage_is_refused_or_harmless(saved, tmp_path, target, seed):
    case, rank_file, item = FUZZED[target]
    folder, _ = saved[case]
    clean = _tensors(f"{folder}/imported")
    rng = random.Random(seed)
    src_root = f"{folder}/legacy"
    original = torch.load(os.path.join(src_root, rank_file), weights_only=False)
    original = original[item] if item else original
    outcomes = {"refused": 0, "harmless": 0}
    for trial in range(6):
        paths = [p for p in _nodes(original) if p]
        tensors = [p for p in paths if isinstance(_at(original, p), torch.Tensor)]  # half the picks: a tensor
        picks = [rng.choice(tensors if rng.random() < 0.5 else paths) for _ in range(rng.randint(1, 3))]

        def damage(s: dict[str, Any]) -> None:
            for p in picks:
                node = s[item] if item else s
                try:
                    for k in p[:-1]:
                        node = node[k]
                    if rng.random() < 0.2 and isinstance(node, dict):
                        node.pop(p[-1], None)
                    else:
                        node[p[-1]] = _junk(rng, node[p[-1]], p)
                except (KeyError, IndexError, TypeError):
                    pass  # an earlier pick replaced a container on this path
        src = _rewrite(src_root, str(tmp_path / f"src{trial}"), damage, rank_file)
        try:
            import_legacy(src, tmp_path / f"out{trial}", vocab_size=mm.VOCAB)
        except CkptkitError:
            outcomes["refused"] += 1
            continue
        got = _tensors(str(tmp_path / f"out{trial}"))  # imported: then exactly what the clean file gives
        assert sorted(got) == sorted(clean), picks
        for k, t in clean.items():
            assert torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)), (k, picks)
        outcomes["harmless"] += 1
    assert outcomes["refused"] > 0, outcomes


def test_cli_convert_imports_the_optimizer_or_leaves_it_out(saved, tmp_path):
    from click.testing import CliRunner

    from ckptkit.cli.main import cli

    folder, _ = saved["fp16_tp2dp2"]
    runner = CliRunner()
    res = runner.invoke(cli, ["convert", f"{folder}/legacy", str(tmp_path / "a"), "--vocab-size", str(mm.VOCAB),
                              "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    scalers = [s for s in _meta(f"{folder}/adapter")["optimizer"]["grad_scalers"] if s is not None]
    assert out["meta"]["optimizer"]["grad_scalers"] == scalers and scalers[0]["scale"] > 1 and out["skipped"] == []
    assert ckptkit.diff(f"{folder}/imported", str(tmp_path / "a")).identical
    res = runner.invoke(cli, ["convert", f"{folder}/legacy", str(tmp_path / "w"), "--vocab-size", str(mm.VOCAB),
                              "--opt", "weights_only=true", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["meta"]["optimizer"] is None and out["skipped"] == ["optimizer: not imported (weights_only)"]


def test_a_legacy_moe_checkpoint_is_refused_before_anything_is_written(worlds, tmp_path):
    """Routed experts in a legacy save (here EP 1, SequentialMLP) have no legacy rule: the import names the first
    expert tensor and writes nothing, rather than importing the dense part and dropping the experts."""
    from ckptkit.errors import LayoutError

    layout = mm.Layout(tp=1, pp=1, ep=1, experts=8, shared_expert=True, expert_bias=True)
    worlds.run(4, job.train_and_save, layout, str(tmp_path), steps=job.STEPS)
    with pytest.raises(LayoutError, match=r"mp_rank_00/model_optim_rng\.pt: tensor 'decoder\.layers\.0\.mlp\.experts\."
                                          r"local_experts\.0\.linear_fc1\.weight'"):
        import_legacy(f"{tmp_path}/legacy", tmp_path / "out", vocab_size=mm.VOCAB)
    with pytest.raises(CkptkitError):
        ckptkit.open(tmp_path / "out")


@pytest.mark.parametrize("case, target", [("bf16_tp2pp2vpp2", "tp2pp1"), ("bf16_distributed_pp2vpp2dp2", "tp1pp2")])
def test_a_legacy_checkpoint_goes_on_to_megatrons_torch_dist_with_its_optimizer(worlds, saved, tmp_path, case,
                                                                                 target):
    """The migration a Megatron-LM team makes: ``ckptkit reshard LEGACY OUT --to ... --format megatron``, one
    command from the legacy save to a torch_dist directory at another layout. Megatron's own load of model,
    distributed optimizer, scheduler and iteration there resumes exactly as ckptkit's adapter resumes the same
    training state (its own save) at that layout: the moments, main copies and step came through."""
    from click.testing import CliRunner

    from ckptkit.cli.main import cli

    folder, _ = saved[case]
    layout = CASES[case][0]
    at = mm.Layout(tp=int(target[2]), pp=int(target[5]), bf16=True, tied=layout.tied, bias=layout.bias)
    out = str(tmp_path / "torch_dist")
    res = CliRunner().invoke(cli, ["reshard", f"{folder}/legacy", out, "--to", target, "--format", "megatron",
                                   "--vocab-size", str(mm.VOCAB)])
    assert res.exit_code == 0, res.output
    megatron = worlds.run(4, mjob.megatron_reference, at, out, steps=STEPS)[0]
    ckptkit_resume = worlds.run(4, mjob.resume, at, f"{folder}/adapter", steps=STEPS)[0]
    for field in ("iteration", "lr", "eval", "losses", "final_eval"):
        assert megatron[field] == ckptkit_resume[field], field
