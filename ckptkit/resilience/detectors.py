"""Spike detection by robust statistics over a sliding window.

A training signal (loss, gradient norm) is a spike when it is non-finite, or
when it exceeds the centre of the recent window by ``k`` times its spread:
``mean + k * std`` (``method="sigma"``, OLMo-core's rule) or
``median + k * 1.4826 * MAD`` (``method="mad"``, robust to earlier outliers in
the window). Nothing is flagged during a warm-up, and spikes are not added to
the window, so a run of bad steps does not teach the detector that bad is
normal. Pure Python, no torch.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal

from ckptkit.errors import OptionsError


@dataclass(frozen=True)
class DetectorConfig:
    """When one signal counts as a spike."""

    window: int = 128
    warmup: int = 32
    k: float = 6.0
    method: Literal["sigma", "mad"] = "sigma"
    min_relative: float = 0.0  # also require value > centre * (1 + min_relative)

    def __post_init__(self) -> None:
        if self.window < 4 or self.warmup < 2 or self.warmup > self.window:
            raise OptionsError(f"detector needs 4 <= window and 2 <= warmup <= window, got {self.window}/{self.warmup}")
        if self.k <= 0:
            raise OptionsError(f"detector k must be positive, got {self.k}")
        if self.method not in ("sigma", "mad"):
            raise OptionsError(f"detector method must be 'sigma' or 'mad', got {self.method!r}")


@dataclass(frozen=True)
class Verdict:
    spike: bool
    reason: str  # "", "nonfinite", "spike"
    value: float
    centre: float
    threshold: float


class SpikeDetector:
    """Feeds on one value per step; says whether it is a spike."""

    def __init__(self, config: DetectorConfig = DetectorConfig()) -> None:
        self.config = config
        self.window: deque[float] = deque(maxlen=config.window)

    def threshold(self) -> tuple[float, float]:
        """The window's centre and the spike threshold (inf during warm-up)."""
        values = list(self.window)
        if len(values) < self.config.warmup:
            return (values[-1] if values else math.nan), math.inf
        if self.config.method == "sigma":
            n = len(values)
            centre = math.fsum(values) / n
            spread = math.sqrt(max(0.0, math.fsum((v - centre) ** 2 for v in values) / n))
        else:
            centre = statistics.median(values)
            spread = 1.4826 * statistics.median(abs(v - centre) for v in values)
        spread = max(spread, 1e-12 * max(1.0, abs(centre)))
        limit = centre + self.config.k * spread
        if self.config.min_relative:
            limit = max(limit, centre + abs(centre) * self.config.min_relative)
        return centre, limit

    def observe(self, value: float) -> Verdict:
        value = float(value)
        centre, limit = self.threshold()
        if not math.isfinite(value):
            return Verdict(True, "nonfinite", value, centre, limit)
        if value > limit:
            return Verdict(True, "spike", value, centre, limit)
        self.window.append(value)
        return Verdict(False, "", value, centre, limit)

    def state_dict(self) -> dict:
        return {"window": list(self.window)}

    def load_state_dict(self, state: dict) -> None:
        self.window = deque((float(v) for v in state.get("window", [])), maxlen=self.config.window)
