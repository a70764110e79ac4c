"""Names and paths a foreign folder hands the importers (converters/common/source_paths.py): a tag is one plain name.

Every case runs with a *bait* folder next to the source holding a valid checkpoint of the same
kind, and an audit hook recording every file opened and folder listed under it
(:class:`tests.test_import_trust_folders.Reads`): a tag, tracker or link that reaches it is a
"read outside" even when the import then fails.

* DeepSpeed's ``latest`` file, the ``tag`` option (library) and ``--tag`` (CLI): hypothesis names with
  ``/``, ``\\``, ``..``, NUL, control and format characters, surrogates, over-long names; a fixed list
  of the nastiest (``../bait/...``, an absolute path to the bait) through ``convert`` and ``reshard``,
  library and CLI. Plain names, unicode included, still import;
* Megatron's ``latest_checkpointed_iteration.txt``: any text; only ASCII digits or ``release`` name an
  iteration, everything else is an error naming the tracker;
* links out of the source (``latest``, a tag or iteration folder, every kind of ``.pt``, ``metadata.json``,
  ``.metadata``) are refused naming the path; links that stay inside are followed; a FIFO where a file
  should be fails at once instead of hanging.

Every case: a one-line error naming the file (or the option) and what was expected, nothing committed
at the destination, nothing under the bait opened. The figures are printed (``-s``) and asserted.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.layout.config import ParallelConfig
from ckptkit.offline.resharding import ReshardOptions
from ckptkit_converters.deepspeed import import_deepspeed
from ckptkit_converters.deepspeed.options import DeepSpeedImportOptions
from ckptkit_converters.registry import convert
from tests.conftest import trials
from tests.test_import_trust_folders import (
    Reads,
    Tally,
    dcp_folder,
    deepspeed_folder,
    expp_folder,
    legacy_folder,
    run_cli,
    run_library,
    torch_dist_folder,
)

TAG = "global_step3"
TRACKER = "latest_checkpointed_iteration.txt"
TP1 = ParallelConfig.parse("tp1pp1")
TALLY = Tally()
SETTINGS = settings(max_examples=trials(12, 200), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("templates")
    out = {"ds": deepspeed_folder(base / "ds"), "moe": deepspeed_folder(base / "moe", moe=True),
           "expp": expp_folder(base / "expp"), "legacy": legacy_folder(base / "legacy")}
    (base / "td").mkdir()
    (base / "dcp").mkdir()
    out["td"] = torch_dist_folder(base / "td")
    out["dcp"] = dcp_folder(base / "dcp")
    return out


@pytest.fixture(scope="module", autouse=True)
def figures():
    yield
    print("\n" + TALLY.report("test_import_trust"))
    TALLY.assert_clean()


_counter = [0]


def case(tmp: Path, templates: dict[str, Path], kind: str, bait_kind: str | None = None) -> tuple[Path, Path, Path]:
    """A fresh ``(src, bait, out)``: a copy of template ``kind`` and a valid checkpoint as bait next to it."""
    _counter[0] += 1
    root = tmp / f"case{_counter[0]}"
    src, bait = root / "src", root / "bait"
    shutil.copytree(templates[kind], src, symlinks=True)
    shutil.copytree(templates[bait_kind or kind], bait, symlinks=True)
    return src, bait, root / "out"


# names: one bad element kept inside (a stripped 'latest' cannot lose it), or whole bad names
_SAFE = st.text(alphabet=st.characters(categories=("L", "N"), include_characters="_-"), min_size=1, max_size=8)
_BAD_PARTS = ["/", "\\", "\x00", "\n", "\r", "\t", "\x1b", "\x7f", "\x85", "\u2028", "\u2029", "\u202e", "\u200b",
              "\ufeff", "/../", "\\..\\"]
_WHOLE_BAD = ["", ".", "..", "../bait/" + TAG, "..\\bait\\" + TAG, "/etc", "C:bait", "c:\\bait", " / ", "../../..",
              "\x00", "a" * 256, "é" * 128, "./" + TAG, TAG + "/", TAG + "/.."]
HOSTILE = st.one_of(st.builds(lambda a, bad, b: a + bad + b, _SAFE, st.sampled_from(_BAD_PARTS), _SAFE),
                    st.sampled_from(_WHOLE_BAD),
                    st.builds(lambda a, n: a * n, st.sampled_from(["x", "é", "😀"]), st.integers(256, 300)))
PLAIN = _SAFE.filter(lambda s: len(s.encode()) <= 255)


def _write_pointer(path: Path, text: str) -> None:
    path.write_bytes(text.encode("utf-8", "surrogatepass"))


# ---------------------------------------------------------------- DeepSpeed tags


@settings(SETTINGS)
@given(name=HOSTILE)
def test_hostile_latest_is_refused_naming_it(tmp_path_factory, templates, name):
    src, bait, out = case(tmp_path_factory.mktemp("latest"), templates, "ds")
    _write_pointer(src / "latest", name)
    marker = None
    with Reads(bait) as reads:
        run_library(TALLY, "deepspeed", f"latest={name!a}", lambda: convert(src, out), [f"{src}/latest"], out,
                    marker, reads)
        run_cli(TALLY, "deepspeed", f"cli latest={name!a}", ["convert", str(src), str(out)], ["latest"], out,
                marker, reads)


@settings(SETTINGS)
@given(name=HOSTILE)
def test_hostile_tag_option_is_refused_naming_it(tmp_path_factory, templates, name):
    src, bait, out = case(tmp_path_factory.mktemp("tagopt"), templates, "ds")
    opts = DeepSpeedImportOptions(tag=name)
    with Reads(bait) as reads:
        run_library(TALLY, "deepspeed", f"tag={name!a}", lambda: convert(src, out, source_options=opts), ["tag option"], out,
                    None, reads)
        run_library(TALLY, "deepspeed", f"reshard tag={name!a}",
                    lambda: ckptkit.reshard(src, out, TP1, options=ReshardOptions(source_options=opts)),
                    ["tag option"], out, None, reads)
        if "\x00" not in name:  # argv cannot hold NUL: an OS limit, not ours
            run_cli(TALLY, "deepspeed", f"cli --tag {name!a}", ["convert", str(src), str(out), "--tag", name],
                    ["--tag"], out, None, reads)


@settings(SETTINGS)
@given(name=PLAIN)
def test_plain_names_still_import(tmp_path_factory, templates, name):
    src, _, out = case(tmp_path_factory.mktemp("plain"), templates, "ds")
    (src / TAG).rename(src / name)
    (src / "latest").write_text(name + "\n")
    assert convert(src, out).format == "ckptkit"
    assert "model/fc.weight" in ckptkit.open(out).keys()
    (src / "latest").unlink()  # no 'latest': not detected, but the importer takes the tag as given
    assert import_deepspeed(src, out.with_name("out2"), tag=name).format == "ckptkit"


_NASTY = ["../bait/" + TAG, "..", ".", "", "../bait", TAG + "/../../bait/" + TAG, "\x00", TAG + "\n\x00",
          "\x1b[31m" + TAG, "\u202e" + TAG, "x" * 300]


@pytest.mark.parametrize("kind", ["ds", "moe", "expp"])
def test_nasty_tags_through_every_door(tmp_path, templates, kind):
    """Each nasty tag (and the bait's absolute path) as ``latest`` and as the option, through convert and
    reshard, library and CLI; DeepSpeed-MoE and stage-0 MoE folders take the same path."""
    src, bait, out = case(tmp_path, templates, kind)
    for name in [*_NASTY, str(bait / TAG)]:
        _write_pointer(src / "latest", name)
        tag_opts = DeepSpeedImportOptions(tag=name)
        with Reads(bait) as reads:
            for what, call, expect in [
                ("convert", lambda: convert(src, out), f"{src}/latest"),
                ("reshard", lambda: ckptkit.reshard(src, out, TP1), f"{src}/latest"),
                ("convert tag", lambda: convert(src, out, source_options=tag_opts), "tag option"),
                ("plan tag", lambda: ckptkit.plan_reshard(src, TP1, options=ReshardOptions(source_options=tag_opts)),
                 "tag option")]:
                run_library(TALLY, "deepspeed", f"{kind} {what} {name!a}", call, [expect], out, None, reads)
            for args in (["convert", str(src), str(out)], ["reshard", str(src), str(out), "--to", "tp1pp1"]):
                run_cli(TALLY, "deepspeed", f"{kind} cli {args[0]} {name!a}", args, [f"{src}/latest"], out, None,
                        reads)


# ---------------------------------------------------------------- Megatron's tracker


def _tracker_verdict(text: str) -> str:
    """The test's own reading of Megatron's rule: an iteration (ASCII digits) or 'release', else refused."""
    t = text.strip()
    if t == "release":
        return "release"
    if t and len(t) <= 18 and all("0" <= c <= "9" for c in t):
        return f"iter_{int(t):07d}"
    return "refused"


@settings(SETTINGS)
@given(text=st.one_of(st.text(max_size=30), st.sampled_from(["2", " 2\n", "release", "Release", "+2", "2.0", "0x2",
                                                              "²", "٢", "2_0", "-2", "1e1", "02", "9" * 19,
                                                              "../bait/iter_0000002", "2\x00", "iter_0000002"])))
def test_tracker_names_an_iteration_or_release(tmp_path_factory, templates, text):
    src, bait, out = case(tmp_path_factory.mktemp("tracker"), templates, "legacy")
    _write_pointer(src / TRACKER, text)
    verdict = _tracker_verdict(text)
    with Reads(bait) as reads:
        if verdict == "iter_0000002":  # the iteration the folder holds: imports
            assert convert(src, out).format == "ckptkit" and not reads.hits
            return
        expect = [TRACKER] if verdict == "refused" else [f"{src}/{verdict}"]
        run_library(TALLY, "megatron", f"tracker={text!a}", lambda: convert(src, out), expect, out, None, reads)
        run_cli(TALLY, "megatron", f"cli tracker={text!a}", ["convert", str(src), str(out)],
                [TRACKER] if verdict == "refused" else [verdict], out, None, reads)


def test_nasty_trackers_through_convert_and_reshard(tmp_path, templates):
    src, bait, out = case(tmp_path, templates, "legacy")
    for text in ["../bait/iter_0000002", str(bait / "iter_0000002"), "٢", "²", "2\x00", "0x2", "", "\x1b", "9" * 40]:
        _write_pointer(src / TRACKER, text)
        with Reads(bait) as reads:
            for what, call in [("convert", lambda: convert(src, out)), ("reshard", lambda: ckptkit.reshard(src, out, TP1))]:
                run_library(TALLY, "megatron", f"{what} tracker={text!a}", call, [TRACKER], out, None, reads)
            for args in (["convert", str(src), str(out)], ["reshard", str(src), str(out), "--to", "tp1pp1"]):
                run_cli(TALLY, "megatron", f"cli {args[0]} tracker={text!a}", args, [TRACKER], out, None, reads)


# ---------------------------------------------------------------- links and special files


def _link_cases(src: Path, bait: Path, kind: str) -> list[tuple[Path, Path]]:
    """(what to replace in src, what in bait it points to) for every file and folder kind the importer reads."""
    if kind == "ds":
        return [(src / "latest", bait / "latest"), (src / TAG, bait / TAG)] + [
            (src / TAG / n, bait / TAG / n) for n in ("mp_rank_00_model_states.pt",
                                                      "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                      "zero_pp_rank_1_mp_rank_00_optim_states.pt")]
    if kind == "moe":
        return [(src / TAG / f"layer_0_expert_{e}_mp_rank_00_model_states.pt",
                 bait / TAG / f"layer_0_expert_{e}_mp_rank_00_model_states.pt") for e in (0, 1)]
    if kind == "expp":
        return [(src / TAG / n, bait / TAG / n) for n in ("expp_rank_0_mp_rank_00_optim_states.pt",
                                                          "expp_rank_1_mp_rank_00_optim_states.pt",
                                                          "mp_rank_00_model_states.pt")]
    if kind == "legacy":
        it = "iter_0000002"
        return [(src / TRACKER, bait / TRACKER), (src / it, bait / it), (src / it / "mp_rank_01", bait / it / "mp_rank_01"),
                (src / it / "mp_rank_00" / "model_optim_rng.pt", bait / it / "mp_rank_00" / "model_optim_rng.pt")]
    if kind == "td":
        return [(src / n, bait / n) for n in ("common.pt", "metadata.json", ".metadata", "__0_0.distcp")]
    return [(src / n, bait / n) for n in (".metadata", "__0_0.distcp")]


def _replace(path: Path, with_: Path | None) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
    if with_ is None:
        os.mkfifo(path)
    else:
        path.symlink_to(with_)


IMPORTER = {"ds": "deepspeed", "moe": "deepspeed", "expp": "deepspeed", "legacy": "megatron", "td": "megatron",
            "dcp": "dcp"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", list(IMPORTER))
def test_links_out_and_fifos_are_refused_before_reading(tmp_path, templates, kind):
    for i, (target, in_bait) in enumerate(_link_cases(tmp_path / "probe" / "src", tmp_path / "probe" / "bait", kind)):
        rel = target.relative_to(tmp_path / "probe" / "src")
        for fifo in (False, True):
            if fifo and (templates[kind] / rel).is_dir():
                continue  # a FIFO in place of a folder is just 'no such folder'
            src, bait, out = case(tmp_path / f"{i}{fifo}", templates, kind)
            _replace(src / rel, None if fifo else bait / in_bait.relative_to(tmp_path / "probe" / "bait"))
            expect = [str(src / rel)] if not fifo else [rel.name]
            with Reads(bait) as reads:
                run_library(TALLY, IMPORTER[kind], f"{kind} {'fifo' if fifo else 'link'} {rel}",
                            lambda: convert(src, out), expect, out, None, reads)
                run_cli(TALLY, IMPORTER[kind], f"{kind} cli {'fifo' if fifo else 'link'} {rel}",
                        ["reshard", str(src), str(out), "--to", "tp1pp1"], [rel.name], out, None, reads)


def test_links_that_stay_inside_are_followed(tmp_path, templates):
    src, _, out = case(tmp_path, templates, "ds")
    (src / "store").mkdir()
    (src / TAG).rename(src / "store" / TAG)
    (src / TAG).symlink_to(Path("store") / TAG)
    assert convert(src, out).format == "ckptkit"
    src, _, out = case(tmp_path, templates, "legacy")
    (src / "iter_0000002").rename(src / "kept")
    (src / "iter_0000002").symlink_to("kept")
    assert convert(src, out).format == "ckptkit"
