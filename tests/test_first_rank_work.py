"""Bookkeeping rank 0 does alone, failing with any exception: every rank fails naming it, none waits.

A job's shared bookkeeping runs on rank 0 alone — listing the run's folder before a resume or a
save, deleting a rolled-back trajectory, reading or creating the run's id — while the other ranks
go on into the next collective. Each of those places caught only the errors it expected
(ckptkit's, the storage's) and let anything else escape on rank 0 alone: a torch ``RuntimeError``,
a ``MemoryError``, a bug's ``TypeError``. Reproduced on 3 ranks for ``discard_after`` and for the
framework checkpointers' resume check: rank 0 raised at once, ranks 1 and 2 waited in the next
collective until the process group's timeout. Every such place now goes through
``engine.collective.first_rank_does``; here each one fails on rank 0 with each kind of exception,
and every rank must raise the caller's own error naming it, within the world's timeout.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ckptkit
from ckptkit import run_identity
from ckptkit.adapters import foreign_steps
from ckptkit.engine.collective import first_rank_does, resolve_comm
from ckptkit.run_folder import RunFolder
from ckptkit.storage.url import open_store

WORLD = 3
ERRORS = {"RuntimeError": RuntimeError, "MemoryError": MemoryError, "TypeError": TypeError,
          "KeyError": KeyError, "OSError": OSError, "SaveError": ckptkit.SaveError}


def _raising(error: str):
    def work(*_args, **_kwargs):
        raise ERRORS[error]("injected on rank 0")
    return work


def first_rank_work(error: str | None, subgroup: bool) -> list:
    group = dist.new_group([1, 2]) if subgroup else None
    if subgroup and dist.get_rank() == 0:
        return ["not in the group"]
    comm = resolve_comm(group)
    calls = []

    def work():
        calls.append(dist.get_rank())
        if error is not None:
            _raising(error)()
        return {"names": ["step-0000001", "step-0000002"], "rank": dist.get_rank()}

    value, failure = first_rank_does(comm, work, "testing")
    return [value, failure, calls]


@pytest.mark.parametrize("subgroup", [False, True], ids=["world", "subgroup"])
@pytest.mark.parametrize("error", [None, *ERRORS])
def test_the_first_rank_works_alone_and_every_rank_hears_how_it_went(worlds, error, subgroup):
    said = worlds.run(WORLD, first_rank_work, error, subgroup, timeout=60)
    members = [1, 2] if subgroup else [0, 1, 2]
    first = members[0]
    for rank in members:
        value, failure, calls = said[rank]
        assert calls == ([rank] if rank == first else []), said  # the group's first rank, once
        if error is None:
            assert failure is None and value == {"names": ["step-0000001", "step-0000002"], "rank": first}
        else:
            assert value is None and "injected on rank 0" in failure, said
            expected_prefix = error not in ("OSError", "SaveError")  # not ckptkit's or the storage's: named by type
            assert failure.startswith(f"{error}: ") == expected_prefix, failure


def _on_rank_0(owner, name: str, error: str):
    """Make ``owner.name`` raise ``error`` on rank 0 (this rank's process only) while the block runs."""
    import contextlib

    @contextlib.contextmanager
    def patched():
        real = getattr(owner, name)
        if dist.get_rank() == 0:
            setattr(owner, name, _raising(error))
        try:
            yield
        finally:
            setattr(owner, name, real)
    return patched()


def discard_failing(run: str, error: str) -> str:
    from tests.test_resilience_ranks import discard_after_one

    with _on_rank_0(RunFolder, "discard_after", error):
        return discard_after_one(run)


def resume_check_failing(run: str, error: str) -> str:
    comm = resolve_comm(None)
    try:
        with _on_rank_0(foreign_steps, "steps_after", error):
            foreign_steps.refuse_newer(open_store(run), run, comm, 2, foreign_steps.DCP)
        return "resumed"
    except ckptkit.CkptkitError as exc:
        return f"{type(exc).__name__}: {exc}"


def run_id_failing(run: str, error: str) -> str:
    comm = resolve_comm(None)
    try:
        with _on_rank_0(run_identity, "read_or_create", error):
            return run_identity.agree(open_store(run), comm)
    except ckptkit.CkptkitError as exc:
        return f"{type(exc).__name__}: {exc}"


CALLERS = {
    "discard_after": (discard_failing, "StorageError", "discarding the checkpoints after step 1 failed on rank 0"),
    "foreign resume check": (resume_check_failing, "ForeignCheckpointError", "could not list the folder"),
    "run id": (run_id_failing, "StorageError", "the run's id could not be read or created on rank 0"),
}


@pytest.mark.parametrize("error", ["RuntimeError", "MemoryError", "TypeError", "OSError"])
@pytest.mark.parametrize("caller", list(CALLERS))
def test_a_failure_of_rank_0s_bookkeeping_fails_every_rank_naming_it(worlds, tmp_path, caller, error):
    fn, kind, words = CALLERS[caller]
    run = str(tmp_path / "run")
    for step in (1, 2):
        ckptkit.save({"w": torch.full((4,), float(step))}, f"{run}/step-{step:07d}")
    said = worlds.run(WORLD, fn, run, error, timeout=60)  # rank 0's patch is undone before the function returns
    assert len(said) == WORLD
    for text in said:
        assert text.startswith(f"{kind}: ") and words in text and "injected on rank 0" in text, said
    if caller == "discard_after":  # nothing deleted behind the error's back
        assert [r.step for r in RunFolder(open_store(run)).records() if r.committed] == [1, 2]
