"""``pytest --module-costs``: where the suite's time goes, per test module.

A module's tests run in several processes (world ranks forked from a server, S3 servers, torchrun
jobs), so the pytest process's own CPU time says little. This plugin reads the machine's busy time
from ``/proc/stat`` at every module boundary (run it on an otherwise quiet machine) and prints each
module's wall time and CPU seconds, the most costly first: the list to start from when the suite
has to get faster.
"""

from __future__ import annotations

import os
import time

import pytest


def _busy_seconds() -> float:
    """CPU seconds the machine has spent busy (user, nice, system, irq, softirq), all cores."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class ModuleCosts:
    def __init__(self) -> None:
        self.costs: dict[str, list[float]] = {}
        self.module: str | None = None
        self.mark = (time.monotonic(), _busy_seconds())

    def _close(self) -> None:
        now = (time.monotonic(), _busy_seconds())
        if self.module is not None:
            cost = self.costs.setdefault(self.module, [0.0, 0.0])
            cost[0] += now[0] - self.mark[0]
            cost[1] += now[1] - self.mark[1]
        self.mark = now

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> None:
        if item.nodeid.split("::")[0] != self.module:
            self._close()
            self.module = item.nodeid.split("::")[0]

    def pytest_sessionfinish(self) -> None:
        self._close()

    def pytest_terminal_summary(self, terminalreporter) -> None:  # noqa: ANN001 - pytest's type
        rows = sorted(self.costs.items(), key=lambda kv: -kv[1][1])
        wall, cpu = sum(c[0] for c in self.costs.values()), sum(c[1] for c in self.costs.values())
        terminalreporter.section("module costs (wall s, machine CPU s)")
        terminalreporter.write_line(f"{wall:8.1f} {cpu:8.1f}  all {len(rows)} modules")
        for module, (w, c) in rows:
            terminalreporter.write_line(f"{w:8.1f} {c:8.1f}  {module}")
