"""SpikePolicy as one frozen dataclass per rung; what the report draws (pure: no torch, no processes).

The policy is configuration only: checkpoints (``state["resilience"]``) and the incident log store
the ladder's state, never the policy. The literal below is a ladder state written by ckptkit 0.1
(the flat-keyword policy) for the trace in ``run``; the grouped policy must write the same and
continue from it the same.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ckptkit.errors import OptionsError
from ckptkit.resilience import DetectorConfig, Flags, Ladder, LowerLR, Rewarm, Rollback, SkipStep, SpikePolicy
from ckptkit.resilience.incidents import Incident
from ckptkit.resilience.report import RunReport, crash_spans, figure, run_name

GROUPED = SpikePolicy(loss=DetectorConfig(window=8, warmup=4), grad_norm=None,
                      rollback=Rollback(after_spikes=2, window_steps=20, steps_before=3, skip_before=1, skip_after=2),
                      rewarm=Rewarm(factor=0.5, steps=4),
                      lower_lr=LowerLR(max_rollbacks=1, window_steps=100, factor=0.5, max_drops=1))
# the ladder's state_dict() after run(..., until=26), as ckptkit 0.1 (flat-keyword policy) wrote it
STATE_0_1 = json.loads(
    '{"loss": {"window": [1.0, 1.01, 1.02, 1.0, 1.01, 1.02, 1.0, 1.02]}, "grad": null, "rollbacks": [13], '
    '"lr_drops": 0, "rewarm_from": 9, "spikes": [25], "nonfinite_run": 0, "samples": [[1, 4, 8], [2, 8, 12], '
    '[3, 12, 16], [4, 16, 20], [5, 20, 24], [6, 24, 28], [7, 28, 32], [8, 32, 36], [9, 36, 40], [14, 56, 60], '
    '[15, 60, 64], [16, 64, 68], [17, 68, 72], [18, 72, 76], [19, 76, 80], [20, 80, 84], [21, 84, 88], '
    '[22, 88, 92], [23, 92, 96], [24, 96, 100], [25, 100, 104], [26, 104, 108]]}')
SPIKES = (12, 13, 25, 27)


def run(lad: Ladder, first: int, until: int) -> list[tuple]:
    out = []
    for s in range(first, until + 1):
        loss = 1.0 + 0.01 * (s % 3)
        d = lad.decide(s, (4 * s, 4 * s + 4), lad.detect(loss * (10 if s in SPIKES else 1), None))
        out.append((s, d.kind, d.restore_at_most, d.skip, d.lower_lr))
        if d.kind == "rollback":
            lad.rolled_back(s, d.restore_at_most, d.lower_lr)
        if d.kind == "stop":
            break
    return [o for o in out if o[1] != "ok"]


def test_grouped_policy_decides_and_saves_as_ckptkit_0_1_did():
    lad = Ladder(GROUPED)
    assert run(lad, 1, 26) == [(12, "skip_step", None, None, False), (13, "rollback", 9, (44, 64), False),
                               (25, "skip_step", None, None, False)]
    assert json.loads(json.dumps(lad.state_dict())) == STATE_0_1
    assert [lad.lr_factor(s) for s in range(8, 14)] == [0.5, 0.5, 0.625, 0.75, 0.875, 1.0]  # re-warm from 9


def test_a_state_written_by_0_1_continues_under_the_grouped_policy():
    """(A checkpoint's state["resilience"]["ladder"], or a rollback incident's state, from before.)"""
    ref = Ladder(GROUPED)
    run(ref, 1, 26)
    back = Ladder(GROUPED)
    back.load_state_dict(STATE_0_1)
    # step 27: a second spike within the window -> rollback; the second within 100 steps -> lower the LR
    assert run(back, 27, 40) == run(ref, 27, 40) == [(27, "rollback", 22, (96, 120), True)]
    assert back.lr_factor(40) == ref.lr_factor(40) == 0.5


def test_unknown_keywords_are_refused():
    with pytest.raises(TypeError, match="rollbak_after"):
        SpikePolicy(rollbak_after=3)  # type: ignore[call-arg]
    with pytest.raises(OptionsError, match="takes a Rollback or None"):
        SpikePolicy(rollback=3)  # type: ignore[arg-type]


def test_presets_are_the_published_practice():
    palm, opt, olmo = SpikePolicy.palm(), SpikePolicy.opt(), SpikePolicy.olmo()
    assert not palm.skip_step.on_spike and palm.rewarm is None
    assert palm.rollback == Rollback(after_spikes=1, steps_before=100, skip_before=100, skip_after=200)
    assert opt.rollback.steps_before == opt.rollback.skip_before == opt.rollback.skip_after == 0
    assert opt.lower_lr.on_every_rollback and opt.lower_lr.factor == 0.7
    assert olmo.rollback is None and olmo.skip_step.on_spike
    assert olmo.loss == olmo.grad_norm == DetectorConfig(window=128, warmup=20, k=6.0, method="sigma")
    assert SpikePolicy.palm(rewarm=Rewarm()).rewarm == Rewarm()  # overrides are rungs
    changed = replace(palm, rollback=replace(palm.rollback, skip_after=500))
    assert changed.rollback.skip_after == 500 and palm.rollback.skip_after == 200  # frozen: a new policy
    with pytest.raises(AttributeError):
        palm.rollback.skip_after = 1  # type: ignore[misc]


def test_presets_on_the_ladder():
    spike, nan = Flags(loss_spike=True), Flags(loss_nonfinite=True)
    olmo = Ladder(SpikePolicy.olmo())
    assert [olmo.decide(s, None, f).kind for s, f in enumerate([spike, spike, nan, nan, nan], 1)] == ["skip_step"] * 5
    palm = Ladder(SpikePolicy.palm())
    for s in range(1, 300):
        palm.decide(s, (s, s + 1), Flags())
    d = palm.decide(300, (300, 301), spike)  # one spike: back >= 100 steps, skip 100 before to 200 after
    assert (d.kind, d.restore_at_most, d.skip, d.lower_lr) == ("rollback", 200, (200, 501), False)
    opt = Ladder(SpikePolicy.opt())
    assert opt.decide(50, None, spike).lower_lr


@pytest.mark.parametrize("make, message", [
    (lambda: Rollback(after_spikes=0), "Rollback.after_spikes must be an integer >= 1"),
    (lambda: Rollback(skip_after=-1), "Rollback.skip_after must be an integer >= 0"),
    (lambda: Rollback(window_steps=2.5), "Rollback.window_steps must be an integer"),
    (lambda: Rewarm(factor=0), r"Rewarm.factor must be in \(0, 1\]"),
    (lambda: Rewarm(steps=0), "Rewarm.steps must be an integer >= 1"),
    (lambda: LowerLR(factor=1.0), r"LowerLR.factor must be in \(0, 1\)"),
    (lambda: LowerLR(max_drops=-1), "LowerLR.max_drops must be an integer >= 0"),
    (lambda: SkipStep(on_spike="yes"), "SkipStep.on_spike must be a bool"),
    (lambda: SpikePolicy(rollback=3), "takes a Rollback or None"),
    (lambda: SpikePolicy(lower_lr=None), "takes a LowerLR, got NoneType"),
    (lambda: DetectorConfig(window=2), "detector needs 4 <= window"),
])
def test_validation_raises_options_error(make, message):
    with pytest.raises(OptionsError, match=message):
        make()


# ---------------------------------------------------------------------------------- the report
def test_run_names_are_folder_names_never_paths():
    assert run_name("/home/me/runs/exp1") == "exp1"
    assert run_name("/home/me/runs/demo/ckpt/") == "demo"  # a generic checkpoint folder: its run's name
    assert run_name("s3://bucket/run1") == "run1" and run_name("s3://bucket") == "bucket"
    assert RunReport("/abs/runs/x/checkpoint", (), (), name="llama-8b").title == "llama-8b"  # recorded wins


def report() -> RunReport:
    incidents = (
        Incident("skip_step", 12, data={"loss": 3.0}),
        Incident("rollback", 20, data={"restored": 10, "steps_lost": 10}),
        Incident("restart", 40, data={"restored": 40, "reached": 47, "steps_lost": 7, "exact": True}),
        Incident("restart", 60, data={"restored": 60, "steps_lost": 3}),  # logged before "reached" was
        Incident("restart", 70, data={"restored": 70, "reached": 70, "steps_lost": 0}),  # nothing lost
    )
    return RunReport("/abs/path/runs/exp1/ckpt", incidents, tuple((s, 1.0 / s, None) for s in range(1, 80)))


def test_the_plot_has_the_run_name_as_title_and_shades_the_steps_crashes_lost():
    rep = report()
    assert crash_spans(rep) == [(40, 47, 7), (60, 63, 3)]
    assert rep.describe() == "1 skipped step, 1 rollback, 3 restarts; 20 steps lost"
    ax = figure(rep).axes[0]
    assert ax.get_title(loc="left") == "exp1"
    assert "/" not in ax.get_title(loc="left") + ax.get_title(loc="right") and "{" not in ax.get_title(loc="right")
    assert sorted(p.get_gid() for p in ax.patches if p.get_gid()) == ["lost:40-47", "lost:60-63"]
    assert {t.get_text() for t in ax.texts} == {"7 steps lost", "3 steps lost"}
    assert "lost to a crash/restart" in ax.get_legend_handles_labels()[1]
