"""Spike policies: detectors plus an escalation ladder, with published presets.

The ladder, rung by rung (each configurable, each can be switched off):

1. **skip the optimizer step** of a spiking step (gradients from a bad batch
   never reach the weights);
2. **roll back** to the newest checkpoint at least ``rollback_before`` steps
   before the episode's first spike, and **skip the data** of the steps
   around it (``skip_before`` steps before the first spike through
   ``skip_after`` steps after the last), recorded as absolute sample ranges;
   triggered by ``rollback_after`` spikes within ``window_steps`` steps, or
   by ``nonfinite_rollback`` non-finite steps in a row;
3. **re-warm the learning rate** after a rollback: scale it from
   ``rewarm_factor`` back to 1 over ``rewarm_steps`` steps;
4. after ``max_rollbacks`` rollbacks within ``rollback_window`` steps,
   **lower the learning rate** permanently by ``lr_factor`` (at most
   ``max_lr_drops`` times), then **stop** with a report.

Presets encode published practice: :meth:`SpikePolicy.palm` (restart ~100
steps before the spike, skip ~200-500 batches), :meth:`SpikePolicy.opt`
(roll back and lower the LR), :meth:`SpikePolicy.olmo` (skip the step when
loss or grad norm exceeds mean + 6 sigma over 128 steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ckptkit.resilience.detectors import DetectorConfig


@dataclass(frozen=True)
class SpikePolicy:
    loss: DetectorConfig | None = field(default_factory=DetectorConfig)
    grad_norm: DetectorConfig | None = field(default_factory=DetectorConfig)
    skip_step: bool = True
    rollback_after: int | None = 3
    window_steps: int = 100
    nonfinite_rollback: int = 2
    rollback_before: int = 50
    skip_before: int = 10
    skip_after: int = 50
    rewarm_factor: float = 0.1
    rewarm_steps: int = 100
    lower_lr_on_rollback: bool = False
    max_rollbacks: int = 3
    rollback_window: int = 2000
    lr_factor: float = 0.5
    max_lr_drops: int = 2

    def __post_init__(self) -> None:
        if self.rollback_after is not None and self.rollback_after < 1:
            raise ValueError("rollback_after must be >= 1 (or None to never roll back)")
        if not 0 < self.rewarm_factor <= 1 or not 0 < self.lr_factor < 1:
            raise ValueError("rewarm_factor must be in (0, 1] and lr_factor in (0, 1)")
        for name in ("window_steps", "nonfinite_rollback", "max_rollbacks", "rollback_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("rollback_before", "skip_before", "skip_after", "rewarm_steps", "max_lr_drops"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")

    @staticmethod
    def palm(**overrides: object) -> SpikePolicy:
        """PaLM: on a spike, restart ~100 steps earlier and skip ~200-500 batches around it."""
        base = SpikePolicy(skip_step=False, rollback_after=1, rollback_before=100, skip_before=100, skip_after=200,
                           rewarm_factor=1.0, rewarm_steps=0)
        return replace(base, **overrides)  # type: ignore[arg-type]

    @staticmethod
    def opt(**overrides: object) -> SpikePolicy:
        """OPT-175B: roll back to the last checkpoint before the spike and lower the learning rate."""
        base = SpikePolicy(skip_step=False, rollback_after=1, rollback_before=0, skip_before=0, skip_after=0,
                           rewarm_factor=1.0, rewarm_steps=0, lower_lr_on_rollback=True, lr_factor=0.7)
        return replace(base, **overrides)  # type: ignore[arg-type]

    @staticmethod
    def olmo(**overrides: object) -> SpikePolicy:
        """OLMo-core: skip the step when loss or grad norm > mean + 6 sigma over the last 128 steps."""
        det = DetectorConfig(window=128, warmup=20, k=6.0, method="sigma")
        base = SpikePolicy(loss=det, grad_norm=det, skip_step=True, rollback_after=None)
        return replace(base, **overrides)  # type: ignore[arg-type]
