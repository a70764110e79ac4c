"""The ``ckptkit`` entry point: the command group and its one error boundary.

The commands (``commands_*.py``, one module each, none importing another) parse their
arguments with the shared types of :mod:`ckptkit.cli.options`, call one library function,
and print through :mod:`ckptkit.cli.output`. They import the library when they run, so
``ckptkit --help`` and ``ckptkit ls`` start without torch (``ls``, ``inspect`` and ``verify``
never import it).

Every failure ckptkit raises on purpose (:class:`ckptkit.errors.CkptkitError`)
is a message for the user, not a bug, so it becomes one ``error: ...`` line on
stderr and exit code 2 — here, once, rather than in every command. Exit code 1
is left to mean "ran fine, found problems" (``verify``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import click

from ckptkit.cli.commands_convert import convert_cmd
from ckptkit.cli.commands_diff import diff_cmd
from ckptkit.cli.commands_inspect import inspect_cmd
from ckptkit.cli.commands_ls import ls_cmd
from ckptkit.cli.commands_plan import plan_cmd
from ckptkit.cli.commands_report import report_cmd
from ckptkit.cli.commands_reshard import reshard_cmd
from ckptkit.cli.commands_verify import verify_cmd
from ckptkit.cli.output import error
from ckptkit import CkptkitError

EXIT_ERROR = 2
EXIT_BUG = 3


class CkptkitGroup(click.Group):
    """A click group that turns ckptkit (and OS) errors into a one-line message and exit code 2.

    Anything else is a bug in ckptkit, never the user's fault: still one line (exit code 3), with
    the traceback only when ``CKPTKIT_DEBUG=1`` — a damaged checkpoint must not look like a crash."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (CkptkitError, OSError) as exc:
            error(str(exc) or type(exc).__name__)
            ctx.exit(EXIT_ERROR)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - the last boundary before a traceback
            if os.environ.get("CKPTKIT_DEBUG") == "1":
                raise
            error(f"internal error ({type(exc).__name__}: {exc}); this is a ckptkit bug, please report it "
                         "(CKPTKIT_DEBUG=1 shows the traceback)")
            ctx.exit(EXIT_BUG)


@click.group(cls=CkptkitGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ckptkit", prog_name="ckptkit")
def cli() -> None:
    """Inspect, verify, compare, convert and reshard checkpoints offline; report on runs, plan intervals.

    ls, inspect and verify read metadata and raw bytes only (no torch, no pickle).

    \b
    Examples:
      ckptkit ls runs/exp1
      ckptkit inspect runs/exp1/step-0001000 --tensor 'layers.0.*'
      ckptkit verify runs/exp1/step-0001000
      ckptkit diff runs/a/step-0001000 runs/b/step-0001000
      ckptkit convert runs/exp1/step-0001000 step-1000.zarr --format zarr
      ckptkit reshard runs/exp1/step-0001000 runs/exp1-tp4pp2/step-0001000 --to tp4pp2
      ckptkit report runs/exp1
      ckptkit plan --params 70e9 --tp 4 --pp 8 --dp 32 --write-gbps 5 --mtbf-hours 3
    """


cli.add_command(ls_cmd)
cli.add_command(inspect_cmd)
cli.add_command(verify_cmd)
cli.add_command(report_cmd)
cli.add_command(plan_cmd)
cli.add_command(diff_cmd)
cli.add_command(convert_cmd)
cli.add_command(reshard_cmd)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point (``ckptkit = "ckptkit.cli.main:main"``); exits the process."""
    for stream in (sys.stdout, sys.stderr):  # a path with undecodable bytes must not crash the output
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
    cli.main(args=list(argv) if argv is not None else None, prog_name="ckptkit")


if __name__ == "__main__":  # python -m ckptkit.cli.main
    main()
