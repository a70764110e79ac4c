"""Megatron's damaged torch_dist folders and export progress, pinned beyond the conformance suite.

* a torch_dist folder whose ``metadata.json`` is truncated, not UTF-8, names another backend or is
  gone (``common.pt`` and the DCP files still there) is detected as Megatron, and the import fails
  naming ``metadata.json`` and what is wrong with it, committing nothing; a plain DCP folder, and
  one with an unrelated ``metadata.json`` but no ``common.pt``, stay DCP;
* an export's progress ends at ``done == total == result.nbytes``, the padded bytes written:
  the sum of the exported tensors' global (padded) sizes as DCP's ``.metadata`` records them.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import ckptkit
from ckptkit.errors import CkptkitError
from ckptkit.offline.formats import RunOptions
from ckptkit_converters import registry
from ckptkit_converters.megatron.exporter import export_torch_dist
from ckptkit_converters.megatron.format import FORMAT
from ckptkit_converters.megatron.names import VOCAB_PADDING_SUFFIX
from tests.format_samples import GOLDEN
from tests.test_import_trust_folders import torch_dist_folder

# ---------------------------------------------------------------- damaged metadata.json


def _truncate(folder: Path) -> None:
    data = (folder / "metadata.json").read_bytes()
    (folder / "metadata.json").write_bytes(data[:len(data) // 2])


def _not_utf8(folder: Path) -> None:
    data = bytearray((folder / "metadata.json").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / "metadata.json").write_bytes(bytes(data))


def _other_backend(folder: Path) -> None:
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))


def _delete(folder: Path) -> None:
    (folder / "metadata.json").unlink()


def _delete_with_dcp_index(folder: Path) -> None:
    """Only the ``*.distcp`` files are left of the DCP part: found by the listing."""
    (folder / "metadata.json").unlink()
    (folder / ".metadata").unlink()


DAMAGED: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated": (_truncate, "not valid JSON"),
    "not_utf8": (_not_utf8, "not valid UTF-8"),
    "other_backend": (_other_backend, "sharded_backend is 'zarr'"),
    "deleted": (_delete, "lacks its metadata.json"),
    "deleted_with_dcp_index": (_delete_with_dcp_index, "lacks its metadata.json"),
}


def _import(src: Path, dest: Path) -> None:
    FORMAT.import_to(str(src), str(dest), None, RunOptions())


def test_an_intact_torch_dist_folder_imports(tmp_path: Path) -> None:
    """The folder the damage cases start from imports cleanly, so each case fails on its damage."""
    src = torch_dist_folder(tmp_path / "src")
    assert registry.detect(src).name == "megatron"
    _import(src, tmp_path / "dest")
    assert (tmp_path / "dest" / "manifest.json").exists()


@pytest.mark.parametrize("damage", list(DAMAGED))
def test_a_damaged_metadata_json_is_detected_and_named(tmp_path: Path, damage: str) -> None:
    src = torch_dist_folder(tmp_path / "src")
    hurt, why = DAMAGED[damage]
    hurt(src)
    assert registry.detect(src).name == "megatron"
    dest = tmp_path / "dest"
    with pytest.raises(CkptkitError) as err:
        _import(src, dest)
    message = str(err.value)
    assert f"{src}/metadata.json" in message and why in message, message
    assert "mp_rank" not in message, message
    assert not (dest / "manifest.json").exists()


def test_a_plain_dcp_folder_stays_dcp(tmp_path: Path) -> None:
    """No ``metadata.json`` and no ``common.pt``: DCP's, whatever Megatron-like names it holds."""
    src = torch_dist_folder(tmp_path / "src")
    (src / "metadata.json").unlink()
    (src / "common.pt").unlink()
    assert registry.detect(src).name == "dcp"


@pytest.mark.parametrize("text", [b'{"sharded', b'{"format": "something else"}'])
def test_an_unrelated_metadata_json_without_common_pt_is_not_megatron(tmp_path: Path, text: bytes) -> None:
    src = torch_dist_folder(tmp_path / "src")
    (src / "common.pt").unlink()
    (src / "metadata.json").write_bytes(text)
    assert registry.detect(src).name == "dcp"


# ---------------------------------------------------------------- export progress


def _written_bytes(folder: Path) -> int:
    """The tensor bytes a torch_dist folder holds, from DCP's ``.metadata`` (global, padded sizes)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(folder)).read_metadata()
    return sum(math.prod(m.size) * m.properties.dtype.itemsize
               for m in meta.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata))


@pytest.mark.parametrize("tp,divisible", [(1, None), (2, 16), (4, 8)])
def test_export_progress_ends_at_the_padded_bytes_written(tmp_path: Path, tp: int, divisible: int | None) -> None:
    src = tmp_path / "ckpt"
    shutil.copytree(GOLDEN / "megatron" / "ckpt", src)
    calls: list[tuple[int, int]] = []
    out = export_torch_dist(src, tmp_path / "out", tp=tp, pp=1, make_vocab_size_divisible_by=divisible,
                            progress=lambda done, total: calls.append((done, total)))
    dones = [d for d, _ in calls]
    assert dones == sorted(dones) and {t for _, t in calls} == {out.nbytes}
    assert calls[-1] == (out.nbytes, out.nbytes) == (_written_bytes(tmp_path / "out"),) * 2
    view = ckptkit.open(src)
    unpadded = sum(m.numel * view[k].dtype.itemsize for k, m in view.manifest.tensors.items()
                   if k.startswith("model/") and not k.endswith(VOCAB_PADDING_SUFFIX))
    assert out.nbytes > unpadded  # vocabulary 30 is padded: its rows count as written
