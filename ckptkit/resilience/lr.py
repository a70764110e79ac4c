"""Learning-rate re-warm and drops on top of any scheduler.

:class:`ScaledLR` wraps a ``torch.optim.lr_scheduler`` (or anything with
``step()`` and ``get_last_lr()``, e.g. a Megatron-style scheduler adapted to
that interface) and multiplies the scheduled learning rate by the
controller's factor: the post-rollback re-warm ramp and any permanent drops.
Before each scheduler step it puts the scheduler's own values back, so
chainable schedulers (``ExponentialLR`` and friends, which read the current
``lr``) never compound the factor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ScaledLR:
    def __init__(self, scheduler: Any, optimizer: Any, factor: Callable[[], float]) -> None:
        self.scheduler = scheduler
        self.optimizer = optimizer
        self.factor = factor
        self._apply()

    def _scheduled(self) -> list[float]:
        return list(self.scheduler.get_last_lr())

    def _apply(self) -> None:
        f = self.factor()
        for group, lr in zip(self.optimizer.param_groups, self._scheduled()):
            group["lr"] = lr * f

    def step(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self._scheduled()):
            group["lr"] = lr  # undo our factor before the scheduler looks
        self.scheduler.step()
        self._apply()

    def refresh(self) -> None:
        """Re-apply the factor now: after a rollback, or after ``ctl.resume`` (which may have taken a
        re-warm or a lowered LR from the incident log that the optimizer's saved ``lr`` predates)."""
        self._apply()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)
        self._apply()
