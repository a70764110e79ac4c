"""``ckptkit plan``: how big a checkpoint is, how long it takes, and how often to take one."""

from __future__ import annotations

import click

from ckptkit.cli.options import json_option
from ckptkit.cli.output import Output


@click.command("plan", short_help="Checkpoint size, save time and the goodput-optimal interval.")
@click.option("--params", type=float, required=True, help="Model parameters, e.g. 70e9.")
@click.option("--tp", type=click.IntRange(1), default=1, show_default=True)
@click.option("--pp", type=click.IntRange(1), default=1, show_default=True)
@click.option("--dp", type=click.IntRange(1), default=1, show_default=True)
@click.option("--zero", type=click.IntRange(0, 3), default=1, show_default=True, help="ZeRO stage / distributed optimizer.")
@click.option("--write-gbps", type=float, required=True, help="Write bandwidth per rank, GB/s.")
@click.option("--mtbf-hours", type=float, required=True, help="Mean time between failures of the whole job.")
@click.option("--restart-seconds", type=float, default=300.0, show_default=True, help="Time to restart and reload.")
@click.option("--blocking-fraction", type=click.FloatRange(0.0, 1.0, min_open=True), default=1.0, show_default=True,
              help="Share of a save that stalls training (asynchronous saves: the snapshot's share).")
@json_option
def plan_cmd(params: float, tp: int, pp: int, dp: int, zero: int, write_gbps: float, mtbf_hours: float,
             restart_seconds: float, blocking_fraction: float, as_json: bool) -> None:
    """Size a checkpoint (bf16 weights, fp32 master weights, Adam moments) and pick the
    Young/Daly interval sqrt(2 * C * MTBF) with its expected goodput.

    \b
    Example:
      ckptkit plan --params 70e9 --tp 4 --pp 8 --dp 32 --zero 1 --write-gbps 5 --mtbf-hours 3
    """
    from ckptkit.resilience import plan

    p = plan(params, tp, pp, dp, zero, write_gbps, mtbf_hours, restart_seconds, blocking_fraction)
    out = Output(as_json)
    if as_json:
        out.json({
            "bytes": {"total": p.size.total, "weights": p.size.weights, "master": p.size.master,
                      "moments": p.size.moments, "per_rank": p.size.per_rank},
            "save_seconds": p.save_seconds, "interval_seconds": p.interval_seconds, "goodput": p.goodput,
        })
        return
    for line in p.lines():
        out.text(line)
