"""A run's story: incidents and the loss curve, as text and as a PNG.

Reads what the controller recorded next to the checkpoints (incidents and
loss history: small JSON objects, no torch) and draws the loss per step with
spikes, rollbacks, skipped data, restarts and preemptions marked. matplotlib
is imported only when a plot is asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckptkit.resilience.incidents import Incident, IncidentLog
from ckptkit.storage.url import open_store


@dataclass(frozen=True)
class RunReport:
    url: str
    incidents: tuple[Incident, ...]
    metrics: tuple[tuple[int, float | None, float | None], ...]

    @property
    def steps_lost(self) -> int:
        return sum(int(i.data.get("steps_lost", 0) or 0) for i in self.incidents if i.kind in ("rollback", "restart"))

    def summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for i in self.incidents:
            out[i.kind] = out.get(i.kind, 0) + 1
        return out

    def to_json(self) -> dict:
        return {
            "url": self.url,
            "summary": self.summary(),
            "steps_lost": self.steps_lost,
            "incidents": [i.to_json() for i in self.incidents],
            "metrics_points": len(self.metrics),
        }


def load_report(url: str) -> RunReport:
    log = IncidentLog(open_store(url), writer=False)
    return RunReport(url, tuple(log.read()), tuple(log.read_metrics()))


def plot(report: RunReport, path: str) -> str:
    """Write the loss curve with incidents marked to ``path`` (PNG); return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    # The history in the order it happened, cut where the step goes back (a rollback or a
    # restart): abandoned stretches are drawn faint, the final trajectory solid.
    segments: list[list[tuple[int, float]]] = [[]]
    for step, loss, _ in report.metrics:
        if segments[-1] and step <= segments[-1][-1][0]:
            segments.append([])
        if loss is not None and math.isfinite(loss):
            segments[-1].append((step, loss))
    ys = [y for seg in segments for _, y in seg]
    labelled = set()
    for i, seg in enumerate(segments):
        # a segment's steps before the next segment's first step are part of the final trajectory
        cut = segments[i + 1][0][0] if i + 1 < len(segments) and segments[i + 1] else math.inf
        for part, kept in (([p for p in seg if p[0] < cut], True), ([p for p in seg if p[0] >= cut - 1], False)):
            if len(part) < 2 or (not kept and cut == math.inf):
                continue
            label = ("loss" if kept else "abandoned (rolled back)") if kept not in labelled else None
            labelled.add(kept)
            ax.plot([x for x, _ in part], [y for _, y in part], lw=0.8, color="tab:blue",
                    alpha=1.0 if kept else 0.3, label=label)
    if ys:
        ax.set_yscale("log" if min(ys) > 0 and max(ys) / max(min(ys), 1e-12) > 50 else "linear")
    marks = {"spike": ("x", "tab:orange"), "skip_step": ("x", "tab:red"), "stop": ("X", "black")}
    shown: set[str] = set()
    first_loss: dict[int, float] = {}
    for seg in segments:
        for x, y in seg:
            first_loss.setdefault(x, y)
    for inc in report.incidents:
        label = inc.kind if inc.kind not in shown else None
        shown.add(inc.kind)
        if inc.kind in marks:
            y = inc.data.get("loss") or first_loss.get(inc.step, ys[-1] if ys else 1.0)
            ax.scatter([inc.step], [y], marker=marks[inc.kind][0], color=marks[inc.kind][1], s=40, zorder=3, label=label)
        elif inc.kind == "rollback":
            restored = inc.data.get("restored", inc.step)
            ax.axvline(inc.step, color="tab:red", ls="--", lw=1, label=label)
            ax.axvspan(restored, inc.step, color="tab:red", alpha=0.08,
                       label="rolled back" if "rolled back" not in shown else None)
            shown.add("rolled back")
        elif inc.kind in ("restart", "preempt", "emergency_save", "save_abandoned"):
            color = {"restart": "tab:green", "preempt": "tab:purple"}.get(inc.kind, "tab:gray")
            ax.axvline(inc.step, color=color, ls=":", lw=1.2, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{report.url}: {report.summary() or 'no incidents'}", fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
