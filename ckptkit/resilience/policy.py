"""Spike policies: detectors plus an escalation ladder, with published presets.

A :class:`SpikePolicy` is one small frozen dataclass per rung, composed:

    SpikePolicy(
        loss=DetectorConfig(...), grad_norm=DetectorConfig(...),   # detection, per signal (None: off)
        skip_step=SkipStep(on_spike=True),                          # rung 1
        rollback=Rollback(after_spikes=3, steps_before=50,          # rung 2 (None: never roll back)
                          skip_before=10, skip_after=50),
        rewarm=Rewarm(factor=0.1, steps=100),                       # rung 3 (None: no re-warm)
        lower_lr=LowerLR(max_rollbacks=3, factor=0.5, max_drops=2), # rung 4, then stop
    )

The ladder, rung by rung:

1. :class:`SkipStep`: **skip the optimizer step** of a spiking step
   (gradients from a bad batch never reach the weights). A non-finite step is
   always skipped, whatever this rung says.
2. :class:`Rollback`: after ``after_spikes`` spikes within ``window_steps``
   steps, or ``after_nonfinite`` non-finite steps in a row, **roll back** to
   the newest checkpoint at least ``steps_before`` steps before the episode's
   first spike, and **skip the data** of the steps around it (``skip_before``
   steps before the first spike through ``skip_after`` steps after the last),
   recorded as absolute sample ranges.
3. :class:`Rewarm`: after a rollback, **re-warm the learning rate**: scale it
   from ``factor`` back to 1 over ``steps`` steps.
4. :class:`LowerLR`: after more than ``max_rollbacks`` rollbacks within
   ``window_steps`` steps, **lower the learning rate** permanently by
   ``factor`` (at most ``max_drops`` times), then **stop** with a report.

Presets encode published practice: :meth:`SpikePolicy.palm` (restart ~100
steps before the spike, skip ~200-500 batches), :meth:`SpikePolicy.opt`
(roll back and lower the LR), :meth:`SpikePolicy.olmo` (skip the step when
loss or grad norm exceeds mean + 6 sigma over 128 steps). Change one rung of
a preset with ``dataclasses.replace``::

    p = SpikePolicy.palm()
    p = replace(p, rollback=replace(p.rollback, skip_after=500))

The policy is configuration only: checkpoints and the incident log store the
ladder's *state* (spikes, rollbacks, LR drops, re-warm start), never the
policy, so a run may resume under a changed policy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ckptkit.errors import OptionsError
from ckptkit.resilience.detectors import DetectorConfig


def _at_least(owner: object, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise OptionsError(f"{type(owner).__name__}.{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class SkipStep:
    """Rung 1: skip the optimizer step of a step whose loss or grad norm spikes.

    ``on_spike=False`` only logs spikes (they still count towards a rollback).
    Non-finite steps are skipped either way: their update would write NaN into
    the weights.
    """

    on_spike: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.on_spike, bool):
            raise OptionsError(f"SkipStep.on_spike must be a bool, got {self.on_spike!r}")


@dataclass(frozen=True)
class Rollback:
    """Rung 2: when to roll back, to which checkpoint, and which data to skip.

    Triggered by ``after_spikes`` spikes within ``window_steps`` steps, or by
    ``after_nonfinite`` non-finite steps in a row. Restores the newest
    checkpoint at least ``steps_before`` steps (and at least one) before the
    episode's first spike, and skips the samples from ``skip_before`` steps
    before the first spike through ``skip_after`` steps after the last.

    ``retain``: how many rollbacks in a row (with no checkpoint committed between
    them) the manager's retention keeps the checkpoints for, whatever its
    ``keep`` rules say, so each restores exactly the checkpoint it would with
    nothing ever deleted (``ckptkit.retention.RollbackHold``). A second rollback
    soon after the first, when the replayed steps spike again, goes further back
    than the first restored. The cost: the checkpoints of about
    ``retain * steps_before`` steps before the newest step, plus ``retain``
    more; with saves at least ``steps_before`` steps apart, ``retain`` beyond
    the rules. 0: retention ignores rollbacks, and one may find nothing to restore.
    """

    after_spikes: int = 3
    window_steps: int = 100
    after_nonfinite: int = 2
    steps_before: int = 50
    skip_before: int = 10
    skip_after: int = 50
    retain: int = 2

    def __post_init__(self) -> None:
        _at_least(self, 1, "after_spikes", "window_steps", "after_nonfinite")
        _at_least(self, 0, "steps_before", "skip_before", "skip_after", "retain")


@dataclass(frozen=True)
class Rewarm:
    """Rung 3: after a rollback, scale the learning rate from ``factor`` back to 1 over ``steps`` steps."""

    factor: float = 0.1
    steps: int = 100

    def __post_init__(self) -> None:
        if not isinstance(self.factor, (int, float)) or not 0 < self.factor <= 1:
            raise OptionsError(f"Rewarm.factor must be in (0, 1], got {self.factor!r}")
        _at_least(self, 1, "steps")


@dataclass(frozen=True)
class LowerLR:
    """Rung 4: too many rollbacks lower the learning rate for good; too many drops stop the run.

    More than ``max_rollbacks`` rollbacks within ``window_steps`` steps: the
    rollback also multiplies the learning rate by ``factor`` for the rest of
    the run, at most ``max_drops`` times; the next such rollback stops the run
    for a human instead. ``on_every_rollback`` lowers it on every rollback
    (OPT-175B's practice), also at most ``max_drops`` times: later rollbacks keep the rate.
    """

    max_rollbacks: int = 3
    window_steps: int = 2000
    factor: float = 0.5
    max_drops: int = 2
    on_every_rollback: bool = False

    def __post_init__(self) -> None:
        _at_least(self, 1, "max_rollbacks", "window_steps")
        _at_least(self, 0, "max_drops")
        if not isinstance(self.factor, (int, float)) or not 0 < self.factor < 1:
            raise OptionsError(f"LowerLR.factor must be in (0, 1), got {self.factor!r}")
        if not isinstance(self.on_every_rollback, bool):
            raise OptionsError(f"LowerLR.on_every_rollback must be a bool, got {self.on_every_rollback!r}")


_RUNGS: dict[str, tuple[type, bool]] = {  # field -> (its type, whether None switches the rung off)
    "loss": (DetectorConfig, True),
    "grad_norm": (DetectorConfig, True),
    "skip_step": (SkipStep, False),
    "rollback": (Rollback, True),
    "rewarm": (Rewarm, True),
    "lower_lr": (LowerLR, False),
}

@dataclass(frozen=True)
class SpikePolicy:
    """Detection per signal plus the four rungs of the ladder (see the module docstring)."""

    loss: DetectorConfig | None = DetectorConfig()
    grad_norm: DetectorConfig | None = DetectorConfig()
    skip_step: SkipStep = SkipStep()
    rollback: Rollback | None = Rollback()
    rewarm: Rewarm | None = Rewarm()
    lower_lr: LowerLR = LowerLR()

    def __post_init__(self) -> None:
        for name, (kind, optional) in _RUNGS.items():
            value = getattr(self, name)
            if not (isinstance(value, kind) or (optional and value is None)):
                raise OptionsError(f"SpikePolicy({name}=...) takes a {kind.__name__}{' or None' if optional else ''}, "
                                   f"got {type(value).__name__} {value!r}")

    @staticmethod
    def palm(**overrides: Any) -> SpikePolicy:
        """PaLM: on a spike, restart ~100 steps earlier and skip ~200-500 batches around it."""
        base = SpikePolicy(skip_step=SkipStep(on_spike=False),
                           rollback=Rollback(after_spikes=1, steps_before=100, skip_before=100, skip_after=200),
                           rewarm=None)
        return replace(base, **overrides)

    @staticmethod
    def opt(**overrides: Any) -> SpikePolicy:
        """OPT-175B: roll back to the last checkpoint before the spike and lower the learning rate."""
        base = SpikePolicy(skip_step=SkipStep(on_spike=False),
                           rollback=Rollback(after_spikes=1, steps_before=0, skip_before=0, skip_after=0),
                           rewarm=None, lower_lr=LowerLR(factor=0.7, on_every_rollback=True))
        return replace(base, **overrides)

    @staticmethod
    def olmo(**overrides: Any) -> SpikePolicy:
        """OLMo-core: skip the step when loss or grad norm > mean + 6 sigma over the last 128 steps."""
        det = DetectorConfig(window=128, warmup=20, k=6.0, method="sigma")
        base = SpikePolicy(loss=det, grad_norm=det, skip_step=SkipStep(on_spike=True), rollback=None)
        return replace(base, **overrides)
