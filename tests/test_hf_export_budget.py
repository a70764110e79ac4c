"""The HF export under ``max_memory``: slabs of rows, the unbudgeted export's bytes exactly.

Every transform the export applies (Megatron's per-group QKV split with its biases, ``[gate; up]``,
the vocabulary trim, torchtitan's rotary permutation under GQA, per-expert reads, a cast) is run
at budgets from a few rows to whole tensors, and every file must equal the unbudgeted export's,
byte for byte. The slab planner's accounting (what a slab reads and makes stays under the budget,
the slabs cover every output row once, in order, whole heads where the rows are permuted) is
property-tested over the row maps those transforms give.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit_converters.hf.exporter import AttentionHeads, HFExportOptions, export_hf
from ckptkit_converters.hf.mapping import HFConfig
from ckptkit_converters.hf.slabs import plan_slabs
from tests.test_convert_hf_moe import E, NG, QPG, V, L, megatron_model


def _files(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def _megatron_ckpt(tmp_path: Path) -> tuple[str, HFConfig]:
    meg, _ = megatron_model(tied=False, moe=True)
    ckptkit.save({"model": meg}, str(tmp_path / "ckpt"))
    conf = {"model_type": "qwen2_moe", "num_attention_heads": NG * QPG, "num_key_value_heads": NG, "vocab_size": V,
            "num_hidden_layers": L, "num_experts": E}
    return str(tmp_path / "ckpt"), HFConfig.from_dict(conf)


@pytest.mark.parametrize("budget", [1 << 10, 5000, 1 << 14, 1 << 30])
@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_megatron_moe_export_is_the_same_bytes_under_any_budget(tmp_path, budget, dtype):
    ckpt, cfg = _megatron_ckpt(tmp_path)
    whole = tmp_path / "whole"
    export_hf(ckpt, str(whole), cfg, options=HFExportOptions(max_shard_bytes=16 << 10, dtype=dtype))
    slabbed = tmp_path / "slabbed"
    result = export_hf(ckpt, str(slabbed), cfg,
                       options=HFExportOptions(max_shard_bytes=16 << 10, dtype=dtype, max_memory=budget))
    assert len(result.shards) > 1
    assert _files(slabbed) == _files(whole)


@pytest.mark.parametrize("n_kv_heads", [None, 4])
def test_torchtitan_rotary_export_is_the_same_bytes_under_a_budget_of_a_few_heads(tmp_path, n_kv_heads):
    pytest.importorskip("torchtitan")
    from tests.test_convert_hf import debug_model

    _, cfg, model = debug_model(n_kv_heads)
    ckptkit.save({"model": {k: v.detach().clone() for k, v in model.state_dict().items()}}, str(tmp_path / "ckpt"))
    attn = cfg.layers[0].attention
    heads = AttentionHeads(attn.n_heads, attn.n_kv_heads or attn.n_heads)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "whole"), heads)
    head_rows = cfg.dim // attn.n_heads
    budget = 3 * head_rows * cfg.dim * 4 * 3  # three heads' rows, read and made (fp32)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "slabbed"), heads, options=HFExportOptions(max_memory=budget))
    assert _files(tmp_path / "slabbed") == _files(tmp_path / "whole")


def test_a_budget_below_one_row_is_refused_naming_the_tensor_and_leaves_no_shard(tmp_path):
    ckpt, cfg = _megatron_ckpt(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(ckptkit.CkptkitError, match=r"tensor '.*' \(.*\): max_memory 64 bytes cannot hold 1 row"):
        export_hf(ckpt, str(out), cfg, options=HFExportOptions(max_memory=64))
    assert not out.exists() or not os.listdir(out)  # checked before anything was written
    with pytest.raises(ckptkit.CkptkitError, match="max_memory must be a positive"):
        HFExportOptions(max_memory=0)


def test_the_cli_takes_max_memory_as_a_size(tmp_path):
    from click.testing import CliRunner

    from ckptkit.cli.main import cli

    ckpt, _ = _megatron_ckpt(tmp_path)
    config = tmp_path / "config.json"
    import json

    config.write_text(json.dumps({"model_type": "qwen2_moe", "num_attention_heads": NG * QPG, "num_key_value_heads": NG,
                                  "vocab_size": V, "num_hidden_layers": L, "num_experts": E}))
    for name, extra in (("whole", []), ("slabbed", ["--max-memory", "4KiB"])):
        result = CliRunner().invoke(cli, ["convert", ckpt, str(tmp_path / name), "--format", "hf", "--hf-config",
                                          str(config), *extra])
        assert result.exit_code == 0, result.output
    assert _files(tmp_path / "slabbed") == _files(tmp_path / "whole")


def _rope_map(heads: int, head_dim: int) -> np.ndarray:
    from ckptkit_converters.hf.mapping import rope_to_hf

    rows = heads * head_dim
    return rope_to_hf(torch.arange(rows).reshape(rows, 1), heads)[:, 0].numpy()


def _qkv_map(groups: int, per_group: int, head_dim: int, take: int) -> np.ndarray:
    from ckptkit_converters.hf.mapping import split_qkv

    cfg = HFConfig(n_heads=groups * per_group, n_kv_heads=groups, source="test")
    rows = groups * (per_group + 2) * head_dim
    return split_qkv(torch.arange(rows).reshape(rows, 1), cfg, "test")[take][:, 0].numpy()


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(["rope", "qkv", "shuffle", "identity"]), a=st.integers(1, 4), b=st.integers(1, 4),
       hd=st.sampled_from([2, 4, 8]), take=st.integers(0, 2), row_read=st.integers(1, 64), row_made=st.integers(1, 64),
       budget=st.integers(1, 4096), seed=st.integers(0, 1 << 16))
def test_slabs_cover_every_row_once_in_order_within_the_budget(kind, a, b, hd, take, row_read, row_made, budget, seed):
    if kind == "rope":
        sources, align = _rope_map(a, hd), hd
    elif kind == "qkv":
        sources, align = _qkv_map(a, b, hd, take), 1
    elif kind == "shuffle":
        sources, align = np.random.default_rng(seed).permutation(a * b * hd), 1
    else:
        sources, align = np.arange(a * b * hd), 1
    try:
        slabs = plan_slabs(sources, align, row_read, row_made, budget, "t")
    except ckptkit.CkptkitError as exc:
        first = sources[:align]
        assert (int(np.ptp(first)) + 1) * row_read + len(first) * row_made > budget or "cannot hold" in str(exc)
        assert "cannot hold" in str(exc)
        return
    assert [s.start for s in slabs] == [0] + [s.stop for s in slabs[:-1]] and slabs[-1].stop == len(sources)
    for s in slabs:
        part = sources[s.start:s.stop]
        assert s.lo == part.min() and s.hi == part.max() + 1
        assert (s.hi - s.lo) * row_read + (s.stop - s.start) * row_made <= budget
        assert s.start % align == 0 and (s.stop % align == 0 or s.stop == len(sources))


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=4), offs=st.lists(st.integers(0, 50), min_size=4,
                                                                              max_size=4),
       itemsize=st.sampled_from([1, 2, 4]), budget=st.integers(1, 2000))
def test_megatron_export_slabs_tile_each_chunk_within_the_budget(sizes, offs, itemsize, budget):
    """converters/megatron/exporter.py ``split_chunk``: the boxes of a target chunk tile it exactly (every
    element once), each within ``max_memory`` (cut by slabs of the outermost axis, then inner axes where one
    slab is too big); only a budget below one run of the innermost axis is refused, naming the tensor."""
    import itertools
    import math

    from ckptkit.errors import LayoutError
    from ckptkit_converters.megatron.exporter import split_chunk

    chunk = (3, tuple(offs[:len(sizes)]), tuple(sizes))
    try:
        slabs = split_chunk(chunk, itemsize, budget, "t")
    except LayoutError as exc:  # only when one run of the innermost axis (the smallest box) is over the budget
        assert sizes[-1] * itemsize > budget and "'t'" in str(exc)
        return
    seen = set()
    for rank, o, z in slabs:
        assert rank == 3 and math.prod(z) * itemsize <= budget
        for cell in itertools.product(*(range(a, a + n) for a, n in zip(o, z))):
            assert cell not in seen
            seen.add(cell)
    assert seen == set(itertools.product(*(range(a, a + n) for a, n in zip(chunk[1], chunk[2]))))
