"""The resilience controller: spikes, preemption and restarts, handled without a human.

    ctl = ResilienceController(manager, policy=SpikePolicy(), batch_size=B)
    lr = ScaledLR(scheduler, optimizer, ctl.lr_factor)
    start = ctl.resume(state)                              # newest valid checkpoint, skip ranges, LR re-warm
    apply(state); lr.refresh()                             # into the optimizer; the factor on top
    for step, batch in ctl.batches(get_batch, start):      # never yields a recorded bad sample
        loss, grad_norm = forward_backward(batch)
        action = ctl.observe(step, loss=loss, grad_norm=grad_norm)
        if action.rollback:
            action.restore(state); continue                # training state rewound in place
        if not action.skip_step:
            optimizer.step()
        ctl.maybe_save(step, state)
        if ctl.should_stop: break                          # preempted (after an emergency save) or stopped

Every decision is agreed across ranks (one small all-reduce per step: the
largest loss and grad norm any rank saw, and a preemption flag), so all ranks
detect on the same values, skip, roll back, save and stop at the same step,
and save the same controller state. The data
position is an absolute sample counter kept in ``state["resilience"]``, so a
rollback or a restart replays exactly the samples the uninterrupted run would
have seen, minus the skipped ranges. What a rollback changes (skip range,
re-warm, the ladder's memory) is in the incident log the moment it is decided,
with the whole post-rollback state, so a restart from the checkpoint the
rollback restored (saved before it) continues exactly as the run would have;
and rank 0 keeps a progress marker, so a restart knows how many steps the
crash cost.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ckptkit.engine.async_save import SaveHandle
from ckptkit.errors import OptionsError, PreviousSaveFailedError, TrainingStopped
from ckptkit.manager import CheckpointManager
from ckptkit.resilience.incidents import Incident, IncidentLog, IncidentLogOptions
from ckptkit.resilience.ladder import Decision, Ladder
from ckptkit.resilience.planner import young_daly_interval
from ckptkit.resilience.policy import SpikePolicy
from ckptkit.resilience.progress import Progress, ProgressMarker, steps_lost
from ckptkit.resilience.recovery import INTENT, RollbackIntent, missing_rollbacks, unfinished_rollback
from ckptkit.resilience.skips import SkipRanges
from ckptkit.resilience.watchdog import Watchdog
from ckptkit.retention import RollbackHold

log = logging.getLogger("ckptkit")
STATE_KEY = "resilience"


def _signal(value: float | None) -> float:
    """A rank's value of a signal as the all-reduce takes it: -inf for none given (every other rank's
    value wins), +inf for a non-finite one (it wins, and is non-finite after it)."""
    if value is None:
        return -math.inf
    return value if math.isfinite(value) else math.inf


def _is_nan(value: float | None) -> float:
    return 1.0 if value is not None and math.isnan(value) else 0.0


def _value(agreed: float, nan: float) -> float | None:
    """The agreed value of a signal: None if no rank gave one; NaN if a rank's was (logged as such)."""
    if nan > 0:
        return math.nan
    return None if agreed == -math.inf else agreed


@dataclass
class Action:
    """What the training loop should do after :meth:`ResilienceController.observe`."""

    decision: Decision
    restore: Callable[[dict[str, Any]], dict[str, Any]] = field(default=lambda s: s)

    @property
    def skip_step(self) -> bool:
        return self.decision.skip_step

    @property
    def rollback(self) -> bool:
        return self.decision.kind == "rollback"


class ResilienceController:
    def __init__(
        self,
        manager: CheckpointManager,
        policy: SpikePolicy = SpikePolicy(),
        *,
        batch_size: int,
        signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1),
        grace_seconds: float = 60.0,
        watchdog_seconds: float | None = 1800.0,
        mtbf_hours: float | None = None,
        name: str | None = None,
        incident_log: IncidentLogOptions = IncidentLogOptions(),
    ) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise OptionsError(f"batch_size must be an integer >= 1 (samples per step, all ranks together), "
                               f"got {batch_size!r}")
        if not isinstance(policy, SpikePolicy):
            raise OptionsError(f"policy must be a SpikePolicy, got {type(policy).__name__}")
        if not isinstance(incident_log, IncidentLogOptions):
            raise OptionsError(f"incident_log must be IncidentLogOptions(...), got {incident_log!r}")
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise OptionsError(f"name must be a non-empty string (the run's name in reports), got {name!r}")
        self.manager = manager
        self.policy = policy
        self.batch_size = batch_size
        self.grace_seconds = grace_seconds
        self.watchdog_seconds = watchdog_seconds
        self.mtbf_hours = mtbf_hours
        self.name = name  # recorded for `ckptkit report` (default: the checkpoint folder's name)
        self.incident_log = incident_log  # how resume() reads the log (skip_damaged: go on without a damaged record)
        self.ladder = Ladder(policy)
        self.skips = SkipRanges()
        self.step = 0  # last completed step
        self.sample = 0  # next sample position in the data stream (absolute)
        self.log = IncidentLog(manager.root, writer=manager.rank == 0)
        self.progress = ProgressMarker(manager.root, writer=manager.rank == 0)
        self.should_stop = False
        self._closed = False
        self._current: tuple[int, int] | None = None
        self._entering: tuple[int, int] | None = None  # (step, marker version) of the step under way
        self._pending: list[tuple[int, dict[str, Any]]] = []  # (restored step, ladder state) to adopt there
        self._preempted_at: float | None = None
        self._preempt_agreed = False
        self._save_costs: list[float] = []
        self._step_times: list[float] = []
        self._last_observe: float | None = None
        self._previous_handlers: dict[int, Any] = {}
        self._install(signals)
        self._hold_rollback_targets()

    # ------------------------------------------------------------- signals
    def _install(self, signals: tuple[int, ...]) -> None:
        """Handle ``signals``; :meth:`close` puts back the handlers they had (they stayed ours, so a
        SIGTERM after close, during evaluation or export, was noted and ignored: the job never left)."""
        for sig in signals:
            try:
                self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: the caller handles signals itself
                log.warning("ckptkit: cannot install a handler for %s outside the main thread", sig)

    def _on_signal(self, signum: int, frame: Any) -> None:
        # only note the time: ranks agree on it at the next observe(), then all save and stop together
        if self._preempted_at is None:
            self._preempted_at = time.monotonic()

    def preempt(self) -> None:
        """What a SIGTERM/SIGUSR1 does: save at the next step within the grace period, then stop."""
        self._on_signal(signal.SIGTERM, None)

    # -------------------------------------------------------------- state
    def _export(self) -> dict[str, Any]:
        return {"step": self.step, "sample": self.sample, "batch_size": self.batch_size,
                "skips": self.skips.to_json(), "ladder": self.ladder.state_dict()}

    def attach(self, state: dict[str, Any]) -> dict[str, Any]:
        """Put the controller's state (data position, skips, ladder) into ``state[STATE_KEY]``.

        One JSON string, so its inner structure may change between versions
        or policies without making checkpoints fail strict key matching.
        """
        state[STATE_KEY] = json.dumps(self._export())
        return state

    @staticmethod
    def _saved(state: dict[str, Any]) -> dict[str, Any]:
        value = state.get(STATE_KEY)
        try:
            doc = json.loads(value) if isinstance(value, str) else value
        except ValueError:
            doc = None
        return doc if isinstance(doc, dict) else {}

    def _import(self, saved: dict[str, Any]) -> None:
        self.step = int(saved.get("step", 0))
        self.sample = int(saved.get("sample", 0))
        self.skips.update(SkipRanges.from_json(saved.get("skips")))
        if isinstance(saved.get("ladder"), dict):
            self.ladder.load_state_dict(saved["ladder"])

    def resume(self, state: dict[str, Any]) -> int:
        """Restore the newest valid checkpoint into ``state`` (if any); return the next step to run.

        Adds ``state["resilience"]`` (the data position, skip ranges and ladder
        state, saved with every checkpoint). What the incident log knows and
        the checkpoint does not is recovered too: skip ranges, and the state of
        any rollback decided after the checkpoint was saved (its re-warm, the
        ladder's memory of it, a lowered learning rate). A crash is logged as a
        ``restart`` incident with the steps it lost.

        The incident log is read by one rank and broadcast, so every rank resumes with the same
        skip ranges and rollback state. A record the store cannot return raises StorageError on
        every rank; a damaged record raises CorruptCheckpointError naming it, unless the controller
        was made with ``incident_log=IncidentLogOptions(skip_damaged=True)`` (then a warning names it).
        """
        self.attach(state)
        if self.name is not None:
            self.log.write_name(self.name)
        # one rank reads, every rank gets the same records or the same error (before the collective
        # restore; rank 0 writes after it)
        incidents = self.log.read_agreed(self.manager._comm, self.incident_log)
        previous = self.progress.read() if self.log.writer else None  # only rank 0 reports the restart
        for incident in incidents:
            if incident.kind in ("rollback", INTENT) and incident.data.get("skip"):
                a, b = incident.data["skip"]
                self.skips.add(int(a), int(b))
        with Watchdog(self.watchdog_seconds or math.inf, "restoring the newest checkpoint"):
            step = self.manager.restore_latest(state)
            unfinished = self._unfinished_rollback(step, state, incidents)
            if unfinished is not None:  # killed inside a rollback: finish it, from its own checkpoint
                step = self.manager.restore_latest(state, at_most=unfinished.restore_at_most)
        if step is not None:
            self._import(self._saved(state))
            self._recover_rollbacks(step, incidents)
            self.attach(state)
        if unfinished is not None:
            self._pending.clear()
            log.warning("ckptkit: the previous job was killed inside its rollback at step %d; finishing it",
                        unfinished.at)
            self._finish_rollback(unfinished, step, state)
            # the rollback counted the steps it lost and moved the marker back: the crash inside it lost no
            # more (until 2026-12-06 the restart counted them again from the marker read above)
            previous = dataclasses.replace(previous, step=self.step, entering=None) if previous is not None else None
        self._hold_rollback_targets()
        self._note_restart(step, previous)
        if step is None:
            return 1
        log.info("ckptkit: resumed at step %d, sample %d (%d samples in skip ranges)", step, self.sample, self.skips.skipped)
        return step + 1

    def _unfinished_rollback(self, step: int | None, state: dict[str, Any],
                             incidents: list[Incident]) -> RollbackIntent | None:
        """The rollback the previous job was killed inside of, if the newest checkpoint (restored into
        ``state`` as ``step``) predates its outcome: one the rollback may not restore (it is newer
        than the rollback's bound: the abandoned trajectory's) and that knows fewer rollbacks.
        A checkpoint saved after the rollback finished knows it, so a rollback whose outcome record
        alone was lost (a store refusing writes, then a crash) is never done twice."""
        intent = unfinished_rollback(incidents)
        if intent is None or step is None:
            return None
        if step <= intent.restore_at_most:  # the newest is the rollback's own choice: finish it there
            return intent
        known = self._saved(state).get("ladder", {})
        rollbacks = known.get("rollbacks", []) if isinstance(known, dict) else []
        return intent if isinstance(rollbacks, list) and len(rollbacks) < intent.seq else None

    def _recover_rollbacks(self, restored: int, incidents: list[Incident]) -> None:
        """Adopt the state of rollbacks the restored checkpoint predates (see recovery.py)."""
        for rb in missing_rollbacks(incidents, self.ladder.rollback_count):
            self.skips.update(SkipRanges.from_json(rb.state.get("skips")))
            ladder = rb.state.get("ladder")
            if not isinstance(ladder, dict):
                continue
            if rb.restored <= restored:
                if rb.restored < restored:
                    log.warning("ckptkit: checkpoint %d predates the rollback at step %d to step %d but was not "
                                "discarded by it; taking the rollback's state", restored, rb.at, rb.restored)
                self.ladder.load_state_dict(ladder)
            else:  # that rollback's checkpoint is gone: replay to it, then continue as the run did
                self._pending.append((rb.restored, ladder))
            log.info("ckptkit: recovered the rollback at step %d to step %d from the incident log", rb.at, rb.restored)

    def _adopt_pending(self) -> None:
        while self._pending and self._pending[0][0] <= self.step:
            _, ladder = self._pending.pop(0)
            self.ladder.load_state_dict(ladder)

    def _note_restart(self, step: int | None, previous: Progress | None) -> None:
        """Log how the previous job ended and what it cost; reset the marker to the restored step."""
        if not self.log.writer:
            return
        restored = step if step is not None else 0  # no checkpoint: everything since the start was lost
        metrics = self.log.read_metrics() if previous is None else []
        newest = metrics[-1][0] if metrics else None  # the newest logged loss: a lower bound without a marker
        lost = steps_lost(previous, restored, newest)
        if lost is None:
            if step is not None:
                self.log.record(Incident("resume", restored, f"resumed from step {restored} (no progress marker: "
                                         "how the previous job ended is not known)"))
            return  # otherwise a fresh run
        data = {"restored": restored, "steps_lost": lost.at_least, "steps_lost_max": lost.at_most,
                "exact": lost.exact, "reached": lost.reached}
        where = f"step {restored}" if step is not None else "the start (no checkpoint yet)"
        if previous is not None and previous.closed:
            if lost.at_least == 0:
                self.log.record(Incident("resume", restored, f"resumed from {where} (the previous job ended cleanly)"))
            else:
                self.log.record(Incident("restart", restored, f"resumed from {where}; the previous job ended "
                                         f"cleanly at step {lost.reached}: {lost.describe()}", data=data))
        else:
            at = f"step {lost.reached}" if lost.exact else f"step {lost.reached} or later"
            self.log.record(Incident("restart", restored, f"resumed from {where} after a crash at {at}: "
                                     f"{lost.describe()}", data=data))
        self.progress.write(restored)  # a crash before the next step must not count these steps again

    # --------------------------------------------------------------- data
    def batches(self, get_batch: Callable[[int], Any], start: int | None = None) -> Iterator[tuple[int, Any]]:
        """Yield ``(step, get_batch(first_sample))`` forever, never touching a skipped sample.

        ``get_batch(p)`` returns the global batch of samples ``[p, p + batch_size)``
        (each rank takes its share). After a rollback the next batch comes from
        the restored position.
        """
        if start is not None and self.step < start - 1:
            self.step = start - 1
        while True:
            step = self.step + 1
            self._enter(step)
            first = self.skips.next_batch_start(self.sample, self.batch_size)
            self._current = (first, first + self.batch_size)
            try:
                yield step, get_batch(first)
            except BaseException:  # GeneratorExit: the loop is gone, by an error in this step or its end
                self._left(step)
                raise

    def _enter(self, step: int) -> None:
        """Note that ``step`` is under way; stored while its forward and backward pass run."""
        self._entering = (step, self.progress.note(self.step, step))

    def _left(self, step: int) -> None:
        """The loop ended inside ``step`` before its agreement (a peer's death surfacing in the
        framework's own collectives, any error): this job reached the step before, exactly."""
        if self._entering is not None and self._entering[0] == step and not self._closed:
            self._entering = None
            self.progress.write(self.step)

    def current_samples(self) -> tuple[int, int] | None:
        return self._current

    # ------------------------------------------------------------ observe
    def observe(self, step: int, *, loss: Any = None, grad_norm: Any = None,
                samples: tuple[int, int] | None = None) -> Action:
        loss_v = None if loss is None else float(loss)
        grad_v = None if grad_norm is None else float(grad_norm)
        samples = samples or self._current
        now = time.monotonic()
        if self._last_observe is not None:
            self._step_times.append(now - self._last_observe)
            self._step_times = self._step_times[-100:]
        self._last_observe = now
        if self._entering is None or self._entering[0] != step:
            self._enter(step)  # the caller does not use batches()
        assert self._entering is not None
        self.progress.wait(self._entering[1])  # no rank can finish this step before the marker says so
        # one all-reduce per step: the largest value of each signal any rank saw, and "a preemption
        # signal arrived"
        try:
            loss_v, grad_v, loss_nan, grad_nan, preempt = self.manager._comm.all_max(
                [_signal(loss_v), _signal(grad_v), _is_nan(loss_v), _is_nan(grad_v),
                 1.0 if self._preempted_at is not None else 0.0])
        except BaseException:
            self._entering = None
            self.progress.write(self.step)  # a peer is gone: this job reached the previous step, exactly
            raise
        self._entering = None
        self.progress.note(step)
        loss_v, grad_v = _value(loss_v, loss_nan), _value(grad_v, grad_nan)
        # every rank's detectors see the same values: the same flags, and the same state in every
        # rank's checkpoint (one value, which a job at another world size loads)
        agreed = self.ladder.detect(loss_v, grad_v)
        if preempt > 0 and not self._preempt_agreed:
            self._preempt_agreed = True
            self._preempted_at = self._preempted_at or time.monotonic()
        decision = self.ladder.decide(step, samples, agreed)
        self.log.metric(step, loss_v, grad_v)
        if decision.kind == "stop":
            self.log.record(Incident("stop", step, decision.reason))
            self.log.flush_metrics()
            self.should_stop = True
            raise TrainingStopped(f"ckptkit stopped the run at step {step}: {decision.reason}")
        if decision.kind == "rollback":
            return Action(decision, lambda state: self._rollback(step, decision, state))
        if decision.reason:
            self.log.record(Incident("skip_step" if decision.skip_step else "spike", step, decision.reason,
                                     data={"loss": loss_v, "grad_norm": grad_v}))
        self.step = step
        if samples is not None:
            self.sample = samples[1]
        self._adopt_pending()
        self._hold_rollback_targets()
        return Action(decision)

    def _hold_rollback_targets(self) -> None:
        """Tell the manager's retention which checkpoints a rollback decided from now on may restore.

        A rollback goes to the newest checkpoint at least ``steps_before`` steps before its episode's
        first spike; that spike is the open episode's first, or a step still to come."""
        r = self.policy.rollback
        if r is None or r.retain == 0:
            self.manager.hold_for_rollback(None)
            return
        back = min(max(r.steps_before, 1), 2**62)  # as Ladder._rollback: at least one step before the first spike
        first = min(self.ladder.spikes[0], self.step + 1) if self.ladder.spikes else self.step + 1
        self.manager.hold_for_rollback(RollbackHold(max(first - back, -2**62), back, min(r.retain, 2**62)))

    def _rollback(self, step: int, decision: Decision, state: dict[str, Any]) -> dict[str, Any]:
        if decision.skip is not None:
            self.skips.add(*decision.skip)
        self._pending.clear()  # a new trajectory: the replayed one's future is not ours any more
        assert decision.restore_at_most is not None
        intent = RollbackIntent(self.ladder.rollback_count + 1, step, decision.reason, decision.restore_at_most,
                                decision.skip, decision.lower_lr, tuple(decision.spike_steps), self.skips.to_json(),
                                self.ladder.state_dict())
        # durable before anything changes: a job killed during the restore or the discard finishes the
        # rollback when it restarts (resume) instead of training on from the abandoned trajectory
        self.log.record(Incident(INTENT, step, decision.reason, data=intent.data()))
        self.attach(state)
        with Watchdog(self.watchdog_seconds or math.inf, f"rolling back from step {step}"):
            restored = self.manager.restore_latest(state, at_most=decision.restore_at_most)
        return self._finish_rollback(intent, restored, state)

    def _finish_rollback(self, intent: RollbackIntent, restored: int | None, state: dict[str, Any]) -> dict[str, Any]:
        """What a rollback does once its checkpoint is restored into ``state`` (``restored``, None if
        there was none): discard the abandoned trajectory, adopt the decided skips and ladder, re-warm
        from the restored step, and record it all. Also how a restart finishes a rollback it was killed in."""
        step = intent.at
        if restored is None:
            self.should_stop = True
            self.log.record(Incident("stop", step, f"{intent.reason}: no checkpoint to roll back to"))
            raise TrainingStopped(f"ckptkit cannot roll back from step {step}: no checkpoint at or before "
                                  f"step {intent.restore_at_most}")
        discarded = self.manager.discard_after(restored)  # the abandoned trajectory's checkpoints
        saved = self._saved(state)
        self.step = int(saved.get("step", restored))
        self.sample = int(saved.get("sample", 0))
        self.skips.update(SkipRanges.from_json(intent.skips))  # every skip decided since that checkpoint, and the new one
        self.ladder.load_state_dict(intent.ladder)  # the ladder's memory of rollbacks outlives the rollback
        self.ladder.rolled_back(step, self.step, intent.lower_lr)
        self.attach(state)
        self._hold_rollback_targets()
        lost = step - restored
        # the whole post-rollback state, durable before training goes on: a crash before the next
        # checkpoint restarts from the restored one, which was saved before this rollback
        self.log.record(Incident("rollback", step, intent.reason, data={
            "restored": restored, "skip": list(intent.skip) if intent.skip else None,
            "lower_lr": intent.lower_lr, "steps_lost": lost, "spikes": list(intent.spikes),
            "discarded": discarded, "seq": self.ladder.rollback_count, "state": self._export()}))
        self.progress.write(self.step)  # back at the restored step: a crash now must not count these again
        log.warning("ckptkit: %s -> rolled back to step %d (%d steps lost), skipping samples %s%s", intent.reason,
                    restored, lost, intent.skip, ", learning rate lowered" if intent.lower_lr else "")
        return state

    def lr_factor(self) -> float:
        """The factor for the scheduled learning rate of the next step (re-warm and drops)."""
        return self.ladder.lr_factor(self.step + 1)

    # ------------------------------------------------------------- saving
    def maybe_save(self, step: int, state: dict[str, Any], *, metrics: dict[str, Any] | None = None) -> SaveHandle | None:
        """The manager's ``maybe_save`` plus the resilience state, metrics and preemption handling."""
        self.attach(state)
        preempting = self._preempt_agreed and not self.should_stop
        if preempting:  # an emergency save: persistent at once, whatever the policy says
            deadline = self._preempted_at + self.grace_seconds if self._preempted_at else None
            self.log.flush_metrics()
            handle = self._emergency_save(step, state, metrics, deadline)
            if handle is None:
                return None
        else:  # through the manager's maybe_save, so its memory tier snapshots at its own interval
            due = self.manager.should_save(step)
            if due:
                self.log.flush_metrics()
            handle = self.manager.maybe_save(step, state, metrics=metrics, due=due)
        if handle is None:
            return None
        if handle.blocked_seconds:
            self._save_costs.append(handle.blocked_seconds)
        if preempting:
            self.log.record(Incident("preempt", step, "preemption signal: emergency save"))
            self._finish_emergency(step, handle, deadline)
        return handle

    def _emergency_save(self, step: int, state: dict[str, Any], metrics: dict[str, Any] | None,
                        deadline: float | None) -> SaveHandle | None:
        """The preemption's save, or None when it was abandoned before a handle existed: a synchronous
        save that could not commit by the deadline, or one refused. Every rank gets the same outcome
        (a save's failure is agreed). A periodic save that had failed in the background is reported and
        the emergency save made all the same. Until 2026-12-06 both escaped ``maybe_save``: the job died
        with a traceback, no incident and ``should_stop`` False (found by a hunt)."""
        try:
            try:
                return self.manager.save(step, state, metrics=metrics, deadline=deadline)
            except PreviousSaveFailedError as exc:  # reported now, and only once: the emergency save is still due
                log.warning("ckptkit: %s; making the emergency save at step %d", exc, step)
                return self.manager.save(step, state, metrics=metrics, deadline=deadline)
        except Exception as exc:  # noqa: BLE001 - abandoned: the previous checkpoint stands
            self.log.record(Incident("preempt", step, "preemption signal: emergency save"))
            self._abandon(step, str(exc) or type(exc).__name__)
            return None

    def _finish_emergency(self, step: int, handle: SaveHandle, deadline: float | None) -> None:
        self.should_stop = True
        remaining = max(0.0, (deadline or time.monotonic() + self.grace_seconds) - time.monotonic())
        try:
            handle.committed.result(timeout=remaining + 5.0)
            self.log.record(Incident("emergency_save", step, "saved on preemption within the grace period"))
        except Exception as exc:  # noqa: BLE001 - abandoned: the previous checkpoint stands
            self.manager.acknowledge(handle)  # also one still running: close() must not raise it again
            self._abandon(step, f"not committed within the grace period ({self.grace_seconds:g} s, and 5 s more)"
                          if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__)

    def _abandon(self, step: int, why: str) -> None:
        self.should_stop = True
        self.log.record(Incident("save_abandoned", step, f"emergency save abandoned: {why}"))
        log.warning("ckptkit: emergency save at step %d abandoned (%s); the previous checkpoint stands", step, why)

    def recommended_interval_steps(self) -> int | None:
        """Young/Daly interval in steps from the measured save cost and step time (needs ``mtbf_hours``)."""
        if self.mtbf_hours is None or not self._save_costs or not self._step_times:
            return None
        cost = sorted(self._save_costs)[len(self._save_costs) // 2]
        step_s = sorted(self._step_times)[len(self._step_times) // 2]
        return max(1, round(young_daly_interval(cost, self.mtbf_hours * 3600) / max(step_s, 1e-6)))

    def close(self) -> None:
        """Wait for the last save, mark the job as ended cleanly, and give the signals back. A failure
        of the last save is raised after all of that is done (it used to skip the rest: the restart
        then reported a crash, and the signal handlers stayed installed)."""
        self._closed = True
        try:
            self.log.flush_metrics()
            self.manager.close()
        finally:
            try:
                self.progress.write(self.step, closed=True)
                self.progress.close()
                self.log.wait()
            finally:
                for sig, previous in self._previous_handlers.items():
                    try:
                        signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
                    except ValueError:  # not the main thread now
                        log.warning("ckptkit: cannot restore the handler of %s outside the main thread", sig)
                self._previous_handlers.clear()
