"""``ckptkit plan``: how big a checkpoint is, how long it takes, and how often to take one —
persistent checkpoints alone, or behind a memory tier (``--memory-replicas`` / ``--memory-parity``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import click

from ckptkit.cli.grouped import GroupedCommand, grouped
from ckptkit.cli.options import FiniteRange, json_option
from ckptkit.cli.output import Output

if TYPE_CHECKING:
    from ckptkit.resilience import Plan, TwoTierPlan

MEMORY = "Memory tier"
MEMORY_ONLY_FLAGS = {"ranks_per_node": "--ranks-per-node", "memory_gbps": "--memory-gbps",
                     "node_failure_share": "--node-failure-share",
                     "memory_restart_seconds": "--memory-restart-seconds"}
POSITIVE = FiniteRange(0.0, min_open=True)


@click.command("plan", cls=GroupedCommand, short_help="Checkpoint size, save time and the goodput-optimal interval(s).")
@grouped("Model and layout", "--params", type=POSITIVE, required=True, help="Model parameters, e.g. 70e9.")
@grouped("Model and layout", "--tp", type=click.IntRange(1), default=1, show_default=True)
@grouped("Model and layout", "--pp", type=click.IntRange(1), default=1, show_default=True)
@grouped("Model and layout", "--dp", type=click.IntRange(1), default=1, show_default=True)
@grouped("Model and layout", "--zero", type=click.IntRange(0, 3), default=1, show_default=True,
         help="ZeRO stage / distributed optimizer.")
@grouped("Storage", "--write-gbps", type=POSITIVE, default=None,
         help="Write bandwidth per rank, GB/s. Give this, --fs-gbps or both.")
@grouped("Storage", "--fs-gbps", type=POSITIVE, default=None,
         help="Aggregate bandwidth of the shared file system / object store, GB/s (bounds the save at scale).")
@grouped("Storage", "--blocking-fraction", type=FiniteRange(0.0, 1.0, min_open=True), default=1.0,
         show_default=True, help="Share of a save (and a memory snapshot) that stalls training "
                                 "(asynchronous saves: the snapshot's share).")
@grouped("Failures", "--mtbf-hours", type=POSITIVE, required=True, help="Mean time between failures of the whole job.")
@grouped("Failures", "--restart-seconds", type=FiniteRange(0.0), default=300.0, show_default=True,
         help="Time to restart and reload from the persistent checkpoint.")
@grouped(MEMORY, "--memory-replicas", type=click.IntRange(1), default=None,
         help="Plan a memory tier whose snapshots have N replicas on other nodes.")
@grouped(MEMORY, "--memory-parity", type=click.IntRange(2), default=None,
         help="Plan a memory tier protected by XOR parity over groups of G ranks on G nodes.")
@grouped(MEMORY, "--ranks-per-node", type=click.IntRange(1), default=8, show_default=True)
@grouped(MEMORY, "--memory-gbps", type=POSITIVE, default=10.0, show_default=True,
         help="Per-rank snapshot copy bandwidth into node memory, GB/s.")
@grouped(MEMORY, "--node-failure-share", type=FiniteRange(0.0, 1.0), default=0.9, show_default=True,
         help="Share of failures recoverable from memory (one node lost per group; Llama 3: most are one GPU or host).")
@grouped(MEMORY, "--memory-restart-seconds", type=FiniteRange(0.0), default=60.0, show_default=True,
         help="Time to restart and restore from memory.")
@json_option
@click.pass_context
def plan_cmd(ctx: click.Context, params: float, tp: int, pp: int, dp: int, zero: int, write_gbps: float | None,
             fs_gbps: float | None, blocking_fraction: float, mtbf_hours: float, restart_seconds: float,
             memory_replicas: int | None, memory_parity: int | None, ranks_per_node: int, memory_gbps: float,
             node_failure_share: float, memory_restart_seconds: float, as_json: bool) -> None:
    """Size a checkpoint (bf16 weights, fp32 master weights, Adam moments), time its save (the
    slower of per-rank and aggregate bandwidth) and pick the Young/Daly interval sqrt(2 * C * MTBF)
    with its expected goodput. With a memory tier, pick both intervals and size host memory.

    \b
    Examples:
      ckptkit plan --params 70e9 --tp 4 --pp 8 --dp 32 --zero 1 --write-gbps 5 --mtbf-hours 3
      ckptkit plan --params 70e9 --tp 4 --pp 8 --dp 32 --write-gbps 5 --fs-gbps 200 --mtbf-hours 2.8 \\
          --memory-parity 8 --blocking-fraction 0.1
    """
    from ckptkit.resilience import MemoryTierPlanOptions, plan, plan_tiers

    if write_gbps is None and fs_gbps is None:
        raise click.UsageError("give a write bandwidth: --write-gbps (per rank), --fs-gbps (aggregate), or both")
    if memory_replicas is not None and memory_parity is not None:
        raise click.UsageError("--memory-replicas and --memory-parity exclude each other: pick one protection")
    tiered = memory_replicas is not None or memory_parity is not None
    for name, flag in MEMORY_ONLY_FLAGS.items():
        if not tiered and ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE:
            raise click.UsageError(f"{flag} describes a memory tier: add --memory-replicas or --memory-parity")
    out = Output(as_json)
    if tiered:
        memory = MemoryTierPlanOptions(memory_replicas, memory_parity, ranks_per_node, memory_gbps,
                                       node_failure_share, memory_restart_seconds)
        t = plan_tiers(params, tp, pp, dp, zero, mtbf_hours=mtbf_hours, write_gbps=write_gbps, fs_gbps=fs_gbps,
                       restart_seconds=restart_seconds, blocking_fraction=blocking_fraction, memory=memory)
        doc, lines = {**_plan_json(t.persistent_only), "tiers": _tiers_json(t)}, t.lines()
    else:
        p = plan(params, tp, pp, dp, zero, write_gbps, mtbf_hours, restart_seconds, blocking_fraction, fs_gbps=fs_gbps)
        doc, lines = _plan_json(p), p.lines()
    if as_json:
        out.json(doc)
        return
    for line in lines:
        out.text(line)


def _plan_json(p: Plan) -> dict[str, Any]:
    """The persistent-only plan; with a memory tier it stays at the top level for comparison."""
    save = p.save
    return {
        "bytes": {"total": p.size.total, "weights": p.size.weights, "master": p.size.master,
                  "moments": p.size.moments, "per_rank": p.size.per_rank},
        "save_seconds": p.save_seconds, "interval_seconds": p.interval_seconds, "goodput": p.goodput,
        "save": None if save is None else {
            "limited_by": save.limited_by, "per_rank_seconds": save.per_rank_seconds,
            "fs_seconds": save.fs_seconds, "write_gbps": save.write_gbps, "fs_gbps": save.fs_gbps,
        },
    }


def _tiers_json(t: TwoTierPlan) -> dict[str, Any]:
    """The two-tier plan; an interval the model never needs (its tier serves no failure) is null."""
    m = t.memory
    return {
        "memory": {"replicas": m.copies if m.parity is None else None, "parity": m.parity,
                   "ranks_per_node": m.ranks_per_node, "nodes": t.nodes, "memory_gbps": m.memory_gbps,
                   "node_failure_share": m.node_failure_share, "restart_seconds": m.restart_seconds,
                   "held_bytes_per_rank": t.held_per_rank, "host_bytes_per_node": t.host_memory_per_node,
                   "copy_seconds": t.memory_copy_seconds, "blocking_seconds": t.memory_cost_seconds,
                   "interval_seconds": _finite(t.memory_interval_seconds)},
        "persistent": {"blocking_seconds": t.persistent_cost_seconds,
                       "interval_seconds": _finite(t.persistent_interval_seconds),
                       "restart_seconds": t.persistent_only.restart_seconds},
        "goodput": t.goodput,
        "persistent_only_goodput": t.persistent_only.goodput,
    }


def _finite(x: float) -> float | None:
    return None if math.isinf(x) else x
