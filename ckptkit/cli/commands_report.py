"""``ckptkit report``: what happened to a run — incidents, steps lost, the loss curve as a PNG."""

from __future__ import annotations

import datetime
import os

import click

from ckptkit.cli.options import json_option
from ckptkit.cli.output import Output, escape


@click.command("report", short_help="Incidents of a run and a plot of its loss curve.")
@click.argument("run_dir")
@click.option("--plot", "png", default=None, help="Where to write the PNG (default: ./<run name>-loss.png).")
@click.option("--no-plot", is_flag=True, help="Only print the incidents.")
@json_option
def report_cmd(run_dir: str, png: str | None, no_plot: bool, as_json: bool) -> None:
    """Print the incident log of RUN_DIR (spikes, skipped steps, rollbacks and the data they
    skipped, restarts, preemptions) and draw its loss curve with them marked.

    \b
    Example:
      ckptkit report runs/exp1
      ckptkit report s3://bucket/run1 --plot run1.png
    """
    from ckptkit.resilience import load_report, plot

    rep = load_report(run_dir)
    path = None
    if not no_plot and rep.metrics:
        name = os.path.basename(run_dir.rstrip("/")) or "run"
        path = plot(rep, png or f"{name}-loss.png")
    out = Output(as_json)
    if as_json:
        doc = rep.to_json()
        doc["plot"] = path
        out.json(doc)
        return
    out.text(f"[bold]run[/] {escape(run_dir)}: {len(rep.metrics)} logged steps, "
             f"{len(rep.incidents)} incidents, {rep.steps_lost} steps lost to rollbacks and restarts", markup=True)
    if rep.incidents:
        rows = []
        for inc in rep.incidents:
            when = datetime.datetime.fromtimestamp(inc.time).strftime("%H:%M:%S")
            detail = inc.detail
            if inc.kind == "rollback":
                d = inc.data
                detail += f" -> restored step {d.get('restored')}, skipped samples {d.get('skip')}, lost {d.get('steps_lost')} steps"
            rows.append([when, str(inc.step), inc.kind, escape(detail)])
        out.table([(c, "left") for c in ("time", "step", "incident", "detail")], rows)
    if path:
        out.text(f"loss curve: {escape(path)}", markup=True)
