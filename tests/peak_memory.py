"""Peak memory of test work, measured where torch allocates: in a fresh process, by the kernel.

``tracemalloc`` sees Python's allocator only. torch allocates tensor memory with its own (c10),
so a reader that sized a 1 GiB tensor from a hostile manifest looked like a few KiB to it. Here
the work runs in a child process forked from an idle, warm "zygote" (torch and ckptkit imported,
nothing computed: an OpenMP team or a thread pool that has run does not survive a fork — forking
the pytest process itself hangs), and the child reports, per :func:`section` and in all:

* ``rss``: the peak resident set (``VmHWM``, reset to the current RSS at the start of each section
  through ``/proc/self/clear_refs``) above the resident set at its start — memory touched, by any
  allocator. It includes library code the child faults in again after the fork (about 16 MiB the
  first time a child loads a checkpoint), so bounds below ~64 MiB mean nothing;
* ``vm``: the peak address space (``VmPeak``, which a fork starts at the parent's size) above the
  size at the start — memory reserved even if never touched. An untouched ``torch.empty(1 << 30)``
  costs no RSS (pages come on first write) but 1 GiB here, and real memory the moment a reader
  fills it. glibc reserves 64 MiB of address space per thread arena, so the zygote runs with
  ``MALLOC_ARENA_MAX=1``: reader thread pools do not count as allocations.

One zygote per pytest process (started on first use, in the background, closed at exit). The
function run must be module-level (it is named by module and name) and return JSON-able data.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELOAD = ("torch", "ckptkit", "ckptkit.api", "ckptkit.offline", "ckptkit.cli.main", "ckptkit.engine.loader",
           "ckptkit.offline.verification", "ckptkit.offline.description", "ckptkit.offline.listing")


@dataclass(frozen=True)
class Measured:
    """What one run in a child reported. Sizes in bytes above the child's start."""

    result: Any
    rss: int  # peak resident set over the whole run
    vm: int  # peak address space over the whole run
    seconds: float
    sections: list[dict] = field(default_factory=list)  # per section(): {"name", "rss", "seconds"}
    hung: bool = False


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmPeak", "VmSize", "VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "reset the peak resident set size to the current one" (Linux >= 4.0)
        return True
    except OSError:
        return False  # then each section's peak counts from the child's start: never less than the truth


_SECTIONS: list[dict] = []  # in the child: what section() measured
_PEAK_RSS = [0]  # in the child: the highest VmHWM seen before any reset


@contextmanager
def section(name: str) -> Iterator[dict]:
    """Measure a part of the work (in the child): its peak RSS above the RSS at its start."""
    _PEAK_RSS[0] = max(_PEAK_RSS[0], _status()["VmHWM"])
    _reset_peak_rss()
    base = _status()["VmRSS"]
    entry: dict[str, Any] = {"name": name}
    t0 = time.monotonic()
    try:
        yield entry
    finally:
        hwm = _status()["VmHWM"]
        _PEAK_RSS[0] = max(_PEAK_RSS[0], hwm)
        entry.update(rss=hwm - base, seconds=time.monotonic() - t0)
        _SECTIONS.append(entry)


def _child(module: str, name: str, args: list, out: int) -> None:
    """Runs in the forked child: the work, then one JSON answer on ``out``; never returns."""
    try:
        start = _status()
        _PEAK_RSS[0] = start["VmHWM"]
        t0 = time.monotonic()
        try:
            answer: dict[str, Any] = {"result": getattr(importlib.import_module(module), name)(*args)}
        except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
            answer = {"raised": traceback.format_exc()}
        end = _status()
        answer.update(seconds=time.monotonic() - t0, sections=_SECTIONS,
                      rss=max(_PEAK_RSS[0], end["VmHWM"]) - start["VmRSS"], vm=end["VmPeak"] - start["VmSize"])
        data = json.dumps(answer).encode()
        while data:
            data = data[os.write(out, data):]
    finally:
        os._exit(0)


def _serve() -> None:
    """The zygote: import, then fork one child per request line; answer one line each."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the work's prints go to stderr, never into the protocol
    for mod in PRELOAD:
        importlib.import_module(mod)
    proto.write("ready\n")
    proto.flush()
    for line in sys.stdin:
        req = json.loads(line)
        importlib.import_module(req["module"])  # once, here: every child inherits it
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child(req["module"], req["name"], req["args"], w)
        os.close(w)
        chunks, deadline, hung = [], time.monotonic() + req["timeout"], False
        while True:
            ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                hung = True
                os.kill(pid, signal.SIGKILL)
                break
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(r)
        _, status, usage = os.wait4(pid, 0)
        if hung:
            answer: dict[str, Any] = {"hung": True}
        elif chunks:
            answer = json.loads(b"".join(chunks))
        else:
            answer = {"raised": f"the child died without an answer (wait status {status})"}
        answer["maxrss"] = usage.ru_maxrss * 1024
        proto.write(json.dumps(answer) + "\n")
        proto.flush()


class Zygote:
    """The parent's handle on the zygote process."""

    def __init__(self) -> None:
        env = {**os.environ, "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.peak_memory"], cwd=ROOT, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._ready = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> Measured:
        """``fn(*args)`` in a fresh child; its result and memory peaks. AssertionError if it raised."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if not self._ready:
            line = self.proc.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"the peak-memory zygote did not start (exit {self.proc.poll()})")
            self._ready = True
        self.proc.stdin.write(json.dumps({"module": fn.__module__, "name": fn.__name__, "args": list(args),
                                          "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the peak-memory zygote died (exit {self.proc.poll()})")
        answer = json.loads(line)
        if answer.get("hung"):
            return Measured(None, 0, 0, timeout, [], hung=True)
        if "raised" in answer:
            raise AssertionError(f"{fn.__name__}{tuple(args)!r:.200} failed in the child:\n{answer['raised']}")
        return Measured(answer["result"], max(answer["rss"], 0), max(answer["vm"], 0), answer["seconds"],
                        answer["sections"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


_ZYGOTE: list[Zygote] = []


def zygote() -> Zygote:
    """The process-wide zygote (started on first call; call it early to overlap its start-up)."""
    if not _ZYGOTE or _ZYGOTE[0].proc.poll() is not None:
        _ZYGOTE[:] = [Zygote()]
        atexit.register(_ZYGOTE[0].close)
    return _ZYGOTE[0]


# ------------------------------------------------------------ controls (run in the child)

def allocate(nbytes: int, touch: bool) -> int:
    """A deliberate allocation through torch's allocator (the control the bounds must catch)."""
    import torch

    with section("allocate"):
        t = torch.empty(nbytes, dtype=torch.uint8)
        if touch:
            t.fill_(1)
    return int(t.numel())


if __name__ == "__main__":
    from tests.peak_memory import _serve as serve  # the importable module: section() records there

    serve()
