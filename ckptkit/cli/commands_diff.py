"""``ckptkit diff``: did two runs diverge, and where? Per-tensor differences, streamed."""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING

import click
from rich.markup import escape
from rich.table import Table

from ckptkit.cli import render
from ckptkit.cli.commands_convert import progress_bar

if TYPE_CHECKING:  # the library (and torch) is imported only when the command runs
    from ckptkit.offline.comparison import DiffReport, TensorDiff


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return "0" if x == 0 else f"{x:.3e}"


@click.command("diff", short_help="Per-tensor differences between two checkpoints of any layouts.")
@click.argument("a")
@click.argument("b")
@click.option("--tensor", "pattern", metavar="PATTERN", help="Only tensors whose key matches this shell pattern.")
@click.option("--all", "show_all", is_flag=True, help="List identical tensors too.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of a table.")
def diff_cmd(a: str, b: str, pattern: str | None, show_all: bool, as_json: bool) -> None:
    """Compare checkpoints A and B tensor by tensor: max and mean |a - b|, ||a - b|| / ||a||.

    The two may have been saved at different layouts and world sizes; both
    are read in model space, chunk by chunk, so memory stays bounded. Values
    (step, scheduler state) are compared too unless --tensor is given. Exits
    0 if everything is bit-identical, 1 if anything differs, 2 on errors.

    \b
    Examples:
      ckptkit diff runs/a/step-0001000 runs/b/step-0001000
      ckptkit diff runs/a/step-0001000 s3://bucket/b/step-0001000 --tensor 'optim/*exp_avg_sq' --json
    """
    from ckptkit.offline.comparison import diff

    with progress_bar("comparing", not as_json and sys.stdout.isatty(), data=False) as progress:
        report = diff(a, b, pattern=pattern, progress=progress)
    if as_json:
        render.print_json(report.to_json())
    else:
        _render(report, show_all)
    click.get_current_context().exit(0 if report.identical else 1)


def _pair(a: object, b: object) -> str:
    """One side, or ``a / b`` when both exist and differ."""
    if a is None or b is None or a == b:
        shown = a if a is not None else b
        return "-" if shown is None else str(list(shown) if isinstance(shown, tuple) else shown)
    return f"{list(a) if isinstance(a, tuple) else a} / {list(b) if isinstance(b, tuple) else b}"


def _row(t: TensorDiff) -> list[str]:
    differing = "-" if t.differing is None else f"{t.differing}/{t.numel}"
    return [escape(t.key), t.status, _pair(t.dtype_a, t.dtype_b), escape(_pair(t.shape_a, t.shape_b)),
            _num(t.max_abs), _num(t.mean_abs), _num(t.rel_norm), differing]


def _render(report: DiffReport, show_all: bool) -> None:
    out = render.console()
    rows = report.tensors if show_all else report.differing()
    if rows:
        table = Table(title=f"{escape(report.a)}  vs  {escape(report.b)}", title_justify="left")
        for name in ("key", "status", "dtype", "shape", "max |a-b|", "mean |a-b|", "rel norm", "differing"):
            table.add_column(name, overflow="fold", justify="left" if name in ("key", "status", "dtype", "shape") else "right")
        for t in rows:
            table.add_row(*_row(t))
        out.print(table)
    for v in report.values:
        out.print(f"value {escape(v.key)}: {escape(str(v.a))} -> {escape(str(v.b))} ({v.status})")
    n, bad = len(report.tensors), len(report.differing())
    verdict = "[green]identical[/]" if report.identical else f"[red]{bad} of {n} tensors differ[/]"
    values = f", {len(report.values)} value(s) differ" if report.values else ""
    out.print(f"{verdict}{values}: {n} tensors compared, {render.human_bytes(report.bytes_read)} read "
              f"in {report.seconds:.2f}s")
