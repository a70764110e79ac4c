"""``ckptkit diff``: did two runs diverge, and where? Per-tensor differences, streamed."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import click

from ckptkit.cli.options import json_option, storage_option
from ckptkit.cli.output import Output, escape, human_bytes

if TYPE_CHECKING:  # the library (and torch) is imported only when the command runs
    from ckptkit.offline import DiffReport, TensorDiff


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
@json_option
@storage_option
def diff_cmd(a: str, b: str, pattern: str | None, show_all: bool, as_json: bool,
             storage_options: dict[str, Any] | None) -> None:
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
    from ckptkit.offline import diff

    out = Output(as_json)
    with out.progress("comparing", data=False) as progress:
        report = diff(a, b, pattern=pattern, storage_options=storage_options, progress=progress)
    if as_json:
        out.json(report.to_json())
    else:
        render(out, report, show_all)
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


def render(out: Output, report: DiffReport, show_all: bool) -> None:
    rows = report.tensors if show_all else report.differing()
    if rows:
        columns = [(name, "left" if name in ("key", "status", "dtype", "shape") else "right")
                   for name in ("key", "status", "dtype", "shape", "max |a-b|", "mean |a-b|", "rel norm", "differing")]
        out.table(columns, [_row(t) for t in rows], title=f"{escape(report.a)}  vs  {escape(report.b)}")
    for v in report.values:
        out.text(f"value {escape(v.key)}: {escape(str(v.a))} -> {escape(str(v.b))} ({v.status})", markup=True)
    n, bad = len(report.tensors), len(report.differing())
    verdict = "[green]identical[/]" if report.identical else f"[red]{bad} of {n} tensors differ[/]"
    values = f", {len(report.values)} value(s) differ" if report.values else ""
    out.text(f"{verdict}{values}: {n} tensors compared, {human_bytes(report.bytes_read)} read "
             f"in {report.seconds:.2f}s", markup=True)
