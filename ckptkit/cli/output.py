"""The command line's one output sink (text, tables, JSON) and its one progress bar.

Every command prints through an :class:`Output`: ``--json`` makes stdout exactly one JSON
document (:meth:`Output.json`), otherwise text lines (:meth:`Output.text`, with rich markup
when asked) and tables (:meth:`Output.table`) go to stdout, and :meth:`Output.progress` draws
a bar on a terminal only. Error lines go to stderr (:func:`error`, used by the one error
boundary in :mod:`ckptkit.cli.main`), so a failed ``--json`` command leaves stdout empty.

rich is imported only when something is drawn, so ``ckptkit --help`` does not pay for it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from rich.console import Console

ProgressFn = Callable[[int, int], None]


def console() -> Console:
    """A rich console on the current stdout; wide when piped, so long tensor keys are not cut."""
    from rich.console import Console

    width = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 200
    return Console(file=sys.stdout, width=width, highlight=False, soft_wrap=False)


def escape(text: object) -> str:
    """``text`` made safe for rich markup (a tensor key like ``[x]`` is not a style)."""
    from rich.markup import escape as rich_escape

    return rich_escape(str(text))


def error(message: str) -> None:
    """The one-line form every CkptkitError takes on the command line (stderr)."""
    click.echo(f"error: {' '.join(message.split())}", err=True)


def human_bytes(n: int) -> str:
    if n >= 1 << 60:  # only a damaged or hostile manifest claims this much (and float() may overflow)
        return f"{n} B" if n < 10**30 else f"an implausible {len(str(n))}-digit byte count"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def ranks_text(ranks: Sequence[int]) -> str:
    """``0-15`` for a contiguous run of ranks, else the first few."""
    ranks = tuple(ranks)
    if ranks and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f", ... ({len(ranks)} ranks)" if len(ranks) > 8 else "")


Column = tuple[str, str]  # (name, "left" | "right")


class Output:
    """Where one command's output goes: ``as_json`` or text; see the module docstring. ``quiet``:
    nowhere (the processes other than the first of a command spread over ``torchrun``: one of
    them speaks for all; errors still go to stderr)."""

    def __init__(self, as_json: bool = False, *, quiet: bool = False) -> None:
        self.as_json = as_json
        self.quiet = quiet
        self._console: Console | None = None

    @property
    def console(self) -> Console:
        if self._console is None:
            self._console = console()
        return self._console

    def json(self, doc: Any) -> None:
        """The one JSON document of a ``--json`` run."""
        if self.quiet:
            return
        click.echo(json.dumps(doc, indent=2))

    def text(self, line: str = "", *, markup: bool = False) -> None:
        """One line of text; ``markup``: rich markup (escape what came from a checkpoint with :func:`escape`)."""
        if self.quiet:
            return
        if markup:
            self.console.print(line, overflow="fold")
        else:
            click.echo(line)

    def table(self, columns: Sequence[Column], rows: Iterable[Sequence[str]], *, title: str | None = None) -> None:
        """A table (cells are rich markup: escape what came from a checkpoint)."""
        if self.quiet:
            return
        from rich.table import Table

        table = Table(title=title, title_justify="left")
        for name, justify in columns:
            table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
        for row in rows:
            table.add_row(*row)
        self.console.print(table)

    @contextmanager
    def progress(self, label: str, *, data: bool = True) -> Iterator[ProgressFn | None]:
        """A ``progress(done, total)`` callback drawing one bar (bytes when ``data``, else a count),
        or None when the output is JSON or stdout is not a terminal."""
        if self.as_json or self.quiet or not sys.stdout.isatty():
            yield None
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TaskProgressColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        columns = (DownloadColumn(binary_units=True), TransferSpeedColumn()) if data else (TaskProgressColumn(),)
        bar = Progress(label, BarColumn(), *columns, TimeRemainingColumn(), console=self.console, transient=True)
        task = bar.add_task(label, total=None)
        with bar:
            yield lambda done, total: bar.update(task, completed=done, total=total)
