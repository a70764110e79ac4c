"""Damaged and hostile checkpoint folders: every reader fails clearly, fast, in bounded memory.

One test per class of hostile input (docs/trust.md gives the policy for each), each case run
through every reader — ``load``, ``open(...)[key][...]``, ``verify``, ``describe`` (``inspect``),
``list_checkpoints`` (``ls``) — and through the CLI, which must answer with exit code 1 or 2 and
one error line, never a traceback. ``test_hostile_counts`` prints the tally the issue note quotes.

The readers of a case run in a fresh child process (tests/peak_memory.py) whose peak resident set
and address space the kernel reports: tracemalloc, used before, never saw torch's allocator, so a
reader that allocated a tensor from a hostile size passed. ``test_the_memory_bound_sees_torch``
shows the bound trips on a deliberate ``torch.empty`` of 1 GiB.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import tracemalloc  # only to show what it cannot see (test_the_memory_bound_sees_torch)
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from click.testing import CliRunner

import ckptkit
from ckptkit.cli.main import cli as cli_main
from tests.ckpt_files import data_object, edit_index, edit_manifest, index_file, manifest_doc, write_manifest_doc
from tests.peak_memory import section, zygote

pytestmark = pytest.mark.timeout(120)
TALLY: Counter[str] = Counter()
PEAKS: Counter[str] = Counter()  # the largest peak RSS of one reader, and address space of one case, in bytes


def make_state(blank: bool = False) -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 8, generator=g)
    return {"model": {"w": torch.zeros_like(w) if blank else w}, "train": {"step": 0 if blank else 9},
            "rng": torch.Generator().manual_seed(1)}


@pytest.fixture(scope="module", autouse=True)
def _warm_zygote():
    zygote()  # started now, its imports overlap the first fixtures


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "run" / "step-0000009"
    ckptkit.save(make_state(), path, metadata={"step": 9, "metrics": {"loss": 1.5}})
    return path


Reader = Callable[[Path], Any]


def _load(p: Path) -> Any:
    return ckptkit.load(make_state(blank=True), p)


def _view(p: Path) -> Any:
    view = ckptkit.open(p)
    return [view[k][...] for k in view.keys()], view.values, view.all_per_rank_values()


def _verify(p: Path) -> Any:
    report = ckptkit.verify(str(p))
    if not report.ok:
        raise ckptkit.CorruptCheckpointError(f"verify: {report.problems[0].message}")
    return report


READERS: dict[str, Reader] = {
    "load": _load,
    "open": _view,
    "verify": _verify,
    "describe": lambda p: ckptkit.describe(str(p)),
    "ls": lambda p: ckptkit.list_checkpoints(str(p.parent)),
}


def _allocate_then_refuse(p: Path, nbytes: int, touch: bool) -> Any:
    t = torch.empty(nbytes, dtype=torch.uint8)  # through torch's allocator: invisible to tracemalloc
    if touch:
        t.fill_(1)
    raise ckptkit.CorruptCheckpointError(f"{p}: control case (allocated {nbytes >> 20} MiB first)")


#: Deliberate over-allocations: the memory bound must trip on them (they never count in the tally).
CONTROLS: dict[str, Reader] = {
    "empty-1GiB": lambda p: _allocate_then_refuse(p, 1 << 30, touch=False),
    "filled-300MiB": lambda p: _allocate_then_refuse(p, 300 << 20, touch=True),
}


def run_readers(path: str, names: list[str]) -> list[dict]:
    """In the child process: each reader on ``path`` — its outcome, seconds and peak RSS."""
    out = []
    for name in names:
        with section(name) as entry:
            try:
                {**READERS, **CONTROLS}[name](Path(path))
                entry["outcome"] = "ok"
            except ckptkit.CkptkitError:
                entry["outcome"] = "error"
            except Exception as exc:  # noqa: BLE001 - what the test is here to find
                entry["outcome"] = f"crash: {type(exc).__name__}: {exc}"[:500]
        out.append(entry)
    return out


def refused_by_every_reader(path: Path, case: str, allow: frozenset[str] = frozenset({"ls"}),
                            limit_s: float = 10.0, memory: int = 256 << 20,
                            readers: tuple[str, ...] = tuple(READERS), cli: bool = True) -> None:
    """Every reader raises a CkptkitError (``allow``: readers for which a clean answer is also
    right, e.g. ``ls`` listing a damaged checkpoint as not committed), in bounded time and memory
    (peak RSS of each reader, peak address space of all, in a fresh process); the CLI exits 1 or 2
    with no traceback."""
    control = not set(readers) <= set(READERS)
    measured = zygote().run(run_readers, str(path), list(readers), timeout=limit_s * len(readers) + 30)
    if not control:
        TALLY["hangs"] += measured.hung
    assert not measured.hung, f"{case}: the readers did not finish within {limit_s * len(readers) + 30:.0f}s"
    if not control:
        PEAKS["vm"] = max(PEAKS["vm"], measured.vm)
    for entry in measured.result:
        name, outcome, elapsed, rss = entry["name"], entry["outcome"], entry["seconds"], entry["rss"]
        if not control:
            PEAKS["rss"] = max(PEAKS["rss"], rss)
            TALLY["tried"] += 1
            TALLY["clear errors" if outcome == "error" else "crashes" if outcome.startswith("crash") else "answered"] += 1
            TALLY["hangs"] += elapsed > limit_s
        assert not outcome.startswith("crash"), f"{case}: {name}: {outcome}"
        assert outcome == "error" or name in allow, f"{case}: {name} accepted a damaged checkpoint"
        assert elapsed < limit_s, f"{case}: {name} took {elapsed:.1f}s"
        assert rss < memory, f"{case}: {name} used {rss >> 20} MiB of memory (peak RSS; bound {memory >> 20} MiB)"
    assert measured.vm < memory, (f"{case}: the readers reserved {measured.vm >> 20} MiB of address space "
                                  f"(bound {memory >> 20} MiB)")
    if not cli:
        return
    for args in (["inspect", str(path)], ["verify", str(path)], ["ls", str(path.parent)], ["inspect", str(path), "--json"]):
        result = CliRunner().invoke(cli_main, args)
        TALLY["cli runs"] += 1
        text = result.output + (result.stderr if result.stderr_bytes is not None else "")
        assert "Traceback" not in text and (result.exception is None or isinstance(result.exception, SystemExit)), \
            f"{case}: ckptkit {' '.join(args[:1])} crashed: {result.exception!r}\n{text}"
        assert result.exit_code in (0, 1, 2), f"{case}: exit code {result.exit_code}"
        if {"inspect": "describe"}.get(args[0], args[0]) not in allow:
            assert result.exit_code in (1, 2), f"{case}: ckptkit {args[0]} accepted it"


@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_the_memory_bound_sees_torch(ckpt, control):
    """The measurement catches what tracemalloc could not: a 1 GiB ``torch.empty`` (address space,
    never touched) and 300 MiB filled (resident) trip the bound every case above runs under."""
    with pytest.raises(AssertionError, match=r"MiB of (memory|address space)"):
        refused_by_every_reader(ckpt, f"control {control}", readers=(control,), cli=False)
    tracemalloc.start()
    try:
        t = torch.empty(1 << 30, dtype=torch.uint8)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del t
    assert peak < 1 << 20  # what the old measurement saw of the same allocation


# ---------------------------------------------------------------- numbers

def int_positions(doc: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(doc, bool):
        return []
    if isinstance(doc, int):
        return [path]
    if isinstance(doc, dict):
        return [p for k, v in doc.items() for p in int_positions(v, (*path, k))]
    if isinstance(doc, list):
        return [p for i, v in enumerate(doc) for p in int_positions(v, (*path, i))]
    return []


def set_raw(doc: Any, path: tuple, marker: str) -> str:
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = marker
    return json.dumps(doc, separators=(",", ":"))


@pytest.mark.parametrize("number", ["1e999", "1" + "0" * 400, "-1", "1.5"])
def test_every_integer_field_of_the_manifest_and_index(ckpt, number):
    """Each integer of the manifest (outside user values) and of the index, replaced by a number that
    overflows a float, a 400-digit integer, a negative or a fraction."""
    from ckptkit.layout.manifest import seal

    pristine = {p: p.read_bytes() for p in (ckpt / "manifest.json", index_file(ckpt))}
    doc = manifest_doc(ckpt)
    skip = ("values", "meta")  # user data: any number is a legal value there (covered below)
    for pos in [p for p in int_positions(doc) if p[0] not in skip]:
        text = set_raw(json.loads(json.dumps(doc)), pos, "__N__").replace('"__N__"', number)
        (ckpt / "manifest.json").write_bytes(seal(text.encode()))
        refused_by_every_reader(ckpt, f"manifest{list(pos)}={number[:8]}")
    for path, data in pristine.items():
        path.write_bytes(data)
    idoc = json.loads(index_file(ckpt).read_text())
    for pos in [p for p in int_positions(idoc) if p[0] != "values"]:
        text = set_raw(json.loads(json.dumps(idoc)), pos, "__N__").replace('"__N__"', number)
        _reseal_raw(ckpt, text)
        refused_by_every_reader(ckpt, f"index{list(pos)}={number[:8]}")
    for path, data in pristine.items():
        path.write_bytes(data)


def _reseal_raw(ckpt: Path, index_text: str) -> None:
    from ckptkit.layout.manifest import sha256_hex

    data = index_text.encode()
    index_file(ckpt).write_bytes(data)

    def fix(doc: dict) -> None:
        for item in doc["indexes"]:
            item[2], item[3] = len(data), sha256_hex(data)

    edit_manifest(ckpt, fix)


def test_huge_numbers_in_user_values_and_metrics_are_values(ckpt):
    """In values and metadata a 400-digit integer is a legal value: stored, listed, loaded exactly."""
    edit_manifest(ckpt, lambda d: d["meta"]["user"]["metrics"].update(loss=10**400))
    infos = ckptkit.list_checkpoints(str(ckpt.parent))
    assert infos[0].metrics["loss"] == 10**400
    for args in (["ls", str(ckpt.parent)], ["ls", str(ckpt.parent), "--json"], ["inspect", str(ckpt)]):
        result = CliRunner().invoke(cli_main, args)
        assert result.exit_code == 0, result.output
    state = make_state()
    state["train"]["big"] = 10**400
    ckptkit.save(state, ckpt.parent / "step-0000010")
    target = make_state(blank=True)
    target["train"]["big"] = 0
    ckptkit.load(target, ckpt.parent / "step-0000010")
    assert target["train"]["big"] == 10**400


# ---------------------------------------------------------------- nesting, encodings, duplicates

@pytest.mark.parametrize("where", ["values", "meta", "tensors", "top"])
def test_deeply_nested_json(ckpt, where):
    deep = "[" * 100_000 + "]" * 100_000
    doc = manifest_doc(ckpt)
    doc[where if where != "top" else "extra"] = "__DEEP__"
    text = json.dumps(doc, separators=(",", ":")).replace('"__DEEP__"', deep)
    from ckptkit.layout.manifest import seal

    (ckpt / "manifest.json").write_bytes(seal(text.encode()))
    refused_by_every_reader(ckpt, f"deep {where}")


def test_values_nested_deeper_than_a_reader_accepts_are_refused_at_save(tmp_path):
    value: Any = 1
    for _ in range(200):
        value = [value]
    with pytest.raises(ckptkit.SaveError, match="nests deeper than"):
        ckptkit.save({"v": value, "w": torch.zeros(2)}, tmp_path / "c")


@pytest.mark.parametrize("target", ["tensor key", "value key", "value string", "mesh dim", "index tensor"])
def test_lone_surrogates(ckpt, target):
    if target == "tensor key":
        edit_manifest(ckpt, lambda d: d["tensors"].update({"model/\ud800": d["tensors"].pop("model/w")}))
    elif target == "value key":
        edit_manifest(ckpt, lambda d: d["values"].update({"\udfff": 1}))
    elif target == "value string":
        edit_manifest(ckpt, lambda d: d["values"].update({"train/step": "x\ud800"}))
    elif target == "mesh dim":
        edit_manifest(ckpt, lambda d: d["meshes"]["m0"].update(dims=["\ud801"]))
    else:
        edit_index(ckpt, lambda d: d["pieces"][0].__setitem__(0, "model/\ud800"))
    refused_by_every_reader(ckpt, f"surrogate in {target}")


def test_saving_a_lone_surrogate_is_refused_with_its_key(tmp_path):
    with pytest.raises(ckptkit.SaveError, match="'path'.*not valid Unicode"):
        ckptkit.save({"path": "/data/\udcff.bin", "w": torch.zeros(2)}, tmp_path / "c")


@pytest.mark.parametrize("where", ["top", "tensor", "values", "index"])
def test_duplicate_json_keys(ckpt, where):
    from ckptkit.layout.manifest import seal

    if where == "index":
        text = index_file(ckpt).read_text().replace('"rank":0', '"rank":0,"rank":0', 1)
        _reseal_raw(ckpt, text)
    else:
        text = json.dumps(manifest_doc(ckpt), separators=(",", ":"))
        text = {"top": text.replace('"world_size":1', '"world_size":1,"world_size":2', 1),
                "tensor": text.replace('"dtype":"float32"', '"dtype":"float32","dtype":"float32"', 1),
                "values": text.replace('"train/step":9', '"train/step":9,"train/step":10', 1)}[where]
        (ckpt / "manifest.json").write_bytes(seal(text.encode()))
    refused_by_every_reader(ckpt, f"duplicate key in {where}")


# ---------------------------------------------------------------- sizes

def test_a_mesh_of_2_to_the_40_ranks_is_refused_before_it_is_built(ckpt):
    edit_manifest(ckpt, lambda d: d["meshes"]["m0"].update(shape=[2**40], ranks={"start": 0, "step": 1}))
    refused_by_every_reader(ckpt, "2**40 mesh", memory=64 << 20)


def test_a_world_of_a_million_ranks_with_one_index_is_refused(ckpt):
    edit_manifest(ckpt, lambda d: d.update(world_size=1 << 20))
    refused_by_every_reader(ckpt, "claimed world", memory=64 << 20)


def test_a_tensor_of_2_to_the_80_elements_is_refused_without_allocating(ckpt):
    edit_manifest(ckpt, lambda d: d["tensors"]["model/w"].update(shape=[2**40, 2**40]))
    # describe reports what the manifest says (a 2**80-element tensor); the readers of data refuse it
    refused_by_every_reader(ckpt, "huge tensor", allow=frozenset({"ls", "describe"}), memory=64 << 20)


@pytest.mark.parametrize("name", ["manifest", "index"])
def test_oversized_metadata_files_are_refused_unread(ckpt, name):
    path = ckpt / "manifest.json" if name == "manifest" else index_file(ckpt)
    with open(path, "r+b") as f:
        f.truncate(600 << 20)  # a sparse 600 MB file
    refused_by_every_reader(ckpt, f"600 MB {name}", memory=64 << 20)


# ---------------------------------------------------------------- files that are not files

def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


def _outside(path: Path) -> None:
    secret = path.parent.parent.parent / f"secret-{path.name}"
    secret.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(secret)


def _socket(path: Path) -> None:
    path.unlink()
    short = Path(tempfile.mkdtemp(dir="/tmp")) / "s"  # AF_UNIX paths are limited to ~108 bytes
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(short))
    s.close()
    os.rename(short, path)


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "outside", "socket", "directory"])
@pytest.mark.parametrize("which", ["manifest", "index", "data"])
def test_non_files_and_escaping_symlinks(ckpt, kind, which):
    path = {"manifest": ckpt / "manifest.json", "index": index_file(ckpt), "data": data_object(ckpt)}[which]
    {"fifo": _fifo, "dev-zero": _dev_zero, "outside": _outside, "socket": _socket, "directory": _directory}[kind](path)
    # describe reads metadata only: a bad data object is for the readers that read it
    allow = frozenset({"ls", "describe"}) if which == "data" else frozenset({"ls"})
    refused_by_every_reader(ckpt, f"{kind} as {which}", allow=allow)


# ---------------------------------------------------------------- state that torch would choke on

@pytest.mark.parametrize("garbage", ["AAAA", "not base64!", "", "x" * 40, 5, None, ["AAAA"]])
def test_garbage_generator_state(ckpt, garbage):
    edit_index(ckpt, lambda d: d["values"].update(rng={"__generator__": garbage}))
    with pytest.raises(ckptkit.CorruptCheckpointError, match="'rng'"):
        ckptkit.load(make_state(blank=True), ckpt)


def test_zarr_array_paths_leaving_the_group(tmp_path):
    from ckptkit_converters.zarr.convert import export_zarr, import_zarr

    ckptkit.save({"w": torch.randn(4, 4)}, tmp_path / "c")
    export_zarr(tmp_path / "c", tmp_path / "z")
    meta = tmp_path / "z" / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["ckptkit"]["arrays"]["w"]["path"] = "../../outside"
    meta.write_text(json.dumps(doc))
    with pytest.raises(ckptkit.UnsafePathError, match="not a plain relative path inside the group"):
        import_zarr(tmp_path / "z", tmp_path / "back")
    result = CliRunner().invoke(cli_main, ["convert", str(tmp_path / "z"), str(tmp_path / "back2"), "--format", "ckptkit"])
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_inspect_of_a_manifest_with_many_tensors_finishes(tmp_path):
    """A 50k-tensor manifest (6 MB): inspect answers in seconds, its table capped, --json whole."""
    path = tmp_path / "c"
    ckptkit.save({"w": torch.zeros(4, 4)}, path)
    doc = manifest_doc(path)
    for i in range(50_000):
        doc["tensors"][f"layers.{i}.w"] = doc["tensors"]["w"]
    write_manifest_doc(path, doc)
    t0 = time.monotonic()
    result = CliRunner().invoke(cli_main, ["inspect", str(path)])
    assert result.exit_code == 0 and "... 49501 more" in result.output
    assert time.monotonic() - t0 < 30
    result = CliRunner().invoke(cli_main, ["inspect", str(path), "--json"])
    assert len(json.loads(result.output)["tensors"]) == 50_001


PIECE_DEFECTS = {  # one field of a tensor's piece in its index (resealed), and what the refusal says
    "checksums": (7, [], "has 0 checksums"),
    "box": (1, ["0"], "expected a box"),
    "flat": (3, [True, 1], "expected a flat range"),
}


@pytest.mark.parametrize("defect", list(PIECE_DEFECTS))
def test_a_damaged_index_entry_is_refused_by_every_reader_that_uses_it(tmp_path, defect):
    """An index is validated entry by entry as readers ask (a loading rank of a resharded job uses a few
    entries of each of many indexes): a damaged entry of ``model/b`` fails every reader of ``model/b`` and the
    whole-checkpoint readers (load, verify, describe), naming the tensor and the index, while a read of
    ``model/a`` alone still returns exactly what was saved (the damaged entry is never trusted, nor needed)."""
    field, value, message = PIECE_DEFECTS[defect]
    path = tmp_path / "c"
    state = {"model": {"a": torch.randn(8, 4), "b": torch.randn(16)}}
    ckptkit.save(state, path)
    edit_index(path, lambda d: next(p for p in d["pieces"] if p[0] == "model/b").__setitem__(field, value))
    refusal = rf"{index_file(path).name}.*'model/b'.*{message}|{index_file(path).name}.*{message}"
    view = ckptkit.open(path)
    assert torch.equal(view["model/a"][...], state["model"]["a"])
    with pytest.raises(ckptkit.ManifestError, match=refusal):
        view["model/b"][...]
    with pytest.raises(ckptkit.ManifestError, match=refusal):
        ckptkit.load({"model": {"a": torch.zeros(8, 4), "b": torch.zeros(16)}}, path)
    with pytest.raises(ckptkit.ManifestError, match=refusal):
        ckptkit.describe(str(path))
    report = ckptkit.verify(str(path))
    assert not report.ok and any(p.kind == "index" and "model/b" in p.message for p in report.problems), report
    result = CliRunner().invoke(cli_main, ["verify", str(path)])
    assert result.exit_code == 1 and "model/b" in result.output and "Traceback" not in result.output


def test_hostile_counts():
    """Runs last in this module: the tally of every hostile case above."""
    print(f"\nhostile cases: {TALLY['tried']} reader runs, {TALLY['clear errors']} clear errors, "
          f"{TALLY['answered']} clean answers (ls or inspect reporting what damaged metadata says), {TALLY['crashes']} crashes, "
          f"{TALLY['hangs']} hangs; {TALLY['cli runs']} CLI runs without a traceback; largest peak RSS of a reader "
          f"{PEAKS['rss'] >> 20} MiB, largest address-space growth of a case {PEAKS['vm'] >> 20} MiB")
    assert TALLY["crashes"] == 0 and TALLY["hangs"] == 0
