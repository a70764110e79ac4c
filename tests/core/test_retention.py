"""Retention is a pure decision: property tests of its guarantees."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.retention import BestK, Decision, Record, RetentionPolicy, decide

records_st = st.lists(
    st.builds(
        lambda step, committed, loss: Record(f"step-{step:07d}", step, committed, {} if loss is None else {"loss": loss}),
        st.integers(0, 5000), st.booleans(), st.one_of(st.none(), st.floats(-10, 10, allow_nan=False)),
    ),
    max_size=30,
    unique_by=lambda r: r.step,
)
policy_st = st.builds(
    RetentionPolicy,
    st.one_of(st.none(), st.integers(1, 5)),
    st.one_of(st.none(), st.sampled_from([100, 1000])),
    st.one_of(st.none(), st.builds(BestK, st.just("loss"), st.integers(1, 3), st.sampled_from(["min", "max"]))),
)


@settings(max_examples=500, deadline=None)
@given(records_st, policy_st)
def test_guarantees(records, policy):
    d: Decision = decide(records, policy)
    committed = sorted((r for r in records if r.committed), key=lambda r: r.step)
    names = {r.name for r in records}
    assert set(d.keep) | set(d.delete) == {r.name for r in committed}
    assert not set(d.keep) & set(d.delete)
    assert all(n in names for n in d.delete)
    assert not any(r.name in d.delete for r in records if not r.committed)  # never touches uncommitted
    if committed:
        assert committed[-1].name in d.keep  # the newest committed survives every policy
    if policy.keeps_everything:
        assert d.delete == ()
    if policy.keep_last:
        assert {r.name for r in committed[-policy.keep_last:]} <= set(d.keep)
    if policy.keep_every:
        assert all(r.name in d.keep for r in committed if r.step % policy.keep_every == 0)
    if policy.keep_best:
        scored = [r for r in committed if "loss" in r.metrics]
        sign = 1 if policy.keep_best.mode == "min" else -1
        best = sorted(scored, key=lambda r: (sign * r.metrics["loss"], -r.step))[: policy.keep_best.k]
        assert all(r.name in d.keep and "best" in d.keep[r.name] for r in best)


def test_example():
    recs = [Record(f"s{s}", s, True, {"val_loss": v}) for s, v in [(100, 3.0), (200, 2.0), (300, 2.5), (400, 2.9), (500, 2.8)]]
    recs.append(Record("s600", 600, False))
    d = decide(recs, RetentionPolicy(keep_last=2, keep_every=200, keep_best=BestK("val_loss", 1)))
    assert d.keep == {"s500": ("latest", "last"), "s400": ("last", "milestone"), "s200": ("milestone", "best")}
    assert d.delete == ("s100", "s300")


def test_policy_round_trips_through_json():
    p = RetentionPolicy(3, 1000, BestK("acc", 2, "max"))
    assert RetentionPolicy.from_json(p.to_json()) == p
