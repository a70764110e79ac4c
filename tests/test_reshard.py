"""``ckptkit reshard``: real checkpoints rewritten at other layouts, read back bit for bit."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

import ckptkit
from ckptkit.cli.main import cli
from ckptkit.engine.metadata_io import read_indexes, read_manifest
from ckptkit.offline.resharding import ReshardOptions, reshard
from ckptkit.errors import CheckpointNotFoundError, CorruptCheckpointError, SaveError
from ckptkit.layout.config import ParallelConfig
from ckptkit.layout.grid import GridLayout
from ckptkit.layout.manifest import ExplicitLayout
from ckptkit.layout.pieces import LocalBox, Piece
from ckptkit.layout.box import Region
from ckptkit.plan.reshard_plan import ReshardError, ReshardPlanOptions
from ckptkit.storage.url import open_store
from tests.reshard_fixtures import gpt_tensors, write_at
from tests.ckpt_files import data_object, without_attempt

TENSORS = gpt_tensors()


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reshard") / "src-tp2pp2"
    write_at(path, TENSORS, ParallelConfig.parse("tp2pp2"), values={"step": 7, "sched": {"lr": 0.5}})
    return path


def tree_digest(path: Path) -> dict[str, str]:
    """File digests by name, save-attempt ids dropped (two writes of the same content compare equal)."""
    return {without_attempt(str(p.relative_to(path))): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _chunk(lo: int, hi: int, k: int, n: int) -> tuple[int, int]:
    """The ``k``-th of ``n`` equal chunks of ``[lo, hi)`` (the tests' sizes divide evenly)."""
    assert (hi - lo) % n == 0
    size = (hi - lo) // n
    return lo + k * size, lo + (k + 1) * size


def held_runs(shape: tuple[int, ...], rule, cfg: ParallelConfig, rank: int) -> list[list[tuple[int, int]]] | None:
    """The oracle, by hand from the degrees and the Megatron conventions (not from ckptkit's rules):
    per dimension, the model-space index ranges target ``rank`` holds; None when it holds nothing.

    Ranks are tp fastest, then dp, then pp. Layers (``layer_axis``) go to pipeline chunks in
    order, chunk ``k`` on stage ``k % pp`` (``pp_layers`` or an even split of ``pp * vpp``
    chunks); ``stage`` pins a tensor to one stage (negative: from the last). ``tp_axis`` is split
    in ``tp`` equal slices — column-parallel weights along their output rows, row-parallel along
    their input columns — each fused part (SwiGLU gate, up) sliced on its own, a vocabulary axis
    padded to a multiple of ``vocab_multiple * tp`` first (the padding holds no model data)."""
    tp_rank, dp_rank, pp_rank = rank % cfg.tp, (rank // cfg.tp) % cfg.dp, rank // (cfg.tp * cfg.dp)
    assert 0 <= dp_rank < cfg.dp and cfg.cp == cfg.ep == 1  # dense tensors: replicated over dp
    runs = [[(0, n)] for n in shape]
    if rule.stage is not None and rule.stage % cfg.pp != pp_rank:
        return None
    if rule.layer_axis is not None:
        n = shape[rule.layer_axis]
        chunks = cfg.pp_layers or (n // (cfg.pp * cfg.vpp),) * (cfg.pp * cfg.vpp)
        bounds = [sum(chunks[:k]) for k in range(len(chunks) + 1)]
        runs[rule.layer_axis] = [(bounds[k], bounds[k + 1]) for k in range(len(chunks))
                                 if k % cfg.pp == pp_rank and bounds[k + 1] > bounds[k]]
    if rule.tp_axis is not None:
        n = shape[rule.tp_axis]
        if rule.fused:
            starts = [sum(rule.fused[:i]) for i in range(len(rule.fused))]
            runs[rule.tp_axis] = [_chunk(a, a + part, tp_rank, cfg.tp) for a, part in zip(starts, rule.fused)]
        elif rule.vocab_multiple:
            m = rule.vocab_multiple * cfg.tp
            lo, hi = _chunk(0, -(-n // m) * m, tp_rank, cfg.tp)
            runs[rule.tp_axis] = [(lo, min(hi, n))] if min(hi, n) > lo else []
        else:
            runs[rule.tp_axis] = [_chunk(0, n, tp_rank, cfg.tp)]
    return runs if all(runs) else None


def mask_of(shape: tuple[int, ...], runs: list[list[tuple[int, int]]] | None) -> torch.Tensor:
    mask = torch.zeros(shape, dtype=torch.bool)
    if runs is not None:
        for box in itertools.product(*runs):
            mask[tuple(slice(a, b) for a, b in box)] = True
    return mask


def stored_by_rank(path: Path, manifest, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """What ``rank`` stored, read from the raw bytes of its own data object (row-major pieces,
    little-endian; docs/format.md), placed by the index's regions: per tensor, (values, count of
    stores of each element) in model space."""
    index = read_indexes(open_store(path), manifest, {rank})[rank]
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    blobs: dict[str, bytes] = {}
    for e in index.entries:
        assert re.fullmatch(rf"data/rank-{rank:05d}-[0-9a-f]{{12}}\.bin", e.object), (rank, e.object)
        if e.object not in blobs:
            blobs[e.object] = (path / e.object).read_bytes()
        full, _ = TENSORS[e.tensor]
        if e.tensor not in out:
            out[e.tensor] = (torch.zeros(full.numel(), dtype=full.dtype), torch.zeros(full.numel(), dtype=torch.int32))
        values, count = out[e.tensor]
        box = e.region.box
        where = torch.arange(full.numel()).reshape(full.shape)[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))]
        where = where.reshape(-1)
        if e.region.flat:
            where = where[e.region.flat[0]:e.region.flat[1]]
        raw = blobs[e.object][e.offset:e.offset + e.nbytes]
        assert len(raw) == where.numel() * full.element_size(), (e.tensor, rank)
        if raw:
            values[where] = torch.frombuffer(bytearray(raw), dtype=full.dtype)
        count[where] += 1
    return {k: (v.reshape(TENSORS[k][0].shape), c.reshape(TENSORS[k][0].shape)) for k, (v, c) in out.items()}


def check_output(path: Path, target: ParallelConfig, *, split_ok: bool = False) -> None:
    """Bit-identical tensors (model-space view), rules and values kept, and — against the oracle
    :func:`held_runs` — every target rank's data object stores only what that rank holds at the
    target layout, with the source's bytes, every element stored exactly once in all; a rank with
    no replica of its pieces stores all of them; a tensor without a rule is whole on one rank;
    the recorded grid layout gives each rank the same elements as the oracle."""
    manifest = read_manifest(open_store(path))
    assert manifest.parallel == str(target) and manifest.world_size == target.world_size
    assert manifest.per_rank_keys == ()
    view = ckptkit.open(path)
    assert view.values == {"step": 7, "sched": {"lr": 0.5}}
    for key, (tensor, rule) in TENSORS.items():
        got = view[key].read()
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), key
        assert manifest.tensors[key].rule == rule
    stored = {r: stored_by_rank(path, manifest, r) for r in range(target.world_size)}
    for key, (tensor, rule) in TENSORS.items():
        shape = tuple(tensor.shape)
        if rule is None:  # no rule: copied whole to one rank (any)
            held = {r: torch.ones(shape, dtype=torch.bool) for r in stored}
            assert sum(key in stored[r] for r in stored) == 1, key
        else:
            held = {r: mask_of(shape, held_runs(shape, rule, target, r)) for r in stored}
        holders = sum(m.int() for m in held.values())
        assert bool((holders > 0).all()) or tensor.numel() == 0, key  # the oracle covers the tensor
        total = torch.zeros(shape, dtype=torch.int32)
        for r, mine in held.items():
            values, count = stored[r].get(key, (torch.zeros_like(tensor), torch.zeros(shape, dtype=torch.int32)))
            here = count > 0
            assert not bool((here & ~mine).any()), f"rank {r} stores elements of {key} it does not hold"
            assert torch.equal(values[here].view(torch.uint8), tensor[here].view(torch.uint8)), (key, r)  # bit for bit
            if bool((holders[mine] == 1).all()):  # no other rank holds them: this one stores them all
                assert torch.equal(here, mine), (key, r)
            total += count
        assert bool((total == 1).all()), f"{key}: elements stored {total.min()}..{total.max()} times, not once"
        layout = manifest.tensors[key].layout
        if rule is not None and not (split_ok and isinstance(layout, ExplicitLayout)):
            assert isinstance(layout, GridLayout), key
            for r, mine in held.items():
                recorded = torch.zeros(shape, dtype=torch.bool)
                local = layout.local_pieces(layout.mesh.coordinate(r))  # type: ignore[arg-type]
                for _, box in (local[1] if local else []):
                    recorded[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))] = True
                assert torch.equal(recorded, mine), (key, r)


@pytest.mark.parametrize("to, pp_layers", [("tp4pp2", None), ("tp1pp1", None), ("tp2pp2vpp2", None),
                                           ("tp2pp2", (1, 3)), ("tp2pp2dp2", None)])
def test_reshard_is_bit_identical_at_the_target_layout(src: Path, tmp_path: Path, to: str, pp_layers):
    target = ParallelConfig.parse(to)
    if pp_layers:
        target = ParallelConfig(tp=target.tp, pp=target.pp, pp_layers=pp_layers)
    before = tree_digest(src)
    result = reshard(src, tmp_path / "out", target)
    assert result.dropped_per_rank == ("rng",) and set(result.plan.unruled) == {"extra/scalar", "extra/token_counts"}
    check_output(tmp_path / "out", target)
    assert tree_digest(src) == before  # the source is only read


def test_a_target_rank_loads_its_shards_with_ckptkit_load(src: Path, tmp_path: Path):
    target = ParallelConfig.parse("tp4pp2")
    reshard(src, tmp_path / "out", target)
    manifest = read_manifest(open_store(tmp_path / "out"))
    key = "model/decoder.layers.mlp.linear_fc1.weight"
    layout = manifest.tensors[key].layout
    assert isinstance(layout, GridLayout)
    rank = 6  # pp stage 1, tp rank 2
    local_shape, pieces = layout.local_pieces(layout.mesh.coordinate(rank))  # type: ignore[misc]
    out = torch.zeros(local_shape)
    decl = [Piece(key, layout.shape, Region(b), LocalBox(o)) for o, b in pieces]
    ckptkit.load({"w": ckptkit.Sharded(out, decl)}, tmp_path / "out", strict=False)
    full = TENSORS[key][0]
    gate, up = full[2:4, 16:24], full[2:4, 48:56]  # layers 2-3, the 3rd of 4 tp slices of each fused part
    assert torch.equal(out, torch.cat([gate, up], dim=1))


def test_resharding_twice_equals_resharding_once(src: Path, tmp_path: Path):
    reshard(src, tmp_path / "mid", ParallelConfig.parse("tp4pp2"))
    reshard(tmp_path / "mid", tmp_path / "twice", ParallelConfig.parse("tp1pp4"))
    reshard(src, tmp_path / "once", ParallelConfig.parse("tp1pp4"))
    a, b = read_manifest(open_store(tmp_path / "twice")), read_manifest(open_store(tmp_path / "once"))
    assert a.tensors == b.tensors and a.values == b.values
    twice, once = tree_digest(tmp_path / "twice"), tree_digest(tmp_path / "once")
    data = [k for k in once if k.startswith("data")]
    assert data and all(twice[k] == once[k] for k in data)  # the data objects are byte-identical
    check_output(tmp_path / "twice", ParallelConfig.parse("tp1pp4"))


def test_a_small_budget_splits_regions_and_stays_exact(src: Path, tmp_path: Path):
    options = ReshardOptions(ReshardPlanOptions(max_memory=8 << 10, source_block=0))
    result = reshard(src, tmp_path / "out", ParallelConfig.parse("tp2pp1"), options=options)
    assert result.plan.split and result.plan.peak_memory <= 8 << 10
    manifest = read_manifest(open_store(tmp_path / "out"))
    for key in result.plan.split:
        assert isinstance(manifest.tensors[key].layout, ExplicitLayout) and manifest.tensors[key].rule == TENSORS[key][1]
    check_output(tmp_path / "out", ParallelConfig.parse("tp2pp1"), split_ok=True)


def test_a_budget_below_one_element_fails_naming_the_budget(src: Path, tmp_path: Path):
    with pytest.raises(ReshardError, match="too small"):
        reshard(src, tmp_path / "out", ParallelConfig.parse("tp4pp2"),
                options=ReshardOptions(ReshardPlanOptions(max_memory=64)))
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_dry_run_prints_the_plan_and_writes_nothing(src: Path, tmp_path: Path):
    result = run("reshard", src, tmp_path / "out", "--to", "tp4pp2", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "target tp4pp2dp1 (8 ranks): 38 tensors" in result.output
    assert "estimated peak" in result.output and "would drop per-rank values" in result.output and "rng" in result.output
    assert "extra/token_counts" in result.output and "nothing written" in result.output
    assert not (tmp_path / "out").exists()
    doc = json.loads(run("reshard", src, "--to", "tp4pp2", "--dry-run", "--json").stdout)
    assert doc["dry_run"] and len(doc["plan"]["ranks"]) == 8
    assert sum(r["bytes_written"] for r in doc["plan"]["ranks"]) == doc["plan"]["bytes"]


def test_cli_reshards_with_uneven_stages_and_reports(src: Path, tmp_path: Path):
    result = run("reshard", src, tmp_path / "out", "--to", "tp2pp2", "--vpp", "2", "--pp-layers", "1,1,1,1",
                 "--max-memory", "64MiB")
    assert result.exit_code == 0, result.output
    assert "resharded" in result.output and "dropped per-rank values" in result.output
    check_output(tmp_path / "out", ParallelConfig(tp=2, pp=2, vpp=2, pp_layers=(1, 1, 1, 1)))


@pytest.mark.parametrize("args, message", [
    (["--to", "tp3pp2"], "linear_fc1.weight' .* fused part of 32 does not split evenly over tp=3"),
    (["--to", "tp2pp3"], "4 layers do not split evenly over pp=3 x vpp=1; give pp_layers"),
    (["--to", "tp2pp2", "--strict"], "'extra/scalar' has no partition rule"),
    (["--to", "tp2pp2", "--pp-layers", "1,2"], "pp_layers \\[1, 2\\] sum to 3, model has 4 layers"),
    (["--to", "tp2pp2cp2", "--format", "megatron"], "writes no context parallelism"),
])
def test_impossible_targets_fail_clearly_and_write_nothing(src: Path, tmp_path: Path, args, message):
    result = CliRunner().invoke(cli, ["reshard", str(src), str(tmp_path / "out"), *args])
    assert result.exit_code == 2
    assert re.search(message, " ".join(result.output.split())), result.output
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_existing_destination_and_missing_source_are_refused(src: Path, tmp_path: Path):
    reshard(src, tmp_path / "out", ParallelConfig.parse("tp1pp1"))
    with pytest.raises(SaveError, match="already holds a committed checkpoint"):
        reshard(src, tmp_path / "out", ParallelConfig.parse("tp4pp2"))
    result = CliRunner().invoke(cli, ["reshard", str(tmp_path / "nope"), str(tmp_path / "o2"), "--to", "tp2pp2"])
    assert result.exit_code == 2 and "error:" in result.output
    with pytest.raises(CheckpointNotFoundError):
        reshard(tmp_path / "nope", tmp_path / "o3", ParallelConfig.parse("tp2pp2"))
    with pytest.raises(ReshardError, match="overlaps the source"):
        reshard(src, src / "inside", ParallelConfig.parse("tp2pp2"))


def test_a_failed_reshard_commits_nothing_and_leaves_the_source_alone(tmp_path: Path):
    bad = tmp_path / "bad"
    write_at(bad, TENSORS, ParallelConfig.parse("tp2pp2"), values={"step": 7, "sched": {"lr": 0.5}})
    obj = data_object(bad)
    raw = bytearray(obj.read_bytes())
    raw[100] ^= 0xFF
    obj.write_bytes(bytes(raw))
    before = tree_digest(bad)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        reshard(bad, tmp_path / "out", ParallelConfig.parse("tp4pp2"))
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert not any(p.is_file() for p in (tmp_path / "out").rglob("*"))
    assert tree_digest(bad) == before
