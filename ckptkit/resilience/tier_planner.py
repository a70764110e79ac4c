"""Two-tier checkpoint planning: a memory tier in front of the persistent one (pure arithmetic).

A memory tier (``ckptkit.MemoryTier``) snapshots every rank's own state into node shared memory
every few steps and protects it against the loss of a node: ``replicas`` copies on other nodes,
or XOR parity over groups of ``G`` ranks on ``G`` different nodes. Most failures of a large job
take down one GPU or one host (the Llama 3 report, Dubey et al. 2024, section 3.3.4 and Table 5:
466 interruptions in 54 days on 16,384 GPUs; of the 419 unexpected ones about 78% were hardware
faults of a GPU or its host, network switches and cables 8.4%; a software crash leaves node
memory intact too). Those restart from memory in seconds; the rest — more nodes lost than the
protection covers — fall back to the persistent checkpoint, which can then be taken rarely.

The model (first order, like Young/Daly). Costs: a memory snapshot stalls training for
``C_m = held bytes per rank / memory bandwidth x blocking fraction``, a persistent checkpoint for
``C_p = save time x blocking fraction``. A share ``q`` of failures is recoverable from memory
(restart ``R_m``), the rest from the persistent tier (restart ``R_p``). A failure loses on
average half an interval of its tier plus that tier's restart, so for intervals
``(tau_m, tau_p)`` the expected goodput is

    1 - C_m / tau_m - C_p / tau_p - [q (tau_m / 2 + R_m) + (1 - q) (tau_p / 2 + R_p)] / MTBF

The expression separates into one Young/Daly problem per tier, each concave in its interval, so
the maximum is ``tau_m = sqrt(2 C_m MTBF / q)`` and ``tau_p = sqrt(2 C_p MTBF / (1 - q))``; each is
raised to its tier's whole write time when shorter (one snapshot or save in flight at a time, so a
shorter interval would only queue them; by concavity the raised value is the constrained maximum).
Edges: ``q = 0`` leaves nothing for the memory tier to do (no snapshots, persistent-only plan);
``q = 1`` makes persistent checkpoints unnecessary against failures (an infinite interval here;
keep them for rollbacks and the end of the run). Assumptions: failures arrive as a Poisson
process at the job's MTBF; a memory-recoverable failure restores from the newest snapshot
(ignoring the rare case where a persistent checkpoint is newer); replication or parity traffic
runs in the background and finishes within ``tau_m``; one snapshot is kept per rank.

Memory held is not the bytes written: the persistent checkpoint writes replicated weights once,
but in memory every data-parallel replica snapshots its own state, replicated weights included,
so host memory is sized from each rank's *held* bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ckptkit.errors import OptionsError
from ckptkit.resilience.planner import (
    GB, MASTER, MOMENTS, WEIGHT, Plan, check_failure_figures, plan,
)

GIB = 2**30


@dataclass(frozen=True)
class MemoryTierPlanOptions:
    """The memory tier to plan for, and the failure figures that decide what it is worth.

    ``replicas`` (copies of each rank's snapshot on other nodes) and ``parity`` (XOR parity over
    groups of that many ranks on as many nodes) exclude each other; neither means one replica, as
    ``ckptkit.MemoryTier`` defaults. ``memory_gbps``: per-rank copy bandwidth into node memory.
    ``node_failure_share``: the share of failures that take down at most one node per protection
    group and so restore from memory (0.9 by default: the module docstring gives the evidence).
    ``restart_seconds``: restart cost when the state comes from memory (processes, process
    groups and model still start again; only the load is fast)."""

    replicas: int | None = None
    parity: int | None = None
    ranks_per_node: int = 8
    memory_gbps: float = 10.0
    node_failure_share: float = 0.9
    restart_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.replicas is not None and self.parity is not None:
            raise OptionsError("the memory tier takes replicas or parity, not both")
        if self.replicas is not None and self.replicas < 1:
            raise OptionsError(f"memory replicas must be >= 1 (a copy on another node), not {self.replicas}")
        if self.parity is not None and self.parity < 2:
            raise OptionsError(f"a parity group spans >= 2 nodes, not {self.parity}")
        if self.ranks_per_node < 1:
            raise OptionsError(f"ranks_per_node must be >= 1, not {self.ranks_per_node}")
        if not self.memory_gbps > 0:
            raise OptionsError(f"memory_gbps must be positive, not {self.memory_gbps}")
        if not 0 <= self.node_failure_share <= 1:
            raise OptionsError(f"node_failure_share must be in [0, 1], not {self.node_failure_share}")
        if not self.restart_seconds >= 0:
            raise OptionsError(f"the memory restart must be >= 0 s, not {self.restart_seconds}")

    @property
    def copies(self) -> int:
        """Replicas on other nodes (1 when neither replicas nor parity was given)."""
        return 0 if self.parity is not None else (self.replicas or 1)

    @property
    def overhead(self) -> float:
        """Extra host memory per byte of snapshot: the replicas, or the parity's 1/(G-1) (RAID-5
        style: each node holds 1/(G-1) of a parity block so that any one of the G nodes may go)."""
        return 1 / (self.parity - 1) if self.parity is not None else float(self.copies)

    def overhead_text(self) -> str:
        return f"1/{self.parity - 1}" if self.parity is not None else str(self.copies)

    def protection(self) -> str:
        if self.parity is not None:
            return f"XOR parity over groups of {self.parity} ranks on {self.parity} nodes (one node per group may go)"
        n = self.copies
        if n == 1:
            return "1 replica on another node (one node may go)"
        return f"{n} replicas on other nodes ({n} nodes may go)"


def held_bytes_per_rank(params: float, tp: int, pp: int, dp: int, zero: int) -> float:
    """Bytes of training state one rank holds (and so snapshots into memory): its model-parallel
    share of the weights and optimizer state, divided over data parallelism only where ZeRO
    shards it (stage >= 1: optimizer state; stage 3: weights too). Unlike the bytes it writes
    to a persistent checkpoint, replicated weights count on every replica."""
    if min(tp, pp, dp) < 1 or params <= 0 or zero not in (0, 1, 2, 3):
        raise OptionsError("params must be positive, degrees >= 1, zero in 0..3")
    mp = tp * pp
    weights = params * WEIGHT / mp / (dp if zero == 3 else 1)
    optimizer = params * (MASTER + MOMENTS) / mp / (dp if zero >= 1 else 1)
    return weights + optimizer


def tier_interval(cost_s: float, mtbf_s: float, share: float, floor_s: float = 0.0) -> float:
    """The interval of one tier that serves ``share`` of the failures: ``sqrt(2 C MTBF / share)``,
    at least ``floor_s`` (its write time); infinite when the tier serves no failure."""
    if cost_s <= 0 or mtbf_s <= 0 or not 0 <= share <= 1:
        raise OptionsError("cost and MTBF must be positive, share in [0, 1]")
    if share == 0:
        return math.inf
    return max(math.sqrt(2 * cost_s * mtbf_s / share), floor_s)


def _tier_loss(interval_s: float, cost_s: float, mtbf_s: float, share: float, restart_s: float) -> float:
    """One tier's share of lost time: its stalls plus, for the failures it serves, half an interval and a restart."""
    if share == 0:
        return 0.0 if math.isinf(interval_s) else cost_s / interval_s
    stalls = 0.0 if math.isinf(interval_s) else cost_s / interval_s
    return stalls + share * (interval_s / 2 + restart_s) / mtbf_s


def two_tier_goodput(memory_interval_s: float, persistent_interval_s: float, memory_cost_s: float,
                     persistent_cost_s: float, mtbf_s: float, memory_share: float, memory_restart_s: float,
                     persistent_restart_s: float) -> float:
    """Expected goodput of the two tiers (the module docstring's expression, clamped at 0).
    An infinite interval means the tier never runs: free when it serves no failure."""
    loss = (_tier_loss(memory_interval_s, memory_cost_s, mtbf_s, memory_share, memory_restart_s)
            + _tier_loss(persistent_interval_s, persistent_cost_s, mtbf_s, 1 - memory_share, persistent_restart_s))
    return max(0.0, 1 - loss)


@dataclass(frozen=True)
class TwoTierPlan:
    """Both intervals, what they cost and buy, and the host memory the tier needs.

    ``persistent_only`` is the plan without a memory tier, for comparison."""

    persistent_only: Plan
    memory: MemoryTierPlanOptions
    ranks: int
    held_per_rank: float
    memory_copy_seconds: float
    memory_cost_seconds: float
    persistent_cost_seconds: float
    memory_interval_seconds: float  # inf: no failure is recoverable from memory
    persistent_interval_seconds: float  # inf: every failure is
    goodput: float
    mtbf_seconds: float
    notes: tuple[str, ...] = field(default=())

    @property
    def nodes(self) -> int:
        return math.ceil(self.ranks / self.memory.ranks_per_node)

    @property
    def host_memory_per_node(self) -> float:
        """Snapshots of a node's ranks plus its share of the protection (replicas or parity)."""
        # two steps at the peak: the newest complete snapshot stays until the next one is protected
        return 2 * min(self.memory.ranks_per_node, self.ranks) * self.held_per_rank * (1 + self.memory.overhead)

    def lines(self) -> list[str]:
        p, m = self.persistent_only, self.memory
        q = m.node_failure_share
        return [
            *p.lines()[:3],
            f"memory tier: {m.protection()}; {self.nodes:,} nodes x {m.ranks_per_node} ranks",
            f"state held per rank: {self.held_per_rank / GIB:,.2f} GiB (its own state: every data-parallel "
            "replica holds its weights, which the checkpoint writes once)",
            f"host memory per node: 2 steps x {min(m.ranks_per_node, self.ranks)} ranks x "
            f"{self.held_per_rank / GIB:,.2f} GiB x (1 + {m.overhead_text()}) = {self.host_memory_per_node / GIB:,.1f} GiB "
            "(the newest complete snapshot stays until the next one is protected)",
            f"memory snapshot: {self.memory_copy_seconds:,.2f} s at {m.memory_gbps:g} GB/s, "
            f"blocking {self.memory_cost_seconds:,.2f} s, {_every(self.memory_interval_seconds)}",
            f"persistent checkpoint: blocking {self.persistent_cost_seconds:,.1f} s, "
            f"{_every(self.persistent_interval_seconds)}",
            f"expected goodput: {100 * self.goodput:.1f}% ({100 * q:g}% of failures restore from memory, restart "
            f"{m.restart_seconds:,.0f} s; the rest from the persistent tier, restart {p.restart_seconds:,.0f} s)",
            f"persistent only: {100 * p.goodput:.1f}% checkpointing every {p.interval_seconds / 60:,.1f} min; "
            f"the memory tier adds {100 * (self.goodput - p.goodput):.1f} points",
            *self.notes,
        ]


def _every(interval_s: float) -> str:
    if math.isinf(interval_s):
        return "never needed against failures in this model"
    return f"every {interval_s / 60:,.1f} min" if interval_s >= 60 else f"every {interval_s:,.0f} s"


def plan_tiers(params: float, tp: int, pp: int, dp: int, zero: int, *, mtbf_hours: float,
               write_gbps: float | None = None, fs_gbps: float | None = None, restart_seconds: float = 300.0,
               blocking_fraction: float = 1.0, memory: MemoryTierPlanOptions | None = None) -> TwoTierPlan:
    """Plan a memory tier in front of persistent checkpoints: both intervals and the goodput they
    give, next to the persistent-only :func:`~ckptkit.resilience.plan` of the same job. The
    arguments are :func:`plan`'s; ``restart_seconds`` is the restart from the persistent tier and
    ``blocking_fraction`` applies to both tiers' writes (asynchronous snapshots stall for a share)."""
    memory = memory if memory is not None else MemoryTierPlanOptions()
    check_failure_figures(mtbf_hours, restart_seconds, blocking_fraction)
    base = plan(params, tp, pp, dp, zero, write_gbps, mtbf_hours, restart_seconds, blocking_fraction, fs_gbps=fs_gbps)
    ranks = tp * pp * dp
    _check_fits(memory, ranks)
    held = held_bytes_per_rank(params, tp, pp, dp, zero)
    copy_s = held / (memory.memory_gbps * GB)
    c_m, c_p = max(copy_s * blocking_fraction, 1e-3), max(base.save_seconds * blocking_fraction, 1e-3)
    mtbf, q = mtbf_hours * 3600, memory.node_failure_share
    tau_m = tier_interval(c_m, mtbf, q, copy_s)
    tau_p = tier_interval(c_p, mtbf, 1 - q, base.save_seconds)
    value = two_tier_goodput(tau_m, tau_p, c_m, c_p, mtbf, q, memory.restart_seconds, restart_seconds)
    notes = ["persistent checkpoints: keep some for rollbacks and the end of the run"] if q == 1 else []
    if q == 0:
        notes.append("no failure restores from memory (node_failure_share 0): the memory tier buys nothing")
    return TwoTierPlan(base, memory, ranks, held, copy_s, c_m, c_p, tau_m, tau_p, value, mtbf, tuple(notes))


def _check_fits(memory: MemoryTierPlanOptions, ranks: int) -> None:
    """The protection needs that many other nodes: a replica or a parity group member per node."""
    nodes = math.ceil(ranks / memory.ranks_per_node)
    if memory.parity is not None and memory.parity > nodes:
        raise OptionsError(f"a parity group of {memory.parity} needs {memory.parity} nodes; "
                           f"{ranks:,} ranks at {memory.ranks_per_node} per node make {nodes}")
    if memory.parity is None and memory.copies > nodes - 1:
        raise OptionsError(f"{memory.copies} memory replica(s) need {memory.copies + 1} nodes; "
                           f"{ranks:,} ranks at {memory.ranks_per_node} per node make {nodes}")


__all__ = ["MemoryTierPlanOptions", "TwoTierPlan", "held_bytes_per_rank", "plan_tiers", "tier_interval",
           "two_tier_goodput"]
