"""``make gpu-check``: every GPU check and a short GPU benchmark, one summary line each, then a verdict.

Run on a machine with one CUDA GPU (the device tool's, see docs/testing.md), after ``make
gpu-wheels`` here has built the wheels it installs there. Checks, in this order:

* every ``tests/test_gpu_*.py`` file, each in a pytest process of its own (one framework's global
  state never meets another's), with a per-check timeout: the CUDA save/load paths, the overlapped
  snapshot, Megatron-core, DeepSpeed, torchtitan, and this harness's own CPU test;
* ``benchmarks/gpu_bench.py`` (one process, whatever time is left): staging bandwidth against a bare
  pinned ``copy_`` floor, and blocking time and step-time overhead against DCP's ``async_save``
  with its pinned-memory stager; 1 GiB of state, and 10 GiB where the time left allows.

Each check's line says PASS, FAIL or SKIPPED (with the reason: a test file whose framework cannot be
imported there is SKIPPED, never PASS). The last line is the verdict:

  ``gpu-check: PASS``        every check passed (exit 0);
  ``gpu-check: FAIL``        a check failed or timed out (exit 1);
  ``gpu-check: INCOMPLETE``  none failed but some were skipped: not a pass (exit 3);
  ``gpu-check: NO-GPU``      no CUDA device: every check SKIPPED, nothing was checked, not a pass (exit 2).

The whole run stays inside ``--budget`` seconds (default 450, under the issue's 8 minutes with the
install); a check that no longer fits is SKIPPED ("time budget"). Logs go to ``--out`` (default
``$OUT`` when the device tool sets it, else ``gpu-out/``): ``gpu-check.log`` (every check's output),
``gpu-check.json`` (the lines as data) and the benchmark's ``gpu-bench.json``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET = 450.0
TIMEOUTS = {"paths": 120, "overlap": 150, "megatron": 150, "deepspeed": 150, "torchtitan": 150, "check": 60}
"""Per test file (tests/test_gpu_<name>.py), seconds; files not named here get DEFAULT_TIMEOUT."""
DEFAULT_TIMEOUT = 120
BENCH_TIMEOUT = 300
BENCH_CHECKS = {
    "bench-staging": "ckptkit's pinned staging bandwidth vs a bare pinned copy_ floor",
    "bench-vs-dcp": "blocking time and step-time overhead vs DCP async_save + pinned stager",
}
MIN_SLOT = 20.0
"""A check is started only with at least this many seconds of the budget left."""
VERDICT_EXIT = {"PASS": 0, "FAIL": 1, "NO-GPU": 2, "INCOMPLETE": 3}


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL, SKIPPED
    detail: str
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)


ORDER = ["paths", "overlap", "megatron", "deepspeed", "torchtitan"]
"""Test files run first, in this order; any other tests/test_gpu_*.py after them, by name."""


def test_files(root: str = ROOT) -> list[str]:
    files = glob.glob(os.path.join(root, "tests", "test_gpu_*.py"))
    return sorted(files, key=lambda p: (ORDER.index(check_name(p)) if check_name(p) in ORDER else len(ORDER),
                                        check_name(p)))


def check_name(path: str) -> str:
    return os.path.basename(path)[len("test_gpu_"):-len(".py")]


def check_names(root: str = ROOT) -> list[str]:
    """Every check, in the order they run."""
    return [check_name(p) for p in test_files(root)] + list(BENCH_CHECKS)


def cuda_facts() -> tuple[bool, str]:
    """Whether a CUDA device is usable here, and a line describing torch and the device."""
    try:
        import torch
    except ImportError as exc:
        return False, f"torch cannot be imported: {exc}"
    line = f"torch {torch.__version__} (CUDA build {torch.version.cuda}) from {os.path.dirname(torch.__file__)}"
    if not torch.cuda.is_available():
        return False, line + "; no CUDA device"
    props = torch.cuda.get_device_properties(0)
    return True, (f"{line}; {torch.cuda.device_count()} device(s), 0: {props.name}, "
                  f"{props.total_memory / 2**30:.0f} GiB, capability {props.major}.{props.minor}")


def versions() -> str:
    import importlib.metadata as md

    out = []
    for name in ("ckptkit", "megatron-core", "deepspeed", "torchtitan", "crc32c"):
        try:
            out.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            out.append(f"{name} missing")
    return ", ".join(out)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    # cuBLAS picks deterministic algorithms only with a fixed workspace (the resume checks compare bits)
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    return env


def _run(cmd: list[str], timeout: float, log: str, title: str) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group; append its output to ``log``. (exit code or None on timeout, output)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = None
    with open(log, "a") as f:
        f.write(f"\n===== {title} ({time.monotonic() - t0:.1f} s, rc={rc}): {' '.join(cmd)}\n{out}")
    return rc, out or ""


def _tail(text: str, n: int = 15) -> str:
    return "\n".join("    | " + line for line in text.rstrip().splitlines()[-n:])


def junit(path: str) -> tuple[int, list[str], list[str], list[str]]:
    """(passed, failures as 'test: message', skips as 'test: reason', notes) from pytest's junit XML. A note is
    a test's ``record_property("note", text)``: what the line should say besides the counts."""
    passed, failed, skipped, notes = 0, [], [], []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "?")
        for prop in case.iter("property"):
            if prop.get("name") == "note" and prop.get("value") and prop.get("value") not in notes:
                notes.append(prop.get("value"))
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            failed.append(f"{name}: {(bad.get('message') or '').splitlines()[0][:200] if bad.get('message') else 'failed'}")
        elif skip is not None:
            reason = (skip.get("message") or "").removeprefix("Skipped: ")
            skipped.append(f"{name}: {reason[:200]}")
        else:
            passed += 1
    return passed, failed, skipped, notes


def run_test_file(path: str, timeout: float, out: str, log: str) -> Result:
    name = check_name(path)
    xml = os.path.join(out, f"junit-{name}.xml")
    if os.path.exists(xml):
        os.remove(xml)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", os.path.relpath(path, ROOT),
           f"--junitxml={xml}", "-o", f"timeout={max(10, int(timeout) - 5)}"]
    t0 = time.monotonic()
    rc, output = _run(cmd, timeout, log, name)
    secs = time.monotonic() - t0
    if rc is None:
        return Result(name, "FAIL", f"timed out after {timeout:.0f} s\n{_tail(output)}", secs)
    if not os.path.exists(xml):
        return Result(name, "FAIL", f"pytest exited {rc} without a report\n{_tail(output)}", secs)
    passed, failed, skipped, notes = junit(xml)
    os.remove(xml)  # the device tool brings back at most 8 files
    counts = f"{passed} passed, {len(failed)} failed, {len(skipped)} skipped" + "".join(f"; {n}" for n in notes)
    if failed or rc not in (0, 5):
        return Result(name, "FAIL", f"{counts}: " + "; ".join(failed or [f'pytest exited {rc}']) + "\n" + _tail(output),
                      secs)
    if skipped or passed == 0:
        reasons: dict[str, list[str]] = {}
        for s in skipped:
            test, _, reason = s.partition(": ")
            reasons.setdefault(reason, []).append(test)
        why = "; ".join(f"{reason} ({tests[0] if len(tests) == 1 else f'{len(tests)} tests'})"
                        for reason, tests in reasons.items())
        return Result(name, "SKIPPED", f"{counts}: " + (why or "no test ran"), secs)
    return Result(name, "PASS", counts, secs)


def run_bench(timeout: float, out: str, log: str) -> list[Result]:
    data = os.path.join(out, "gpu-bench.json")
    if os.path.exists(data):
        os.remove(data)
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_bench.py"), "--json", data,
           "--budget", str(int(timeout - 15))]
    t0 = time.monotonic()
    rc, output = _run(cmd, timeout, log, "gpu_bench")
    secs = time.monotonic() - t0
    if rc is None or not os.path.exists(data):
        why = f"timed out after {timeout:.0f} s" if rc is None else f"exited {rc} without results"
        return [Result(n, "FAIL", f"gpu_bench.py {why}\n{_tail(output)}", secs) for n in BENCH_CHECKS]
    with open(data) as f:
        results = json.load(f)
    lines = []
    for name in BENCH_CHECKS:
        r = results.get(name)
        if r is None:
            lines.append(Result(name, "FAIL", f"gpu_bench.py (exit {rc}) reported nothing for it\n{_tail(output)}", secs))
        else:
            lines.append(Result(name, r["status"], r["detail"], secs, r.get("figures", {})))
    if rc != 0 and all(x.status == "PASS" for x in lines):
        lines[-1] = Result(lines[-1].name, "FAIL", f"gpu_bench.py exited {rc}\n{_tail(output)}", secs)
    return lines


def verdict(results: list[Result], gpu: bool) -> str:
    if not gpu:
        return "NO-GPU"
    if any(r.status == "FAIL" for r in results):
        return "FAIL"
    if any(r.status != "PASS" for r in results) or not results:
        return "INCOMPLETE"
    return "PASS"


def line(r: Result) -> str:
    head, _, rest = r.detail.partition("\n")
    text = f"gpu-check: {r.name:<13} {r.status:<7} {head}" + (f" ({r.seconds:.1f} s)" if r.seconds else "")
    return text + ("\n" + rest if rest else "")


def install_and_rerun(args: argparse.Namespace) -> int:
    """pip-install the carried wheels for this interpreter (its own torch stays: no torch wheel is carried),
    then run the checks in a fresh interpreter that sees them (the budget counts the install)."""
    import shutil

    t0 = time.monotonic()
    wheels = sorted(glob.glob(os.path.join(args.install, "*.whl")))
    if not wheels:
        print(f"gpu-check: FAIL: no wheels in {args.install}/: run make gpu-wheels where a registry is reachable "
              "and carry the folder", flush=True)
        return VERDICT_EXIT["FAIL"]
    shutil.rmtree(args.site, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
                           "--no-deps", "--no-compile", "--no-cache-dir", "--target", args.site, *wheels],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"gpu-check: installing {len(wheels)} wheels into {args.site} failed (is {sys.executable} the GPU "
              f"machine's Python 3.12?):\n{_tail(proc.stdout + proc.stderr, 6)}", flush=True)
    else:
        print(f"gpu-check: installed {len(wheels)} wheels from {args.install}/ into {args.site} "
              f"({time.monotonic() - t0:.1f} s)", flush=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (args.site, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, os.path.abspath(__file__), "--budget", f"{args.budget - (time.monotonic() - t0):.0f}",
           "--out", args.out, *(["--only", *args.only] if args.only else [])]
    return subprocess.run(cmd, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=BUDGET, help="seconds for the whole run (default %(default)s)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "gpu-out"))
    ap.add_argument("--only", nargs="*", help="run only these checks (names as printed)")
    ap.add_argument("--install", metavar="DIR", help="first install DIR/*.whl (make gpu-wheels' folder) with pip "
                    "--no-index --no-deps into --site, then run with --site on PYTHONPATH (what make gpu-check does)")
    ap.add_argument("--site", default="/tmp/ckptkit-gpu-site", help="where --install puts the wheels")
    args = ap.parse_args(argv)
    if args.install:
        return install_and_rerun(args)
    deadline = time.monotonic() + args.budget
    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, "gpu-check.log")
    open(log, "w").close()
    gpu, facts = cuda_facts()
    print(f"gpu-check: python {sys.version.split()[0]} at {sys.executable}; {facts}", flush=True)
    print(f"gpu-check: {versions()}", flush=True)
    names = check_names()
    if args.only:
        names = [n for n in names if n in args.only]
    results: list[Result] = []
    if not gpu:
        results = [Result(n, "SKIPPED", "no CUDA device") for n in names]
        for r in results:
            print(line(r), flush=True)
    else:
        for path in test_files():
            name = check_name(path)
            if name not in names:
                continue
            left = deadline - time.monotonic()
            if left < MIN_SLOT:
                r = Result(name, "SKIPPED", f"time budget of {args.budget:.0f} s spent")
            else:
                r = run_test_file(path, min(TIMEOUTS.get(name, DEFAULT_TIMEOUT), left), args.out, log)
            results.append(r)
            print(line(r), flush=True)
        bench = [n for n in BENCH_CHECKS if n in names]
        if bench:
            left = deadline - time.monotonic()
            if left < 45:
                rs = [Result(n, "SKIPPED", f"time budget of {args.budget:.0f} s spent") for n in bench]
            else:
                rs = [r for r in run_bench(min(BENCH_TIMEOUT, left), args.out, log) if r.name in bench]
            for r in rs:
                results.append(r)
                print(line(r), flush=True)
    word = verdict(results, gpu)
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIPPED")}
    summary = f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIPPED']} skipped"
    with open(os.path.join(args.out, "gpu-check.json"), "w") as f:
        json.dump({"verdict": word, "facts": facts, "results": [asdict(r) for r in results]}, f, indent=1)
    note = {"PASS": "", "FAIL": "", "INCOMPLETE": "; skipped checks are not a pass",
            "NO-GPU": "; no CUDA device here, nothing was checked: not a pass"}[word]
    print(f"gpu-check: {word} ({summary}{note})", flush=True)
    return VERDICT_EXIT[word]


if __name__ == "__main__":
    sys.exit(main())
