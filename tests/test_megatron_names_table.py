"""Megatron's names in one table, and the names retired in this release (issue 25).

* converters/megatron/names.py spells every Megatron tensor name; the HF key tables' ``megatron_*``
  families are built from it, so they can only name tensors it knows;
* ``divisible_by=`` became ``make_vocab_size_divisible_by=`` (Megatron's own name) on the imports,
  the export, ``resolve_vocab`` and ``padded_vocab``: the old keyword still works for one release,
  warning, and gives the same result;
* the torchtitan Llama key table is named by the HF ``model_type`` it serves, ``llama``; ``llama3``
  still finds it for one release, warning.

Small folders built by hand (tests/test_import_trust_folders.py), no Megatron install needed.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.errors import CkptkitError, LayoutError
from ckptkit_converters.hf import families
from ckptkit_converters.megatron import names
from ckptkit_converters.megatron.exporter import export_torch_dist
from ckptkit_converters.megatron.files import SavedArgs
from ckptkit_converters.megatron.importer import import_legacy, import_torch_dist, read_torch_dist, resolve_vocab
from tests.test_import_trust_folders import legacy_folder, torch_dist_folder

NEW = "make_vocab_size_divisible_by"


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    view = ckptkit.open(str(path))
    return {k: view[k][...] for k in view.manifest.tensors}


def _warned_renamed(caught: list[warnings.WarningMessage], old: str, new: str) -> bool:
    return any(issubclass(w.category, DeprecationWarning) and old in str(w.message) and new in str(w.message)
               for w in caught)


# ---------------------------------------------------------------- one table of Megatron names


def test_the_vocab_names_are_the_live_adapters():
    """The converters and the live adapter must call the vocab tensors and their padding side tensors alike:
    an export reads the padding rows the adapter saved, by name."""
    from ckptkit.adapters.megatron import model_space

    assert names.VOCAB_TENSORS == model_space.VOCAB_KEYS
    assert names.VOCAB_PADDING_SUFFIX == model_space.PADDING_SUFFIX


def test_every_megatron_key_the_hf_tables_map_is_a_name_megatron_names_knows():
    """A Megatron key typed into converters/hf/families.py by hand, not taken from names.py, would drift
    from the partition rules: every key a ``megatron_*`` table maps or drops has a rule there (or is a
    vocab tensor's padding side tensor, or an MoE layer's own pre-MLP norm, which the HF export maps and
    names.py spells but gives no partition rule)."""
    tables = [f for f in families.FAMILIES.values() if f.naming == families.MEGATRON]
    assert len(tables) == 5
    moe_norm = f"{names.LAYER_PREFIX}{names.LOCAL_PRE_MLP_NORM}weight"
    padding = {key + names.VOCAB_PADDING_SUFFIX for key in names.VOCAB_TENSORS}
    seen = set()
    for table in tables:
        for key in [rule.ours for rule in table.rules] + list(table.drop):
            seen.add(key)
            if key == moe_norm or key in padding:
                continue
            names.rule_for(key, divisible_by=8)  # raises LayoutError for a name names.py does not know
    assert moe_norm in seen and padding <= seen and f"{names.LAYER_PREFIX}{names.SHARED_GATE}" in seen
    with pytest.raises(LayoutError, match="names.py"):
        names.rule_for(f"{names.LAYER_PREFIX}mlp.linear_fc1.weigth", divisible_by=8)


# ---------------------------------------------------------------- divisible_by -> make_vocab_size_divisible_by


def test_padded_vocab_and_resolve_vocab_take_the_old_keyword_for_one_release():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert names.padded_vocab(250, make_vocab_size_divisible_by=16, tp=4) == 256
        assert not caught
        assert names.padded_vocab(250, divisible_by=16, tp=4) == 256
    assert _warned_renamed(caught, "divisible_by=", NEW + "=")
    args = SavedArgs()  # records nothing: the given values are the ones used
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new = resolve_vocab(250, args=args, padded_rows=256, where="ckpt", make_vocab_size_divisible_by=16)
        assert not caught
        old = resolve_vocab(250, args=args, padded_rows=256, where="ckpt", divisible_by=16)
    assert new == old == (250, 16)
    assert _warned_renamed(caught, "resolve_vocab(divisible_by=", NEW)
    with pytest.raises(TypeError, match=f"pass {NEW}= only"):
        names.padded_vocab(250, divisible_by=16, make_vocab_size_divisible_by=16, tp=4)


@pytest.mark.parametrize("kind", ["torch_dist", "legacy"])
def test_the_imports_take_the_old_keyword_for_one_release(tmp_path, kind):
    """Both spellings import the same checkpoint; the old one warns, and its value is the one checked
    against the saved args (a disagreeing one is refused either way)."""
    if kind == "torch_dist":
        source, importer, recorded = str(torch_dist_folder(tmp_path / "src")), import_torch_dist, 16
    else:
        source, importer, recorded = str(legacy_folder(tmp_path / "src")), import_legacy, 8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new = importer(source, str(tmp_path / "new"), make_vocab_size_divisible_by=recorded)
        assert not [w for w in caught if issubclass(w.category, DeprecationWarning)]
        old = importer(source, str(tmp_path / "old"), divisible_by=recorded)
    assert _warned_renamed(caught, f"{importer.__name__}(divisible_by=", NEW)
    assert new.meta == old.meta and new.meta[NEW] == recorded
    ours, theirs = _tensors(tmp_path / "new"), _tensors(tmp_path / "old")
    assert ours.keys() == theirs.keys() and len(ours) == 3
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    disagrees = "disagrees with the checkpoint's make_vocab_size_divisible_by"
    with pytest.raises(LayoutError, match=disagrees):
        importer(source, str(tmp_path / "bad_new"), make_vocab_size_divisible_by=recorded * 2)
    with pytest.warns(DeprecationWarning, match=NEW), pytest.raises(LayoutError, match=disagrees):
        importer(source, str(tmp_path / "bad_old"), divisible_by=recorded * 2)


def test_the_export_takes_the_old_keyword_for_one_release(tmp_path):
    """Re-padding the vocabulary to another multiple: both spellings write the same rows (16 tokens padded
    to 24 x tp 2 = 48), the checkpoint's own multiple (16 x 2 = 32) without either; the old one warns."""
    import_torch_dist(str(torch_dist_folder(tmp_path / "src")), str(tmp_path / "ck"))

    def rows(folder: Path) -> int:
        ckpt, _ = read_torch_dist(str(folder))
        return ckpt.tensors[names.EMBEDDING].shape[0]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_torch_dist(str(tmp_path / "ck"), str(tmp_path / "new"), tp=2, pp=1, make_vocab_size_divisible_by=24)
        assert not [w for w in caught if issubclass(w.category, DeprecationWarning)]
        export_torch_dist(str(tmp_path / "ck"), str(tmp_path / "old"), tp=2, pp=1, divisible_by=24)
    assert _warned_renamed(caught, "export_torch_dist(divisible_by=", NEW)
    export_torch_dist(str(tmp_path / "ck"), str(tmp_path / "own"), tp=2, pp=1)
    assert rows(tmp_path / "new") == rows(tmp_path / "old") == 48 and rows(tmp_path / "own") == 32
    back = {}
    for name in ("new", "old"):
        import_torch_dist(str(tmp_path / name), str(tmp_path / f"{name}_back"), vocab_size=16,
                          make_vocab_size_divisible_by=24)
        back[name] = _tensors(tmp_path / f"{name}_back")
    original = _tensors(tmp_path / "ck")  # 16 tokens, no padding rows: the export made 32 (zeros), kept apart
    pads = {f"model/{k}{names.VOCAB_PADDING_SUFFIX}" for k in names.VOCAB_TENSORS}
    assert back["new"].keys() == back["old"].keys() == original.keys() | pads
    assert all(torch.equal(back["new"][k], original[k]) and torch.equal(back["old"][k], original[k]) for k in original)
    for name in ("new", "old"):
        assert all(back[name][k].shape[0] == 32 and not back[name][k].any() for k in pads)


# ---------------------------------------------------------------- the llama table, formerly llama3


def test_llama3_finds_the_llama_table_for_one_release():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = families.family_named("llama")
        assert not caught and table.model_type == "llama" and table.naming == families.TORCHTITAN
        assert families.family_for("llama", families.TORCHTITAN) is table
        assert families.family_named("llama3") is table
        assert _warned_renamed(caught, "'llama3'", "'llama'")
        caught.clear()
        assert families.FAMILIES["llama3"] is table and _warned_renamed(caught, "'llama3'", "'llama'")
        caught.clear()
        assert families.LLAMA3 is families.LLAMA is table and _warned_renamed(caught, "LLAMA3", "LLAMA")
    assert "llama3" in families.FAMILIES and "llama3" not in list(families.FAMILIES)
    assert len(families.FAMILIES) == len(list(families.FAMILIES)) == 10
    with pytest.raises(CkptkitError, match=r"unknown model family 'llama2' \(known: llama, qwen3") as e:
        families.family_named("llama2")
    assert "llama3" not in str(e.value)
    with pytest.raises(KeyError):
        families.FAMILIES["llama2"]


def test_an_hf_export_with_family_llama3_writes_what_llama_writes(tmp_path):
    """The key table picked by its old name exports the same tensors, reporting the table's name now."""
    from safetensors.torch import load_file

    from ckptkit_converters.hf.exporter import HFExportOptions, export_hf
    from ckptkit_converters.hf.mapping import AttentionHeads

    g = torch.Generator().manual_seed(0)
    dim, ffn, vocab = 8, 12, 10
    sd = {"tok_embeddings.weight": torch.randn(vocab, dim, generator=g), "norm.weight": torch.randn(dim, generator=g),
          "output.weight": torch.randn(vocab, dim, generator=g)}
    for layer in range(2):
        p = f"layers.{layer}."
        for w in ("wq", "wk", "wv"):
            sd[f"{p}attention.qkv_linear.{w}.weight"] = torch.randn(dim, dim, generator=g)
        sd[p + "attention.wo.weight"] = torch.randn(dim, dim, generator=g)
        sd[p + "feed_forward.w1.weight"] = torch.randn(ffn, dim, generator=g)
        sd[p + "feed_forward.w3.weight"] = torch.randn(ffn, dim, generator=g)
        sd[p + "feed_forward.w2.weight"] = torch.randn(dim, ffn, generator=g)
        sd[p + "attention_norm.weight"] = torch.randn(dim, generator=g)
        sd[p + "ffn_norm.weight"] = torch.randn(dim, generator=g)
    ckptkit.save({"model": sd}, str(tmp_path / "ck"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new = export_hf(str(tmp_path / "ck"), str(tmp_path / "new"), AttentionHeads(2, 2),
                        options=HFExportOptions(family="llama"))
        assert not [w for w in caught if issubclass(w.category, DeprecationWarning)]
        old = export_hf(str(tmp_path / "ck"), str(tmp_path / "old"), AttentionHeads(2, 2),
                        options=HFExportOptions(family="llama3"))
    assert _warned_renamed(caught, "'llama3'", "'llama'")
    assert new.family == old.family == "llama"
    ours = load_file(str(tmp_path / "new" / "model.safetensors"))
    theirs = load_file(str(tmp_path / "old" / "model.safetensors"))
    assert ours.keys() == theirs.keys() and len(ours) == len(sd)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert torch.equal(ours["model.layers.1.mlp.down_proj.weight"], sd["layers.1.feed_forward.w2.weight"])
