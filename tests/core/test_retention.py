"""Retention is a pure decision: property tests of its guarantees."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.retention import BestK, Decision, Record, RetentionPolicy, RollbackHold, decide

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


# ------------------------------------------------------------------ what a spike rollback may still need

def reachable(committed: list[int], hold: RollbackHold) -> set[int]:
    """Brute force over every bound: the checkpoints ``hold.depth`` rollbacks in a row may restore
    with nothing deleted. The first may use any bound from ``at_most`` on; each next one any bound
    from the step the one before restored, plus one, minus ``steps_before``."""
    found: set[int] = set()
    lowest = hold.at_most
    top = max(committed, default=0)
    for _ in range(hold.depth):
        level = {max(older) for a in range(lowest, max(top, lowest) + 1) if (older := [s for s in committed if s <= a])}
        if not level:
            break
        found |= level
        lowest = min(level) + 1 - hold.steps_before
    return found


small_records = st.lists(
    st.builds(lambda step, committed: Record(f"step-{step:07d}", step, committed), st.integers(0, 300), st.booleans()),
    max_size=25, unique_by=lambda r: r.step)
holds = st.builds(RollbackHold, st.integers(-20, 320), st.integers(1, 80), st.integers(1, 4))


@settings(max_examples=400, deadline=None)
@given(small_records, policy_st, holds)
def test_the_hold_keeps_exactly_what_rollbacks_in_a_row_may_restore(records, policy, hold):
    """Kept: what the rules keep, and every checkpoint ``depth`` rollbacks in a row may restore with
    nothing ever deleted (brute force over every bound): nothing more, nothing less."""
    d = decide(records, policy, hold)
    plain = decide(records, policy)
    committed = sorted(r.step for r in records if r.committed)
    assert set(d.keep) | set(d.delete) == {r.name for r in records if r.committed}
    need = reachable(committed, hold)
    assert {r.step for r in records if r.name in d.keep} == {r.step for r in records if r.name in plain.keep} | need
    for r in records:
        if r.name in d.keep and r.name not in plain.keep:
            assert d.keep[r.name] == ("rollback",)


@settings(max_examples=400, deadline=None)
@given(small_records, policy_st, holds, st.lists(st.integers(0, 60), min_size=1, max_size=4))
def test_rollbacks_in_a_row_restore_what_they_would_with_nothing_deleted(records, policy, hold, slack):
    """Up to ``depth`` rollbacks, each with a bound its predecessor allows: each restores the newest
    kept checkpoint at or before its bound, and that is the newest there ever was."""
    d = decide(records, policy, hold)
    committed = sorted(r.step for r in records if r.committed)
    kept = sorted(r.step for r in records if r.name in d.keep)
    bound = hold.at_most + slack[0]
    for extra in [*slack[1:hold.depth], None][:hold.depth]:
        every = [s for s in committed if s <= bound]
        still = [s for s in kept if s <= bound]
        assert (every[-1] if every else None) == (still[-1] if still else None), bound
        if not every or extra is None:
            break
        bound = every[-1] + 1 - hold.steps_before + extra


def test_keep_last_one_holds_the_checkpoints_a_rollback_goes_back_to():
    recs = [Record(f"s{s}", s, True) for s in (10, 20, 30, 40, 50)]
    # the controller at step 50, no open episode, steps_before=25: a rollback goes to <= 26 or later
    d = decide(recs, RetentionPolicy(keep_last=1), RollbackHold(26, 25))
    assert d.keep == {"s20": ("rollback",), "s30": ("rollback",), "s40": ("rollback",), "s50": ("latest", "last", "rollback")}
    assert d.delete == ("s10",)
    # a second rollback right after one to step 20 goes to <= 20 + 1 - 25: step 10 is held too
    assert decide(recs, RetentionPolicy(keep_last=1), RollbackHold(26, 25, depth=2)).delete == ()
    assert decide(recs, RetentionPolicy(keep_last=1), RollbackHold(5, 25)).delete == ()  # nothing old enough yet
    assert decide(recs, RetentionPolicy(), RollbackHold(26, 25)).delete == ()
    assert RollbackHold.from_json(RollbackHold(26, 25, 2).to_json()) == RollbackHold(26, 25, 2)
    assert [RollbackHold.from_json(v) for v in ([1, 0, 1], [1, 2], "x", [True, 1, 1], [2**63, 1, 1])] == [None] * 5
