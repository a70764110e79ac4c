"""Golden checkpoints: what older ckptkit versions wrote, read by today's code bit for bit.

The on-disk format is a promise to everyone holding months-old checkpoints. tests/golden/ keeps
small checkpoints of every format version — written by the code of the commit each one's
README line names (tests/make_golden.py) and never regenerated — next to their expected content
computed without ckptkit (``expected.npz``: tensors, bfloat16 as raw uint16 bits, generator
states; ``expected.json``: values in make_golden's own encoding). Each is checked here for:
verification, every tensor through ``ckptkit.open`` bit for bit, values, metadata and per-rank
values as stored; a real load at the saving world size (its ranks played by threads of this
process) restoring every rank's generator and per-rank values; and a load in one process (another
world size) giving the same global tensors and values. No gloo world is started.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckptkit
from ckptkit.engine.loader import load_state
from ckptkit.engine.state import flatten_state
from ckptkit.layout.values import decode_value
from ckptkit.storage.url import open_store
from tests.make_golden import FIXTURES, decode, same

GOLDEN = Path(__file__).parent / "golden"
VERSIONS = sorted(p.name for p in GOLDEN.glob("v*") if p.is_dir())
CASES = [f"{v}/{name}" for v in VERSIONS for name in FIXTURES if (GOLDEN / v / name / "expected.json").exists()]


class Golden:
    def __init__(self, folder: Path, tmp: Path) -> None:
        self.doc = json.loads((folder / "expected.json").read_text())
        self.path = tmp / "ckpt"
        shutil.copytree(folder / "ckpt", self.path)  # the committed fixture is never touched by a test
        with np.load(folder / "expected.npz", allow_pickle=False) as z:
            self.arrays = {k: z[k] for k in z.files}
        self.tensors = {k: self._tensor(k, spec) for k, spec in self.doc["tensors"].items()}
        self.values = decode(self.doc["values"])
        self.rank_values = {int(r): decode(v) for r, v in self.doc["rank_values"].items()}
        self.world = self.doc["world_size"]
        self.per_rank = {int(r): {k: decode(e["value"]) if "value" in e else self.arrays[e["generator"]].tobytes()
                                  for k, e in entries.items()} for r, entries in self.doc["per_rank"].items()}

    def _tensor(self, key: str, spec: dict) -> torch.Tensor:
        a = self.arrays[spec["array"]]
        t = torch.from_numpy(a.copy())
        if spec["dtype"] == "bfloat16":
            assert a.dtype == np.uint16, key
            t = t.view(torch.bfloat16)
        assert str(t.dtype).removeprefix("torch.") == spec["dtype"] and list(t.shape) == spec["shape"], key
        return t

    def generators(self, rank: int) -> dict[str, bytes]:
        return {k: v for k, v in self.per_rank.get(rank, {}).items() if self.doc["per_rank"][str(rank)][k].get("generator")}


@pytest.fixture(params=CASES)
def golden(request: pytest.FixtureRequest, tmp_path: Path) -> Golden:
    return Golden(GOLDEN / request.param, tmp_path)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_exact(got: torch.Tensor, want: torch.Tensor, key: str) -> None:
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (key, got.dtype, want.dtype, got.shape)
    assert torch.equal(bits(got), bits(want)), f"{key}: bytes differ"


def assert_same(got: Any, want: Any, what: str) -> None:
    assert same(got, want), f"{what}: got {got!r}, expected {want!r}"


# ---------------------------------------------------------------- the fixture set itself

def test_every_version_has_every_fixture_in_its_own_format():
    assert {"v1", "v2"} <= set(VERSIONS)
    for v in VERSIONS:
        for name in FIXTURES:
            folder = GOLDEN / v / name
            doc = json.loads((folder / "expected.json").read_text())
            assert doc["fixture"] == name and f"v{doc['format_version']}" == v, folder
            raw = (folder / "ckpt" / "manifest.json").read_bytes()
            assert json.loads(raw)["version"] == doc["format_version"], folder  # really written in that format
            assert (b'"manifest_sha256"' in raw) == (doc["format_version"] >= 2), folder  # v2 seals its manifest
    size = sum(p.stat().st_size for p in GOLDEN.rglob("*") if p.is_file())
    assert size < 2 << 20, f"tests/golden/ holds {size} bytes: keep fixtures tiny"


# ---------------------------------------------------------------- read with today's code

def test_verifies(golden: Golden):
    report = ckptkit.verify(golden.path)
    assert report.ok, report.problems


def test_open_returns_every_tensor_bit_for_bit(golden: Golden):
    view = ckptkit.open(golden.path)
    assert view.world_size == golden.world
    assert sorted(view.keys()) == sorted(golden.tensors)
    for key, want in golden.tensors.items():
        assert_bit_exact(view[key][...], want, key)


def test_values_metadata_and_per_rank_values_as_stored(golden: Golden):
    view = ckptkit.open(golden.path)
    assert sorted(view.values) == sorted(golden.values)
    for key, want in golden.values.items():
        assert_same(view.values[key], want, key)
    for rank in range(golden.world):  # what each rank of a same-size job gets back
        assert_same(view.values_of(rank), {**golden.values, **golden.rank_values.get(rank, {})}, f"values of rank {rank}")
    if golden.doc["metadata"] is not None:  # what save(metadata=) got
        assert_same(decode_value(view.meta["user"], "metadata"), decode(golden.doc["metadata"]), "metadata")
    for rank in range(golden.world):
        stored = view.per_rank_values(rank)
        want = golden.per_rank.get(rank, {})
        assert sorted(stored) == sorted(want), rank
        for key, value in want.items():
            if key in golden.generators(rank):
                continue  # a generator's state is checked by restoring it (test_load_at_the_saving_world_size)
            assert_same(decode_value(stored[key], key), value, f"per-rank value {key} of rank {rank}")


def blank_state(golden: Golden, rank: int | None) -> dict[str, Any]:
    """A state asking for every tensor in full (zeros), every value (None) and, for ``rank``, its
    per-rank values (a fresh torch.Generator, ckptkit.PerRank(None))."""
    state: dict[str, Any] = {}

    def put(key: str, leaf: Any) -> None:
        parts = [p.replace("%2F", "/").replace("%25", "%") for p in key.split("/")]
        node = state
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = leaf

    for key, t in golden.tensors.items():
        put(key, torch.zeros_like(t))
    for key in {**golden.values, **golden.rank_values.get(rank if rank is not None else -1, {})}:
        put(key, None)
    if rank is not None:
        for key in golden.per_rank.get(rank, {}):
            put(key, torch.Generator() if key in golden.generators(rank) else ckptkit.PerRank(None))
    return state


def leaf(state: dict[str, Any], key: str) -> Any:
    node: Any = state
    for p in key.split("/"):
        node = node[p.replace("%2F", "/").replace("%25", "%")]
    return node


def test_load_in_one_process_gives_the_same_global_tensors(golden: Golden):
    state = blank_state(golden, None)
    ckptkit.load(state, golden.path, strict=False, options=ckptkit.LoadOptions(per_rank_on_resize="skip"))
    for key, want in golden.tensors.items():
        assert_bit_exact(leaf(state, key), want, key)
    for key, want in golden.values.items():
        assert_same(leaf(state, key), want, key)


class ThreadComm:
    """ckptkit's collectives for ranks played by threads of this process."""

    def __init__(self, rank: int, shared: dict[str, Any]) -> None:
        self.rank, self.world_size, self.shared = rank, shared["world"], shared

    def _exchange(self, obj: Any) -> list[Any]:
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = obj
        barrier.wait()
        out = list(slots)
        barrier.wait()
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        return self._exchange(obj)

    def all_gather_json(self, obj: Any) -> list[Any]:
        return [json.loads(json.dumps(o)) for o in self._exchange(obj)]

    def gather(self, obj: Any) -> list[Any] | None:
        out = self._exchange(obj)
        return out if self.rank == 0 else None

    def broadcast(self, obj: Any) -> Any:
        return self._exchange(obj)[0]

    def any_flags(self, flags: list[bool]) -> list[bool]:
        return [any(f) for f in zip(*self._exchange(flags))]

    def all_min(self, values: list[int]) -> list[int]:
        return [min(v) for v in zip(*self._exchange(values))]


def test_load_at_the_saving_world_size_restores_each_ranks_own_values(golden: Golden):
    world = golden.world
    shared = {"world": world, "slots": [None] * world, "barrier": threading.Barrier(world, timeout=30)}
    states = [blank_state(golden, r) for r in range(world)]
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            load_state(flatten_state(states[rank]), open_store(golden.path), ThreadComm(rank, shared), strict=True,
                       options=ckptkit.LoadOptions())
        except BaseException as exc:  # noqa: BLE001 - raised in the test thread
            errors.append(exc)
            shared["barrier"].abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    for rank, state in enumerate(states):
        for key, want in golden.tensors.items():
            assert_bit_exact(leaf(state, key), want, f"{key} on rank {rank}")
        for key, want in {**golden.values, **golden.rank_values.get(rank, {})}.items():
            assert_same(leaf(state, key), want, f"{key} on rank {rank}")
        gens = golden.generators(rank)
        for key, want in golden.per_rank.get(rank, {}).items():
            got = leaf(state, key)
            if key in gens:
                assert got.get_state().numpy().tobytes() == want, f"generator {key} of rank {rank}"
            else:
                assert_same(got.value, want, f"per-rank value {key} of rank {rank}")
