"""The torch_dist import and export of ``_extra_state`` items, against hostile and damaged items.

Megatron writes each ``_extra_state`` ShardedObject as a DCP bytes item holding
``torch.save([payload])``. These folders are built with DCP itself (a small torch_dist directory,
tests/test_import_trust_folders.py) plus items of every form a foreign folder may hold: TE 2.x
payloads (imported), None and empty payloads (not stored), TE 1.x's ``io.BytesIO`` (listed as
skipped), and hostile or damaged ones (refused naming the file and item, nothing committed).
The real Megatron round trips are in tests/test_megatron_extra_state.py.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptkit.errors import CkptkitError, UnsafeCheckpointError
from ckptkit.offline.view import open as open_view
from ckptkit_converters.megatron.exporter import export_torch_dist
from ckptkit_converters.megatron.importer import import_torch_dist
from tests import te_payloads as te
from tests.test_import_trust_folders import torch_dist_folder

QKV = "decoder.layers.self_attention.linear_qkv._extra_state"


def _blob(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _folder(root: Path, items: dict[str, io.BytesIO]) -> Path:
    """A torch_dist directory (2 layers) whose DCP data also holds ``items`` as bytes items."""
    folder = torch_dist_folder(root / "td")
    tensors = _dcp_tensors(folder)
    for name in os.listdir(folder):
        if name.endswith(".distcp") or name == ".metadata":
            os.remove(folder / name)
    dcp.save({**tensors, **items}, checkpoint_id=str(folder), no_dist=True, planner=_RawBytes())
    return folder


class _RawBytes(dcp.DefaultSavePlanner):
    """Bytes items written as they are, as Megatron's own planner writes its ShardedObjects (DCP's default
    would ``torch.save`` the ``io.BytesIO`` itself)."""

    def transform_object(self, write_item, object):
        return object if isinstance(object, io.BytesIO) else super().transform_object(write_item, object)


def _dcp_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(folder)).read_metadata()
    state = {k: torch.empty(m.size) for k, m in meta.state_dict_metadata.items()}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state


def _import(folder: Path, dest: Path):
    return import_torch_dist(folder, dest, vocab_size=16, make_vocab_size_divisible_by=16)


def test_te2_payloads_import_and_export_back_as_megatron_wrote_them(tmp_path):
    payloads = {layer: te.payload(f"layer {layer}") for layer in range(2)}
    folder = _folder(tmp_path, {f"{QKV}/shard_{layer}_2": _blob([p]) for layer, p in payloads.items()})
    result = _import(folder, tmp_path / "imported")
    assert QKV not in result.skipped
    view = open_view(str(tmp_path / "imported"))
    for layer, p in payloads.items():
        name = f"extra/{QKV}/shard_{layer}_2"
        assert torch.equal(view[name].read(), p)
        assert view.manifest.tensors[name].rule.layer == layer
    out = tmp_path / "exported"
    export_torch_dist(tmp_path / "imported", out, tp=1, pp=1)
    again = _import(out, tmp_path / "again")  # the export is a torch_dist folder: read back by the import
    assert QKV not in again.skipped
    for layer, p in payloads.items():
        assert torch.equal(open_view(str(tmp_path / "again"))[f"extra/{QKV}/shard_{layer}_2"].read(), p)


def test_empty_and_none_payloads_are_not_stored_and_te1_bytes_io_is_listed(tmp_path):
    folder = _folder(tmp_path, {f"{QKV}/shard_0_2": _blob([None]),
                                f"{QKV}/shard_1_2": _blob([torch.empty(0, dtype=torch.uint8)]),
                                "decoder.layers.mlp.linear_fc1._extra_state/shard_0_2": _blob([io.BytesIO(b"te1")])})
    result = _import(folder, tmp_path / "imported")
    assert QKV not in result.skipped
    assert "decoder.layers.mlp.linear_fc1._extra_state" in result.skipped
    assert not [k for k in open_view(str(tmp_path / "imported")).manifest.tensors if k.startswith("extra/")]


def _hostile() -> bytes:
    class Call:
        def __reduce__(self):
            return (os.system, ("true",))

    return pickle.dumps({"recipe": Call()})


@pytest.mark.parametrize("item, error, match", [
    (lambda: _blob([torch.frombuffer(bytearray(_hostile()), dtype=torch.uint8)]), UnsafeCheckpointError,
     "names posix.system"),
    (lambda: _blob([torch.zeros(2, 3, dtype=torch.uint8)]), CkptkitError, "holds Tensor, expected"),
    (lambda: _blob([{"scale": torch.ones(1)}]), CkptkitError, "holds dict, expected"),
    (lambda: _blob([torch.ones(4)]), CkptkitError, "holds Tensor, expected"),
    (lambda: io.BytesIO(b"not a torch.save archive"), CkptkitError, "not a readable torch.save archive"),
    (lambda: _blob([torch.frombuffer(bytearray(b"\x80\x04garbage"), dtype=torch.uint8)]), UnsafeCheckpointError,
     "not a pickle"),
], ids=["code-running", "2-d", "dict", "float", "garbage-blob", "garbage-payload"])
def test_a_hostile_or_damaged_item_refuses_the_import_naming_it(tmp_path, item, error, match):
    folder = _folder(tmp_path, {f"{QKV}/shard_1_2": item()})
    dest = tmp_path / "imported"
    with pytest.raises(error, match=match) as info:
        _import(folder, dest)
    assert "__0_0.distcp" in str(info.value) and f"{QKV}/shard_1_2" in str(info.value)
    assert not (dest / "manifest.json").exists()


def test_an_export_refuses_a_hostile_stored_payload(tmp_path):
    """A ckptkit checkpoint whose stored payload names os.system (written by someone else): the export,
    whose output Megatron would hand to TE, refuses it naming the tensor and leaves no folder."""
    folder = _folder(tmp_path, {f"{QKV}/shard_0_2": _blob([te.payload("fine")])})
    _import(folder, tmp_path / "imported")
    view = open_view(str(tmp_path / "imported"))
    name = f"extra/{QKV}/shard_0_2"
    assert name in view.manifest.tensors
    _swap_payload(tmp_path / "imported", name, _hostile())
    with pytest.raises(UnsafeCheckpointError, match=f"tensor '{name}'.*names posix.system"):
        export_torch_dist(tmp_path / "imported", tmp_path / "out", tp=1, pp=1)
    assert not (tmp_path / "out").exists()


def _swap_payload(folder: Path, name: str, data: bytes) -> None:
    """Rewrite one stored payload through ckptkit's own offline writer (a valid checkpoint holding it)."""
    import shutil

    from ckptkit.offline.view import open as view_of

    view = view_of(str(folder))
    tensors = {k: view[k].read() for k in view.manifest.tensors}
    tensors[name] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    values = dict(view.manifest.values)
    shutil.rmtree(folder)
    _write_plain(folder, tensors, values, {k: t.rule for k, t in view.manifest.tensors.items()})


def _write_plain(folder: Path, tensors, values, rules) -> None:
    from ckptkit.engine.offline_writer import StoredTensor, write_offline
    from ckptkit.layout.box import Box, Region
    from ckptkit.layout.manifest import ExplicitLayout, TensorMeta
    from ckptkit.storage.url import open_store

    specs = {k: StoredTensor(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in tensors.items()}
    keys = sorted(tensors)
    pieces = {0: [(k, Region(Box((0,) * t.dim(), tuple(t.shape)))) for k, t in ((k, tensors[k]) for k in keys)]}

    class Source:
        bytes_read = 0

        def __len__(self):
            return len(keys)

        def __getitem__(self, ref):
            return tensors[keys[ref]]

    layouts = {k: TensorMeta(k, specs[k].dtype, specs[k].shape, ExplicitLayout(((pieces[0][i][1], 0),)),
                             rule=rules.get(k)) for i, k in enumerate(keys)}
    write_offline(open_store(str(folder)), world_size=1, tensors=specs, pieces=pieces, source=lambda r, p: Source(),
                  values=values, meta={"user": {}}, layouts=layouts)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=4),
       cut=st.one_of(st.none(), st.integers(0, 1 << 16)))
def test_a_damaged_item_imports_vetted_or_is_refused_cleanly(tmp_path, edits, cut):
    """Random byte edits and truncations of a real ``torch.save([payload])`` item: the import either stores a
    payload that passes the vetting, or fails with a ckptkit error naming the file; never another exception,
    never a half-written checkpoint."""
    blob = bytearray(_blob([te.payload("fuzz")]).getvalue())
    for at, value in edits:
        blob[at % len(blob)] = value
    data = bytes(blob if cut is None else blob[: cut % (len(blob) + 1)])
    root = tmp_path / f"case{abs(hash((tuple(edits), cut))) % 10**9}"
    folder = _folder(root, {f"{QKV}/shard_0_2": io.BytesIO(data)})
    dest = root / "imported"
    try:
        result = _import(folder, dest)
    except CkptkitError as exc:
        assert "__0_0.distcp" in str(exc) or str(folder) in str(exc), exc
        assert not (dest / "manifest.json").exists()
        return
    from ckptkit.adapters.megatron import te_payload

    view = open_view(str(dest))
    name = f"extra/{QKV}/shard_0_2"
    if name in view.manifest.tensors:
        te_payload.check(view[name].read().numpy().tobytes(), name)
    else:  # an item decoding to None or an empty payload carries nothing; another form is listed as skipped
        assert result.skipped in ((), (QKV,)), result.skipped
