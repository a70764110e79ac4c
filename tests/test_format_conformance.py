"""One conformance suite that every registered checkpoint format passes (docs/architecture.md,
"The converters' house").

Parametrised over ``ckptkit_converters.registry.formats()`` (ids: the format names), so a newly
registered format is checked by being registered; what differs per format (its sample, options,
what a round trip keeps, how to add or remove a tensor in its files) is data in
tests/format_samples.py. A format without a sample fails here, asking for one. Checked:

* **round trip** ckptkit -> format -> ckptkit through ``registry.convert``: the exported folder is
  detected as the format, and every kept tensor comes back with its dtype, shape and bytes (the
  exact set of kept keys: nothing lost, nothing invented), and kept values equal;
* **missing and extra tensors**, changed through the format's own files: a clear error naming
  the tensor, or, where the format's own tools accept the change (the sample says why), exactly
  what the folder then holds;
* **hostile folders**: one file per role of an exported folder truncated, flipped in the middle,
  replaced by a link leaving the folder, by a FIFO, or deleted: a ``CkptkitError`` naming the
  file, or exactly the sample's tensors; never another exception, other values, or a hang;
* **progress**: called on export and import, monotone, ending at done == total > 0;
* **nothing committed at DEST on failure**: no manifest after a failed import; after a failed
  export, nothing the format detects; after a ``check_export`` refusal, nothing at all;
* **options**: frozen dataclasses, every field defaulted and parseable from ``--opt`` text; None
  means the defaults; options of the wrong type are a clear error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import threading
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit
from ckptkit.errors import CkptkitError
from ckptkit.layout.config import ParallelConfig
from ckptkit.offline import list_checkpoints
from ckptkit.offline.formats import Format, RunOptions, parse_options
from ckptkit_converters import registry
from tests.format_samples import SAMPLES, Sample

FORMATS = registry.formats()
by_format = pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
HANG_SECONDS = 10.0  # an import of these samples takes well under a second; a hang never ends
HUNG = "hung"
Progressed = list[tuple[int, int]]


# ---------------------------------------------------------------- the prepared sample of each format


@dataclass(frozen=True)
class Prepared:
    """A format's sample exported once (with progress recorded) and imported back once: every
    check copies ``exported`` before damaging it and compares imports with ``tensors``/``values``."""

    fmt: Format
    sample: Sample
    exported: Path
    imported: Path
    tensors: dict[str, torch.Tensor]
    values: dict[str, Any]
    export_progress: Progressed
    import_progress: Progressed


def sample_of(fmt: Format, root: Path) -> Sample:
    """The format's sample: a registered format without one fails the suite (never skips it)."""
    if fmt.name not in SAMPLES:
        pytest.fail(f"format {fmt.name!r} is registered but has no conformance sample: add a factory for it to "
                    "SAMPLES in tests/format_samples.py (a small ckptkit checkpoint it can hold, its export "
                    "options, the keys a round trip keeps, and its add/remove-a-tensor mutations)")
    return SAMPLES[fmt.name](root)


def _prepare(fmt: Format, root: Path) -> Prepared:
    """Export the sample and import it back through ``registry.convert`` (the one table every caller
    uses), recording both directions' progress."""
    if fmt.import_options is None or fmt.export_options is None:
        pytest.skip(f"{fmt.name} converts one way only; the round-trip checks need both directions")
    sample = sample_of(fmt, root)
    exported, imported = root / "exported", root / "imported"
    export_progress: Progressed = []
    import_progress: Progressed = []
    registry.convert(sample.source, exported, to_format=fmt.name, target_options=sample.export_options,
                     run=RunOptions(progress=lambda done, total: export_progress.append((done, total))))
    sample.finish_export(exported)
    registry.convert(exported, imported, to_format=registry.CKPTKIT, source_options=sample.import_options,
                     run=RunOptions(progress=lambda done, total: import_progress.append((done, total))))
    view = ckptkit.open(sample.source)
    tensors = {k: view[k].read() for k in sorted(sample.kept)}
    values = {k: view.values[k] for k in sorted(sample.kept_values)}
    return Prepared(fmt, sample, exported, imported, tensors, values, export_progress, import_progress)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Format], Prepared]:
    """Each format prepared once per module, on first use (a failure is raised again for each test)."""
    done: dict[str, Prepared | BaseException] = {}

    def get(fmt: Format) -> Prepared:
        if fmt.name not in done:
            try:
                done[fmt.name] = _prepare(fmt, tmp_path_factory.mktemp(f"conformance-{fmt.name}"))
            except BaseException as exc:  # skip and fail outcomes too: the next test sees the same
                done[fmt.name] = exc
        outcome = done[fmt.name]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return get


# ---------------------------------------------------------------- helpers


def same_bytes(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaNs and signed zeros included, which ``torch.equal`` would not say)."""
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return False
    return torch.equal(got.contiguous().reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8))


def tensor_problems(path: Path, want: dict[str, torch.Tensor], *, values_too: bool = True) -> list[str]:
    """How the checkpoint at ``path`` differs from ``want``: keys lost or added, dtypes, shapes, bytes."""
    view = ckptkit.open(path)
    keys = set(view.keys())
    problems = [f"lost {sorted(set(want) - keys)}"] if set(want) - keys else []
    problems += [f"added {sorted(keys - set(want))}"] if keys - set(want) else []
    for key in sorted(set(want) & keys):
        got = view[key].read()
        if got.dtype != want[key].dtype or tuple(got.shape) != tuple(want[key].shape):
            problems.append(f"{key}: {got.dtype} {list(got.shape)}, want {want[key].dtype} {list(want[key].shape)}")
        elif values_too and not same_bytes(got, want[key]):
            problems.append(f"{key}: other values")
    return problems


INTERNAL_ERRORS = (KeyError, IndexError, AttributeError, TypeError, AssertionError, NameError, ZeroDivisionError)
"""Python's own errors of a program gone astray (not ckptkit's subclasses of them)."""


def unclear(exc: BaseException) -> str:
    """Why ``exc`` is not a clear error ("" : it is one): not a ``CkptkitError``, or one that only
    repeats a crash's text (``importing A into B failed: 'out.bias'``, a ``KeyError`` in the
    write): a parser's error explained (``not a readable pickle (KeyError: 180)``) is clear."""
    if not isinstance(exc, CkptkitError):
        return f"{type(exc).__name__} (not a CkptkitError): {exc}"
    cause = exc.__cause__ or exc.__context__
    while cause is not None:
        if isinstance(cause, INTERNAL_ERRORS) and not isinstance(cause, CkptkitError) \
                and str(exc).endswith(str(cause)):
            return f"{type(exc).__name__} wrapping a crash ({type(cause).__name__}: {cause}): {exc}"
        cause = cause.__cause__ or cause.__context__
    return ""


def committed_at(dest: Path) -> bool:
    """Whether ``dest`` holds a committed ckptkit checkpoint: a manifest, a committed entry of the run
    folder as ``list_checkpoints`` sees it, or a checkpoint ``ckptkit.open`` opens."""
    if (dest / "manifest.json").exists():
        return True
    if not dest.exists():
        return False
    if any(info.committed for info in list_checkpoints(dest)):
        return True
    try:
        ckptkit.open(dest)
    except CkptkitError:
        return False
    return True


def copy_of(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest, symlinks=True)
    return dest


def import_into(p: Prepared, source: Path, dest: Path) -> None:
    p.fmt.import_to(str(source), str(dest), p.sample.import_options, RunOptions())


# ---------------------------------------------------------------- 1. samples


@by_format
def test_every_registered_format_has_a_sample(fmt: Format, tmp_path: Path) -> None:
    sample = sample_of(fmt, tmp_path)
    assert sample.kept, f"{fmt.name}'s sample keeps no tensor: a round trip would check nothing"
    assert set(sample.kept) <= set(ckptkit.open(sample.source).keys())
    assert set(sample.kept_values) <= set(ckptkit.open(sample.source).values)


# ---------------------------------------------------------------- 2. round trip


@by_format
def test_round_trip_keeps_every_kept_tensor_bit_exact(fmt: Format, prepared: Callable[[Format], Prepared]) -> None:
    p = prepared(fmt)
    assert fmt.detect(str(p.exported)), f"{p.exported} is not detected as {fmt.name} after its own export"
    found = registry.detect(p.exported)
    assert found is not None and found.name == fmt.name, f"the registry detects {found} first"
    assert tensor_problems(p.imported, p.tensors) == []
    values = ckptkit.open(p.imported).values
    assert {k: values.get(k) for k in p.values} == p.values


# ---------------------------------------------------------------- 3. missing and extra tensors


def _changed_import(p: Prepared, tmp_path: Path, mutate: Callable[[Path], Any], accepted: str,
                    lost: bool) -> None:
    """Import a folder changed by ``mutate``: refused naming the tensor (nothing committed), or, where
    the sample says the format accepts the change (``accepted``: why), exactly what the folder holds."""
    folder = copy_of(p.exported, tmp_path / "changed")
    change = mutate(folder)
    dest = tmp_path / "dest"
    if accepted:
        import_into(p, folder, dest)
        want = dict(p.tensors)
        if lost:
            want.pop(change.ckptkit_key)
        elif p.sample.extra_imported and change.copies is not None:
            want[change.ckptkit_key] = p.tensors[change.copies]
        assert tensor_problems(dest, want) == [], accepted
        return
    with pytest.raises(CkptkitError) as caught:
        import_into(p, folder, dest)
    assert unclear(caught.value) == ""
    assert change.format_name in str(caught.value), f"the error does not name {change.format_name!r}"
    assert not committed_at(dest)


@by_format
def test_a_missing_tensor_is_named_or_accepted_as_the_formats_tools_do(fmt: Format, prepared: Callable[[Format], Prepared],
                                              tmp_path: Path) -> None:
    p = prepared(fmt)
    _changed_import(p, tmp_path, p.sample.drop_tensor, p.sample.missing_accepted, lost=True)


@by_format
def test_an_extra_tensor_is_named_or_accepted_as_the_formats_tools_do(fmt: Format, prepared: Callable[[Format], Prepared],
                                             tmp_path: Path) -> None:
    p = prepared(fmt)
    _changed_import(p, tmp_path, p.sample.add_tensor, p.sample.extra_accepted, lost=False)


# ---------------------------------------------------------------- 4. hostile folders


def roles(folder: Path) -> dict[str, Path]:
    """One file per role of an exported folder: files alike but for their numbers (ranks, shards,
    chunks) share a role, and a root file is not a nested one; the largest of each is taken."""
    files: dict[str, list[Path]] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder)
        role = ("" if len(rel.parts) == 1 else "nested/") + re.sub(r"\d+", "N", path.name)
        files.setdefault(role, []).append(path)
    return {role: max(paths, key=lambda q: q.stat().st_size) for role, paths in sorted(files.items())}


def _informative(name: str) -> bool:
    return len(name) >= 4 and re.search(r"[A-Za-z]", name) is not None


def names_file(message: str, folder: Path, file: Path) -> bool:
    """Whether an error names ``file``: its path in the folder (or a folder of it below the root, such
    as a zarr array node for a chunk), or its own name where that says something (not ``0``)."""
    rel = file.relative_to(folder)
    names = [rel.as_posix(), *(Path(*rel.parts[:n]).as_posix() for n in range(2, len(rel.parts)))]
    if _informative(file.name):
        names.append(file.name)
    return any(n in message for n in names)


def _truncate(path: Path, outside: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _flip(path: Path, outside: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(max(0, middle - 4), min(len(data), middle + 4)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _link_out(path: Path, outside: Path) -> None:
    """The same bytes, but outside the folder: following the link is the fault, not what it reads."""
    outside.mkdir(exist_ok=True)
    bait = outside / path.name
    shutil.copyfile(path, bait)
    path.unlink()
    path.symlink_to(bait)


def _fifo(path: Path, outside: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _delete(path: Path, outside: Path) -> None:
    path.unlink()


DAMAGES: dict[str, Callable[[Path, Path], None]] = {
    "truncated": _truncate, "flipped": _flip, "link_out": _link_out, "fifo": _fifo, "deleted": _delete}


def _release(path: Path) -> None:
    """Unblock a reader stuck opening a FIFO (a writer that opens and closes: the reader sees EOF)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def bounded_import(p: Prepared, folder: Path, dest: Path, fifo: Path | None) -> BaseException | None | str:
    """Run the import in a thread: its exception, None when it succeeded, or :data:`HUNG` after
    :data:`HANG_SECONDS` (a reader stuck on ``fifo`` is then released, so no thread stays behind)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            import_into(p, folder, dest)
            outcome.append(None)
        except BaseException as exc:  # reported by the test, whatever it is
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True, name="conformance-import")
    worker.start()
    worker.join(HANG_SECONDS)
    if worker.is_alive():
        if fifo is not None:
            _release(fifo)
            worker.join(HANG_SECONDS)
        return HUNG
    return outcome[0]


def judge(p: Prepared, damage: str, folder: Path, file: Path, dest: Path, outcome: BaseException | None | str) -> str:
    """What is wrong with one hostile case's outcome ("" : nothing)."""
    if outcome == HUNG:
        return "the import hung"
    if isinstance(outcome, BaseException):
        if unclear(outcome):
            return unclear(outcome)
        if committed_at(dest):
            return f"failed ({outcome}) but left a committed checkpoint at DEST"
        if not names_file(str(outcome), folder, file):
            return f"the error does not name the file: {type(outcome).__name__}: {outcome}"
        return ""
    if damage == "link_out":
        return "imported through a link leaving the folder"
    loose = damage == "flipped" and bool(p.sample.unchecked_data)
    problems = tensor_problems(dest, p.tensors, values_too=not loose)
    return f"imported, but {problems}" if problems else ""


@by_format
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_hostile_folders_fail_clearly_or_import_exactly(fmt: Format, damage: str,
                                                        prepared: Callable[[Format], Prepared],
                                                        tmp_path: Path) -> None:
    p = prepared(fmt)
    failures = []
    for n, (role, file) in enumerate(roles(p.exported).items()):
        folder = copy_of(p.exported, tmp_path / f"case{n}")
        target = folder / file.relative_to(p.exported)
        DAMAGES[damage](target, tmp_path / f"outside{n}")
        dest = tmp_path / f"dest{n}"
        problem = judge(p, damage, folder, target, dest, bounded_import(p, folder, dest, target if damage == "fifo" else None))
        if problem:
            failures.append(f"{role} ({file.relative_to(p.exported)}) {damage}: {problem}")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- 5. progress


def progress_problems(calls: Progressed) -> list[str]:
    if not calls:
        return ["never called"]
    problems = []
    dones = [d for d, _ in calls]
    if dones != sorted(dones):
        problems.append(f"done goes back: {dones}")
    if any(d > t for d, t in calls):
        problems.append(f"done passes total: {calls}")
    done, total = calls[-1]
    if not (done == total > 0):
        problems.append(f"last call is {done}/{total}, not done == total > 0")
    return problems


@by_format
def test_export_reports_progress(fmt: Format, prepared: Callable[[Format], Prepared]) -> None:
    assert progress_problems(prepared(fmt).export_progress) == []


@by_format
def test_import_reports_progress(fmt: Format, prepared: Callable[[Format], Prepared]) -> None:
    assert progress_problems(prepared(fmt).import_progress) == []


# ---------------------------------------------------------------- 6. nothing at DEST after a failed export


def kept_byte(checkpoint: Path, kept: frozenset[str]) -> tuple[Path, int]:
    """The data object and offset of a byte in the middle of a kept tensor's stored piece (read from
    the ranks' indexes): a byte every export of the sample must read."""
    for index in sorted((checkpoint / "index").glob("*.json")):
        for key, _offsets, _sizes, _flat, obj, start, length, *_ in json.loads(index.read_text())["pieces"]:
            if key in kept and length:
                return checkpoint / obj, start + length // 2
    raise AssertionError(f"{checkpoint}: no stored piece of a kept tensor")


def _cut_at(path: Path, at: int) -> None:
    path.write_bytes(path.read_bytes()[:at])


def _flip_at(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@by_format
@pytest.mark.parametrize("damage", [_cut_at, _flip_at], ids=["truncated", "flipped"])
def test_an_export_of_a_damaged_source_leaves_nothing_detected(fmt: Format, damage: Callable[[Path, int], None],
                                                                prepared: Callable[[Format], Prepared],
                                                                tmp_path: Path) -> None:
    """A kept tensor's bytes in the source damaged: the export fails clearly (ckptkit's sizes and
    checksums), and leaves no file at DEST (so nothing there is taken for the format)."""
    p = prepared(fmt)
    source = copy_of(p.sample.source, tmp_path / "source")
    damage(*kept_byte(source, p.sample.kept))
    dest = tmp_path / "dest"
    with pytest.raises(CkptkitError) as caught:
        fmt.export_from(str(source), str(dest), p.sample.export_options, RunOptions())
    assert unclear(caught.value) == ""
    assert not fmt.detect(str(dest)), f"a failed export left {dest} looking like {fmt.name}"
    left = sorted(str(f.relative_to(dest)) for f in dest.rglob("*") if not f.is_dir()) if dest.exists() else []
    assert left == [], f"a failed export left files at {dest}: {left}"


@by_format
def test_options_check_export_refuses_create_nothing(fmt: Format, prepared: Callable[[Format], Prepared],
                                                    tmp_path: Path) -> None:
    p = prepared(fmt)
    refused = p.sample.refused_export
    if refused is None:  # every options instance exports: the defaults pass the check
        fmt.check_export(fmt.export_options())
        return
    with pytest.raises(CkptkitError):
        fmt.check_export(refused)
    for n, export in enumerate((
            lambda dest: fmt.export_from(str(p.sample.source), str(dest), refused, RunOptions()),
            lambda dest: registry.convert(p.sample.source, dest, to_format=fmt.name, target_options=refused))):
        dest = tmp_path / f"dest{n}"
        with pytest.raises(CkptkitError):
            export(dest)
        assert not dest.exists(), f"a refused export created {sorted(dest.rglob('*'))}"


# ---------------------------------------------------------------- 7. options


def option_classes(fmt: Format) -> list[type]:
    return [cls for cls in (fmt.import_options, fmt.export_options) if cls is not None]


@by_format
def test_options_are_frozen_dataclasses_with_every_field_defaulted(fmt: Format) -> None:
    for cls in option_classes(fmt):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls  # type: ignore[attr-defined]
        undefaulted = [f.name for f in dataclasses.fields(cls)
                       if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        assert undefaulted == [], f"{cls.__name__}: no default for {undefaulted}"
        made = cls()
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(made, dataclasses.fields(cls)[0].name, None)


def texts_for(kind: Any) -> list[tuple[str, Callable[[Any], bool]]]:
    """Valid ``--opt`` texts for a field of type ``kind``, each with a check of the value it parses to."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(kind)
        out = [("none", lambda v: v is None)] if type(None) in members else []
        return out + [t for m in members if m is not type(None) for t in texts_for(m)]
    if origin is typing.Literal:
        return [(str(a), lambda v, a=a: v == a) for a in typing.get_args(kind)]
    if kind is bool:
        return [("true", lambda v: v is True), ("off", lambda v: v is False)]
    if kind is int:
        return [("3", lambda v: v == 3 and type(v) is int)]
    if kind is float:
        return [("0.5", lambda v: v == 0.5)]
    if kind is str:
        return [("a-text", lambda v: v == "a-text")]
    if kind is ParallelConfig:
        return [("tp2pp1", lambda v: isinstance(v, ParallelConfig) and v.tp == 2 and v.pp == 1)]
    raise AssertionError(f"no --opt text is known for an option of type {kind}: use int, float, bool, str, a "
                         "Literal, a class with parse, or X | None (docs/architecture.md, How to add a format)")


@by_format
def test_every_option_parses_from_text(fmt: Format) -> None:
    from ckptkit.offline.formats import option_types

    for cls in option_classes(fmt):
        for name, kind in option_types(cls).items():
            for text, check in texts_for(kind):
                value = parse_options(cls, {name: text}, what=f"the {fmt.name} options")[name]
                assert check(value), f"{cls.__name__}.{name}: {text!r} parsed to {value!r}"
        with pytest.raises(CkptkitError, match="no_such_option"):
            parse_options(cls, {"no_such_option": "1"}, what=f"the {fmt.name} options")


@by_format
def test_a_wrongly_typed_option_text_names_the_option(fmt: Format) -> None:
    from ckptkit.offline.formats import option_types

    for cls in option_classes(fmt):
        for name, kind in option_types(cls).items():
            if kind is str or typing.get_args(kind) == (str, type(None)):
                continue  # any text is a string
            with pytest.raises(CkptkitError, match=name):
                parse_options(cls, {name: "[not-valid]"}, what=f"the {fmt.name} options")


def _outcome(call: Callable[[], Any], dest: Path) -> tuple[str, Any]:
    """What a conversion did, comparable across two destinations: its error (type and text, the
    destination's path left out) or the files it wrote."""
    try:
        call()
    except CkptkitError as exc:
        return type(exc).__name__, str(exc).replace(str(dest), "DEST")
    return "written", sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*"))


@by_format
def test_no_options_mean_the_defaults(fmt: Format, prepared: Callable[[Format], Prepared], tmp_path: Path) -> None:
    p = prepared(fmt)
    src, out = str(p.sample.source), str(p.exported)
    a, b = tmp_path / "export_none", tmp_path / "export_defaults"
    assert _outcome(lambda: fmt.export_from(src, str(a), None, RunOptions()), a) == \
        _outcome(lambda: fmt.export_from(src, str(b), fmt.export_options(), RunOptions()), b)
    a, b = tmp_path / "import_none", tmp_path / "import_defaults"
    none, defaults = (_outcome(lambda: fmt.import_to(out, str(a), None, RunOptions()), a),
                      _outcome(lambda: fmt.import_to(out, str(b), fmt.import_options(), RunOptions()), b))
    assert none[0] == defaults[0] and (none[0] == "written" or none == defaults), (none, defaults)
    if none[0] == "written":  # attempt-named objects differ: compare what the two checkpoints hold
        view = ckptkit.open(b)
        assert tensor_problems(a, {k: view[k].read() for k in view.keys()}) == []


@by_format
def test_options_of_the_wrong_type_are_a_clear_error(fmt: Format, prepared: Callable[[Format], Prepared],
                                                    tmp_path: Path) -> None:
    p = prepared(fmt)
    wrong_import, wrong_export = fmt.export_options(), fmt.import_options()
    with pytest.raises(CkptkitError, match=fmt.import_options.__name__):
        fmt.import_to(str(p.exported), str(tmp_path / "a"), wrong_import, RunOptions())
    with pytest.raises(CkptkitError, match=fmt.export_options.__name__):
        fmt.export_from(str(p.sample.source), str(tmp_path / "b"), wrong_export, RunOptions())
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
