"""Resilience: spike detection and the escalation ladder, preemption, restarts, the interval planner.

The pure parts (detectors, ladder, skip ranges, planner) import no torch.
"""

from ckptkit.resilience.detectors import DetectorConfig, SpikeDetector
from ckptkit.resilience.ladder import Decision, Flags, Ladder
from ckptkit.resilience.planner import Plan, SaveTime, checkpoint_size, goodput, plan, save_time, young_daly_interval
from ckptkit.resilience.policy import LowerLR, Rewarm, Rollback, SkipStep, SpikePolicy
from ckptkit.resilience.skips import SkipRanges
from ckptkit.resilience.tier_planner import (
    MemoryTierPlanOptions, TwoTierPlan, held_bytes_per_rank, plan_tiers, two_tier_goodput,
)



def __getattr__(name: str) -> object:
    """``load_report`` / ``plot`` (``ckptkit report``) load on first use: the report reads run folders
    and may import matplotlib, which a training job never needs."""
    if name in ("load_report", "plot"):
        from ckptkit.resilience import report

        return getattr(report, name)
    raise AttributeError(f"module 'ckptkit.resilience' has no attribute {name!r}")


__all__ = [
    "load_report", "plot",
    "DetectorConfig", "SpikeDetector", "Decision", "Flags", "Ladder", "checkpoint_size", "goodput", "plan",
    "young_daly_interval", "Plan", "SaveTime", "save_time", "MemoryTierPlanOptions", "TwoTierPlan",
    "held_bytes_per_rank", "plan_tiers", "two_tier_goodput", "SpikePolicy", "SkipStep", "Rollback", "Rewarm", "LowerLR", "SkipRanges",
]
