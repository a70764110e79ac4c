"""``ckptkit report``: what happened to a run — incidents, steps lost, the loss curve as a PNG."""

from __future__ import annotations

import datetime
import os

import click
from rich.markup import escape
from rich.table import Table

from ckptkit.cli import render
from ckptkit.resilience.report import load_report, plot


@click.command("report", short_help="Incidents of a run and a plot of its loss curve.")
@click.argument("run_dir")
@click.option("--plot", "png", default=None, help="Where to write the PNG (default: ./<run name>-loss.png).")
@click.option("--no-plot", is_flag=True, help="Only print the incidents.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of a table.")
def report_cmd(run_dir: str, png: str | None, no_plot: bool, as_json: bool) -> None:
    """Print the incident log of RUN_DIR (spikes, skipped steps, rollbacks and the data they
    skipped, restarts, preemptions) and draw its loss curve with them marked.

    \b
    Example:
      ckptkit report runs/exp1
      ckptkit report s3://bucket/run1 --plot run1.png
    """
    rep = load_report(run_dir)
    path = None
    if not no_plot and rep.metrics:
        name = os.path.basename(run_dir.rstrip("/")) or "run"
        path = plot(rep, png or f"{name}-loss.png")
    if as_json:
        doc = rep.to_json()
        doc["plot"] = path
        render.print_json(doc)
        return
    out = render.console()
    out.print(f"[bold]run[/] {escape(run_dir)}: {len(rep.metrics)} logged steps, "
              f"{len(rep.incidents)} incidents, {rep.steps_lost} steps lost to rollbacks and restarts")
    if rep.incidents:
        table = Table()
        for col in ("time", "step", "incident", "detail"):
            table.add_column(col, overflow="fold")
        for inc in rep.incidents:
            when = datetime.datetime.fromtimestamp(inc.time).strftime("%H:%M:%S")
            detail = inc.detail
            if inc.kind == "rollback":
                d = inc.data
                detail += f" -> restored step {d.get('restored')}, skipped samples {d.get('skip')}, lost {d.get('steps_lost')} steps"
            table.add_row(when, str(inc.step), inc.kind, escape(detail))
        out.print(table)
    if path:
        out.print(f"loss curve: {escape(path)}")
