"""A click command whose ``--help`` shows its options in named groups.

``ckptkit convert`` takes options for five formats; one flat list of ~25 flags hid which ones
mean anything for the conversion at hand. Each option here carries a ``group`` ("Common",
"zarr export", "Megatron", ...) and the help prints one section per group, in the order the
groups first appear. A command may add a closing section of its own (``extra_help``), written
only when help is asked for, so it may import what listing it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


class GroupedOption(click.Option):
    def __init__(self, *args: Any, group: str = "Common", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group


def grouped(group: str, *decls: str, **kwargs: Any) -> Callable[[F], F]:
    """``click.option`` in the help section ``group``."""
    return click.option(*decls, cls=GroupedOption, group=group, **kwargs)


class GroupedCommand(click.Command):
    """Options printed per group; ``extra_help(formatter)`` adds sections after them."""

    def __init__(self, *args: Any, extra_help: Callable[[click.HelpFormatter], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.extra_help = extra_help

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                sections.setdefault(getattr(param, "group", "Common"), []).append(record)
        for name, records in sections.items():
            with formatter.section(f"{name} options"):
                formatter.write_dl(records)
        if self.extra_help is not None:
            self.extra_help(formatter)
