"""Checkpoint sizing and the interval that maximises goodput (pure arithmetic).

Sizes for mixed-precision Adam training: bf16 weights (2 B/param), fp32
master weights (4 B/param) and two fp32 Adam moments (8 B/param). With
ZeRO stage >= 1 (or Megatron's distributed optimizer) the optimizer state is
split over data parallelism, with stage 3 the weights too; otherwise every
data-parallel replica holds them, but only one replica writes them.

A save takes as long as the slower of two bounds: the busiest rank's bytes
over the per-rank write bandwidth, and the checkpoint's unique bytes over the
aggregate bandwidth of the shared file system or object store. The second
bound is the one large jobs hit: 1,024 ranks at 5 GB/s each would need
5 TB/s of storage, an order of magnitude above what a shared file system
typically sustains, so a per-rank figure alone is optimistic at scale.

The interval comes from Young/Daly: ``tau = sqrt(2 * C * MTBF)`` where ``C``
is the time a checkpoint costs the run (for an asynchronous save, the
blocking time, not the whole persist). Expected goodput for interval ``tau``
with restart cost ``R``: the fraction of time spent on useful work is

    1 - C / tau - (tau / 2 + R) / MTBF

(first order: a failure loses on average half an interval plus the restart).
The interval never drops below the save time itself: at most one save is in
flight, so a shorter interval would only queue saves.

Two tiers (a memory tier in front of the persistent one) are planned by
:mod:`ckptkit.resilience.tier_planner`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ckptkit.errors import OptionsError

WEIGHT, MASTER, MOMENTS = 2, 4, 8  # bytes per parameter
GB = 1e9  # bandwidths are decimal GB/s, as storage vendors quote them


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


SaveBound = Literal["file system", "per-rank bandwidth"]


@dataclass(frozen=True)
class SaveTime:
    """How long one checkpoint takes to write, and which of the two bounds sets it.

    ``per_rank_seconds`` is the busiest rank's bytes over the per-rank bandwidth, ``fs_seconds`` the
    unique bytes over the aggregate bandwidth; either is None when its bandwidth was not given."""

    seconds: float
    per_rank_seconds: float | None
    fs_seconds: float | None
    write_gbps: float | None
    fs_gbps: float | None
    writers: int

    @property
    def limited_by(self) -> SaveBound:
        if self.fs_seconds is not None and (self.per_rank_seconds is None or self.fs_seconds >= self.per_rank_seconds):
            return "file system"
        return "per-rank bandwidth"

    def describe(self) -> str:
        """Which bound limits the save, and what the other one would allow (or assumes)."""
        if self.limited_by == "file system":
            text = f"limited by the file system's {self.fs_gbps:,g} GB/s aggregate"
            if self.per_rank_seconds is not None:
                text += f"; per-rank bandwidth alone would allow {self.per_rank_seconds:,.1f} s"
            return text
        assert self.write_gbps is not None
        text = f"limited by per-rank bandwidth, {self.write_gbps:,g} GB/s"
        if self.fs_seconds is not None:
            return text + f"; the file system's {self.fs_gbps:,g} GB/s aggregate would allow {self.fs_seconds:,.1f} s"
        return (text + f"; assumes storage sustains {self.writers:,} ranks x {self.write_gbps:,g} = "
                f"{self.writers * self.write_gbps:,g} GB/s in aggregate, unless bounded by fs_gbps")


def save_time(size: CheckpointSize, writers: int, write_gbps: float | None = None,
              fs_gbps: float | None = None) -> SaveTime:
    """The save time of ``size`` written by ``writers`` ranks: the slower of the per-rank bound
    (busiest rank's bytes / ``write_gbps``) and the storage bound (unique bytes / ``fs_gbps``).
    Unique bytes count replicated weights once, as the checkpoint stores them."""
    if write_gbps is None and fs_gbps is None:
        raise OptionsError("give a write bandwidth: per rank (write_gbps), aggregate (fs_gbps), or both")
    for name, value in (("write_gbps", write_gbps), ("fs_gbps", fs_gbps)):
        if value is not None and not value > 0:
            raise OptionsError(f"{name} must be positive, not {value}")
    per_rank_s = None if write_gbps is None else size.per_rank / (write_gbps * GB)
    fs_s = None if fs_gbps is None else size.total / (fs_gbps * GB)
    seconds = max(s for s in (per_rank_s, fs_s) if s is not None)
    return SaveTime(seconds, per_rank_s, fs_s, write_gbps, fs_gbps, writers)


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
    save: SaveTime | None = None  # which bound sets save_seconds (None: built by hand, bound unknown)

    def lines(self) -> list[str]:
        gib = 2**30
        s = self.size
        save = f"save time: {self.save_seconds:,.1f} s"
        if self.save is not None:
            save += f" ({self.save.describe()})"
        return [
            f"checkpoint size: {s.total / gib:,.1f} GiB "
            f"(weights {s.weights / gib:,.1f}, fp32 master {s.master / gib:,.1f}, Adam moments {s.moments / gib:,.1f})",
            f"per-rank shard: {s.per_rank / gib:,.2f} GiB",
            save,
            f"Young/Daly interval: {self.interval_seconds / 60:,.1f} min"
            + (" (the save time: saves never queue)" if self.interval_seconds <= self.save_seconds else ""),
            f"expected goodput: {100 * self.goodput:.1f}% (restart cost {self.restart_seconds:,.0f} s)",
        ]


def check_failure_figures(mtbf_hours: float, restart_seconds: float, blocking_fraction: float) -> None:
    """The figures every plan takes, checked once (an MTBF of 0 would divide by zero far from here)."""
    if not mtbf_hours > 0:
        raise OptionsError(f"mtbf_hours must be positive, not {mtbf_hours}")
    if not restart_seconds >= 0:
        raise OptionsError(f"restart_seconds must be >= 0, not {restart_seconds}")
    if not 0 <= blocking_fraction <= 1:
        raise OptionsError(f"blocking_fraction must be in [0, 1], not {blocking_fraction}")


def plan(params: float, tp: int, pp: int, dp: int, zero: int, write_gbps: float | None, mtbf_hours: float,
         restart_seconds: float = 300.0, blocking_fraction: float = 1.0, *, fs_gbps: float | None = None) -> Plan:
    """``write_gbps``: per-rank write bandwidth (GB/s); ``fs_gbps``: aggregate bandwidth of the
    shared file system or object store (GB/s). Give either or both (None for the one unknown): the
    save takes as long as the slower bound. ``blocking_fraction``: share of the save that stalls
    training (1 for synchronous saves; the snapshot's share for asynchronous ones)."""
    check_failure_figures(mtbf_hours, restart_seconds, blocking_fraction)
    size = checkpoint_size(params, tp, pp, dp, zero)
    save = save_time(size, tp * pp * dp, write_gbps, fs_gbps)
    cost = max(save.seconds * blocking_fraction, 1e-3)
    mtbf = mtbf_hours * 3600
    tau = max(young_daly_interval(cost, mtbf), save.seconds)  # saves never queue
    return Plan(size, save.seconds, tau, goodput(tau, cost, mtbf, restart_seconds), restart_seconds, save)
