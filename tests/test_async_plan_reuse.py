"""An asynchronous save reuses the plan of the last save whose structure had the same fingerprint;
anything a manifest records that the fingerprint leaves out is committed stale. Found by a hunt
(2026-12-06): a save whose partition rule alone changed committed the previous save's rule (and
``ckptkit reshard`` then copied the tensor whole instead of splitting it). And the metadata of a save
was encoded when the background thread committed, so a caller's dict changed after ``save_async``
returned (a reused one, a metric's list) committed the later values.

The class test: a seeded random walk over state structures (partition rules, keys, shapes, dtypes,
pieces, plain tensors, values), each saved by one long-lived ``AsyncSaver`` and synchronously; the
two checkpoints' manifests and indexes must be equal but for the attempt's own names, and the
asynchronous one must load bit-exact."""

from __future__ import annotations

import json
import random

import pytest
import torch

import ckptkit
from ckptkit.engine.async_save import AsyncSaver
from ckptkit.storage import open_store

RULES = [None, ckptkit.PartitionRule(tp_axis=0), ckptkit.PartitionRule(tp_axis=1),
         ckptkit.PartitionRule(tp_axis=0, fused=(2, 2)), ckptkit.PartitionRule(tp_axis=1, dp_axis=0),
         ckptkit.PartitionRule(layer=1), ckptkit.PartitionRule(expert=0, num_experts=2)]


CHOICES = {
    "shape": [(4, 6), (4, 4), (6, 4)], "dtype": [torch.float32, torch.bfloat16], "split": [False, True],
    "order": [False, True], "rule": RULES, "extra": [(), ("a",), ("b",), ("a", "c"), ("c", "a")],
    "extra_shape": [(3,), (2, 2)], "step": [False, True],
}


def _walk(rnd: random.Random, previous: dict | None) -> dict:
    """The next structure: the previous one with one choice drawn again (or a fresh draw now and then),
    which is exactly when a cached plan is reused, or must not be."""
    if previous is None or rnd.random() < 0.15:
        return {name: rnd.choice(options) for name, options in CHOICES.items()}
    name = rnd.choice(list(CHOICES))
    return {**previous, name: rnd.choice(CHOICES[name])}


def _state(c: dict) -> dict:
    shape = c["shape"]
    local = torch.randn(shape).to(c["dtype"])
    if not c["split"]:
        pieces = [ckptkit.box_piece("w", shape, (0, 0), shape)]
    else:  # two boxes of one tensor, in either order
        half = shape[0] // 2
        pieces = [ckptkit.box_piece("w", shape, (0, 0), (half, shape[1])),
                  ckptkit.box_piece("w", shape, (half, 0), (shape[0] - half, shape[1]), local_offsets=(half, 0))]
        pieces = pieces[::-1] if c["order"] else pieces
    rule = c["rule"]
    state: dict = {"w": ckptkit.Sharded(local, pieces, rule=rule if _fits(rule, shape) else None)}
    for key in c["extra"]:
        state[key] = torch.randn(c["extra_shape"])
    if c["step"]:
        state["step"] = 7
    return state


def _fits(rule, shape) -> bool:
    return rule is None or rule.fused is None or sum(rule.fused) == shape[rule.tp_axis]


def _committed(path) -> tuple[dict, list]:
    """The manifest and its indexes with the attempt's own names and its time taken out."""
    manifest = json.loads((path / "manifest.json").read_text())
    attempt = manifest.pop("attempt")
    indexes = [json.loads((path / entry[1]).read_text().replace(attempt, "ATTEMPT")) for entry in manifest.pop("indexes")]
    manifest.pop("manifest_sha256")
    manifest["meta"].pop("created")
    return manifest, indexes


def _same_tensors(got: dict, want: dict) -> bool:
    for key, value in want.items():
        value = value.local if isinstance(value, ckptkit.Sharded) else value
        other = got[key].local if isinstance(got[key], ckptkit.Sharded) else got[key]
        if isinstance(value, torch.Tensor) and not torch.equal(value, other):
            return False
        if not isinstance(value, torch.Tensor) and value != other:
            return False
    return True


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_every_async_save_commits_what_a_sync_save_of_its_state_does(tmp_path, executor):
    seed = random.randrange(10**6)
    rnd = random.Random(seed)
    saver = AsyncSaver(ckptkit.AsyncOptions(executor=executor))
    try:
        choices = None
        for i in range(30 if executor == "thread" else 12):
            choices = _walk(rnd, choices)
            state = _state(choices)
            saver.save(state, open_store(str(tmp_path / f"a{i}"))).wait()
            ckptkit.save(state, str(tmp_path / f"s{i}"))
            assert _committed(tmp_path / f"a{i}") == _committed(tmp_path / f"s{i}"), (seed, i, choices)
            back = {k: (ckptkit.Sharded(torch.zeros_like(v.local), v.pieces, rule=v.rule)
                        if isinstance(v, ckptkit.Sharded) else torch.zeros_like(v) if isinstance(v, torch.Tensor)
                        else -1) for k, v in state.items()}
            ckptkit.load(back, str(tmp_path / f"a{i}"))
            assert _same_tensors(back, state), (seed, i)
    finally:
        saver.close()


def test_metadata_is_committed_as_it_was_when_the_save_was_called(tmp_path, held_writes):
    meta = {"step": 1, "epochs": [0], "nested": {"seen": [1]}}
    handle = ckptkit.save_async({"w": torch.ones(8)}, str(tmp_path / "one"), metadata=meta)
    meta["step"] = 2  # the training loop reuses its dict for the next step
    meta["epochs"].append(1)
    meta["nested"]["seen"].append(2)
    held_writes.set()
    handle.wait()
    assert ckptkit.open(tmp_path / "one").meta["user"] == {"step": 1, "epochs": [0], "nested": {"seen": [1]}}
    ckptkit.close_async()


def test_metrics_are_committed_as_they_were_when_the_save_was_called(tmp_path, held_writes):
    mgr = ckptkit.CheckpointManager(str(tmp_path / "run"), save=ckptkit.SavePolicy(every_steps=1))
    recent = [0.5]
    mgr.maybe_save(1, {"w": torch.ones(8)}, metrics={"val_loss": 0.5, "recent": recent})
    recent.append(0.1)
    held_writes.set()
    mgr.close()
    assert mgr.records()[0].metrics == {"val_loss": 0.5, "recent": [0.5]}
