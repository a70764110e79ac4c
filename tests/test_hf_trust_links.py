"""Symlinks in and out of a Hugging Face hub cache layout, through the library and the CLI.

``~/.cache/huggingface/hub/models--ORG--NAME/snapshots/REV/`` is a folder of links into the repo's
``blobs/``: such a snapshot imports exactly like the plain folder it mirrors (the layout is confirmed
with huggingface_hub's own ``scan_cache_dir`` / ``try_to_load_from_cache``, no network). Every other
link that leaves the source — out of the cache, into another repo, to ``refs/``, to a device, a loop,
a dangling one, a blob that is itself a link out — is refused naming the file, and the bait it points
at is never opened (tests/test_hf_trust.py ``attempt`` watches every open).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from ckptkit_converters.hf.importer import import_hf
from ckptkit_converters.hf.mapping import HFConfig
from tests.test_hf_trust import attempt, built, checkpoint_tensors, report  # noqa: F401 - built: a fixture

pytestmark = pytest.mark.timeout(300)


def make_cache(root: Path, src: Path, repo_id: str = "org/tiny", rev: str = "0" * 40) -> Path:
    """The hub cache layout, as huggingface_hub writes it: blobs named by their hash, a snapshot of relative
    links into ``../../blobs/``, ``refs/main`` naming the revision. Returns the snapshot folder."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(f"../../blobs/{blob}", snap / f.name)
    return snap


def test_a_hub_cache_snapshot_imports_like_the_folder_it_links(tmp_path, built):
    hub = pytest.importorskip("huggingface_hub")
    src = built("llama_sharded")
    cache = tmp_path / "hub"
    snap = make_cache(cache, src)
    info = hub.scan_cache_dir(cache)  # huggingface_hub's own reading of the layout: this is the real thing
    assert not info.warnings and [r.repo_id for r in info.repos] == ["org/tiny"]
    files = {f.file_name for r in info.repos for rev in r.revisions for f in rev.files}
    assert files == {p.name for p in src.iterdir()}
    found = hub.try_to_load_from_cache("org/tiny", "model.safetensors.index.json", cache_dir=cache)
    assert Path(found) == snap / "model.safetensors.index.json"
    want = checkpoint_tensors(_imported(src, tmp_path / "plain"))
    attempt("hub cache: snapshot", snap, snap / "config.json", expect="import", names="", root=tmp_path,
            reference=lambda: want, allowed=[snap.parent.parent])
    link = tmp_path / "link-to-snapshot"  # the source given as a link to the snapshot
    os.symlink(snap, link)
    attempt("hub cache: snapshot", link, snap / "config.json", expect="import", names="", root=tmp_path,
            reference=lambda: want, allowed=[snap.parent.parent])


def _imported(src: Path, dest: Path) -> Path:
    import_hf(str(src), str(dest), HFConfig.from_file(src / "config.json"))
    return dest


def test_links_leaving_a_snapshot_or_a_plain_folder_are_refused(tmp_path, built):
    """Every link that leaves the folder (a snapshot: its repo's blobs/) is refused before it is opened; the
    bait files it points at are never read (the audit hook would see them)."""
    src = built("llama")
    bait = tmp_path / "bait"
    bait.mkdir()
    shutil.copy(src / "model.safetensors", bait / "model.safetensors")
    other = make_cache(tmp_path / "hub", src, "org/other")
    blob_of_other = os.path.realpath(other / "model.safetensors")
    in_cache = {
        "to a file outside the cache": str(bait / "model.safetensors"),
        "to another repo's blob": blob_of_other,
        "to the repo's refs/main": "../../refs/main",
        "relative, out of the cache": "../../../../bait/model.safetensors",
        "to /dev/zero": "/dev/zero",
        "dangling": "../../blobs/nothing-here",
        "a loop": "model.safetensors",
    }
    for i, (case, target) in enumerate(in_cache.items()):
        snap = make_cache(tmp_path / f"hub{i}", src)
        (snap / "model.safetensors").unlink()
        os.symlink(target, snap / "model.safetensors")
        attempt(f"hub cache: link {case}", snap, snap / "config.json", expect="refuse", names="model.safetensors",
                root=tmp_path, allowed=[snap.parent.parent])
    plain_cases = {
        "absolute, outside": str(bait / "model.safetensors"),
        "relative, outside": "../bait/model.safetensors",
        "into a hub cache blob": blob_of_other,
        "to /dev/zero": "/dev/zero",
        "dangling": "nothing-here",
        "a loop": "model.safetensors",
    }
    for i, (case, target) in enumerate(plain_cases.items()):
        plain = tmp_path / f"plain{i}"  # a folder outside any cache: nothing outside it is read
        shutil.copytree(src, plain)
        (plain / "model.safetensors").unlink()
        os.symlink(target, plain / "model.safetensors")
        attempt(f"plain folder: link {case}", plain, plain / "config.json", expect="refuse",
                names="model.safetensors", root=tmp_path)
    # a blob that is itself a link out of the cache, and a snapshot whose cache lacks blobs/
    snap = make_cache(tmp_path / "hubx", src)
    blob = Path(os.path.realpath(snap / "model.safetensors"))
    blob.unlink()
    os.symlink(bait / "model.safetensors", blob)
    attempt("hub cache: blob links out", snap, snap / "config.json", expect="refuse", names="model.safetensors",
            root=tmp_path, allowed=[snap.parent.parent])
    snap = make_cache(tmp_path / "huby", src)
    shutil.rmtree(snap.parent.parent / "blobs")
    attempt("hub cache: no blobs/", snap, src / "config.json", expect="refuse", names="model.safetensors",
            root=tmp_path, allowed=[snap.parent.parent])


def test_links_inside_a_plain_folder_are_followed_and_fifos_refused(tmp_path, built):
    src = built("llama")
    folder = tmp_path / "inside"
    shutil.copytree(src, folder)
    (folder / "real").mkdir()
    (folder / "model.safetensors").rename(folder / "real" / "weights.bin")
    os.symlink("real/weights.bin", folder / "model.safetensors")
    want = checkpoint_tensors(_imported(src, tmp_path / "plain"))
    attempt("plain folder: link inside", folder, folder / "config.json", expect="import", names="", root=tmp_path,
            reference=lambda: want)
    fifo = tmp_path / "fifo"
    shutil.copytree(src, fifo)
    (fifo / "model.safetensors").unlink()
    os.mkfifo(fifo / "model.safetensors")
    attempt("plain folder: FIFO shard", fifo, fifo / "config.json", expect="refuse", names="model.safetensors",
            root=tmp_path)
    os.mkfifo(tmp_path / "config-fifo.json")  # --hf-config naming a FIFO: refused, never opened to block
    attempt("config: FIFO", src, tmp_path / "config-fifo.json", expect="refuse", names="config-fifo.json",
            root=tmp_path)


def test_hf_trust_links_counts():
    """Runs last in this module: the tally of every HF importer case so far in this session."""
    print("\n" + report("HF importer cases so far"))

