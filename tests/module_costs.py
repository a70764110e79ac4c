"""``pytest --module-costs``: where the suite's time goes, per test module.

A module's tests run in several processes (world ranks forked from a server, S3 servers, torchrun
jobs), so the pytest process's own CPU time says little. This plugin reads, at every module boundary,
the machine's busy time from ``/proc/stat`` and the CPU time of this pytest process's own process
tree (every live descendant's, plus what exited descendants left in their parents' child-time
fields), and prints each module's wall time and both CPU figures, the most costly first: the list
to start from when the suite has to get faster. The tree's figure holds on a busy machine too (it
counts only the suite's own processes); wall time does not.
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


def _tree_seconds(root: int | None = None) -> float:
    """CPU seconds of ``root`` (this process) and its descendants: user + system of each live one, plus the
    children's times each has reaped (how an exited rank's CPU stays counted, in its fork server's fields)."""
    root = os.getpid() if root is None else root
    parents: dict[int, int] = {}
    seconds: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        pid = int(entry)
        parents[pid] = int(fields[1])
        seconds[pid] = sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(seconds.get(pid, 0) for pid in tree) / os.sysconf("SC_CLK_TCK")


class ModuleCosts:
    def __init__(self) -> None:
        self.costs: dict[str, list[float]] = {}
        self.module: str | None = None
        self.mark = self._now()

    @staticmethod
    def _now() -> tuple[float, float, float]:
        return time.monotonic(), _busy_seconds(), _tree_seconds()

    def _close(self) -> None:
        now = self._now()
        if self.module is not None:
            cost = self.costs.setdefault(self.module, [0.0, 0.0, 0.0])
            for i in range(3):
                cost[i] += now[i] - self.mark[i]
        self.mark = now

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> None:
        if item.nodeid.split("::")[0] != self.module:
            self._close()
            self.module = item.nodeid.split("::")[0]

    def pytest_sessionfinish(self) -> None:
        self._close()

    def pytest_terminal_summary(self, terminalreporter) -> None:  # noqa: ANN001 - pytest's type
        rows = sorted(self.costs.items(), key=lambda kv: -kv[1][2])
        total = [sum(c[i] for c in self.costs.values()) for i in range(3)]
        terminalreporter.section("module costs (wall s, machine CPU s, the suite's own CPU s)")
        terminalreporter.write_line(f"{total[0]:8.1f} {total[1]:8.1f} {total[2]:8.1f}  all {len(rows)} modules")
        for module, (w, c, t) in rows:
            terminalreporter.write_line(f"{w:8.1f} {c:8.1f} {t:8.1f}  {module}")
