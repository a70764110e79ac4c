"""The HF conversions driven by their options alone, the prefix spelled alike both ways, HF detection,
and the result's old field names (one release, with a DeprecationWarning).

A format object runs an HF import or export from ``HFImportOptions`` / ``HFExportOptions`` and nothing
else (the CLI's ``--hf-config``, ``--heads``/``--kv-heads``, ``--hf-family``, ``--prefix``): each
must give the same checkpoint, or the same shards, as the keyword form. The models are tiny ones saved
by ``transformers``' own ``save_pretrained`` (tests/test_hf_trust.py ``built``).
"""

from __future__ import annotations

import dataclasses
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.errors import CkptkitError, OptionsError
from ckptkit.storage.url import open_store
from ckptkit_converters.hf.exporter import HFExportResult, export_hf
from ckptkit_converters.hf.files import is_hf_folder
from ckptkit_converters.hf.importer import import_hf
from ckptkit_converters.hf.mapping import HFConfig
from ckptkit_converters.hf.options import HFExportOptions, HFImportOptions, hf_config_of
from tests.s3_server import s3_env, s3_server  # noqa: F401 - fixtures
from tests.test_hf_trust import built, checkpoint_tensors  # noqa: F401 - built: a fixture
from tests.test_hf_trust_links import make_cache

pytestmark = pytest.mark.timeout(300)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def shards(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# ---------------------------------------------------------------- detection


def test_is_hf_folder_sees_save_pretrained_folders_local_hub_and_s3(tmp_path, built, s3_env):  # noqa: F811
    single, sharded = built("llama"), built("llama_sharded")
    assert {p.name for p in single.iterdir()} >= {"config.json", "model.safetensors"}
    assert (sharded / "model.safetensors.index.json").exists() and not (sharded / "model.safetensors").exists()
    assert is_hf_folder(single) and is_hf_folder(str(sharded))
    assert is_hf_folder(make_cache(tmp_path / "hub", sharded))  # a hub snapshot: links into the repo's blobs/
    url = f"s3://{s3_env}/models/tiny"
    store = open_store(url)
    for f in sorted(single.iterdir()):
        store.put_bytes(f.name, f.read_bytes())
    assert is_hf_folder(url)
    assert not is_hf_folder(f"s3://{s3_env}/models/none")


def test_is_hf_folder_is_false_for_what_is_not_a_model_folder(tmp_path, built):
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "ckpt"
    ckptkit.save({"model": {"w": torch.ones(4)}}, str(ckpt))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "dcp"))
    (tmp_path / "empty").mkdir()
    only_config = tmp_path / "only-config"
    only_config.mkdir()
    shutil.copy(built("llama") / "config.json", only_config)
    weights_only = tmp_path / "weights-only"
    shutil.copytree(built("llama"), weights_only)
    (weights_only / "config.json").unlink()
    for folder in (ckpt, tmp_path / "dcp", tmp_path / "empty", only_config, weights_only, tmp_path / "absent"):
        assert not is_hf_folder(folder), folder
    assert not (tmp_path / "absent").exists()  # detection creates nothing


# ---------------------------------------------------------------- the import from its options


def test_import_options_alone_give_the_keyword_import(tmp_path, built):
    src = built("llama")
    want = checkpoint_tensors(_import(src, tmp_path / "keywords", HFConfig.from_file(src / "config.json")))
    # no config path: the folder's own config.json, read through the import's store
    import_hf(str(src), str(tmp_path / "folder-config"), options=HFImportOptions())
    assert same(checkpoint_tensors(tmp_path / "folder-config"), want)
    import_hf(str(src), str(tmp_path / "given-config"), options=HFImportOptions(config=str(src / "config.json")))
    assert same(checkpoint_tensors(tmp_path / "given-config"), want)
    config = HFImportOptions().hf_config(src)
    assert config == dataclasses.replace(HFConfig.from_file(src / "config.json"), source=config.source)
    assert config.source.endswith("config.json")


def test_import_options_without_a_config_anywhere_are_the_clis_error(tmp_path, built):
    bare = tmp_path / "bare"
    shutil.copytree(built("llama"), bare)
    (bare / "config.json").unlink()
    with pytest.raises(CkptkitError, match=r"--from hf needs the model's config.json \(--hf-config\)"):
        import_hf(str(bare), str(tmp_path / "out"), options=HFImportOptions())
    assert not (tmp_path / "out").exists()


def test_import_options_and_keywords_are_not_both_given(tmp_path, built):
    src = built("llama")
    with pytest.raises(OptionsError, match="prefix as keywords"):
        import_hf(str(src), str(tmp_path / "out"), options=HFImportOptions(), prefix="")
    with pytest.raises(OptionsError, match="family, make_vocab_size_divisible_by as keywords"):
        import_hf(str(src), str(tmp_path / "out"), options=HFImportOptions(), family="llama", make_vocab_size_divisible_by=64)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", [dict(prefix="model"), dict(family="gpt9"), dict(naming="nemo"),
                                 dict(make_vocab_size_divisible_by=0)])
def test_import_options_are_checked_when_made(bad):
    with pytest.raises(OptionsError):
        HFImportOptions(**bad)


def _import(src: Path, dest: Path, config: HFConfig, **kw: object) -> Path:
    import_hf(str(src), str(dest), config, **kw)  # type: ignore[arg-type]
    return dest


@pytest.mark.parametrize("prefix, under", [(None, "model/"), ("model/", "model/"), ("", ""), ("x/", "x/")])
def test_the_import_prefix_is_model_by_default_and_otherwise_as_given(tmp_path, built, prefix, under):
    src = built("llama")
    config = HFConfig.from_file(src / "config.json")
    keys = sorted(ckptkit.open(str(_import(src, tmp_path / "out", config, prefix=prefix))).keys())
    assert keys and all(k.startswith(under) and "/" not in k[len(under):] for k in keys)
    via_options = _import(src, tmp_path / "options", None, options=HFImportOptions(prefix=prefix))  # type: ignore[arg-type]
    assert sorted(ckptkit.open(str(via_options)).keys()) == keys


# ---------------------------------------------------------------- the export from its options


def test_export_options_alone_give_the_keyword_export(tmp_path, built):
    src = built("llama")
    ckpt = _import(src, tmp_path / "ckpt", HFConfig.from_file(src / "config.json"))
    export_hf(str(ckpt), str(tmp_path / "keywords"), HFConfig.from_file(src / "config.json"))
    result = export_hf(str(ckpt), str(tmp_path / "options"), options=HFExportOptions(config=str(src / "config.json")))
    assert result.prefix == "model/"  # detected, as with the keyword form
    assert shards(tmp_path / "options") == shards(tmp_path / "keywords")


def test_export_options_heads_stand_in_for_a_config(tmp_path, built):
    config = hf_config_of(None, heads=4, kv_heads=2)
    assert (config.n_heads, config.n_kv_heads, config.source) == (4, 2, "the head counts given")
    assert HFExportOptions(heads=4).hf_config().n_kv_heads == 4  # no kv_heads: as many as heads
    from_file = HFExportOptions(config=str(built("llama") / "config.json"), heads=8, kv_heads=8).hf_config()
    assert (from_file.n_heads, from_file.n_kv_heads, from_file.model_type) == (8, 8, "llama")  # flags win
    with pytest.raises(CkptkitError, match=r"needs the model's Hugging Face config.json .*--heads N"):
        HFExportOptions().hf_config()
    with pytest.raises(OptionsError, match="heads must be a positive integer"):
        HFExportOptions(heads=0)
    with pytest.raises(OptionsError, match="prefix must end with '/'"):
        HFExportOptions(prefix="model")


# ---------------------------------------------------------------- the result's old names


def test_result_dest_and_bytes_still_work_for_a_release_and_warn():
    result = HFExportResult("src", "dst", "hf", 3, 1234, 1234, 0.5, ("model.safetensors",), "llama", "model/")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names: no warning
        assert (result.destination, result.nbytes) == ("dst", 1234)
    with pytest.warns(DeprecationWarning, match=r"HFExportResult.dest .*use .destination"):
        assert result.dest == "dst"
    with pytest.warns(DeprecationWarning, match=r"HFExportResult.bytes .*use .nbytes"):
        assert result.bytes == 1234
    assert "dest" not in result.to_json() and result.to_json()["nbytes"] == 1234
