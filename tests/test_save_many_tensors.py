"""Saves of many small tensors, as a MoE rank holds them (every local expert's weights and both Adam
moments of each): the checksum batches, the process writer's packed answers, sources that hand out
a piece only once an earlier one is released, and the garbage collector left as the save found it.

Why: a save's background work used to queue one checksum task per piece and build its metadata
with the collector running; with thousands of pieces that set off full collections, tens of ms
each, in which the training thread could not run (benchmarks/bench_launch_stall.py). The pieces
are now checksummed in batches, the metadata built with the collector paused, and the process
writer's plan and answers packed. Each of those must still give every piece its own checksums.
"""

from __future__ import annotations

import gc
import random
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
import ckptkit.engine.writer as writer
from ckptkit.engine.async_save import AsyncSaver
from ckptkit.engine.block_crc import block_crcs
from ckptkit.engine.collective import LocalComm, Outcome
from ckptkit.engine.saver import bind, classify_state, plan_collective
from ckptkit.engine.state import flatten_state
from ckptkit.engine.tensor_bytes import as_bytes
from ckptkit.engine.writer_process import _pack_crcs, _unpack_crcs
from ckptkit.errors import SaveError
from ckptkit.storage import open_store

BLOCK = 4096
OPTIONS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=20)


def many_tensors(sizes: list[int], seed: int) -> dict[str, torch.Tensor]:
    """Tensors of ``sizes`` bytes (multiples of 4 as float32, the rest as uint8), distinct values."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for i, n in enumerate(sizes):
        if n % 4 == 0:
            state[f"experts.{i}.w"] = torch.randn(n // 4, generator=g)
        else:
            state[f"experts.{i}.b"] = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return state


def loads_back(state: dict[str, torch.Tensor], path) -> None:
    """Every tensor loads bit-equal. The load checks every block's CRC, so a checksum that went to
    another piece (or another block) fails here, naming the tensor."""
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    ckptkit.load(target, str(path))
    for k, v in state.items():
        assert torch.equal(target[k], v), k


@pytest.fixture(scope="module")
def process_saver():
    saver = AsyncSaver(options=ckptkit.AsyncOptions(executor="process", block_size=BLOCK))
    yield saver
    saver.close()


sizes_st = st.lists(st.integers(0, 5 * BLOCK + 3), min_size=1, max_size=60)


@settings(**OPTIONS)
@given(sizes=sizes_st, batch=st.sampled_from([1, 5000, BLOCK * 3, 1 << 20]), seed=st.integers(0, 9))
def test_every_piece_keeps_its_own_checksums_whatever_the_batches(sizes, batch, seed, tmp_path_factory, monkeypatch,
                                                                  process_saver):
    monkeypatch.setattr(writer, "CRC_BATCH_BYTES", batch)
    state = many_tensors(sizes, seed)
    root = tmp_path_factory.mktemp("many")
    ckptkit.save(state, str(root / "sync"), options=ckptkit.SaveOptions(block_size=BLOCK))  # write_pieces
    handle = ckptkit.save_async(state, str(root / "thread"), options=ckptkit.AsyncOptions(block_size=BLOCK))
    handle.wait()  # write_staged_spans, one checksum task for every piece
    process_saver.save(state, open_store(str(root / "process")))
    process_saver.wait()  # the same in the writer process, its plan and answers packed
    for name in ("sync", "thread", "process"):
        loads_back(state, root / name)


def test_a_source_that_waits_for_a_release_is_never_kept_waiting(tmp_path):
    """A streaming source (the offline writer's readers) hands out its next piece only once an earlier one
    is released; pieces checksummed in batches would wait for pieces that wait for them. Here every piece
    waits for the release of the one before it."""
    state = many_tensors([BLOCK // 2] * 200, seed=1)
    cls = classify_state(flatten_state(state), 0)
    plan, planned = plan_collective(cls, Outcome(True), LocalComm(), "test")
    assert plan is not None and planned.ok
    prep = bind(plan, cls)
    store = open_store(str(tmp_path / "c"))
    assert store.streams_writes
    free = threading.Semaphore(1)
    released: list[int] = []

    def tensor_for(item):
        assert free.acquire(timeout=30), "the writer waited for a piece it had not released"
        return prep.tensors[item.ref]

    def release(item):
        released.append(item.ref)
        free.release()

    entries = writer.write_pieces(store, prep.plan, tensor_for, BLOCK, release=release)
    assert sorted(released) == sorted(i.ref for i in prep.plan.items)  # each once
    by_item = {(e.tensor, e.offset): e.crcs for e in entries}
    for item in prep.plan.items:
        assert by_item[(item.tensor, item.offset)] == block_crcs(as_bytes(prep.tensors[item.ref]), BLOCK)


@given(st.lists(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=9), max_size=50))
def test_the_process_writers_packed_answer_round_trips(crcs):
    crcs = [tuple(c) for c in crcs]
    assert _unpack_crcs(_pack_crcs(crcs), len(crcs)) == crcs


def test_a_process_writers_answer_for_other_pieces_is_refused():
    packed = _pack_crcs([(1, 2), (3,)])
    with pytest.raises(SaveError, match="2 pieces' checksums for 3"):
        _unpack_crcs(packed, 3)
    with pytest.raises(SaveError, match="2 checksums where it counted 3"):
        _unpack_crcs((packed[0], packed[1][:-4]), 2)


@pytest.mark.parametrize("enabled", [True, False], ids=["collector-on", "collector-off"])
def test_a_save_and_a_load_leave_the_collector_as_they_found_it(enabled, tmp_path, process_saver):
    """Megatron-LM's ``--manual-gc`` turns the collector off for the whole run and collects at its own
    intervals: a save that paused and resumed it must not turn it back on, nor leave it off for a run that
    has it on."""
    state = many_tensors([BLOCK] * 300, seed=2)
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        ckptkit.save(state, str(tmp_path / "sync"))
        assert gc.isenabled() is enabled
        ckptkit.save_async(state, str(tmp_path / "thread")).wait()
        assert gc.isenabled() is enabled
        process_saver.save(state, open_store(str(tmp_path / "process")))
        process_saver.wait()
        assert gc.isenabled() is enabled
        loads_back(state, tmp_path / "thread")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("how", ["async", "sync"])
def test_a_save_of_thousands_of_tensors_allocates_little_in_the_collectors_sight(how, tmp_path):
    """Every collection stops every thread of the process, the training thread too; a save's own
    allocations set them off. A save of 4,096 tensors (after the first) set off about 170 young and middle
    collections asynchronously and 290 synchronously before the checksums were batched and the metadata
    built with the collector paused; about 19 and 47 since, and full collections in proportion. A count,
    not a time: it follows from how many collectable objects the save's code makes, not from the machine."""
    state = many_tensors([1024] * 4096, seed=3)
    counts = [0, 0, 0]

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            counts[info["generation"]] += 1

    saver = AsyncSaver()
    try:
        for rep in range(3):
            gc.collect()
            counts[:] = [0, 0, 0]
            gc.callbacks.append(count)
            try:
                if how == "async":
                    saver.save(state, open_store(str(tmp_path / f"c{rep}")))
                    saver.wait()
                else:
                    ckptkit.save(state, str(tmp_path / f"c{rep}"))
            finally:
                gc.callbacks.remove(count)
    finally:
        saver.close()
    limit = {"async": 50, "sync": 90}[how]
    assert counts[0] + counts[1] < limit, f"collections (young, middle, full) during the last save: {counts}"


def test_the_process_writer_never_persists_an_earlier_staging_buffer(tmp_path):
    """The writer process is handed the staging buffer once and keeps it; a new buffer (the state's structure
    changed, so the plan and its buffer did) must be handed over again. It was recognised by ``id()`` of a
    temporary storage wrapper, which Python reuses at once: a new buffer passed for the old one, and the
    writer persisted the previous save's bytes (with their own, matching checksums when the new buffer was
    smaller) under the new step. Here every save has another structure, so another buffer, and new values."""
    saver = AsyncSaver(options=ckptkit.AsyncOptions(executor="process"))
    rng = random.Random(0)
    try:
        for rep in range(40):
            sizes = [4 * rng.randint(1, 2048) for _ in range(rng.randint(1, 12))]  # another structure, another buffer
            state = many_tensors(sizes, seed=100 + rep)
            saver.save(state, open_store(str(tmp_path / f"c{rep}")))
            saver.wait()
            loads_back(state, tmp_path / f"c{rep}")
    finally:
        saver.close()
