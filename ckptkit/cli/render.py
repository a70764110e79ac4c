"""Rendering catalog results for people (rich tables) and programs (one JSON document).

Kept apart from the commands so every command formats sizes, errors and
tables the same way, and so the library results stay free of presentation.
Human output goes to stdout; error lines go to stderr, so ``--json`` stdout
is always exactly one parseable document.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from ckptkit.offline import CheckpointDescription, CheckpointInfo, VerifyReport


def console() -> Console:
    """A console on the current stdout; wide when piped, so long tensor keys are not cut."""
    width = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 200
    return Console(file=sys.stdout, width=width, highlight=False, soft_wrap=False)


def error(message: str) -> None:
    """The one-line form every CkptkitError takes on the command line."""
    click.echo(f"error: {' '.join(message.split())}", err=True)


def print_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2))


def human_bytes(n: int) -> str:
    if n >= 1 << 60:  # only a damaged or hostile manifest claims this much (and float() may overflow)
        return f"{n} B" if n < 10**30 else f"an implausible {len(str(n))}-digit byte count"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def ranks_text(ranks: tuple[int, ...]) -> str:
    """``0-15`` for a contiguous run of ranks, else the first few."""
    if ranks and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f", ... ({len(ranks)} ranks)" if len(ranks) > 8 else "")


def checkpoint_table(infos: list[CheckpointInfo], url: str) -> None:
    out = console()
    if not infos:
        out.print(f"no checkpoints in {escape(url)}")
        return
    table = Table(title=escape(url), title_justify="left")
    for name, justify in (("name", "left"), ("step", "right"), ("size", "right"), ("committed", "left"),
                          ("world", "right"), ("metrics", "left"), ("kept as", "left"), ("created", "left")):
        table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for i in infos:
        committed = "[green]yes[/]" if i.committed else f"[red]no[/]: {escape(i.reason or '')}"
        metrics = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(i.metrics.items()))
        table.add_row(
            escape(i.name), "-" if i.step is None else str(i.step), human_bytes(i.total_bytes), committed,
            "-" if i.world_size is None else str(i.world_size), escape(metrics or "-"),
            escape(", ".join(i.keep) or "-"), escape(i.created or "-"),
        )
    out.print(table)


def description(d: CheckpointDescription, pattern: str | None = None, limit: int | None = None) -> None:
    """The tables of ``inspect``; at most ``limit`` rows each (a 300k-tensor checkpoint would take
    minutes to lay out as a table and nobody reads it: the last row says how many are left)."""
    out = console()
    meta = d.meta
    out.print(f"[bold]checkpoint[/] {escape(d.url)}")
    saved = f"saved {meta.get('created', '?')} by ckptkit {meta.get('ckptkit_version', '?')}"
    out.print(f"  world size {d.world_size} · format v{d.version} · {escape(saved)}")
    logical = sum(t.nbytes for t in d.tensors)
    what = f"{len(d.tensors)} tensors" + (f" matching {pattern!r}" if pattern is not None else "")
    total = f" (checkpoint total {human_bytes(d.total_bytes)})" if pattern is not None else ""
    out.print(f"  {escape(what)}: {human_bytes(logical)}{total}")
    if d.parallel:
        out.print(f"  parallel config: {escape(d.parallel)}")
    for m in d.meshes:
        dims = ", ".join(f"{n}={s}" for n, s in zip(m.dims, m.shape))
        out.print(f"  mesh {m.name}: ({escape(dims)}) on ranks {ranks_text(m.ranks)}")
    if d.values:
        out.print(f"  values: {escape(', '.join(d.values))}")
    if d.per_rank_keys:
        out.print(f"  per-rank values: {escape(', '.join(d.per_rank_keys))}")
    if meta.get("user"):
        out.print(f"  user metadata: {escape(json.dumps(meta['user']))}")
    tensors = Table(title="tensors", title_justify="left")
    for name in ("key", "dtype", "shape", "size", "layout", "pieces"):
        tensors.add_column(name, overflow="fold", justify="right" if name in ("size", "pieces") else "left")
    for t in d.tensors[:limit]:
        tensors.add_row(escape(t.key), t.dtype, escape(str(list(t.shape))), human_bytes(t.nbytes),
                        escape(t.layout), str(t.stored_pieces))
    if limit is not None and len(d.tensors) > limit:
        tensors.add_row(f"... {len(d.tensors) - limit} more (--tensor PATTERN, --limit 0 or --json)", "", "", "", "", "")
    out.print(tensors if d.tensors else "  (no tensors)")
    ranks = Table(title="pieces per rank", title_justify="left")
    for name in ("rank", "pieces", "bytes", "per-rank values"):
        ranks.add_column(name, overflow="fold", justify="left" if name == "per-rank values" else "right")
    for r in d.ranks[:limit]:
        ranks.add_row(str(r.rank), str(r.pieces), human_bytes(r.nbytes), escape(", ".join(r.value_keys) or "-"))
    if limit is not None and len(d.ranks) > limit:
        ranks.add_row(f"... {len(d.ranks) - limit} more", "", "", "")
    out.print(ranks)


def verify_report(report: VerifyReport) -> None:
    out = console()
    counts = (f"{report.tensors} tensors, {report.pieces} pieces, {human_bytes(report.bytes_checked)} checked "
              f"in {report.objects} data object{'s' * (report.objects != 1)}")
    if report.ok:
        out.print(f"[green]OK[/] {escape(report.url)}: {counts}")
        return
    for p in report.problems:
        out.print(f"[red]{escape(p.kind)}[/]: {escape(p.message)}", overflow="fold")
    n = len(report.problems)
    checked = f" ({counts})" if report.tensors or report.pieces else ""
    out.print(f"[red]FAILED[/] {escape(report.url)}: {n} problem{'s' * (n != 1)}{checked}")


@contextmanager
def byte_progress(enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A progress bar over bytes (a ``progress(done, total)`` callback), or None when not on a terminal."""
    if not enabled:
        yield None
        return
    bar = Progress("verifying", BarColumn(), DownloadColumn(binary_units=True), TransferSpeedColumn(),
                   TimeRemainingColumn(), console=console(), transient=True)
    task = bar.add_task("verify", total=None)
    with bar:
        yield lambda done, total: bar.update(task, completed=done, total=total)
