"""The Hugging Face importer against hostile and damaged folders: safetensors headers, the index, symlinks.

Every case runs through the library (``import_hf``) and the CLI (``ckptkit convert SRC DEST --from hf``)
and must end one of two ways: refused with a one-line ``CkptkitError`` naming the file (CLI: exit 2, one
``error:`` line), with nothing committed at DEST; or imported exactly as the ``safetensors`` package
reads the folder. Never a traceback, never a silent different result, never a read outside the source
(an audit hook records every file Python opens), in bounded time and memory (peak RSS, which sees
torch's allocator). The last test of each test_hf_trust*.py module prints the tally per case class so
far in the session and asserts silent imports, tracebacks and reads outside are zero (the folders
against their config: tests/test_hf_trust_config.py; a damaged or hostile index:
tests/test_hf_trust_index.py; symlinks and the hub cache: tests/test_hf_trust_links.py).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.cli.main import cli
from ckptkit.storage.local import LocalStore
from ckptkit.storage.url import open_store
from ckptkit_converters.hf.files import DTYPES, ITEMSIZE, MAX_HEADER, SafetensorsFile
from ckptkit_converters.hf.importer import import_hf
from ckptkit_converters.hf.mapping import HFConfig
from tests.conftest import trials

pytestmark = pytest.mark.timeout(300)
TALLY: dict[str, Counter[str]] = defaultdict(Counter)
LIMIT_S, LIMIT_RSS = 20.0, 256 << 20
FUZZ = settings(max_examples=trials(15, 200), deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])

# ---------------------------------------------------------------- watching what a case opens and holds

_OPENED: list[str] = []
_WATCH = [False]


def _audit(event: str, args: tuple) -> None:
    if _WATCH[0] and event == "open" and isinstance(args[0], (str, bytes)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # installed once per process; records only while a case runs


def _status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) << 10
    except OSError:
        return None
    return None


class Watched:
    """Files opened, seconds taken and peak RSS growth (reset through /proc/self/clear_refs) of a block."""

    def __enter__(self) -> Watched:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM, the peak RSS, to the current RSS
            self.rss0 = _status("VmRSS")
        except OSError:
            self.rss0 = None
        _OPENED.clear()
        _WATCH[0] = True
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.monotonic() - self.t0
        _WATCH[0] = False
        self.opened = list(_OPENED)
        peak = _status("VmHWM")
        self.rss = (peak - self.rss0) if peak is not None and self.rss0 is not None else 0

    def outside(self, allowed: list[Path], under: Path) -> list[str]:
        """Opened paths under ``under`` (the test's folder) that resolve outside every ``allowed`` root."""
        roots = [os.path.realpath(a) for a in allowed]
        base = os.path.realpath(under)
        out = []
        for p in self.opened:
            real = os.path.realpath(p)
            if real.startswith(base + os.sep) and not any(real == r or real.startswith(r + os.sep) for r in roots):
                out.append(real)
        return out


def test_the_watch_sees_reads_outside_and_torch_memory(tmp_path):
    """The figures the suite asserts to be zero can be nonzero: a read of a bait file and a large torch
    allocation are both seen."""
    bait = tmp_path / "bait"
    bait.write_bytes(b"x")
    (tmp_path / "src").mkdir()
    with Watched() as w:
        bait.read_bytes()
        os.close(os.open(bait, os.O_RDONLY))
        torch.empty(300 << 20, dtype=torch.uint8).fill_(1)
    assert w.outside([tmp_path / "src"], tmp_path) == [str(bait.resolve())] * 2
    if w.rss0 is not None:
        assert w.rss >= 256 << 20


# ---------------------------------------------------------------- running a case both ways


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    view = ckptkit.open(str(path))
    return {k: view[k][...] for k in view.keys()}


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and
        bytes(a[k].reshape(-1).view(torch.uint8).numpy()) == bytes(b[k].reshape(-1).view(torch.uint8).numpy())
        for k in a)


def attempt(kind: str, source: Path, config: Path, *, expect: str, names: str, root: Path,
            reference: Callable[[], dict[str, torch.Tensor] | None] | None = None,
            allowed: list[Path] | None = None, family: str | None = None) -> list[str]:
    """Import ``source`` through the library and through the CLI; tally and check each outcome.

    ``expect``: "refuse", "import" (must equal ``reference()``) or "either" (a refusal, or an import equal
    to ``reference()``, which is None when the ``safetensors`` package itself refuses the folder).
    ``names``: text every error must contain (the file); ``family``: a key table by name (CLI --hf-family)
    instead of the config's model_type. Returns the outcomes ("error"/"imported")."""
    allowed = [source, config, *(allowed or [])]
    outcomes = []
    for how in ("library", "cli"):
        dest = root / f"dest-{how}-{time.monotonic_ns()}"
        with Watched() as w:
            outcome, message = _run(how, source, dest, config, family)
        TALLY[kind]["tried"] += 1
        outside = w.outside([*allowed, dest], root)
        TALLY[kind]["reads outside"] += bool(outside)
        assert not outside, f"{kind} ({how}): read outside the source: {outside[:3]}"
        assert w.seconds < LIMIT_S, f"{kind} ({how}): took {w.seconds:.1f}s"
        assert w.rss < LIMIT_RSS, f"{kind} ({how}): peak RSS grew by {w.rss >> 20} MiB"
        if outcome == "traceback":
            TALLY[kind]["tracebacks"] += 1
            pytest.fail(f"{kind} ({how}): not a clear error: {message}")
        if outcome == "error":
            TALLY[kind]["clear errors"] += 1
            assert "\n" not in message.strip() and names in message, f"{kind} ({how}): unclear error: {message!r}"
            assert expect != "import", f"{kind} ({how}): refused a good folder: {message}"
            assert not (dest / "manifest.json").exists(), f"{kind} ({how}): a checkpoint was committed at DEST"
        else:
            want = reference() if reference is not None else None
            good = expect != "refuse" and want is not None and same_tensors(checkpoint_tensors(dest), want)
            TALLY[kind]["imports" if good else "silent imports"] += 1
            assert good, f"{kind} ({how}): imported something the safetensors package does not read that way"
        outcomes.append(outcome)
        shutil.rmtree(dest, ignore_errors=True)
    return outcomes


def _run(how: str, source: Path, dest: Path, config: Path, family: str | None) -> tuple[str, str]:
    if how == "library":
        try:
            import_hf(str(source), str(dest), HFConfig.from_file(config), family=family)
            return "imported", ""
        except ckptkit.CkptkitError as exc:
            return "error", str(exc)
        except Exception as exc:  # noqa: BLE001 - what the test is here to find
            return "traceback", f"{type(exc).__name__}: {exc}"
    args = ["convert", str(source), str(dest), "--from", "hf", "--hf-config", str(config),
            *(["--hf-family", family] if family else [])]
    result = CliRunner().invoke(cli, args)
    text = result.output
    if result.exit_code == 0:
        return "imported", ""
    if result.exit_code == 2 and "Traceback" not in text and text.startswith("error:") and \
            (result.exception is None or isinstance(result.exception, SystemExit)):
        return "error", text
    return "traceback", f"exit {result.exit_code}: {text} {result.exception!r}"


# ---------------------------------------------------------------- a tiny Llama saved by transformers

_BUILT: dict[str, Path] = {}
LLAMA = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def tiny(kind: str, base: Path) -> Path:
    """A tiny model saved by ``transformers``' own ``save_pretrained`` (built once per process): ``llama``
    (one model.safetensors), ``llama_sharded`` (an index and 12 shards), ``qwen3_moe`` (4 experts)."""
    if kind not in _BUILT:
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        if kind.startswith("llama"):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
        else:
            model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
                **LLAMA, head_dim=16, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2))
        path = base / f"built-{kind}"
        model.save_pretrained(str(path), **({"max_shard_size": "40KB"} if kind.endswith("sharded") else {}))
        _BUILT[kind] = path
    return _BUILT[kind]


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Callable[[str], Path]:
    base = tmp_path_factory.mktemp("hf-built")
    return lambda kind: tiny(kind, base)


def header_of(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_st(path: Path, header: Any, data: bytes, n: int | None = None) -> None:
    """A safetensors file from a header (a dict, or the JSON text as bytes), its data, and optionally a
    header length field that lies."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    body += b" " * (-len(body) % 8) if not isinstance(header, bytes) else b""
    length = len(body) if n is None else n
    path.write_bytes((length % 2**64).to_bytes(8, "little") + body + data)


def package_reads(path: Path) -> dict[str, torch.Tensor] | None:
    """What the ``safetensors`` package loads from ``path``; None where it refuses."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception:  # noqa: BLE001 - any refusal
        return None


def reference_import(folder: Path, config: Path, root: Path, family: str | None = None) -> dict[str, torch.Tensor] | None:
    """The checkpoint ckptkit makes of what the package reads from ``folder``'s shards, re-saved by the
    package itself into a clean folder (None if the package refuses a shard)."""
    from safetensors.torch import save_file

    clean = root / f"clean-{time.monotonic_ns()}"
    clean.mkdir()
    for f in folder.iterdir():
        if f.suffix == ".safetensors":
            tensors = package_reads(f)
            if tensors is None:
                return None
            save_file(tensors, str(clean / f.name), metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy(f, clean / f.name)
    out = root / f"clean-out-{time.monotonic_ns()}"
    import_hf(str(clean), str(out), HFConfig.from_file(config), family=family)
    return checkpoint_tensors(out)


# ---------------------------------------------------------------- 1. safetensors headers, fuzzed

NAMES = st.text(alphabet="ab.λ0_", min_size=1, max_size=6).filter(lambda s: s != "__metadata__")
CODES = sorted(DTYPES) + ["U16", "F8_E8M0"]
ODD_INTS = ["2.5", "true", '"4"', "-1", "-0", "1e2", "null", str(2**64), str(2**64 - 1), str(2**63), "[]", "{}",
            "4.0", str(10**30)]


@st.composite
def header_cases(draw, mutation: Callable[..., bytes]) -> tuple[str, bytes]:
    """(mutation, file bytes): a valid safetensors file of random tensors laid out in random order, then
    ``mutation``: one of the things a hostile or damaged writer does to a header."""
    names = draw(st.lists(NAMES, min_size=0, max_size=4, unique=True))
    specs = [(n, draw(st.sampled_from(sorted(DTYPES))), draw(st.lists(st.integers(0, 3), max_size=3))) for n in names]
    order, pos, header = draw(st.permutations(range(len(specs)))), 0, {}
    for i in order:
        n, code, shape = specs[i]
        size = ITEMSIZE[code] * math.prod(shape)
        header[n] = {"dtype": code, "shape": shape, "data_offsets": [pos, pos + size]}
        pos += size
    if draw(st.booleans()):
        header["__metadata__"] = {"format": "pt"}
    data = draw(st.binary(min_size=pos, max_size=pos))
    raw = mutation(draw, header, data, names)
    return mutation.__name__, raw


def _raw(header: dict, marks: dict[str, str]) -> bytes:
    text = json.dumps(header)
    for mark, value in marks.items():
        text = text.replace(json.dumps(mark), value)
    return text.encode()


def _file(body: bytes, data: bytes, n: int | None = None) -> bytes:
    return ((len(body) if n is None else n) % 2**64).to_bytes(8, "little") + body + data


def valid(draw, header, data, names):
    return _file(json.dumps(header).encode(), data)


def offset(draw, header, data, names):
    if not names:
        return _file(json.dumps(header).encode(), data + draw(st.binary(min_size=1, max_size=3)))
    n = draw(st.sampled_from(names))
    which = draw(st.integers(0, 1))
    old = header[n]["data_offsets"][which]
    others = [x for m in names for x in header[m]["data_offsets"]]
    value = draw(st.sampled_from([str(v) for v in (0, old - 1, old + 1, old + 2, old + 8, *others)] + ODD_INTS))
    header[n]["data_offsets"][which] = "__V__"
    return _file(_raw(header, {"__V__": value}), data)


def overlap(draw, header, data, names):
    if len(names) < 2:
        return valid(draw, header, data, names)
    a, b = draw(st.permutations(names))[:2]
    how = draw(st.integers(0, 2))
    if how == 0:  # two weights of one shape on one set of bytes: every size check passes
        header[a] = dict(header[b])
    elif how == 1:
        header[a]["data_offsets"] = list(header[b]["data_offsets"])
    else:
        header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
    return _file(json.dumps(header).encode(), data)


def gap(draw, header, data, names):
    d = draw(st.integers(1, 9))
    at = draw(st.integers(0, len(data)))
    for m in names:
        header[m]["data_offsets"] = [x + d if x > at or (x == at and draw(st.booleans())) else x
                                     for x in header[m]["data_offsets"]]
    return _file(json.dumps(header).encode(), data[:at] + bytes(d) + data[at:])


def tail(draw, header, data, names):
    cut = draw(st.integers(-9, 9))
    return _file(json.dumps(header).encode(), data[:len(data) + cut] if cut < 0 else data + bytes(cut))


def shape(draw, header, data, names):
    if not names:
        return valid(draw, header, data, names)
    n = draw(st.sampled_from(names))
    if draw(st.booleans()):  # one entry
        header[n]["shape"] = [*header[n]["shape"], "__V__"][-draw(st.integers(1, 3)):]
        value = draw(st.sampled_from(ODD_INTS))
    else:  # the whole shape
        header[n]["shape"] = "__V__"
        value = draw(st.sampled_from(["[0]", "[1, 0]", f"[{2**63}, 0]", f"[{2**40}, {2**40}, 0]", f"[{2**62}, 4]",
                                      "5", "null", '"x"', "{}", "[[1]]", "[" * 50 + "1" + "]" * 50]))
    return _file(_raw(header, {"__V__": value}), data)


def dtype(draw, header, data, names):
    if not names:
        return valid(draw, header, data, names)
    header[draw(st.sampled_from(names))]["dtype"] = draw(st.sampled_from(
        ["f32", "F32 ", "", "U16", "F4", "C64", "I128", 3, None, ["F32"], *CODES]))
    return _file(json.dumps(header).encode(), data)


def fields(draw, header, data, names):
    if not names:
        return _file(b"[]", data)
    n = draw(st.sampled_from(names))
    choice = draw(st.integers(0, 3))
    if choice == 0:
        del header[n][draw(st.sampled_from(["dtype", "shape", "data_offsets"]))]
    elif choice == 1:
        depth = draw(st.sampled_from([1, 20, 99, 150, 400]))
        header[n]["extra"] = "__V__"
        return _file(_raw(header, {"__V__": "[" * depth + "]" * depth}), data)
    elif choice == 2:
        header[n] = draw(st.sampled_from([[], "x", 1, None]))
    else:
        return _file(_raw(header, {}).replace(b'"dtype"', b'"dtype": "F32", "dtype"', 1), data)  # duplicate key
    return _file(json.dumps(header).encode(), data)


def length(draw, header, data, names):
    body = json.dumps(header).encode()
    n = draw(st.sampled_from([0, 1, len(body) - 1, len(body) + 1, len(body) + 8, len(body) + len(data) + 1,
                              MAX_HEADER + 1, 2**63, 2**64 - 1]))
    return _file(body, data, n)


def text(draw, header, data, names):
    body = json.dumps(header).encode()
    variant = draw(st.integers(0, 6))
    body = [b"\xff" + body, body + b"x", b"  " + body + b"  ", body[:-1], body.replace(b"{", b'{"\\ud800": 1, ', 1),
            json.dumps([header]).encode(), body + b"\x00" * 3][variant]
    return _file(body, data)


def metadata(draw, header, data, names):
    header["__metadata__"] = draw(st.sampled_from([{"a": 1}, {"a": None}, [], "x", None, {"a": {"b": "c"}}, {}]))
    return _file(json.dumps(header).encode(), data)


MUTATIONS = [valid, offset, overlap, gap, tail, shape, dtype, fields, length, text, metadata]


def _ours(store: Any, name: str) -> tuple[str, Any]:
    try:
        f = SafetensorsFile(store, name)
        return "read", {k: f.read(k) for k in f.entries}
    except ckptkit.CkptkitError as exc:
        return "error", str(exc)
    except Exception as exc:  # noqa: BLE001
        return "traceback", f"{type(exc).__name__}: {exc}"


# what ckptkit refuses and the package reads: dtypes it does not import, dimensions torch cannot hold, and
# the limits every checkpoint document gets (nesting past 100 levels, a key given twice)
STRICTER = ("does not import", "beyond what torch can hold", "nested deeper than", "duplicate key")


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.__name__ for m in MUTATIONS])
@given(data=st.data())
@FUZZ
def test_fuzzed_headers_read_as_the_package_reads_them_or_are_refused(tmp_path, mutation, data):
    """Local files (our parser, then the package on the same descriptor) and the remote path's strict
    parser alone (the tensorstore engine: not a local store) against what the package loads."""
    mutation, raw = data.draw(header_cases(mutation))
    path = tmp_path / "x.safetensors"
    path.write_bytes(raw)
    theirs = package_reads(path)
    kind = f"header fuzz: {mutation}"
    for store in (LocalStore(str(tmp_path)), open_store(str(tmp_path), {"io_engine": "tensorstore"})):
        with Watched() as w:
            outcome, got = _ours(store, "x.safetensors")
        TALLY[kind]["tried"] += 1
        assert w.seconds < LIMIT_S and w.rss < LIMIT_RSS, f"{mutation}: {w.seconds:.1f}s, {w.rss >> 20} MiB"
        assert not w.outside([tmp_path], tmp_path.parent)
        if outcome == "traceback":
            TALLY[kind]["tracebacks"] += 1
            pytest.fail(f"{mutation}: {got}")
        if outcome == "error":
            TALLY[kind]["clear errors"] += 1
            assert "\n" not in got and "x.safetensors" in got, got
            assert theirs is None or any(s in got for s in STRICTER), f"{mutation}: refused what the package reads: " \
                                                                      f"{got}"
        else:
            same = theirs is not None and same_tensors(got, theirs)
            TALLY[kind]["imports" if same else "silent imports"] += 1
            verdict = "refuses" if theirs is None else "differs"
            assert same, f"{mutation}: read {sorted(got)} where the package {verdict} ({raw[:200]!r})"


LLAMA_MUTATIONS = [offset, overlap, gap, tail, shape, dtype, length, metadata]


@pytest.mark.parametrize("mutation", LLAMA_MUTATIONS, ids=[m.__name__ for m in LLAMA_MUTATIONS])
@given(case=st.data())
@settings(max_examples=trials(3, 25), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_fuzzed_headers_of_a_real_llama_import_exactly_or_are_refused(tmp_path, built, mutation, case):
    """The same mutations on the header of a Llama saved by transformers, through import_hf and the CLI."""
    src = built("llama")
    header, data = header_of(src / "model.safetensors")
    names = [n for n in header if n != "__metadata__"]
    folder = tmp_path / f"hf-{time.monotonic_ns()}"
    shutil.copytree(src, folder)
    (folder / "model.safetensors").write_bytes(mutation(case.draw, header, data, names))
    attempt(f"llama header: {mutation.__name__}", folder, folder / "config.json", expect="either",
            names="model.safetensors", root=tmp_path,
            reference=lambda: reference_import(folder, folder / "config.json", tmp_path))


def test_shared_bytes_holes_and_stray_bytes_are_refused_naming_the_tensors(tmp_path, built):
    """The three findings of issue 24 by hand: two weights on one set of bytes, a hole, bytes after the end."""
    src = built("llama")
    header, data = header_of(src / "model.safetensors")
    k, v = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"
    cases = {}
    shared = json.loads(json.dumps(header))
    shared[v]["data_offsets"] = list(shared[k]["data_offsets"])
    cases["shared"] = (shared, data, "overlapping tensor")
    holed = json.loads(json.dumps(header))
    end = max(e["data_offsets"][1] for n, e in holed.items() if n != "__metadata__")
    last = next(n for n, e in holed.items() if n != "__metadata__" and e["data_offsets"][1] == end)
    begin = holed[last]["data_offsets"][0]
    holed[last]["data_offsets"] = [begin + 8, end + 8]  # 8 bytes before the last tensor belong to none
    cases["hole"] = (holed, data[:begin] + bytes(8) + data[begin:], "belong to no tensor")
    cases["stray"] = (header, data + bytes(16), "belong to no tensor")
    for name, (h, d, why) in cases.items():
        folder = tmp_path / name
        shutil.copytree(src, folder)
        write_st(folder / "model.safetensors", h, d)
        assert package_reads(folder / "model.safetensors") is None  # the package refuses each
        attempt("hand-made headers", folder, folder / "config.json", expect="refuse", names="model.safetensors",
                root=tmp_path)
        with pytest.raises(ckptkit.CorruptCheckpointError, match=why):
            import_hf(str(folder), str(tmp_path / f"{name}-out"), HFConfig.from_file(folder / "config.json"))


def test_the_package_check_runs_on_the_file_read_and_must_agree(tmp_path, built):
    """The second opinion is real: the package refuses what it refuses, a header it reads differently
    from ours is refused, and a file swapped for a FIFO or another size is never handed to it."""
    from safetensors.torch import save_file

    from ckptkit_converters.hf.files import check_with_package, parse_header

    path = built("llama") / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    entries, meta = parse_header(raw[8:8 + n], len(raw), "llama")
    check_with_package(str(path), len(raw), entries, meta, "llama")  # agrees: nothing to say
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.ones(3)}, str(other))
    with pytest.raises(ckptkit.CorruptCheckpointError, match="reads this header differently"):
        check_with_package(str(other), other.stat().st_size, entries, meta, "other")
    header, data = header_of(path)
    header["model.norm.weight"] = dict(header["model.layers.0.input_layernorm.weight"])
    write_st(tmp_path / "bad.safetensors", header, data)
    size = (tmp_path / "bad.safetensors").stat().st_size
    with pytest.raises(ckptkit.CorruptCheckpointError, match="the safetensors package refuses it: .*invalid offset"):
        check_with_package(str(tmp_path / "bad.safetensors"), size, entries, meta, "bad")
    with pytest.raises(ckptkit.CorruptCheckpointError, match="changed while being opened"):
        check_with_package(str(path), len(raw) + 1, entries, meta, "llama")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ckptkit.CorruptCheckpointError, match="changed while being opened"):
        check_with_package(str(tmp_path / "fifo"), len(raw), entries, meta, "fifo")


def report(title: str) -> str:
    """The tally per case class; asserts the figures that must be zero are."""
    lines = [title, f"{'case class':48} tried  errors  imports  silent  tracebacks  outside"]
    total: Counter[str] = Counter()
    for kind in sorted(TALLY):
        c = TALLY[kind]
        total.update(c)
        lines.append(f"{kind:48} {c['tried']:5}  {c['clear errors']:6}  {c['imports']:7}  {c['silent imports']:6}  "
                     f"{c['tracebacks']:10}  {c['reads outside']:7}")
    lines.append(f"{'total':48} {total['tried']:5}  {total['clear errors']:6}  {total['imports']:7}  "
                 f"{total['silent imports']:6}  {total['tracebacks']:10}  {total['reads outside']:7}")
    assert total["silent imports"] == total["tracebacks"] == total["reads outside"] == 0
    return "\n".join(lines)


def test_hf_trust_counts():
    """Runs last in this module: the tally of every HF importer case so far in this session."""
    print("\n" + report("HF importer cases so far"))
