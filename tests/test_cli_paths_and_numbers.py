"""Command-line arguments that name the source by another spelling, or numbers that are not numbers.

Found by a hunt over the CLI (2026-12-06), each reproduced first:

* ``convert --format hf`` into a folder holding a model (``config.json``, ``model.safetensors``,
  as ``save_pretrained`` writes a small one) overwrote its weights without a word, and a failed
  export then deleted them (truncated by the write, removed by the cleanup);
* the "DEST may not be SRC or lie inside it" check compared path strings: through a link to the
  source, or with a DCP or zarr source (checked against its temporary import), reshard wrote into
  the source's folder; exports did not check at all (``convert CK CK --format hf`` wrote shards
  into the checkpoint);
* ``--chunk-mib nan``, ``--shard-mib inf`` and ``--to tp99999999999999999999`` ended as "this is a
  ckptkit bug" (exit 3), and ``plan --params nan`` printed a "nan min" interval;
* ``ckptkit report`` on a missing path printed "0 incidents" and exited 0.

The tests look for the classes: every spelling of an overlap for every writing command, every
float option of every command given every non-finite value, every degree past the bound.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

import ckptkit
from ckptkit.cli.main import cli

D, H, KV, F, V, L = 16, 4, 2, 32, 40, 2


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def llama(path: Path) -> Path:
    """A tiny torchtitan-named Llama checkpoint and its HF config."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    sd = {"tok_embeddings.weight": r(V, D), "norm.weight": r(D), "output.weight": r(V, D)}
    for i in range(L):
        p = f"layers.{i}."
        sd.update({p + "attention.qkv_linear.wq.weight": r(D, D), p + "attention.qkv_linear.wk.weight": r(KV * D // H, D),
                   p + "attention.qkv_linear.wv.weight": r(KV * D // H, D), p + "attention.wo.weight": r(D, D),
                   p + "feed_forward.w1.weight": r(F, D), p + "feed_forward.w2.weight": r(D, F),
                   p + "feed_forward.w3.weight": r(F, D), p + "attention_norm.weight": r(D),
                   p + "ffn_norm.weight": r(D)})
    ckptkit.save({"model": sd}, str(path))
    config = path.parent / "config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "hidden_size": D, "num_attention_heads": H, "num_key_value_heads": KV,
        "intermediate_size": F, "vocab_size": V, "num_hidden_layers": L, "tie_word_embeddings": False}))
    return config


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("held", ["model.safetensors", "model-00001-of-00002.safetensors",
                                  "model.safetensors.index.json", "adapter.safetensors"])
def test_an_hf_export_never_writes_over_weights_in_its_destination(tmp_path, held):
    config = llama(tmp_path / "ck")
    dest = tmp_path / "user_model"
    dest.mkdir()
    (dest / "config.json").write_text(config.read_text())
    (dest / held).write_bytes(b"the user's weights")
    before = digest(dest)
    result = run("convert", str(tmp_path / "ck"), str(dest), "--format", "hf", "--hf-config", str(config))
    assert result.exit_code == 2 and f"{dest}/{held} exists" in result.stderr, result.output
    assert digest(dest) == before


def test_an_hf_export_keeps_the_config_and_tokenizer_it_is_written_next_to(tmp_path):
    config = llama(tmp_path / "ck")
    dest = tmp_path / "user_model"
    dest.mkdir()
    (dest / "config.json").write_text(config.read_text())
    (dest / "tokenizer.json").write_text("{}")
    result = run("convert", str(tmp_path / "ck"), str(dest), "--format", "hf", "--hf-config", str(config))
    assert result.exit_code == 0, result.output
    assert (dest / "tokenizer.json").read_text() == "{}" and (dest / "model.safetensors").is_file()


def spellings(tmp_path: Path, src: Path) -> dict[str, str]:
    """Destinations that are, or are inside, or hold, ``src``, by several spellings."""
    link = tmp_path / "link"
    if not link.exists():
        link.symlink_to(src, target_is_directory=True)
    return {"itself": str(src), "inside": str(src / "inner"), "through a link": str(link / "inner"),
            "the link itself": str(link), "with ..": str(src / "x" / ".." / "inner"),
            "a file:// URL": f"file://{src}/inner", "around it": str(src.parent)}


COMMANDS = {
    "reshard": lambda src, dst: ("reshard", src, dst, "--to", "tp1pp1"),
    "convert to zarr": lambda src, dst: ("convert", src, dst, "--format", "zarr"),
    "convert to dcp": lambda src, dst: ("convert", src, dst, "--format", "dcp"),
}


@pytest.mark.parametrize("command, source_format", [(c, f) for c in COMMANDS for f in ("ckptkit", "dcp")
                                                     if (c, f) != ("convert to dcp", "dcp")])  # DCP -> DCP: no such direction
def test_no_writing_command_writes_into_or_around_its_source(tmp_path, command, source_format):
    base = tmp_path / "base"
    base.mkdir()
    src = base / "src"
    ckptkit.save({"w": torch.arange(6.0), "step": 3}, str(src if source_format == "ckptkit" else base / "ck"))
    if source_format == "dcp":
        assert run("convert", str(base / "ck"), str(src), "--format", "dcp").exit_code == 0
    before = digest(base)
    for name, dst in spellings(tmp_path, src).items():
        result = run(*COMMANDS[command](str(src), dst))
        assert result.exit_code == 2 and "overlaps the source" in result.stderr, (name, result.output)
        assert digest(base) == before, name  # nothing written, nothing removed


def test_an_hf_export_into_its_own_checkpoint_is_refused(tmp_path):
    config = llama(tmp_path / "ck")
    before = digest(tmp_path / "ck")
    for dst in (tmp_path / "ck", tmp_path / "ck" / "hf"):
        result = run("convert", str(tmp_path / "ck"), str(dst), "--format", "hf", "--hf-config", str(config))
        assert result.exit_code == 2 and "overlaps the source" in result.stderr, result.output
    assert digest(tmp_path / "ck") == before


def float_options() -> list[tuple[str, str]]:
    """Every (command, option) of the CLI whose type is a float range: found, not listed."""
    found = []
    for name, command in cli.commands.items():
        for param in command.params:
            if isinstance(param, click.Option) and isinstance(param.type, click.FloatRange):
                found.append((name, param.opts[0]))
    return found


def test_the_float_options_are_found():
    options = float_options()
    assert ("convert", "--chunk-mib") in options and ("plan", "--params") in options and len(options) >= 10


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "1e999"])
@pytest.mark.parametrize("command, option", float_options())
def test_a_float_option_refuses_what_is_not_a_finite_number(tmp_path, command, option, value):
    required = {"plan": ["--params", "7e9", "--mtbf-hours", "3", "--write-gbps", "5"],
                "convert": [str(tmp_path / "src"), str(tmp_path / "dst"), "--format", "zarr"]}[command]
    args = [a for a in required]
    if option in args:
        args[args.index(option) + 1] = value
    else:
        args += [option, value]
    result = run(command, *args)
    assert result.exit_code == 2 and ("is not a finite number" in result.output or "is not in the range" in result.output), \
        result.output
    assert "Traceback" not in result.output and "nan min" not in result.output


@pytest.mark.parametrize("layout", ["tp99999999999999999999", "dp1048577", "tp1024dp1025", "pp2097152",
                                    "tp1pp1vpp99999999999", "ep9999999999999dp1"])
def test_a_layout_past_the_formats_bound_is_a_usage_error_at_once(tmp_path, layout):
    ckptkit.save({"w": torch.arange(6.0)}, str(tmp_path / "src"))
    result = run("reshard", str(tmp_path / "src"), "--to", layout, "--dry-run")
    assert result.exit_code == 2 and "1048576" in result.output, result.output


def test_numbers_at_the_bound_still_parse():
    from ckptkit.layout.config import ParallelConfig

    assert ParallelConfig.parse("tp8pp8dp16384").world_size == 2**20
    assert math.isfinite(float("1e308"))
