"""Which rank writes what in a torch_dist export at uneven pipeline stages and virtual pipeline chunks.

Megatron's load reads any torch_dist directory by overlap, so a directory written for one pipeline split
loads at another (tests/test_megatron.py resumes exports at tp2pp2vpp2 and at uneven tp1pp2 in Megatron
itself, bit-exact). What the target split changes is which rank's file holds each layer: the rank whose
pipeline chunk holds it, so that each rank of the target job reads its own layers from its own file. Here,
on the golden Megatron checkpoint (2 layers), without Megatron: every chunk of every layer-stacked tensor,
model and optimizer, and every layer's ``_extra_state``, lies in the file of the rank that owns the layer at
the target (read from DCP's own ``.metadata``); the tensors are those of the even split, bit for bit; and
splits that do not hold the model's layers are refused naming the counts, with nothing written.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from ckptkit.errors import LayoutError
from ckptkit.layout.config import ParallelConfig
from ckptkit_converters.megatron.exporter import export_torch_dist
from tests.format_samples import GOLDEN
from tests.test_megatron_optimizer_export import read_torch_dist

SOURCE = GOLDEN / "megatron" / "ckpt"
LAYERS = 2
STACKED = re.compile(r"^(optimizer\.state\.\w+\.)?decoder\.layers\.")


def _file_rank(relative_path: str) -> int:
    """DCP's ``FileSystemWriter`` names each plan's file ``__<plan index>_<n>.distcp``; the export's plans are
    its target ranks in order."""
    match = re.match(r"^__(\d+)_\d+\.distcp$", relative_path)
    assert match, relative_path
    return int(match.group(1))


@pytest.mark.parametrize("pp, vpp, pp_layers", [(2, 1, None), (2, 1, (2, 0)), (2, 2, (0, 1, 1, 0)), (1, 2, (1, 1))],
                         ids=["even", "uneven-all-on-stage-0", "virtual-chunks-swap-stages", "pp1-vpp2"])
def test_each_layer_is_written_by_the_rank_that_holds_it(tmp_path: Path, pp: int, vpp: int,
                                                         pp_layers: tuple[int, ...] | None) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    out = tmp_path / "out"
    export_torch_dist(SOURCE, out, tp=1, pp=pp, vpp=vpp, pp_layers=pp_layers)
    config = ParallelConfig(tp=1, pp=pp, vpp=vpp, pp_layers=pp_layers)
    meta = FileSystemReader(str(out)).read_metadata()
    layers_seen: dict[str, set[int]] = {}
    for index, info in meta.storage_data.items():
        rank = _file_rank(info.relative_path)
        if "._extra_state/shard_" in index.fqn:
            layer = int(index.fqn.rsplit("shard_", 1)[1].split("_")[0])
            assert config.layer_owner(layer, LAYERS)[0] == rank, (index.fqn, rank)
        elif STACKED.match(index.fqn):
            size = meta.state_dict_metadata[index.fqn].chunks
            chunk = next(c for c in size if tuple(c.offsets) == tuple(index.offset))
            layers = range(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0])
            assert {config.layer_owner(layer, LAYERS)[0] for layer in layers} == {rank}, (index.fqn, rank)
            layers_seen.setdefault(index.fqn, set()).update(layers)
    assert layers_seen and all(seen == set(range(LAYERS)) for seen in layers_seen.values())
    assert any(k.startswith("optimizer.state.exp_avg.decoder.layers.") for k in layers_seen)
    even = tmp_path / "even"
    export_torch_dist(SOURCE, even, tp=1, pp=1)
    a, b = read_torch_dist(out), read_torch_dist(even)
    assert sorted(a) == sorted(b) and all(a[k].equal(b[k]) for k in a)


@pytest.mark.parametrize("pp, vpp, pp_layers, message", [
    (3, 1, None, "2 layers do not split evenly over pp=3 x vpp=1"),
    (2, 2, None, "2 layers do not split evenly over pp=2 x vpp=2"),
    (2, 1, (1, 2), r"pp_layers \[1, 2\] sum to 3, model has 2 layers"),
    (2, 2, (1, 1), r"pp_layers \[1, 1\] must give 4 non-negative layer counts"),
])
def test_a_split_that_does_not_hold_the_layers_is_refused(tmp_path: Path, pp: int, vpp: int,
                                                          pp_layers: tuple[int, ...] | None, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        export_torch_dist(SOURCE, tmp_path / "out", tp=1, pp=pp, vpp=vpp, pp_layers=pp_layers)
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_the_cli_exports_at_a_virtual_pipeline_target(tmp_path: Path) -> None:
    """`ckptkit convert SRC OUT --format megatron --to tp1pp2vpp2` (even chunks need 4 layers: refused naming
    them) and `ckptkit reshard ... --format megatron --vpp 2 --pp-layers 0,1,1,0`."""
    from click.testing import CliRunner

    from ckptkit.cli.main import cli

    result = CliRunner().invoke(cli, ["convert", str(SOURCE), str(tmp_path / "a"), "--format", "megatron",
                                      "--to", "tp1pp2vpp2"])
    assert result.exit_code != 0 and "do not split evenly over pp=2 x vpp=2" in " ".join(result.output.split())
    result = CliRunner().invoke(cli, ["reshard", str(SOURCE), str(tmp_path / "b"), "--format", "megatron",
                                      "--to", "tp1pp2", "--vpp", "2", "--pp-layers", "0,1,1,0"])
    assert result.exit_code == 0, result.output
    assert os.path.exists(tmp_path / "b" / ".metadata")
