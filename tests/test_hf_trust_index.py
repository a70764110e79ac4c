"""A damaged or hostile ``model.safetensors.index.json``, through the library and the CLI.

The index names the shards an HF folder is read from, so it is untrusted like every other byte of the
folder: paths out of the folder (``../``, absolute), names that are not shards, shards that do not
exist, a tensor listed in a file that does not hold it (or not listed, or held twice), a malformed or
oversized document, a FIFO in its place. Each is refused with one line naming the folder, with nothing
committed at DEST (tests/test_hf_trust.py ``attempt``). The module's last test prints the tally of the
HF importer cases so far in the session.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.test_hf_trust import attempt, built, report  # noqa: F401 - built: a fixture

pytestmark = pytest.mark.timeout(300)


def _index_cases(folder: Path) -> dict[str, Callable[[], None]]:
    index = folder / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    wm = doc["weight_map"]
    name = sorted(wm)[0]
    other = next(f for f in sorted(set(wm.values())) if f != wm[name])

    def put(d: Any) -> Callable[[], None]:
        return lambda: index.write_text(json.dumps(d))

    return {
        "parent path": put({**doc, "weight_map": {**wm, name: "../" + wm[name]}}),
        "absolute path": put({**doc, "weight_map": {**wm, name: str(folder / wm[name])}}),
        "not safetensors": put({**doc, "weight_map": {**wm, name: "config.json"}}),
        "absent file": put({**doc, "weight_map": {**wm, name: "model-99999-of-00012.safetensors"}}),
        "listed in another file": put({**doc, "weight_map": {**wm, name: other}}),
        "unlisted tensor": put({**doc, "weight_map": {k: v for k, v in wm.items() if k != name}}),
        "listed, not held": put({**doc, "weight_map": {**wm, "model.layers.0.mlp.extra.weight": other}}),
        "no weight_map": put({"metadata": {}}),
        "weight_map a list": put({"weight_map": list(wm)}),
        "duplicate key": lambda: index.write_text(
            index.read_text().replace('"weight_map": {', f'"weight_map": {{"{name}": "{other}", ', 1)),
        "deep nesting": put({**doc, "metadata": {"x": json.loads("[" * 300 + "]" * 300)}}),
        "not JSON": lambda: index.write_bytes(b"\xff{}"),
        "FIFO": lambda: (index.unlink(), os.mkfifo(index)),
        "oversized": lambda: index.write_bytes(b" " * (65 << 20) + json.dumps(doc).encode()),
        "tensor in two shards": lambda: _copy_tensor_into(folder, name, wm[name], other),
    }


def _copy_tensor_into(folder: Path, name: str, src: str, dst: str) -> None:
    from safetensors.torch import load_file, save_file

    extra = load_file(str(folder / src))[name]
    tensors = load_file(str(folder / dst))
    save_file({**tensors, name: extra}, str(folder / dst), metadata={"format": "pt"})


def test_a_damaged_or_hostile_index_is_refused(tmp_path, built):
    src = built("llama_sharded")
    for case in _index_cases(src):
        folder = tmp_path / case.replace(" ", "-")
        shutil.copytree(src, folder)
        _index_cases(folder)[case]()
        attempt(f"index: {case}", folder, src / "config.json", expect="refuse", names=str(folder), root=tmp_path)


def test_hf_trust_index_counts():
    """Runs last in this module: the tally of every HF importer case so far in this session."""
    print("\n" + report("HF importer cases so far"))
