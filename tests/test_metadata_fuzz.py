"""Hostile and damaged metadata, fuzzed: every outcome is an identical load or a ckptkit error.

hypothesis mutates a valid two-rank checkpoint's manifest and indexes field by field — a value
replaced by another type, a huge or negative number, a float that overflows, a deep nesting, a
string with a lone surrogate, a duplicated key, a missing field, a truncated or doubled file — and
then every reader runs on it: ``load``, a lazy view of every tensor and value, ``verify``,
``describe`` and ``list_checkpoints``. Two modes:

* *raw*: the mutated bytes as they are — the manifest's seal and the index digests must catch
  every change, so a load either fails with a ckptkit error or returns exactly what was saved;
* *resealed*: the digests recomputed after the mutation, as a hostile writer would — the parser
  itself is reached, and must answer with a ckptkit error (or load what the edit says), never a
  crash, a hang or unbounded memory. Time and memory per example are bounded.

The readers of each example run in a fresh child process (tests/peak_memory.py): its peak resident
set and peak address space are what is bounded, so torch's allocator counts (tracemalloc, used
before, saw only Python's; ``test_the_memory_bound_sees_torch`` shows a 1 GiB ``torch.empty`` trips
the bound).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.layout.manifest import seal, sha256_hex, unseal
from tests.conftest import trials
from tests.peak_memory import zygote
from tests.test_bitflips import WORLD, expected, identical, load_whole, save_rank

TIME_LIMIT = 20.0  # seconds per example, for all readers together
MEMORY_LIMIT = 512 << 20  # peak RSS, and peak address space, of the process running the readers


@pytest.fixture(scope="module")
def pristine(worlds, tmp_path_factory) -> Path:
    zygote()  # started now, its imports overlap the world's save
    ckpt = tmp_path_factory.mktemp("fuzz") / "run" / "step-0001234"
    worlds.run(WORLD, save_rank, str(ckpt))
    return ckpt


def paths_of(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every position in a JSON document (containers and leaves)."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += paths_of(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += paths_of(v, (*prefix, i))
    return out


def set_at(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    node = doc
    for p in path[:-1]:
        node = node[p]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


_DELETE = object()
DEEP = "__deep__"  # replaced in the text by a nesting deeper than any reader accepts
SURROGATE = "__lone_surrogate__"
OVERFLOW = "__1e999__"  # replaced by a number that overflows a float

replacements = st.one_of(
    st.just(_DELETE), st.none(), st.booleans(), st.integers(-2**70, 2**70),
    st.sampled_from([10**400, -1, 0, 2**62 + 1, 2**31, 2**40, 1 << 24]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([OVERFLOW, 1.5, -0.0]),
    st.text(max_size=10), st.sampled_from([DEEP, SURROGATE, "../../etc/passwd", "/dev/zero", "float99", "grid"]),
    st.lists(st.integers(-3, 2**40), max_size=4), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def render(doc: Any) -> bytes:
    text = json.dumps(doc, separators=(",", ":"))
    text = text.replace(json.dumps(DEEP), "[" * 50_000 + "]" * 50_000)
    text = text.replace(json.dumps(SURROGATE), '"\\ud800x"')
    return text.replace(json.dumps(OVERFLOW), "1e999").encode()


@st.composite
def mutations(draw, docs: dict[str, Any]) -> tuple[str, tuple, Any, str]:
    name = draw(st.sampled_from(sorted(docs)))
    path = draw(st.sampled_from(paths_of(docs[name])))
    kind = draw(st.sampled_from(["replace", "replace", "replace", "duplicate-key", "truncate", "double"]))
    return name, path, draw(replacements), kind


def apply(ckpt: Path, docs: dict[str, Any], raw: dict[str, bytes], mutation: tuple, reseal: bool) -> None:
    name, path, value, kind = mutation
    if kind == "replace" and path:
        body = render(set_at(json.loads(json.dumps(docs[name])), path, value))
    elif kind == "duplicate-key":
        text = render(docs[name]).decode()
        body = text.replace('{"format"', '{"format":"x","format"', 1).encode()
    elif kind == "truncate":
        body = render(docs[name])[: max(1, len(render(docs[name])) * 2 // 3)]
    else:
        body = render(docs[name]) * 2
    if name == "manifest.json":
        (ckpt / name).write_bytes(seal(body) if reseal and body.endswith(b"}") and body != b"{}" else body)
        return
    (ckpt / name).write_bytes(body)
    if reseal:  # the manifest vouches for the edited index, as a hostile writer would make it
        manifest = json.loads(unseal(raw["manifest.json"], "x")[0])
        for item in manifest["indexes"]:
            if item[1] == name:
                item[2], item[3] = len(body), sha256_hex(body)
        (ckpt / "manifest.json").write_bytes(seal(json.dumps(manifest, separators=(",", ":")).encode()))


def run_every_reader(ckpt: Path) -> dict | Exception:
    got = load_whole(str(ckpt))
    for reader in (lambda: ckptkit.describe(str(ckpt)), lambda: ckptkit.list_checkpoints(str(ckpt.parent))):
        try:
            reader()
        except ckptkit.CkptkitError:
            pass
    report = ckptkit.verify(str(ckpt))
    damage = (ckptkit.CorruptCheckpointError, ckptkit.ManifestError, ckptkit.CoverageError)
    if isinstance(got, damage):  # (a state mismatch after a legal edit is not damage)
        assert not report.ok, f"verify passed a checkpoint that load found damaged ({got})"
    return got


def check_readers(ckpt: str, reseal: bool) -> str:
    """In the child process: every reader on ``ckpt``; a raw edit must load identically or fail."""
    got = run_every_reader(Path(ckpt))
    if not reseal and not isinstance(got, Exception):
        want = expected()
        per_rank = {0: {"loader": {"pos": 77}}, 1: {"loader": {"pos": 78}}}
        assert identical(got, want, per_rank), "the edit changed what a load returns without an error"
    return "error" if isinstance(got, Exception) else "loaded"


PEAKS = {"examples": 0, "rss": 0, "vm": 0}  # the largest peaks of one example's readers, in bytes


def check_bounds(measured, what: Any) -> None:
    assert not measured.hung and measured.seconds < TIME_LIMIT, f"readers took {measured.seconds:.1f}s on {what}"
    assert measured.rss < MEMORY_LIMIT, f"readers used {measured.rss >> 20} MiB of memory (peak RSS) on {what}"
    assert measured.vm < MEMORY_LIMIT, f"readers reserved {measured.vm >> 20} MiB of address space on {what}"


def fuzz(pristine: Path, tmp_path_factory, mutation: tuple, reseal: bool) -> None:
    ckpt = tmp_path_factory.mktemp("case") / "run" / pristine.name
    shutil.copytree(pristine, ckpt)
    raw = {str(p.relative_to(ckpt)): p.read_bytes() for p in ckpt.rglob("*.json")}
    docs = {"manifest.json": json.loads(unseal(raw["manifest.json"], "x")[0])}
    docs.update({k: json.loads(v) for k, v in raw.items() if k != "manifest.json"})
    apply(ckpt, docs, raw, mutation, reseal)
    measured = zygote().run(check_readers, str(ckpt), reseal, timeout=TIME_LIMIT + 10)
    PEAKS.update(examples=PEAKS["examples"] + 1, rss=max(PEAKS["rss"], measured.rss), vm=max(PEAKS["vm"], measured.vm))
    check_bounds(measured, mutation[:2])


def allocate_then_read(ckpt: str, nbytes: int) -> str:
    """The control: a reader run that first allocates ``nbytes`` with torch, never touching them."""
    held = torch.empty(nbytes, dtype=torch.uint8)
    out = check_readers(ckpt, False)
    del held
    return out


def test_the_memory_bound_sees_torch(pristine):
    """The bound every example runs under trips on a 1 GiB ``torch.empty`` beside the readers."""
    check_bounds(zygote().run(allocate_then_read, str(pristine), 0), "the pristine checkpoint")
    with pytest.raises(AssertionError, match="MiB of address space"):
        check_bounds(zygote().run(allocate_then_read, str(pristine), 1 << 30), "a control")


def _docs_of(pristine: Path) -> dict[str, Any]:
    raw = {str(p.relative_to(pristine)): p.read_bytes() for p in pristine.rglob("*.json")}
    docs = {"manifest.json": json.loads(unseal(raw["manifest.json"], "x")[0])}
    docs.update({k: json.loads(v) for k, v in raw.items() if k != "manifest.json"})
    return docs


FUZZ = settings(max_examples=trials(60, 1500), deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


@pytest.mark.parametrize("reseal", [False, True], ids=["raw", "resealed"])
def test_mutated_metadata_is_refused_or_harmless(pristine, tmp_path_factory, reseal):
    docs = _docs_of(pristine)

    @FUZZ
    @given(mutation=mutations(docs))
    def one(mutation):
        fuzz(pristine, tmp_path_factory, mutation, reseal)

    one()


def test_fuzz_figures():
    """Runs last in this module: the peaks the bounds were checked against."""
    print(f"\nmetadata fuzz: {PEAKS['examples']} examples in a fresh process each; largest peak RSS "
          f"{PEAKS['rss'] >> 20} MiB, largest address-space growth {PEAKS['vm'] >> 20} MiB (bound {MEMORY_LIMIT >> 20} MiB)")
