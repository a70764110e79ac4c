"""A bit flipped anywhere in a committed multi-rank checkpoint is caught, or changes nothing.

Every file of a checkpoint saved by 2 real gloo ranks — the manifest (tensor layouts, values,
metadata, index digests), every index (pieces, offsets, checksums, per-rank values) and every data
object — gets single-bit flips. After each flip, a load at another world size (this process), a
lazy view of every tensor and value, and the per-rank values must either give back exactly what
was saved or raise a ckptkit error; ``verify`` must flag every flip that changes what a load can
return. Flips in the alignment padding between pieces change nothing a load returns: they are
counted apart. The default run flips a sample of positions; ``--run-slow`` flips every byte of
every metadata file.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.distributed as dist

import ckptkit
from ckptkit.layout.box import Box
from tests.conftest import trials

WORLD = 2


def rank_state(rank: int, blank: bool = False) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    shared = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    own = torch.randn(50, 3, generator=g)
    # a ZeRO-like flat buffer: each rank holds half of the flattening of "opt/m" (7 x 5)
    full = torch.linspace(-3, 3, 35)
    lo, hi = (0, 18) if rank == 0 else (18, 35)
    buf = full[lo:hi].clone()
    piece = ckptkit.flat_piece("opt/m", (7, 5), Box.full((7, 5)), lo, hi)
    state = {
        "shared": torch.zeros_like(shared) if blank else shared,
        f"stage{rank}": {"w": torch.zeros_like(own) if blank else own},
        "opt": ckptkit.Sharded(torch.zeros_like(buf) if blank else buf, [piece]),
        "train": {"step": 0 if blank else 1234, "lr": 0.0 if blank else 3e-4, "tag": "" if blank else "run-a",
                  "sched": [] if blank else [1, 2.5, (3, "x")]},
        "loader": ckptkit.PerRank(None if blank else {"pos": 77 + rank}),
    }
    return state


def save_rank(path: str) -> None:
    ckptkit.save(rank_state(dist.get_rank()), path, metadata={"step": 1234})


def expected() -> dict:
    """What a one-process load of the whole model must return."""
    s0, s1 = rank_state(0), rank_state(1)
    return {"shared": s0["shared"], "stage0/w": s0["stage0"]["w"], "stage1/w": s1["stage1"]["w"],
            "opt/m": torch.linspace(-3, 3, 35).reshape(7, 5), "train": s0["train"]}


def load_whole(path: str) -> dict | Exception:
    """Load every tensor and value at world size 1; the exception if ckptkit refused."""
    s0 = rank_state(0, blank=True)
    state = {"shared": s0["shared"], "stage0": {"w": torch.zeros(50, 3)}, "stage1": {"w": torch.zeros(50, 3)},
             "opt": {"m": torch.zeros(7, 5)}, "train": s0["train"], "loader": ckptkit.PerRank(None)}
    try:
        ckptkit.load(state, path, options=ckptkit.LoadOptions(per_rank_on_resize="skip"))
        view = ckptkit.open(path)
        viewed = {k: view[k][...] for k in view.keys()}
        values = view.values
        per_rank = view.all_per_rank_values()
    except ckptkit.CkptkitError as exc:
        return exc
    return {"shared": state["shared"], "stage0/w": state["stage0"]["w"], "stage1/w": state["stage1"]["w"],
            "opt/m": state["opt"]["m"], "train": state["train"], "viewed": viewed, "values": values,
            "per_rank": per_rank}


def identical(got: dict, want: dict, per_rank: dict) -> bool:
    for k in ("shared", "stage0/w", "stage1/w", "opt/m"):
        if not torch.equal(got[k], want[k]) or not torch.equal(got["viewed"][k], want[k]):
            return False
    train = {f"train/{k}": v for k, v in want["train"].items()}
    return got["train"] == want["train"] and got["values"] == train and got["per_rank"] == per_rank


def flip(path: Path, offset: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))


def test_every_flip_is_caught_or_harmless(worlds, tmp_path):
    ckpt = tmp_path / "step-0001234"
    worlds.run(WORLD, save_rank, str(ckpt))
    want = expected()
    baseline = load_whole(str(ckpt))
    assert not isinstance(baseline, Exception), baseline
    per_rank = baseline["per_rank"]
    assert identical(baseline, want, per_rank) and per_rank == {0: {"loader": {"pos": 77}}, 1: {"loader": {"pos": 78}}}
    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    rng = random.Random(0)
    tried = caught = harmless = 0
    harmless_in_metadata: list[str] = []
    silent: list[str] = []
    unflagged: list[str] = []
    for path in files:
        size = path.stat().st_size
        metadata = path.suffix == ".json"
        if metadata:
            positions = range(size) if trials(0, 1) else sorted(rng.sample(range(size), min(size, 60)))
        else:
            positions = sorted(rng.sample(range(size), min(size, trials(40, 600))))
        for offset in positions:
            bit = rng.randrange(8)
            flip(path, offset, bit)
            try:
                got = load_whole(str(ckpt))
                tried += 1
                if isinstance(got, Exception):
                    caught += 1
                elif identical(got, want, per_rank):
                    harmless += 1
                    if metadata:
                        harmless_in_metadata.append(f"{path.name}@{offset}^{bit}")
                else:
                    silent.append(f"{path.name}@{offset}^{bit}")
                changes_values = isinstance(got, Exception) or not identical(got, want, per_rank)
                if changes_values and ckptkit.verify(str(ckpt)).ok:
                    unflagged.append(f"{path.name}@{offset}^{bit}")
            finally:
                flip(path, offset, bit)
    print(f"bit flips: {tried} tried, {caught} caught, {harmless} harmless (padding), {len(silent)} silent")
    assert not silent, f"flips that changed what a load returned without an error: {silent[:10]}"
    assert not unflagged, f"value-changing flips verify did not flag: {unflagged[:10]}"
    # metadata is covered byte for byte (the manifest by its seal, each index by the manifest's digest)
    assert not harmless_in_metadata, harmless_in_metadata[:10]
    assert load_whole(str(ckpt)) is not None and ckptkit.verify(str(ckpt)).ok
