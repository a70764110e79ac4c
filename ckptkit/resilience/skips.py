"""Skipped data as absolute sample ranges.

A range ``[start, end)`` names positions in the run's data stream — the
sample counter that keeps counting through skips — never positions relative
to earlier skips. Recorded that way in every later checkpoint (and in the
incident log), it means the same samples after any number of restarts.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class SkipRanges:
    ranges: list[tuple[int, int]] = field(default_factory=list)  # sorted, disjoint, non-adjacent

    def add(self, start: int, end: int) -> None:
        if end <= start:
            return
        merged = []
        for a, b in self.ranges:
            if b < start or a > end:
                merged.append((a, b))
            else:
                start, end = min(a, start), max(b, end)
        merged.append((start, end))
        self.ranges = sorted(merged)

    def update(self, other: SkipRanges) -> None:
        for a, b in other.ranges:
            self.add(a, b)

    def contains(self, sample: int) -> bool:
        i = bisect.bisect_right(self.ranges, (sample, float("inf"))) - 1
        return i >= 0 and self.ranges[i][0] <= sample < self.ranges[i][1]

    def next_batch_start(self, sample: int, batch: int) -> int:
        """The first position >= ``sample`` whose batch ``[p, p + batch)`` touches no skipped sample."""
        while True:
            hit = next(((a, b) for a, b in self.ranges if a < sample + batch and sample < b), None)
            if hit is None:
                return sample
            sample = hit[1]

    @property
    def skipped(self) -> int:
        return sum(b - a for a, b in self.ranges)

    def to_json(self) -> list[list[int]]:
        return [[a, b] for a, b in self.ranges]

    @staticmethod
    def from_json(value: object) -> SkipRanges:
        out = SkipRanges()
        if isinstance(value, list):
            for item in value:
                if isinstance(item, (list, tuple)) and len(item) == 2:
                    out.add(int(item[0]), int(item[1]))
        return out
