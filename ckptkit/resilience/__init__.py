"""Resilience: spike detection and the escalation ladder, preemption, restarts, the interval planner.

The pure parts (detectors, ladder, skip ranges, planner) import no torch.
"""

from ckptkit.resilience.detectors import DetectorConfig, SpikeDetector
from ckptkit.resilience.ladder import Decision, Flags, Ladder
from ckptkit.resilience.planner import checkpoint_size, goodput, plan, young_daly_interval
from ckptkit.resilience.policy import LowerLR, Rewarm, Rollback, SkipStep, SpikePolicy
from ckptkit.resilience.skips import SkipRanges

__all__ = [
    "DetectorConfig", "SpikeDetector", "Decision", "Flags", "Ladder", "checkpoint_size", "goodput", "plan",
    "young_daly_interval", "SpikePolicy", "SkipStep", "Rollback", "Rewarm", "LowerLR", "SkipRanges",
]
