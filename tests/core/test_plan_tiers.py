"""The planner's two bandwidth bounds and its two tiers (pure arithmetic, and ``ckptkit plan``).

The closed-form intervals are checked against a grid search of the goodput expression they
claim to maximise, so a wrong formula (or a wrong edge at q = 0 / q = 1) cannot hide in both."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.errors import OptionsError
from ckptkit.resilience import (
    MemoryTierPlanOptions,
    checkpoint_size,
    goodput,
    held_bytes_per_rank,
    plan,
    plan_tiers,
    save_time,
    two_tier_goodput,
)
from ckptkit.resilience.tier_planner import tier_interval

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
LLAMA = dict(params=70e9, tp=4, pp=8, dp=32, zero=1)  # 1,024 ranks
positive = st.floats(0.01, 1e4, allow_nan=False)

# ------------------------------------------------------------------ the save's two bounds


@settings(max_examples=200, deadline=None)
@given(params=st.floats(1e6, 1e12), tp=st.integers(1, 8), pp=st.integers(1, 16), dp=st.integers(1, 256),
       write=st.none() | positive, fs=st.none() | positive)
def test_save_time_is_the_slower_bound(params: float, tp: int, pp: int, dp: int, write: float | None,
                                       fs: float | None) -> None:
    size = checkpoint_size(params, tp, pp, dp, 1)
    if write is None and fs is None:
        with pytest.raises(OptionsError, match="write bandwidth"):
            save_time(size, tp * pp * dp, write, fs)
        return
    s = save_time(size, tp * pp * dp, write, fs)
    bounds = {"per-rank bandwidth": None if write is None else size.per_rank / (write * 1e9),
              "file system": None if fs is None else size.total / (fs * 1e9)}
    assert s.seconds == pytest.approx(max(b for b in bounds.values() if b is not None))
    assert bounds[s.limited_by] == pytest.approx(s.seconds)
    if s.limited_by == "file system":
        assert f"limited by the file system's {fs:,g} GB/s aggregate" in s.describe()
    else:
        assert "limited by per-rank bandwidth" in s.describe()


def test_the_file_system_bounds_a_large_job() -> None:
    """1,024 ranks x 5 GB/s would be 5 TB/s: a 200 GB/s file system sets the save time, and the
    per-rank figure alone says what aggregate it assumes."""
    fs = plan(**LLAMA, write_gbps=5, mtbf_hours=3, fs_gbps=200)
    alone = plan(**LLAMA, write_gbps=5, mtbf_hours=3)
    assert fs.save is not None and fs.save.limited_by == "file system"
    assert fs.save_seconds == pytest.approx(70e9 * 14 / 200e9)
    assert "limited by the file system's 200 GB/s aggregate" in "\n".join(fs.lines())
    assert alone.save is not None and alone.save.limited_by == "per-rank bandwidth"
    assert "1,024 ranks x 5 = 5,120 GB/s" in "\n".join(alone.lines())
    assert fs.interval_seconds > alone.interval_seconds and fs.goodput < alone.goodput
    # a fast file system leaves the per-rank bound in charge; the aggregate alone is enough too
    assert plan(**LLAMA, write_gbps=5, mtbf_hours=3, fs_gbps=1e5).save.limited_by == "per-rank bandwidth"
    assert plan(**LLAMA, write_gbps=None, mtbf_hours=3, fs_gbps=200).save_seconds == pytest.approx(fs.save_seconds)


def test_old_positional_signature_unchanged() -> None:
    p = plan(70e9, 4, 8, 32, 1, 5, 3, 300.0, 1.0)
    assert p.save_seconds == pytest.approx(70e9 * 14 / 1024 / 5e9)
    assert p.interval_seconds == pytest.approx(math.sqrt(2 * p.save_seconds * 3 * 3600))


def test_the_interval_never_drops_below_the_save() -> None:
    """A tiny blocking share would ask for saves faster than they finish: they would only queue."""
    p = plan(**LLAMA, write_gbps=None, mtbf_hours=3, fs_gbps=1, blocking_fraction=1e-6)
    assert p.interval_seconds == pytest.approx(p.save_seconds)
    assert "saves never queue" in "\n".join(p.lines())


# ------------------------------------------------------------------ the two tiers' intervals


def _grid(lo: float, hi: float, n: int = 400) -> list[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


@settings(max_examples=150, deadline=None)
@given(c_m=st.floats(1e-3, 30), c_p=st.floats(1e-2, 600), mtbf_h=st.floats(0.5, 50),
       q=st.floats(0.01, 0.99), r_m=st.floats(0, 300), r_p=st.floats(0, 3600))
def test_closed_form_intervals_beat_a_grid_search(c_m: float, c_p: float, mtbf_h: float, q: float, r_m: float,
                                                  r_p: float) -> None:
    mtbf = mtbf_h * 3600
    tau_m, tau_p = tier_interval(c_m, mtbf, q), tier_interval(c_p, mtbf, 1 - q)
    best = two_tier_goodput(tau_m, tau_p, c_m, c_p, mtbf, q, r_m, r_p)
    grid_m, grid_p = _grid(c_m / 10, 20 * mtbf, 120), _grid(c_p / 10, 50 * mtbf, 120)
    grid_best = max(two_tier_goodput(a, b, c_m, c_p, mtbf, q, r_m, r_p) for a in grid_m for b in grid_p)
    assert best >= grid_best - 1e-12
    # and the grid comes close to it: the closed form is the maximum, not merely above a coarse grid
    assert grid_best >= best - 1e-3


@settings(max_examples=60, deadline=None)
@given(bf=st.floats(1e-4, 1), mem_gbps=st.floats(0.5, 50), fs=st.floats(20, 2000), q=st.floats(0.01, 0.99))
def test_plan_tiers_is_the_best_feasible_pair(bf: float, mem_gbps: float, fs: float, q: float) -> None:
    """The planner's pair beats every feasible pair (intervals at least the write times) on a grid."""
    t = plan_tiers(**LLAMA, mtbf_hours=2.8, fs_gbps=fs, blocking_fraction=bf,
                   memory=MemoryTierPlanOptions(parity=8, memory_gbps=mem_gbps, node_failure_share=q))
    save = t.persistent_only.save_seconds
    assert t.memory_interval_seconds >= t.memory_copy_seconds and t.persistent_interval_seconds >= save

    def value(a: float, b: float) -> float:
        return two_tier_goodput(a, b, t.memory_cost_seconds, t.persistent_cost_seconds, t.mtbf_seconds, q, 60, 300)

    grid = max(value(a, b) for a in _grid(t.memory_copy_seconds, 1e5, 80) for b in _grid(save, 1e6, 80))
    assert t.goodput == pytest.approx(value(t.memory_interval_seconds, t.persistent_interval_seconds))
    assert t.goodput >= grid - 1e-12


def test_goodput_expression() -> None:
    """The docstring's first-order expression, term by term."""
    c_m, c_p, mtbf, q, r_m, r_p, tau_m, tau_p = 0.5, 5.0, 10_000.0, 0.9, 60.0, 300.0, 100.0, 1000.0
    expected = 1 - c_m / tau_m - c_p / tau_p - (q * (tau_m / 2 + r_m) + (1 - q) * (tau_p / 2 + r_p)) / mtbf
    assert two_tier_goodput(tau_m, tau_p, c_m, c_p, mtbf, q, r_m, r_p) == pytest.approx(expected)
    assert tier_interval(c_m, mtbf, q) == pytest.approx(math.sqrt(2 * c_m * mtbf / q))
    assert tier_interval(c_p, mtbf, 1 - q) == pytest.approx(math.sqrt(2 * c_p * mtbf / (1 - q)))


def test_edges_q_zero_and_one() -> None:
    none = plan_tiers(**LLAMA, mtbf_hours=3, fs_gbps=200, restart_seconds=300,
                      memory=MemoryTierPlanOptions(parity=8, node_failure_share=0.0))
    assert math.isinf(none.memory_interval_seconds)
    assert none.persistent_interval_seconds == pytest.approx(none.persistent_only.interval_seconds)
    assert none.goodput == pytest.approx(none.persistent_only.goodput)
    every = plan_tiers(**LLAMA, mtbf_hours=3, fs_gbps=200,
                       memory=MemoryTierPlanOptions(replicas=1, node_failure_share=1.0))
    assert math.isinf(every.persistent_interval_seconds) and math.isfinite(every.memory_interval_seconds)
    c_m, mtbf = every.memory_cost_seconds, every.mtbf_seconds
    assert every.goodput == pytest.approx(goodput(every.memory_interval_seconds, c_m, mtbf, 60.0))
    assert "never needed against failures" in "\n".join(every.lines())
    for t in (none, every):
        assert all(math.isfinite(x) for x in (t.goodput, t.host_memory_per_node))


def test_the_memory_tier_pays_where_failures_are_frequent() -> None:
    t = plan_tiers(**LLAMA, mtbf_hours=2.8, write_gbps=5, fs_gbps=200, blocking_fraction=0.1,
                   memory=MemoryTierPlanOptions(parity=8))
    assert t.goodput > t.persistent_only.goodput
    assert t.memory_interval_seconds < t.persistent_only.interval_seconds < t.persistent_interval_seconds
    assert t.goodput >= 0.98


# ------------------------------------------------------------------ memory figures


def test_held_bytes_follow_zero() -> None:
    """A rank holds its own state, replicated weights included; it writes them only once per replica set."""
    p, mp, dp = 70e9, 32, 32
    assert held_bytes_per_rank(p, 4, 8, dp, 0) == pytest.approx(p * 14 / mp)
    assert held_bytes_per_rank(p, 4, 8, dp, 1) == pytest.approx(p * 2 / mp + p * 12 / mp / dp)
    assert held_bytes_per_rank(p, 4, 8, dp, 2) == held_bytes_per_rank(p, 4, 8, dp, 1)
    assert held_bytes_per_rank(p, 4, 8, dp, 3) == pytest.approx(p * 14 / mp / dp)
    written = checkpoint_size(p, 4, 8, dp, 1).per_rank
    assert held_bytes_per_rank(p, 4, 8, dp, 1) > 5 * written


@pytest.mark.parametrize("memory, factor, text", [
    (MemoryTierPlanOptions(replicas=1), 2.0, "x (1 + 1)"),
    (MemoryTierPlanOptions(replicas=2), 3.0, "x (1 + 2)"),
    (MemoryTierPlanOptions(), 2.0, "x (1 + 1)"),
    (MemoryTierPlanOptions(parity=8), 1 + 1 / 7, "x (1 + 1/7)"),
    (MemoryTierPlanOptions(parity=4, ranks_per_node=4), 1 + 1 / 3, "4 ranks x"),
])
def test_host_memory_per_node(memory: MemoryTierPlanOptions, factor: float, text: str) -> None:
    t = plan_tiers(**LLAMA, mtbf_hours=3, fs_gbps=200, memory=memory)
    held = held_bytes_per_rank(**LLAMA)
    assert t.held_per_rank == pytest.approx(held)
    assert t.host_memory_per_node == pytest.approx(2 * memory.ranks_per_node * held * factor)
    assert t.nodes == 1024 // memory.ranks_per_node
    assert text in "\n".join(t.lines())


@pytest.mark.parametrize("kwargs, match", [
    (dict(replicas=1, parity=4), "not both"),
    (dict(replicas=0), "replicas must be >= 1"),
    (dict(parity=1), ">= 2 nodes"),
    (dict(node_failure_share=1.5), r"\[0, 1\]"),
    (dict(memory_gbps=0), "memory_gbps"),
])
def test_memory_options_are_checked(kwargs: dict, match: str) -> None:
    with pytest.raises(OptionsError, match=match):
        MemoryTierPlanOptions(**kwargs)


def test_protection_needs_enough_nodes() -> None:
    with pytest.raises(OptionsError, match="parity group of 8 needs 8 nodes"):
        plan_tiers(70e9, 4, 8, 1, 1, mtbf_hours=3, fs_gbps=200, memory=MemoryTierPlanOptions(parity=8))
    with pytest.raises(OptionsError, match="need 2 nodes"):
        plan_tiers(7e9, 8, 1, 1, 1, mtbf_hours=3, fs_gbps=200, memory=MemoryTierPlanOptions(replicas=1))


# ------------------------------------------------------------------ ckptkit plan


def _cli(*args: str):
    from ckptkit.cli.main import cli

    return CliRunner().invoke(cli, ["plan", *args])


BASE = ("--params", "70e9", "--tp", "4", "--pp", "8", "--dp", "32", "--mtbf-hours", "2.8")


def test_cli_fs_bound() -> None:
    out = _cli(*BASE, "--write-gbps", "5", "--fs-gbps", "200")
    assert out.exit_code == 0, out.output
    assert "limited by the file system's 200 GB/s aggregate" in out.stdout
    out = _cli(*BASE, "--fs-gbps", "200")  # --write-gbps is optional once --fs-gbps is given
    assert out.exit_code == 0 and "save time: 4.9 s" in out.stdout


def test_cli_needs_a_bandwidth() -> None:
    out = _cli(*BASE)
    assert out.exit_code == 2 and "--write-gbps (per rank), --fs-gbps (aggregate), or both" in out.output


def test_cli_memory_protections_exclude_each_other() -> None:
    out = _cli(*BASE, "--fs-gbps", "200", "--memory-replicas", "1", "--memory-parity", "8")
    assert out.exit_code == 2 and "exclude each other" in out.output


def test_cli_memory_flags_need_a_memory_tier() -> None:
    out = _cli(*BASE, "--fs-gbps", "200", "--memory-gbps", "20")
    assert out.exit_code == 2 and "--memory-gbps describes a memory tier" in out.output


def test_cli_too_few_nodes_is_one_line() -> None:
    out = _cli("--params", "7e9", "--tp", "8", "--fs-gbps", "200", "--mtbf-hours", "3", "--memory-parity", "4")
    assert out.exit_code == 2 and "error: a parity group of 4 needs 4 nodes" in out.output


def test_cli_two_tiers_text_and_json() -> None:
    args = (*BASE, "--write-gbps", "5", "--fs-gbps", "200", "--memory-parity", "8", "--blocking-fraction", "0.1",
            "--ranks-per-node", "8", "--memory-gbps", "10", "--node-failure-share", "0.9",
            "--memory-restart-seconds", "60")
    text = _cli(*args)
    assert text.exit_code == 0, text.output
    assert "host memory per node: 2 steps x 8 ranks x 4.84 GiB x (1 + 1/7) = 88.5 GiB" in text.stdout
    assert "persistent only:" in text.stdout and "memory snapshot:" in text.stdout
    doc = json.loads(_cli(*args, "--json").stdout)
    tiers = doc["tiers"]
    t = plan_tiers(**LLAMA, mtbf_hours=2.8, write_gbps=5, fs_gbps=200, blocking_fraction=0.1,
                   memory=MemoryTierPlanOptions(parity=8))
    assert tiers["goodput"] == pytest.approx(t.goodput)
    assert tiers["memory"]["interval_seconds"] == pytest.approx(t.memory_interval_seconds)
    assert tiers["persistent"]["interval_seconds"] == pytest.approx(t.persistent_interval_seconds)
    assert tiers["memory"]["host_bytes_per_node"] == pytest.approx(t.host_memory_per_node)
    assert tiers["memory"]["parity"] == 8 and tiers["memory"]["replicas"] is None
    assert doc["save"]["limited_by"] == "file system" and doc["goodput"] == pytest.approx(t.persistent_only.goodput)
    # an interval the model never needs is null, not Infinity (which is not JSON)
    doc = json.loads(_cli(*args, "--node-failure-share", "1", "--json").stdout)
    assert doc["tiers"]["persistent"]["interval_seconds"] is None


def test_cli_json_without_a_memory_tier_keeps_its_keys() -> None:
    doc = json.loads(_cli(*BASE, "--write-gbps", "5", "--json").stdout)
    assert {"bytes", "save_seconds", "interval_seconds", "goodput"} <= set(doc) and "tiers" not in doc
    assert doc["save"]["limited_by"] == "per-rank bandwidth" and doc["save"]["fs_seconds"] is None


def _documented_plan_commands() -> list[list[str]]:
    """Every ``ckptkit plan ...`` line in the README and docs (continuations joined, comments dropped)."""
    commands = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text().replace("\\\n", " ")
        for m in re.finditer(r"^\s*(?:\$ )?ckptkit plan (.*)$", text, re.MULTILINE):
            commands.append(shlex.split(m.group(1), comments=True))
    return commands


def test_documented_plan_examples_run() -> None:
    commands = _documented_plan_commands()
    assert any("--memory-parity" in c and "--fs-gbps" in c for c in commands)
    for argv in commands:
        out = _cli(*argv)
        assert out.exit_code == 0, (argv, out.output)
