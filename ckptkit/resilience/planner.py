"""Checkpoint sizing and the interval that maximises goodput (pure arithmetic).

Sizes for mixed-precision Adam training: bf16 weights (2 B/param), fp32
master weights (4 B/param) and two fp32 Adam moments (8 B/param). With
ZeRO stage >= 1 (or Megatron's distributed optimizer) the optimizer state is
split over data parallelism, with stage 3 the weights too; otherwise every
data-parallel replica holds them, but only one replica writes them.

The interval comes from Young/Daly: ``tau = sqrt(2 * C * MTBF)`` where ``C``
is the time a checkpoint costs the run (for an asynchronous save, the
blocking time, not the whole persist). Expected goodput for interval ``tau``
with restart cost ``R``: the fraction of time spent on useful work is

    1 - C / tau - (tau / 2 + R) / MTBF

(first order: a failure loses on average half an interval plus the restart).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckptkit.errors import OptionsError

WEIGHT, MASTER, MOMENTS = 2, 4, 8  # bytes per parameter


@dataclass(frozen=True)
class CheckpointSize:
    weights: float
    master: float
    moments: float
    per_rank: float  # bytes the busiest writing rank writes

    @property
    def total(self) -> float:
        return self.weights + self.master + self.moments


def checkpoint_size(params: float, tp: int = 1, pp: int = 1, dp: int = 1, zero: int = 1) -> CheckpointSize:
    if min(tp, pp, dp) < 1 or params <= 0 or zero not in (0, 1, 2, 3):
        raise OptionsError("params must be positive, degrees >= 1, zero in 0..3")
    model_parallel = tp * pp
    weights, master, moments = params * WEIGHT, params * MASTER, params * MOMENTS
    optimizer = master + moments
    per_mp_rank_weights = weights / model_parallel
    per_mp_rank_opt = optimizer / model_parallel
    # replicas write once between them: spread over dp either way (ZeRO shards; ckptkit balances replicas)
    per_rank = per_mp_rank_weights / dp + per_mp_rank_opt / dp
    return CheckpointSize(weights, master, moments, per_rank)


def young_daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Optimal seconds between checkpoints for a checkpoint cost and a mean time between failures."""
    if cost_s <= 0 or mtbf_s <= 0:
        raise OptionsError("cost and MTBF must be positive")
    return math.sqrt(2 * cost_s * mtbf_s)


def goodput(interval_s: float, cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Expected fraction of wall time that makes progress (first-order model, clamped at 0)."""
    return max(0.0, 1 - cost_s / interval_s - (interval_s / 2 + restart_s) / mtbf_s)


@dataclass(frozen=True)
class Plan:
    size: CheckpointSize
    save_seconds: float
    interval_seconds: float
    goodput: float
    restart_seconds: float

    def lines(self) -> list[str]:
        gib = 2**30
        s = self.size
        return [
            f"checkpoint size: {s.total / gib:,.1f} GiB "
            f"(weights {s.weights / gib:,.1f}, fp32 master {s.master / gib:,.1f}, Adam moments {s.moments / gib:,.1f})",
            f"per-rank shard: {s.per_rank / gib:,.2f} GiB",
            f"save time: {self.save_seconds:,.1f} s",
            f"Young/Daly interval: {self.interval_seconds / 60:,.1f} min",
            f"expected goodput: {100 * self.goodput:.1f}% (restart cost {self.restart_seconds:,.0f} s)",
        ]


def plan(params: float, tp: int, pp: int, dp: int, zero: int, write_gbps: float, mtbf_hours: float,
         restart_seconds: float = 300.0, blocking_fraction: float = 1.0) -> Plan:
    """``write_gbps``: per-rank write bandwidth (GB/s). ``blocking_fraction``: share of the save
    that stalls training (1 for synchronous saves; the snapshot's share for asynchronous ones)."""
    size = checkpoint_size(params, tp, pp, dp, zero)
    save_s = size.per_rank / (write_gbps * 1e9)
    cost = max(save_s * blocking_fraction, 1e-3)
    mtbf = mtbf_hours * 3600
    tau = young_daly_interval(cost, mtbf)
    return Plan(size, save_s, tau, goodput(tau, cost, mtbf, restart_seconds), restart_seconds)
