"""A save that fails on one rank, anywhere, with any exception: every rank fails naming it, none waits.

The save paths carried a rank's failure through their collectives only when it was ckptkit's own
or the storage's (``CkptkitError``, ``OSError``). Anything else — a torch ``RuntimeError`` from a
copy, a ``MemoryError`` while staging, a ``ValueError`` or ``TypeError`` from a bug — escaped on
that rank before the next collective, and the other ranks waited in it until the process group's
timeout (30 minutes by default), then died. Reproduced on 2 ranks with a ``RuntimeError`` in the
background write: rank 1 raised at once, rank 0 hung.

Here each point of the save where a rank works alone before a collective raises on one rank, for
every save mode: the synchronous save, the background thread, the overlapped snapshot and staging
in waves. Every rank must raise ``SaveError`` naming that rank and the exception, within the
world's timeout; the failed step must not be committed; the step before must load as saved; and
the next save must commit.
"""

from __future__ import annotations

import contextlib
import os
import re

import pytest
import torch
import torch.distributed as dist

import ckptkit
import ckptkit.engine.async_save as async_save
import ckptkit.engine.overlap as overlap
import ckptkit.engine.saver as saver

WORLD = 3

MODES = {
    "sync": None,
    "thread": ckptkit.AsyncOptions(),
    "overlap": ckptkit.AsyncOptions(snapshot="overlap"),
    "waves": ckptkit.AsyncOptions(max_staging_bytes=8192, over_budget="waves"),
}

# (module, attribute) a rank calls alone before the save's next collective, per mode
POINTS = {
    "classify": {"sync": (saver, "flatten_state"), "*": (async_save, "flatten_state")},
    "stage": {"thread": (async_save, "snapshot"), "overlap": (overlap.OverlapSnapshot, "copy"),
              "waves": (async_save, "stage_in_waves")},
    "write": {"sync": (saver, "write_pieces"), "thread": (async_save, "write_staged"),
              "overlap": (async_save, "write_staged"), "waves": (async_save, "write_waves")},
    "index": {"sync": (saver, "write_index"), "*": (async_save, "write_index")},
    "check target (rank 0)": {"*": (saver, "check_target")},
    "merge (rank 0)": {"*": (saver, "merge_gathered")},
}
ERRORS = {"RuntimeError": RuntimeError, "MemoryError": MemoryError, "ValueError": ValueError,
          "TypeError": TypeError, "KeyError": KeyError}


def where(point: str, mode: str):
    table = POINTS[point]
    return table.get(mode, table.get("*"))


@contextlib.contextmanager
def raising(owner, name: str, error: type[BaseException], message: str):
    """``owner.name`` raises ``error(message)`` while inside; restored after (the ranks are reused)."""
    original = getattr(owner, name)

    def fail(*args, **kwargs):
        raise error(message)

    setattr(owner, name, fail)
    try:
        yield
    finally:
        setattr(owner, name, original)


def state_of(step: int, rank: int) -> dict:
    """A rank's state: replicas every rank holds (written by one of them) and a tensor of its own
    (so every rank writes, and stages, bytes: over the waves budget)."""
    return {"w": torch.full((32, 64), float(100 * step)), "b": torch.arange(16.0) + step, "step": step,
            f"own{rank}": torch.full((48, 64), float(100 * step + rank))}


def save_with_a_fault(run: str, mode: str, point: str, error: str, bad_rank: int) -> str:
    rank = dist.get_rank()
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.SGD(params, lr=0.1)
    mgr = ckptkit.CheckpointManager(run, asynchronous=MODES[mode], guard=optimizer)
    try:
        mgr.save(1, state_of(1, rank))
        mgr.wait()
        owner, name = where(point, mode)
        outcome = "committed"
        fault = raising(owner, name, ERRORS[error], f"injected on rank {rank}") if rank == bad_rank else contextlib.nullcontext()
        handle = None
        with fault:
            try:
                handle = mgr.save(2, state_of(2, rank))
                optimizer.step()  # the overlapped snapshot's copy is final before the state changes
                if handle is not None:
                    handle.committed.result(timeout=120)
            except ckptkit.SaveError as exc:
                outcome = str(exc)
                if handle is not None:
                    mgr.acknowledge(handle)
        mgr.save(3, state_of(3, rank))
        mgr.wait()
        return outcome
    finally:
        mgr.close()


CASES = [(mode, point) for point in POINTS for mode in MODES if where(point, mode) is not None]


@pytest.mark.parametrize("mode,point", CASES, ids=[f"{m}-{p.split()[0]}" for m, p in CASES])
def test_a_save_failing_on_one_rank_fails_on_every_rank_and_names_it(worlds, tmp_path, mode, point):
    i = CASES.index((mode, point))
    error = list(ERRORS)[i % len(ERRORS)]
    bad_rank = 0 if "rank 0" in point else 1 + i % (WORLD - 1)
    run = str(tmp_path / "run")
    said = worlds.run(WORLD, save_with_a_fault, run, mode, point, error, bad_rank, timeout=150)
    for rank, text in enumerate(said):
        assert re.search(rf"rank {bad_rank}( \(committing\))?: {error}: '?injected on rank {bad_rank}", text), (rank, text)
    assert not os.path.exists(os.path.join(run, "step-0000002", "manifest.json"))
    for step in (1, 3):
        want = {k: v for r in range(WORLD) for k, v in state_of(step, r).items()}
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in want.items()}
        ckptkit.load(target, os.path.join(run, f"step-{step:07d}"))
        assert all(torch.equal(target[k], v) if isinstance(v, torch.Tensor) else target[k] == v for k, v in want.items())
