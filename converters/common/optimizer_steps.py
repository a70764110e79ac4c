"""What an imported optimizer's step may be: the one rule every importer that records the step checks.

Adam's step counts the updates made; its bias correction divides by ``1 - beta ** step``. A step that is NaN,
infinite, negative or fractional is never one a training run saved: it is a damaged optimizer state, and a
resume from it runs Adam's update on it (NaN losses from the first step). The Megatron and DeepSpeed imports
refuse one, each naming its own file.
"""

from __future__ import annotations

import math
from typing import Any


def is_step_count(value: Any) -> bool:
    """Whether ``value`` (a plain number) is a count of steps: a finite whole number >= 0."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value >= 0 and value == int(value))
