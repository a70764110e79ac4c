"""Reaching into a checkpoint folder from tests: its files by rank, and editing its manifest.

Object names carry the save attempt (``data/rank-00000-<attempt>.bin``), and the manifest is
sealed by its own digest, so a test that damages a file on purpose, or edits the manifest to
reach a deeper check, goes through these helpers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

from ckptkit.layout.manifest import seal, sha256_hex, unseal


def _one(folder: Path, pattern: str) -> Path:
    hits = sorted(folder.glob(pattern))
    assert len(hits) == 1, f"expected one {pattern} in {folder}, found {[h.name for h in hits]}"
    return hits[0]


def data_object(ckpt: str | Path, rank: int = 0) -> Path:
    return _one(Path(ckpt) / "data", f"rank-{rank:05d}*.bin")


def index_file(ckpt: str | Path, rank: int = 0) -> Path:
    return _one(Path(ckpt) / "index", f"rank-{rank:05d}*.json")


def object_key(ckpt: str | Path, rank: int = 0, kind: str = "data") -> str:
    """The store key (``data/rank-00000-<attempt>.bin``) of a rank's data object or index."""
    path = data_object(ckpt, rank) if kind == "data" else index_file(ckpt, rank)
    return f"{kind}/{path.name}"


def manifest_doc(ckpt: str | Path) -> dict[str, Any]:
    body, _ = unseal((Path(ckpt) / "manifest.json").read_bytes(), "test")
    return json.loads(body)


def write_manifest_doc(ckpt: str | Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` as the manifest, sealed like ckptkit writes it (so later checks are reached)."""
    (Path(ckpt) / "manifest.json").write_bytes(seal(json.dumps(doc, separators=(",", ":")).encode()))


def edit_manifest(ckpt: str | Path, fn: Callable[[dict[str, Any]], Any]) -> None:
    doc = manifest_doc(ckpt)
    fn(doc)
    write_manifest_doc(ckpt, doc)


def edit_index(ckpt: str | Path, fn: Callable[[dict[str, Any]], Any], rank: int = 0, reseal: bool = True) -> None:
    """Edit a rank's index; with ``reseal`` the manifest's digest of it is updated to match."""
    path = index_file(ckpt, rank)
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))
    if reseal:
        reseal_index(ckpt, rank)


def reseal_index(ckpt: str | Path, rank: int = 0) -> None:
    """After editing an index, make the manifest's digest match again (to reach deeper checks)."""
    data = index_file(ckpt, rank).read_bytes()

    def fix(doc: dict[str, Any]) -> None:
        for item in doc["indexes"]:
            if item[0] == rank:
                item[2], item[3] = len(data), sha256_hex(data)

    edit_manifest(ckpt, fix)


def without_attempt(key: str) -> str:
    """``data/rank-00000-<attempt>.bin`` -> ``data/rank-00000.bin``: names to compare across saves."""
    return re.sub(r"-[0-9a-f]{12}(\.(?:bin|json))", r"\1", key)
