"""A run's story: incidents and the loss curve, as text and as a PNG.

Reads what the controller recorded next to the checkpoints (incidents and
loss history: small JSON objects, no torch) and draws the loss per step with
spikes, rollbacks, skipped data, restarts (and the steps each crash lost) and
preemptions marked, titled with the run's name (the one the controller
recorded, else the checkpoint folder's). matplotlib is imported only when a
plot is asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptkit.errors import CheckpointNotFoundError
from ckptkit.resilience.incidents import Incident, IncidentLog
from ckptkit.resilience.recovery import INTENT, unfinished_rollback
from ckptkit.storage.url import open_store

if TYPE_CHECKING:
    from matplotlib.figure import Figure


GENERIC_FOLDERS = {"ckpt", "ckpts", "checkpoint", "checkpoints"}  # named after the parent folder instead

_WORDS = {  # incident kind -> (singular, plural) for the plot's title
    "spike": ("spike logged", "spikes logged"), "skip_step": ("skipped step", "skipped steps"),
    "rollback": ("rollback", "rollbacks"), "restart": ("restart", "restarts"), "resume": ("resume", "resumes"),
    "preempt": ("preemption", "preemptions"), "emergency_save": ("emergency save", "emergency saves"),
    "save_abandoned": ("abandoned save", "abandoned saves"), "stop": ("stop", "stops"),
    "rollback_decided": ("rollback killed before it finished", "rollbacks killed before they finished"),
}


def run_name(url: str) -> str:
    """A run's name from its checkpoint root: the folder's basename (``s3://bucket/exp1`` -> ``exp1``),
    or its parent's when the folder has a generic name (``runs/demo/ckpt`` -> ``demo``)."""
    parts = [p for p in url.rstrip("/").replace("\\", "/").split("/") if p and not p.endswith(":")]
    if len(parts) >= 2 and parts[-1].lower() in GENERIC_FOLDERS:
        return parts[-2]
    return parts[-1] if parts else url


@dataclass(frozen=True)
class RunReport:
    url: str
    incidents: tuple[Incident, ...]
    metrics: tuple[tuple[int, float | None, float | None], ...]
    name: str = ""  # the name the controller recorded; run_name(url) when none was

    @property
    def title(self) -> str:
        """The run's human name (never a path)."""
        return self.name or run_name(self.url)

    @property
    def steps_lost(self) -> int:
        return sum(int(i.data.get("steps_lost", 0) or 0) for i in self.incidents if i.kind in ("rollback", "restart"))

    def summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for i in self.incidents:
            out[i.kind] = out.get(i.kind, 0) + 1
        return out

    def describe(self) -> str:
        """The summary in words: ``2 skipped steps, 1 rollback, 1 restart; 19 steps lost``."""
        parts = []
        for kind, n in self.summary().items():
            one, many = _WORDS.get(kind, (kind.replace("_", " "), kind.replace("_", " ") + "s"))
            parts.append(f"{n} {one if n == 1 else many}")
        text = ", ".join(parts) or "no incidents"
        lost = self.steps_lost
        return f"{text}; {lost} step{'s' * (lost != 1)} lost" if lost else text

    def to_json(self) -> dict:
        return {
            "url": self.url,
            "name": self.title,
            "summary": self.summary(),
            "steps_lost": self.steps_lost,
            "incidents": [i.to_json() for i in self.incidents],
            "metrics_points": len(self.metrics),
        }


def load_report(url: str) -> RunReport:
    """The run's incidents and loss history. A rollback's decision record (written before its restore,
    so that a restart can finish it) is shown only while its outcome is missing: the job was killed
    inside that rollback and the next start finishes it."""
    store = open_store(url)
    if not store.list_children():  # a typo or a file: not "a run without incidents"
        raise CheckpointNotFoundError(f"{store.url}: no run folder here (nothing under it)")
    log = IncidentLog(store, writer=False)
    incidents = log.read()
    pending = unfinished_rollback(incidents)
    shown = tuple(i for i in incidents if i.kind != INTENT or (pending is not None and i.step == pending.at
                                                               and i.data.get("seq") == pending.seq))
    return RunReport(url, shown, tuple(log.read_metrics()), log.read_name() or "")


def crash_spans(report: RunReport) -> list[tuple[int, int, int]]:
    """``(restored, reached, steps lost)`` of every restart that lost steps, from its incident.

    ``reached`` is the newest step the crashed job certainly reached; incidents
    of versions without it give ``restored + steps_lost``."""
    out = []
    for inc in report.incidents:
        if inc.kind != "restart":
            continue
        d = inc.data
        try:
            restored = int(d.get("restored", inc.step))
            lost = int(d.get("steps_lost") or 0)
            reached = int(d["reached"]) if d.get("reached") is not None else restored + lost
        except (TypeError, ValueError):
            continue
        if reached > restored:
            out.append((restored, reached, reached - restored))
    return out


def plot(report: RunReport, path: str) -> str:
    """Write the loss curve with incidents marked to ``path`` (PNG); return the path."""
    figure(report).savefig(path, dpi=110)
    return path


def figure(report: RunReport) -> Figure:
    """The loss curve with incidents marked, titled with the run's name (no pyplot: no global state)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 5))
    ax = fig.subplots()
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
        elif inc.kind == "restart":
            ax.axvline(inc.step, color="tab:green", ls=":", lw=1.2, label=label)
        elif inc.kind in ("preempt", "emergency_save", "save_abandoned"):
            color = "tab:purple" if inc.kind == "preempt" else "tab:gray"
            ax.axvline(inc.step, color=color, ls=":", lw=1.2, label=label)
    for restored, reached, lost in crash_spans(report):
        # the steps a crash threw away: trained past the restored checkpoint, then lost with the job
        ax.axvspan(restored, reached, facecolor="tab:green", alpha=0.12, hatch="//", edgecolor="tab:green", lw=0,
                   label="lost to a crash/restart" if "lost" not in shown else None, gid=f"lost:{restored}-{reached}")
        shown.add("lost")
        ax.annotate(f"{lost} step{'s' * (lost != 1)} lost", xy=((restored + reached) / 2, 1.0),
                    xycoords=("data", "axes fraction"), xytext=(0, -12), textcoords="offset points",
                    ha="center", va="top", fontsize=7, color="tab:green")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(report.title, fontsize=12, loc="left", fontweight="bold")
    ax.set_title(report.describe(), fontsize=8, loc="right", color="0.3")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig
