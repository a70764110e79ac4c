"""The incident log is read once and agreed by every rank, and no record is ever skipped silently.

A resume takes each rollback's skip range and state from the incident log. Every rank used to read
the log on its own and drop any record it could not read — a StorageError after retries included —
so one rank could resume without a skip range the others kept, and train on the samples they skip.
Now one rank reads and broadcasts the records or the error; a record the store could not return is
an error naming it; a damaged record is an error naming it unless the run opts in with
``IncidentLogOptions(skip_damaged=True)``, and then a warning names it.

* damaged records, hand-made (truncated, bad JSON, NaN, huge, duplicate keys, wrong field types,
  hostile files) and fuzzed with hypothesis: every one is an error naming the record, none is
  skipped without a word, none crashes;
* real 2-rank gloo worlds (tests/worlds.py) in which the ranks' views differ: a record missing from
  one rank's view of the folder, and a per-rank S3 fault (each rank's own
  :class:`tests.fault_proxy.FaultProxy` in front of the moto server) that makes the records
  unreadable for rank 1 only, or for rank 0 only. Every rank gets the same result, or every rank
  raises the same error.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptkit.errors import CkptkitError, CorruptCheckpointError, StorageError
from ckptkit.resilience.incidents import (  # noqa: I001
    _decode_floats,
    INCIDENTS,
    MAX_RECORD_BYTES,
    Incident,
    IncidentLog,
    IncidentLogOptions,
)
from ckptkit.storage.url import open_store
from tests.conftest import trials
from tests.s3_server import CREDENTIALS, s3_env, s3_server  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(300)
TALLY: Counter[str] = Counter()
SKIP = IncidentLogOptions(skip_damaged=True)


def rollback(step: int, skip: list[int], t: float) -> Incident:
    return Incident("rollback", step, f"spike at {step}", t, {"restored": step - 10, "skip": skip, "seq": 1,
                                                               "state": {"skips": [skip], "ladder": {}}})


def write_log(url: str, storage_options: dict | None = None) -> IncidentLog:
    """Two good records: a spike with a NaN loss and a rollback with a skip range."""
    log = IncidentLog(open_store(url, storage_options), writer=True)
    log.record(Incident("spike", 40, "loss spike", 1.0, {"loss": math.nan, "grad_norm": math.inf}))
    log.record(rollback(42, [400, 480], 2.0))
    return log


def add_raw(url: str, body: bytes, name: str = "0000000003.000000-00003-abcdef.json") -> str:
    """A record written byte for byte (as damage or a hostile writer would); returns its key."""
    path = Path(url) / INCIDENTS / name
    path.write_bytes(body)
    return f"{INCIDENTS}/{name}"


# ---------------------------------------------------------------- single process: damaged records

GOOD = {"kind": "rollback", "step": 50, "detail": "d", "time": 3.0,
        "data": {"restored": 40, "skip": [500, 560], "seq": 2, "state": {"skips": [[500, 560]], "ladder": {}}}}


def doc(**changes: Any) -> bytes:
    out = json.loads(json.dumps(GOOD))
    for path, value in changes.items():
        node = out
        *parents, last = path.split("__")
        for p in parents:
            node = node[p]
        if value is _DROP:
            del node[last]
        else:
            node[last] = value
    return json.dumps(out).encode()


_DROP = object()
DAMAGED: dict[str, bytes] = {
    "truncated": doc()[: len(doc()) * 2 // 3],
    "empty": b"",
    "bad JSON": b"{kind: 'rollback'}",
    "NaN": doc().replace(b'"time": 3.0', b'"time": NaN'),
    "Infinity": doc().replace(b'"step": 50', b'"step": Infinity'),
    "1e999": doc().replace(b'"time": 3.0', b'"time": 1e999'),
    "duplicate key": doc().replace(b'{"kind": "rollback"', b'{"kind": "spike", "kind": "rollback"'),
    "lone surrogate": doc().replace(b'"detail": "d"', b'"detail": "\\ud800"'),
    "not UTF-8": doc().replace(b'"detail": "d"', b'"detail": "\xff\xfe"'),
    "deep nesting": doc().replace(b'"ladder": {}', b'"ladder": ' + b"[" * 200 + b"]" * 200),
    "a list": b"[1, 2, 3]",
    "kind missing": doc(kind=_DROP),
    "kind a number": doc(kind=3),
    "kind empty": doc(kind=""),
    "step a string": doc(step="50"),
    "step a bool": doc(step=True),
    "step a fraction": doc(step=50.5),
    "step huge": doc(step=10**30),
    "detail null": doc(detail=None),
    "time a string": doc(time="3"),
    "time before 1970": doc(time=-1e12),  # `ckptkit report` crashed formatting these (2026-12-06)
    "time past year 9999": doc(time=1e300),
    "data a list": doc(data=[]),
    "data missing": doc(data=_DROP),
    "skip a string": doc(data__skip="400-480"),
    "skip one number": doc(data__skip=[400]),
    "skip backwards": doc(data__skip=[480, 400]),
    "skip negative": doc(data__skip=[-5, 400]),
    "skip fractions": doc(data__skip=[400.5, 480]),
    "state a list": doc(data__state=[]),
    "seq a string": doc(data__seq="2"),
    "restored missing": doc(data__restored=_DROP),
    "state.skips a string": doc(data__state__skips="x"),
    "state.skips backwards": doc(data__state__skips=[[9, 3]]),
    "state.ladder a number": doc(data__state__ladder=5),
    "malformed float tag": doc(data__loss={"__float__": "banana"}),
}


INTENT = {"kind": "rollback_decided", "step": 50, "detail": "d", "time": 3.0,
          "data": {"seq": 2, "restore_at_most": 20, "skip": [500, 560], "lower_lr": False, "spikes": [48, 50],
                   "skips": [[500, 560]], "ladder": {}}}


def intent(**changes: Any) -> bytes:
    """A decided rollback's record (a restart may finish the rollback from it) with ``changes``."""
    out = json.loads(json.dumps(INTENT))
    for name, value in changes.items():
        if value is _DROP:
            del out["data"][name]
        else:
            out["data"][name] = value
    return json.dumps(out).encode()


DAMAGED.update({
    "decided: seq 0": intent(seq=0),
    "decided: seq missing": intent(seq=_DROP),
    "decided: bound a string": intent(restore_at_most="20"),
    "decided: bound missing": intent(restore_at_most=_DROP),
    "decided: skip backwards": intent(skip=[560, 500]),
    "decided: skips a string": intent(skips="x"),
    "decided: skips missing": intent(skips=_DROP),
    "decided: skips backwards": intent(skips=[[9, 3]]),
    "decided: ladder a list": intent(ladder=[]),
    "decided: lower_lr a string": intent(lower_lr="no"),
    "decided: spikes of strings": intent(spikes=["48"]),
    "decided: spikes missing": intent(spikes=_DROP),
})


def _fifo(url: str) -> str:
    name = "0000000003.000000-00003-f1f0f0.json"
    os.mkfifo(Path(url) / INCIDENTS / name)
    return f"{INCIDENTS}/{name}"


def _outside(url: str) -> str:
    secret = Path(url).parent / "secret.json"
    secret.write_bytes(doc())
    name = "0000000003.000000-00003-0a751d.json"
    (Path(url) / INCIDENTS / name).symlink_to(secret)
    return f"{INCIDENTS}/{name}"


HOSTILE_FILES: dict[str, Callable[[str], str]] = {
    "huge record": lambda url: add_raw(url, doc().replace(b"}", b" " * (MAX_RECORD_BYTES + 1) + b"}", 1)),
    "a FIFO": _fifo,
    "a link outside the run": _outside,
    "not a record's name": lambda url: add_raw(url, doc(), name="notes.txt"),
}


def refuses(url: str, key: str, case: str) -> None:
    """read() names the record in a CorruptCheckpointError; skip_damaged reads the rest and warns."""
    TALLY["cases"] += 1
    log = IncidentLog(open_store(url), writer=False)
    try:
        got = log.read()
    except CorruptCheckpointError as exc:
        TALLY["clear errors"] += 1
        assert key in str(exc) and "damaged incident record" in str(exc), f"{case}: {exc}"
        assert "\n" not in str(exc), f"{case}: not one line: {exc!r}"
    except CkptkitError as exc:
        TALLY["other errors"] += 1
        raise AssertionError(f"{case}: expected CorruptCheckpointError, got {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - what the test is here to find
        TALLY["crashes"] += 1
        raise AssertionError(f"{case}: crashed: {type(exc).__name__}: {exc}") from exc
    else:
        TALLY["silent skips" if len(got) < 3 else "accepted"] += 1
        raise AssertionError(f"{case}: read {len(got)} records without an error")
    records: list[logging.LogRecord] = []
    handler = _Collect(records)
    logging.getLogger("ckptkit").addHandler(handler)
    try:
        got = log.read(SKIP)
    finally:
        logging.getLogger("ckptkit").removeHandler(handler)
    assert [i.kind for i in got] == ["spike", "rollback"], f"{case}: {got}"
    assert any(key in r.getMessage() and "skip_damaged" in r.getMessage() for r in records), \
        f"{case}: no warning names {key}: {[r.getMessage() for r in records]}"


class _Collect(logging.Handler):
    def __init__(self, out: list[logging.LogRecord]) -> None:
        super().__init__(logging.WARNING)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        self.out.append(record)


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_record_is_an_error_naming_it(tmp_path, case):
    url = str(tmp_path / "run")
    write_log(url)
    refuses(url, add_raw(url, DAMAGED[case]), case)


@pytest.mark.parametrize("case", list(HOSTILE_FILES))
def test_a_hostile_file_in_the_log_is_an_error_naming_it(tmp_path, case):
    url = str(tmp_path / "run")
    write_log(url)
    refuses(url, HOSTILE_FILES[case](url), case)


def test_good_records_round_trip_with_non_finite_floats_and_leftover_temporaries(tmp_path):
    """NaN and inf in a record's data are written as tagged strings (strict JSON has neither) and
    read back; a temporary left by a write interrupted before its rename is not a record."""
    url = str(tmp_path / "run")
    write_log(url)
    add_raw(url, doc()[:10], name="0000000009.000000-00009-abcdef.json.tmp-123-0123456789ab")
    spike, rb = IncidentLog(open_store(url), writer=False).read()
    assert math.isnan(spike.data["loss"]) and spike.data["grad_norm"] == math.inf
    assert rb.data["skip"] == [400, 480] and rb.data["state"]["skips"] == [[400, 480]]
    raw = sorted((Path(url) / INCIDENTS).glob("*.json"))[0].read_bytes()
    assert b"NaN" not in raw and b"Infinity" not in raw


# ---------------------------------------------------------------- fuzzed records

MARK_NAN, MARK_DEEP, MARK_SURROGATE = "__nan__", "__deep__", "__surrogate__"
values = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8), st.sampled_from([MARK_NAN, MARK_DEEP, MARK_SURROGATE, "", [], {}, [1], [3, 1], [-1, 2]]),
    st.lists(st.integers(-3, 2**40), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def paths_of(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += paths_of(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += paths_of(v, (*prefix, i))
    return out


def render(d: Any) -> bytes:
    text = json.dumps(d)
    text = text.replace(json.dumps(MARK_NAN), "NaN").replace(json.dumps(MARK_DEEP), "[" * 150 + "]" * 150)
    return text.replace(json.dumps(MARK_SURROGATE), '"\\ud800"').encode()


@st.composite
def mutated_records(draw) -> tuple[str, bytes]:
    kind = draw(st.sampled_from(["replace", "replace", "delete", "truncate", "duplicate", "append"]))
    d = json.loads(json.dumps(GOOD))
    path = draw(st.sampled_from(paths_of(d)))
    if kind in ("replace", "delete"):
        node = d
        for p in path[:-1]:
            node = node[p]
        if kind == "delete":
            del node[path[-1]]
        else:
            node[path[-1]] = draw(values)
        return kind, render(d)
    body = render(d)
    if kind == "truncate":
        return kind, body[: draw(st.integers(0, len(body) - 1))]
    if kind == "duplicate":
        return kind, body.replace(b'"detail"', b'"detail": "x", "detail"', 1)
    return kind, body + draw(st.sampled_from([b"{", b"]", b" x", b"\x00", b"}"]))


@settings(max_examples=trials(150, 3000), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mutated=mutated_records())
def test_fuzzed_records_are_read_exactly_or_refused_by_name(tmp_path_factory, mutated):
    kind, body = mutated
    url = str(tmp_path_factory.mktemp("fuzz") / "run")
    write_log(url)
    key = add_raw(url, body)
    TALLY["fuzzed"] += 1
    try:
        got = IncidentLog(open_store(url), writer=False).read()
    except CorruptCheckpointError as exc:
        TALLY["fuzzed clear errors"] += 1
        assert key in str(exc), exc
        return
    except Exception as exc:  # noqa: BLE001
        TALLY["fuzzed crashes"] += 1
        raise AssertionError(f"{kind}: {type(exc).__name__}: {exc}") from exc
    assert len(got) == 3, f"{kind}: {len(got)} of 3 records read and no error: a silent skip"
    TALLY["fuzzed read exactly"] += 1
    parsed = json.loads(body)  # it was valid: the record must say exactly what the file says
    mine = next(i for i in got if i.time == parsed["time"] and i.step == parsed["step"] and i.detail == parsed["detail"])
    assert mine.kind == parsed["kind"]
    # NaN-aware: a bare NaN inside data is a legacy record's non-finite loss, read as a float
    assert json.dumps(mine.data, sort_keys=True) == json.dumps(_decode_floats(parsed["data"], "x"), sort_keys=True)


def test_a_record_written_before_floats_were_tagged_still_reads(tmp_path):
    """Earlier versions wrote a NaN loss as a bare ``NaN`` (Python's json default): a resume must still
    read such a record, the loss as NaN. Everywhere else a non-finite number stays an error."""
    url = str(tmp_path / "run")
    write_log(url)
    legacy = doc().replace(b'"data": {', b'"data": {"loss": NaN, "grad_norm": Infinity, ', 1)
    assert b"NaN" in legacy
    add_raw(url, legacy)
    got = IncidentLog(open_store(url), writer=False).read()
    mine = [i for i in got if "loss" in i.data and i.kind == "rollback"]
    assert len(mine) == 1 and math.isnan(mine[0].data["loss"]) and mine[0].data["grad_norm"] == math.inf


# ---------------------------------------------------------------- gloo worlds: ranks agree


def resume_on_rank(roots: list[str], server: str | None, fault_rank: int | None, skip_damaged: bool) -> dict:
    """On every rank of a world: a ResilienceController resumes from ``roots[rank]``; returns what
    it resumed with, or the error. With ``server`` (S3), ``fault_rank`` reads through a proxy that
    answers 500 to every GET of an incident record."""
    import torch.distributed as dist

    from ckptkit.manager import CheckpointManager
    from ckptkit.resilience.controller import ResilienceController
    from tests.fault_proxy import FaultProxy, Faults

    rank = dist.get_rank()
    proxy, options = None, None
    if server is not None:
        os.environ.update(CREDENTIALS)
        endpoint = server
        if rank == fault_rank:
            proxy = FaultProxy(server, Faults(error=1.0, statuses=(500,), methods=frozenset({"GET"}),
                                              path=r"/\.ckptkit/incidents/[^?]+\.json"))
            endpoint = proxy.endpoint
        options = {"endpoint_url": endpoint, "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}}}
    warnings: list[logging.LogRecord] = []
    handler = _Collect(warnings)
    logging.getLogger("ckptkit").addHandler(handler)
    out: dict[str, Any] = {}
    try:
        mgr = CheckpointManager(roots[rank], asynchronous=None, storage_options=options)
        ctl = ResilienceController(mgr, batch_size=8, signals=(), watchdog_seconds=600,
                                   incident_log=IncidentLogOptions(skip_damaged=skip_damaged))
        try:
            start = ctl.resume({})
            out.update(ok=True, start=start, skips=ctl.skips.to_json())
        except CkptkitError as exc:
            out.update(ok=False, type=type(exc).__name__, error=str(exc))
        ctl.close()
    finally:
        logging.getLogger("ckptkit").removeHandler(handler)
        if proxy is not None:
            out["faults"] = proxy.injected()
            proxy.close()
    out["warnings"] = [r.getMessage() for r in warnings if "incident record" in r.getMessage()]
    return out


def agree(results: list[dict]) -> dict:
    """Every rank's answer is the same (the proxy's fault count aside); returns it."""
    core = [{k: v for k, v in r.items() if k not in ("faults", "warnings")} for r in results]
    assert all(c == core[0] for c in core), f"ranks resumed differently: {results}"
    TALLY["world runs"] += 1
    TALLY["world runs agreed"] += 1
    return results[0]


def copy_view(src: str, dst: str, leave_out: str | None = None) -> None:
    """``dst``: rank 1's view of the run folder ``src`` (hard links), without ``leave_out``."""
    for dirpath, _, files in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        os.makedirs(os.path.join(dst, rel), exist_ok=True)
        for f in files:
            if os.path.join(rel, f) != leave_out:
                os.link(os.path.join(dirpath, f), os.path.join(dst, rel, f))


def test_ranks_whose_views_of_the_log_differ_resume_alike(worlds, tmp_path):
    """Rank 1's view of the folder lacks the rollback record (a stale per-node cache): it used to
    resume without the rollback's skip range."""
    run = str(tmp_path / "run")
    write_log(run)
    rb = sorted(os.listdir(os.path.join(run, INCIDENTS)))[-1]
    copy_view(run, str(tmp_path / "view"), leave_out=os.path.join(INCIDENTS, rb))
    result = agree(worlds.run(2, resume_on_rank, [run, str(tmp_path / "view")], None, None, False))
    assert result["ok"] and result["skips"] == [[400, 480]], result


def test_a_damaged_record_stops_every_rank_and_the_opt_in_goes_on_with_a_warning(worlds, tmp_path):
    run = str(tmp_path / "run")
    write_log(run)
    key = add_raw(run, DAMAGED["truncated"])
    result = agree(worlds.run(2, resume_on_rank, [run, run], None, None, False))
    assert not result["ok"] and result["type"] == "CorruptCheckpointError" and key in result["error"], result
    results = worlds.run(2, resume_on_rank, [run, run], None, None, True)
    result = agree(results)
    assert result["ok"] and result["skips"] == [[400, 480]], result
    assert all(any(key in w for w in r["warnings"]) for r in results), results


@pytest.mark.parametrize("fault_rank", [1, 0])
def test_a_record_one_rank_cannot_read_on_s3(worlds, s3_env, s3_server, fault_rank):  # noqa: F811
    """Every GET of an incident record fails (500, after retries) for one rank only. Rank 1's fault
    changes nothing (it does not read); rank 0's makes every rank raise the StorageError naming the
    record — it used to be skipped silently by the rank that met it."""
    root = f"s3://{s3_env}/run"
    write_log(root, {})
    results = worlds.run(2, resume_on_rank, [root, root], s3_server.endpoint, fault_rank, False)
    result = agree(results)
    if fault_rank == 1:
        assert result["ok"] and result["skips"] == [[400, 480]], result
    else:
        assert results[0]["faults"] > 0
        assert not result["ok"] and result["type"] == "StorageError", result
        assert re.search(r"\.ckptkit/incidents/[0-9.]+-\d{5}-[0-9a-f]{6}\.json: could not read", result["error"]), result


def test_incident_figures():
    """Runs last in this module: the tally the issue note quotes."""
    print(f"\nincident log: {TALLY['cases']} hand-made damaged records, {TALLY['clear errors']} errors naming the "
          f"record, {TALLY['silent skips']} silent skips, {TALLY['crashes']} crashes; fuzzed {TALLY['fuzzed']}: "
          f"{TALLY['fuzzed clear errors']} errors naming the record, {TALLY['fuzzed read exactly']} read exactly, "
          f"{TALLY['fuzzed crashes']} crashes, 0 silent skips; {TALLY['world runs']} 2-rank resumes, "
          f"{TALLY['world runs agreed']} with every rank agreeing")
    assert TALLY["silent skips"] == 0 and TALLY["crashes"] == 0 and TALLY["fuzzed crashes"] == 0
