"""Detectors on synthetic traces, the ladder as a state machine, skip ranges, the planner."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.resilience import (
    DetectorConfig,
    Flags,
    Ladder,
    LowerLR,
    Rewarm,
    Rollback,
    SkipRanges,
    SkipStep,
    SpikeDetector,
    SpikePolicy,
)
from ckptkit.resilience import checkpoint_size, goodput, plan, young_daly_interval


def clean_trace(n: int, seed: int, noise: float = 0.02) -> list[float]:
    """A decaying loss with 2% per-step noise (a large batch's) and occasional benign bumps of
    up to 5% (a harder data shard)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        base = 2.0 + 8.0 * math.exp(-i / 300)
        bump = 1.0 + 0.05 * rng.random() if rng.random() < 0.01 else 1.0
        out.append(base * bump * (1 + noise * rng.gauss(0, 1)))
    return out


@pytest.mark.parametrize("method", ["mad", "sigma"])
def test_no_false_positives_on_long_clean_noisy_traces(method):
    det_cfg = DetectorConfig(window=128, warmup=32, k=6.0, method=method)
    for seed in range(8):
        det = SpikeDetector(det_cfg)
        flagged = [i for i, v in enumerate(clean_trace(5000, seed)) if det.observe(v).spike]
        assert flagged == [], (seed, flagged[:5])


@pytest.mark.parametrize("method", ["mad", "sigma"])
def test_injected_spikes_are_caught_at_once(method):
    det = SpikeDetector(DetectorConfig(window=128, warmup=32, k=6.0, method=method))
    trace = clean_trace(3000, 1)
    for at in (500, 1500, 2500):
        trace[at] *= 2.0
    trace[2000] = float("nan")
    verdicts = [det.observe(v) for v in trace]
    assert [i for i, v in enumerate(verdicts) if v.spike] == [500, 1500, 2000, 2500]
    assert verdicts[2000].reason == "nonfinite" and verdicts[500].reason == "spike"


def test_detector_learns_nothing_from_spikes_and_warms_up():
    det = SpikeDetector(DetectorConfig(window=16, warmup=8, k=3.0))
    for v in [100.0, 1.0, 50.0]:  # during warm-up nothing is a spike (no statistics yet)
        assert not det.observe(v).spike
    for _ in range(20):
        det.observe(1.0 + 1e-3 * _)
    before = list(det.window)
    assert det.observe(1e6).spike and list(det.window) == before


def policy(skip_step: bool = True, nonfinite_rollback: int = 2, max_lr_drops: int = 1,
           every_rollback: bool = False) -> SpikePolicy:
    return SpikePolicy(loss=DetectorConfig(window=32, warmup=8), grad_norm=None,
                       skip_step=SkipStep(on_spike=skip_step),
                       rollback=Rollback(after_spikes=3, window_steps=20, after_nonfinite=nonfinite_rollback,
                                         steps_before=5, skip_before=2, skip_after=4),
                       rewarm=Rewarm(factor=0.1, steps=10),
                       lower_lr=LowerLR(max_rollbacks=2, window_steps=500, factor=0.5, max_drops=max_lr_drops,
                                        on_every_rollback=every_rollback))


def test_ladder_rungs_in_order():
    lad = Ladder(policy())
    spike = Flags(loss_spike=True)
    samples = lambda s: (8 * s, 8 * s + 8)  # noqa: E731
    assert all(lad.decide(s, samples(s), Flags()).kind == "ok" for s in range(1, 11))
    assert lad.decide(11, samples(11), spike).kind == "skip_step"  # rung 1
    assert lad.decide(12, samples(12), spike).kind == "skip_step"
    d = lad.decide(13, samples(13), spike)  # rung 2: third spike within 20 steps
    assert d.kind == "rollback" and d.restore_at_most == 11 - 5
    assert d.skip == (8 * (11 - 2), 8 * 13 + 8 + 4 * 8) and not d.lower_lr
    lad.rolled_back(13, resumed_step=6, lowered_lr=False)
    assert lad.lr_factor(6) == pytest.approx(0.1) and lad.lr_factor(11) == pytest.approx(0.55)  # rung 3
    assert lad.lr_factor(16) == 1.0
    for s in (20, 21):
        lad.decide(s, samples(s), spike)
    d = lad.decide(22, samples(22), spike)
    assert d.kind == "rollback" and not d.lower_lr  # second rollback: still within max_rollbacks
    lad.rolled_back(22, 14, False)
    for s in (30, 31):
        lad.decide(s, samples(s), spike)
    d = lad.decide(32, samples(32), spike)
    assert d.kind == "rollback" and d.lower_lr  # rung 4: too many rollbacks -> lower the LR
    lad.rolled_back(32, 25, True)
    assert lad.lr_factor(100) == pytest.approx(0.5)
    for s in (40, 41):
        lad.decide(s, samples(s), spike)
    d = lad.decide(42, samples(42), spike)
    assert d.kind == "stop" and "stopping for a human" in d.reason  # out of rungs


def test_nonfinite_always_skips_the_step_and_rolls_back_when_repeated():
    lad = Ladder(policy(skip_step=False, nonfinite_rollback=2))
    assert lad.decide(5, None, Flags(loss_nonfinite=True)).kind == "skip_step"
    assert lad.decide(6, None, Flags(grad_nonfinite=True)).kind == "rollback"


@st.composite
def flag_streams(draw):
    return draw(st.lists(st.sampled_from([Flags(), Flags(), Flags(), Flags(loss_spike=True), Flags(loss_nonfinite=True)]),
                         min_size=1, max_size=300))


@settings(max_examples=300, deadline=None)
@given(flag_streams(), st.integers(0, 3), st.booleans())
def test_ladder_invariants(stream, seed, every_rollback):
    """``every_rollback``: OPT's practice (SpikePolicy.opt) lowers the learning rate at every rollback,
    and still at most ``max_drops`` times (it lowered it at every one, without bound, until 2026-12-06)."""
    pol = policy(max_lr_drops=1 + seed % 2, every_rollback=every_rollback)
    lad = Ladder(pol)
    twin = Ladder(pol)
    step = 1
    for flags in stream:
        d = lad.decide(step, (8 * step, 8 * step + 8), flags)
        assert twin.decide(step, (8 * step, 8 * step + 8), flags) == d  # deterministic: ranks agree
        if not flags.any:
            assert d.kind == "ok"
        if flags.nonfinite:
            assert d.skip_step or d.kind == "stop"
        if d.kind == "rollback":
            assert d.restore_at_most is not None and d.restore_at_most < step
            assert d.skip is None or d.skip[0] < d.skip[1]
            resumed = max(0, d.restore_at_most)
            for l in (lad, twin):
                l.rolled_back(step, resumed, d.lower_lr)
            assert lad.lr_drops <= pol.lower_lr.max_drops
        if d.kind == "stop":
            # only once every rung is used: the LR was lowered as often as allowed, and this would
            # be one rollback more than max_rollbacks within the window
            assert lad.lr_drops == pol.lower_lr.max_drops
            assert len([s for s in lad.rollbacks if s > step - pol.lower_lr.window_steps]) >= pol.lower_lr.max_rollbacks
            # and final: the same trouble on the next step stops again, on a ladder restored from
            # the state too (a restarted run does not start rolling back once more)
            back = Ladder(pol)
            back.load_state_dict(lad.state_dict())
            for l in (lad, back):
                assert l.decide(step + 1, (8 * step + 8, 8 * step + 16), flags).kind == "stop"
            break
        assert 0 < lad.lr_factor(step) <= 1
        step += 1
    back = Ladder(pol)
    back.load_state_dict(lad.state_dict())
    assert back.state_dict() == lad.state_dict()


def test_skip_ranges_are_absolute_and_merge():
    s = SkipRanges()
    s.add(100, 200)
    s.add(150, 260)
    s.add(400, 410)
    assert s.to_json() == [[100, 260], [400, 410]]
    assert s.contains(100) and not s.contains(260) and s.skipped == 170
    # batches of 8 from 96: [96,104) touches the range, so the next clean batch starts at 260
    assert s.next_batch_start(96, 8) == 260 and s.next_batch_start(392, 8) == 392
    assert s.next_batch_start(395, 8) == 410
    assert SkipRanges.from_json(s.to_json()) == s


def test_planner():
    size = checkpoint_size(70e9, tp=4, pp=8, dp=32, zero=1)
    assert size.total == pytest.approx(70e9 * 14)
    assert size.per_rank == pytest.approx(70e9 * 14 / (4 * 8 * 32))
    assert young_daly_interval(60, 3 * 3600) == pytest.approx(math.sqrt(2 * 60 * 3 * 3600))
    tau = young_daly_interval(60, 10800)
    assert goodput(tau, 60, 10800) > goodput(tau / 4, 60, 10800)
    assert goodput(tau, 60, 10800) > goodput(tau * 4, 60, 10800)
    p = plan(70e9, 4, 8, 32, 1, write_gbps=5, mtbf_hours=3)
    assert p.save_seconds == pytest.approx(size.per_rank / 5e9)
    assert "Young/Daly interval" in "\n".join(p.lines())
    # per-rank bandwidth alone: the plan says so, and what aggregate it assumes (tests/core/test_plan_tiers.py: more)
    assert p.save is not None and p.save.limited_by == "per-rank bandwidth"
    assert "5,120 GB/s in aggregate" in "\n".join(p.lines())
    fs = plan(70e9, 4, 8, 32, 1, write_gbps=5, mtbf_hours=3, fs_gbps=200)
    assert fs.save_seconds == pytest.approx(size.total / 200e9) and fs.save.limited_by == "file system"
