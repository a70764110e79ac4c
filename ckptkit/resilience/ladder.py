"""The escalation ladder as a pure state machine (no torch, no I/O).

Per step: :meth:`Ladder.detect` runs the detectors on the values the
controller agreed across ranks (the largest any rank saw) and returns four
flags; :meth:`Ladder.decide` turns them into a decision. The
same inputs give the same decisions on every rank, and the state round-trips
through JSON so a restarted run continues the same ladder.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Literal

from ckptkit.resilience.detectors import SpikeDetector
from ckptkit.resilience.policy import SpikePolicy


@dataclass(frozen=True)
class Flags:
    loss_spike: bool = False
    loss_nonfinite: bool = False
    grad_spike: bool = False
    grad_nonfinite: bool = False

    @property
    def nonfinite(self) -> bool:
        return self.loss_nonfinite or self.grad_nonfinite

    @property
    def any(self) -> bool:
        return self.loss_spike or self.grad_spike or self.nonfinite

    def describe(self) -> str:
        parts = []
        if self.loss_nonfinite:
            parts.append("non-finite loss")
        elif self.loss_spike:
            parts.append("loss spike")
        if self.grad_nonfinite:
            parts.append("non-finite grad norm")
        elif self.grad_spike:
            parts.append("grad-norm spike")
        return ", ".join(parts)


@dataclass(frozen=True)
class Decision:
    kind: Literal["ok", "skip_step", "rollback", "stop"]
    reason: str = ""
    restore_at_most: int | None = None  # roll back to the newest checkpoint with step <= this
    skip: tuple[int, int] | None = None  # absolute sample range to skip from now on
    lower_lr: bool = False
    spike_steps: tuple[int, ...] = ()

    @property
    def skip_step(self) -> bool:
        return self.kind in ("skip_step", "rollback")


class Ladder:
    def __init__(self, policy: SpikePolicy = SpikePolicy()) -> None:
        self.policy = policy
        self.loss = SpikeDetector(policy.loss) if policy.loss is not None else None
        self.grad = SpikeDetector(policy.grad_norm) if policy.grad_norm is not None else None
        self.spikes: deque[int] = deque()
        self.nonfinite_run = 0
        self.samples: OrderedDict[int, tuple[int, int]] = OrderedDict()
        r = policy.rollback
        self._keep = (max(r.window_steps, r.skip_before, r.steps_before) if r is not None else 0) + 8
        self.rollbacks: list[int] = []
        self.lr_drops = 0
        self.rewarm_from: int | None = None

    # ----------------------------------------------------------- per step
    def detect(self, loss: float | None, grad_norm: float | None) -> Flags:
        lv = self.loss.observe(loss) if self.loss is not None and loss is not None else None
        gv = self.grad.observe(grad_norm) if self.grad is not None and grad_norm is not None else None
        return Flags(
            loss_spike=bool(lv and lv.reason == "spike"),
            loss_nonfinite=bool(lv and lv.reason == "nonfinite"),
            grad_spike=bool(gv and gv.reason == "spike"),
            grad_nonfinite=bool(gv and gv.reason == "nonfinite"),
        )

    def decide(self, step: int, samples: tuple[int, int] | None, flags: Flags) -> Decision:
        p, r = self.policy, self.policy.rollback
        if samples is not None:
            self.samples[step] = samples
            while len(self.samples) > self._keep:
                self.samples.popitem(last=False)
        window = r.window_steps if r is not None else 100  # without rung 2 the episode only shows in the log
        while self.spikes and self.spikes[0] <= step - window:
            self.spikes.popleft()
        if not flags.any:
            self.nonfinite_run = 0
            return Decision("ok")
        self.spikes.append(step)
        self.nonfinite_run = self.nonfinite_run + 1 if flags.nonfinite else 0
        reason = f"{flags.describe()} at step {step}"
        wants_rollback = r is not None and (
            len(self.spikes) >= r.after_spikes or self.nonfinite_run >= r.after_nonfinite
        )
        if not wants_rollback:
            if p.skip_step.on_spike or flags.nonfinite:
                return Decision("skip_step", reason, spike_steps=(step,))
            return Decision("ok", reason, spike_steps=(step,))
        return self._rollback(step, reason)

    def _rollback(self, step: int, reason: str) -> Decision:
        r, low = self.policy.rollback, self.policy.lower_lr
        assert r is not None
        first = self.spikes[0]
        recent = [s for s in self.rollbacks if s > step - low.window_steps] + [step]
        # on_every_rollback (OPT's practice) lowers it at every rollback, and still at most max_drops
        # times: it used to lower it at every one, without bound when the rollbacks were spread out
        lower = low.on_every_rollback and self.lr_drops < low.max_drops
        if len(recent) > low.max_rollbacks:
            if self.lr_drops >= low.max_drops:
                return Decision(
                    "stop",
                    f"{reason}: {len(recent)} rollbacks within {low.window_steps} steps after lowering the "
                    f"learning rate {self.lr_drops} times; stopping for a human",
                    spike_steps=tuple(self.spikes),
                )
            lower = True
        skip = self._skip_range(first, step)
        restore = first - max(r.steps_before, 1)
        return Decision("rollback", reason, restore, skip, lower, tuple(self.spikes))

    def _skip_range(self, first: int, last: int) -> tuple[int, int] | None:
        r = self.policy.rollback
        assert r is not None
        known = [s for s in self.samples if s >= first - r.skip_before]
        if not known or last not in self.samples:
            return None
        start = self.samples[min(known)][0]
        a, b = self.samples[last]
        end = b + r.skip_after * (b - a)
        return (start, end) if end > start else None

    def rolled_back(self, at_step: int, resumed_step: int, lowered_lr: bool) -> None:
        """The controller restored a checkpoint: the episode is over, re-warm from ``resumed_step``."""
        self.rollbacks.append(at_step)
        self.spikes.clear()
        self.nonfinite_run = 0
        if lowered_lr:
            self.lr_drops += 1
        self.rewarm_from = resumed_step if self.policy.rewarm is not None else None
        self.samples = OrderedDict((s, r) for s, r in self.samples.items() if s <= resumed_step)

    def lr_factor(self, step: int) -> float:
        """Multiplier for the scheduled learning rate at ``step``: permanent drops times the re-warm ramp."""
        factor = self.policy.lower_lr.factor ** self.lr_drops
        rw = self.policy.rewarm
        if self.rewarm_from is not None and rw is not None:
            t = (step - self.rewarm_from) / rw.steps
            if t < 1:
                factor *= rw.factor + (1 - rw.factor) * max(0.0, t)
        return factor

    # ------------------------------------------------------------- state
    @property
    def rollback_count(self) -> int:
        """Rollbacks in this run's history (what a restart compares with the incident log)."""
        return len(self.rollbacks)

    def state_dict(self) -> dict[str, Any]:
        """Everything a restarted run needs to take the same decisions from here on.

        The open episode too (spikes within the window, the run of non-finite
        steps, the sample ranges of recent steps): without them a run restarted
        between two spikes would need ``Rollback.after_spikes`` new ones, and would
        skip a smaller data range than the uninterrupted run.
        """
        return {
            "loss": self.loss.state_dict() if self.loss is not None else None,
            "grad": self.grad.state_dict() if self.grad is not None else None,
            "rollbacks": list(self.rollbacks),
            "lr_drops": self.lr_drops,
            "rewarm_from": self.rewarm_from,
            "spikes": list(self.spikes),
            "nonfinite_run": self.nonfinite_run,
            "samples": [[s, a, b] for s, (a, b) in self.samples.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.loss is not None and isinstance(state.get("loss"), dict):
            self.loss.load_state_dict(state["loss"])
        if self.grad is not None and isinstance(state.get("grad"), dict):
            self.grad.load_state_dict(state["grad"])
        self.rollbacks = [int(s) for s in state.get("rollbacks", [])]
        self.lr_drops = int(state.get("lr_drops", 0))
        rw = state.get("rewarm_from")
        self.rewarm_from = int(rw) if rw is not None else None
        self.spikes = deque(int(s) for s in state.get("spikes") or [])
        self.nonfinite_run = int(state.get("nonfinite_run", 0) or 0)
        if isinstance(state.get("samples"), list):  # absent in states saved before it was kept
            self.samples = OrderedDict((int(s), (int(a), int(b))) for s, a, b in state["samples"])
