"""``reshard`` spread over the processes of a real gloo job (and over ``torchrun``): the same checkpoint,
byte for byte, as one process writes; one failure anywhere fails every process and commits nothing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.engine.offline_spread import share_of
from ckptkit.layout.config import ParallelConfig
from ckptkit.offline.resharding import ReshardOptions, reshard
from ckptkit.plan.reshard_plan import ReshardPlanOptions
from tests.ckpt_files import manifest_doc
from tests.reshard_fixtures import gpt_tensors, write_at
from tests.test_import_trust_folders import torch_dist_folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTEMPT = re.compile(r"-[0-9a-f]{12}(?=\.(?:bin|json))")


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spread") / "src-tp2pp2"
    write_at(path, gpt_tensors(), ParallelConfig.parse("tp2pp2"), values={"step": 7, "sched": {"lr": 0.5}})
    return path


def checkpoint_bytes(path: Path) -> dict[str, Any]:
    """Everything a checkpoint folder holds, with what must differ between two writes taken out: the
    save-attempt id in object names (and in the index and manifest that name the objects), the
    manifest's creation time and its digests of the indexes (whose bytes name the objects). Data objects
    are compared as raw bytes."""
    doc = json.loads(ATTEMPT.sub("", json.dumps(manifest_doc(path))))
    doc.pop("attempt", None)
    doc["meta"].pop("created", None)
    doc["indexes"] = [ref[:3] for ref in doc["indexes"]]  # [rank, key, size, sha256]: the digest names the attempt
    out: dict[str, Any] = {"manifest.json": doc}
    for p in sorted(path.rglob("*")):
        name = ATTEMPT.sub("", str(p.relative_to(path)))
        if not p.is_file() or name == "manifest.json":
            continue
        out[name] = p.read_bytes() if name.endswith(".bin") else json.loads(ATTEMPT.sub("", p.read_text()))
    return out


def assert_same_checkpoint(a: Path, b: Path) -> None:
    ca, cb = checkpoint_bytes(a), checkpoint_bytes(b)
    assert sorted(ca) == sorted(cb)
    assert any(k.endswith(".bin") and ca[k] for k in ca)
    for k in ca:
        assert ca[k] == cb[k], f"{k} differs"
    assert ckptkit.diff(a, b).identical


SMALL = ReshardPlanOptions(max_memory=8 << 10, source_block=0)  # regions cut into pieces (tests/test_reshard.py)


def spread(source: str, dest: str, to: str, plan: ReshardPlanOptions = ReshardPlanOptions()) -> dict[str, Any]:
    """One process's part of a spread reshard (run on every rank of a world); every call of the
    progress callback it was given, and the plan's bytes."""
    import torch.distributed as dist

    calls: list[tuple[int, int]] = []
    result = reshard(source, dest, ParallelConfig.parse(to), options=ReshardOptions(plan),
                     process_group=dist.group.WORLD, progress=lambda done, total: calls.append((done, total)))
    from torch.distributed import distributed_c10d

    attempt = manifest_doc(dest)["attempt"]  # the shared counter every process added its bytes to
    counted = int(distributed_c10d._get_default_store().add(f"ckptkit/offline/{attempt}/bytes", 0))
    return {"destination": result.destination, "bytes_read": result.bytes_read, "split": len(result.plan.split),
            "progress": calls, "nbytes": result.plan.nbytes, "counted": counted}


def spread_expecting_failure(source: str, dest: str, to: str, fail_on: int | None = None) -> str:
    """A spread reshard that must fail on this process; ``fail_on``: the process whose writer is made to
    fail (fault injection in that process only). Returns the error's type and message."""
    import torch.distributed as dist

    from ckptkit.engine import offline_writer

    if fail_on is not None and dist.get_rank() == fail_on:
        real = offline_writer._RankWriter.write

        def failing(self: Any, rank: int) -> Any:
            raise OSError(f"injected failure writing target rank {rank}")

        offline_writer._RankWriter.write = failing  # type: ignore[method-assign]
    try:
        reshard(source, dest, ParallelConfig.parse(to), process_group=dist.group.WORLD)
    except Exception as exc:  # noqa: BLE001 - the test looks at what every process raised
        return f"{type(exc).__name__}: {exc}"
    finally:
        if fail_on is not None and dist.get_rank() == fail_on:
            offline_writer._RankWriter.write = real  # type: ignore[possibly-undefined]
    return "no error"


@pytest.mark.parametrize("processes,to,small", [(2, "tp4pp2", False), (4, "tp2pp1", True), (4, "tp2pp2dp2", False),
                                                (4, "tp1pp4", False)])
def test_a_spread_reshard_is_the_one_process_checkpoint_byte_for_byte(worlds, src: Path, tmp_path: Path,
                                                                      processes: int, to: str, small: bool):
    """tp2pp1 from 4 processes: two of them write no target rank, and regions are cut into pieces."""
    plan = SMALL if small else ReshardPlanOptions()
    one = reshard(src, tmp_path / "one", ParallelConfig.parse(to), options=ReshardOptions(plan))
    assert bool(one.plan.split) == small
    results = worlds.run(processes, spread, str(src), str(tmp_path / "spread"), to, plan)
    assert len({r["destination"] for r in results}) == 1 and results[0]["destination"].endswith("spread")
    # one progress bar, on process 0: every process's bytes, never past the total, ending at it
    first, total = results[0]["progress"], results[0]["nbytes"]
    assert first and all(r["progress"] == [] for r in results[1:])
    assert all(t == total for _, t in first) and first[-1] == (total, total)
    assert [d for d, _ in first] == sorted(d for d, _ in first)
    assert {r["counted"] for r in results} == {total}  # the shared counter saw every process's bytes
    assert len({r["bytes_read"] for r in results}) == 1 and results[0]["bytes_read"] > 0
    assert_same_checkpoint(tmp_path / "one", tmp_path / "spread")


def dcp_folder(folder: Path) -> Path:
    """A DCP checkpoint as torchtitan's ``dcp.save`` of a model and its optimizer state writes one."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(3)
    state = {"model": {f"layers.{i}.attention.wq.weight": torch.randn(16, 16, generator=g) for i in range(4)},
             "optimizer": {"state": {"layers.0.attention.wq.weight": {"exp_avg": torch.randn(16, 16, generator=g)}}},
             "train_state": {"step": 5}}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return folder


@pytest.mark.parametrize("kind", ["torch_dist", "dcp"])
def test_a_foreign_source_is_imported_once_and_resharded_spread_byte_for_byte(worlds, tmp_path: Path, kind: str):
    source = torch_dist_folder(tmp_path / "mlm") if kind == "torch_dist" else dcp_folder(tmp_path / "dcp")
    reshard(source, tmp_path / "one", ParallelConfig.parse("tp2pp1"))
    worlds.run(2, spread, str(source), str(tmp_path / "spread"), "tp2pp1")
    assert_same_checkpoint(tmp_path / "one", tmp_path / "spread")
    assert not [p for p in tmp_path.rglob(".ckptkit-import-*")]


def test_a_failing_process_fails_every_process_and_commits_nothing(worlds, src: Path, tmp_path: Path):
    errors = worlds.run(4, spread_expecting_failure, str(src), str(tmp_path / "out"), "tp4pp2", 2)
    assert all(e.startswith("StorageError: ") for e in errors), errors
    assert all("process 2: injected failure writing target rank" in e for e in errors), errors
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert not [p for p in (tmp_path / "out").rglob("*") if p.is_file()]  # the partial output is removed
    # the same destination then takes a good reshard
    worlds.run(4, spread, str(src), str(tmp_path / "out"), "tp4pp2")
    assert ckptkit.diff(src, tmp_path / "out").identical


def test_a_committed_destination_fails_every_process_before_writing(worlds, src: Path, tmp_path: Path):
    reshard(src, tmp_path / "out", ParallelConfig.parse("tp4pp2"))
    before = checkpoint_bytes(tmp_path / "out")
    errors = worlds.run(2, spread_expecting_failure, str(src), str(tmp_path / "out"), "tp1pp4")
    assert all("already holds a committed checkpoint" in e for e in errors), errors
    assert checkpoint_bytes(tmp_path / "out") == before


def test_a_missing_source_fails_every_process_naming_it(worlds, tmp_path: Path):
    errors = worlds.run(2, spread_expecting_failure, str(tmp_path / "nothing"), str(tmp_path / "out"), "tp2pp1")
    assert all(str(tmp_path / "nothing") in e for e in errors), errors


def test_torchrun_spreads_the_cli_reshard(src: Path, tmp_path: Path):
    reshard(src, tmp_path / "one", ParallelConfig.parse("tp4pp2"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           "-m", "ckptkit", "reshard", str(src), str(tmp_path / "spread"),
           "--to", "tp4pp2", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    job = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    doc = json.loads(job.stdout)  # one JSON document: only the first process prints
    assert doc["destination"].endswith("spread") and not doc["dry_run"]
    assert_same_checkpoint(tmp_path / "one", tmp_path / "spread")
    # convert to DCP is spread too: the same files as one process writes, one JSON document
    from ckptkit_converters.registry import convert

    convert(src, tmp_path / "dcp-one", to_format="dcp")
    cmd[cmd.index("reshard"):] = ["convert", str(src), str(tmp_path / "dcp"), "--format", "dcp", "--json"]
    job = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert json.loads(job.stdout)["destination"].endswith("dcp")
    assert folder_bytes(tmp_path / "dcp-one") == folder_bytes(tmp_path / "dcp")
    # reshard --format megatron (the torch_dist export) is spread too
    from ckptkit_converters.megatron.options import MegatronExportOptions
    from tests.format_samples import GOLDEN

    golden = str(GOLDEN / "megatron" / "ckpt")
    convert(golden, tmp_path / "mlm-one", to_format="megatron",
            target_options=MegatronExportOptions(layout=ParallelConfig.parse("tp2pp2")))
    cmd[cmd.index("convert"):] = ["reshard", golden, str(tmp_path / "mlm"), "--to", "tp2pp2", "--format", "megatron"]
    job = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert folder_bytes(tmp_path / "mlm-one") == folder_bytes(tmp_path / "mlm")
    # a conversion that is not spread (an import) refuses under torchrun (every process would write DEST)
    from tests.test_import_trust_folders import dcp_folder

    cmd[cmd.index("reshard"):] = ["convert", str(dcp_folder(tmp_path / "dcp-src")), str(tmp_path / "imp")]
    job = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert job.returncode != 0 and "a conversion to ckptkit runs in one process" in job.stderr
    assert not (tmp_path / "imp").exists()


def folder_bytes(path: Path) -> dict[str, Any]:
    """A DCP export's files: the data files' bytes, and ``.metadata`` as what it says (its pickle also
    holds the export's path and a fresh save id, as every DCP save's does)."""
    from ckptkit_converters.common.safe_unpickle import load_dcp_metadata

    out: dict[str, Any] = {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
    md = load_dcp_metadata(out.pop(".metadata"), str(path))
    out[".metadata"] = (md.state_dict_metadata, md.planner_data, md.storage_data, md.version)
    return out


def spread_dcp_export(source: str, dest: str, fail_on: int | None = None) -> dict[str, Any]:
    """One process's part of a spread DCP export (through the registry, as the CLI calls it); with
    ``fail_on``, that process's file writes fail. Returns its progress calls, or its error."""
    import torch.distributed as dist

    from ckptkit.offline import RunOptions
    from ckptkit_converters.dcp import export as dcp_export
    from ckptkit_converters.registry import convert

    calls: list[tuple[int, int]] = []
    real = dcp_export._write_rank_file
    if fail_on is not None and dist.get_rank() == fail_on:
        def failing(view, out, rank, *a, **k):
            raise OSError(f"injected failure writing DCP file of rank {rank}")

        dcp_export._write_rank_file = failing
    try:
        convert(source, dest, to_format="dcp", run=RunOptions(process_group=dist.group.WORLD,
                                                              progress=lambda d, t: calls.append((d, t))))
    except Exception as exc:  # noqa: BLE001 - the test looks at what every process raised
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        dcp_export._write_rank_file = real
    return {"progress": calls}


@pytest.mark.parametrize("processes", [2, 4])
def test_a_spread_dcp_export_is_the_one_process_export_byte_for_byte(worlds, src: Path, tmp_path: Path, processes: int):
    from ckptkit_converters.registry import convert

    convert(src, tmp_path / "one", to_format="dcp")
    results = worlds.run(processes, spread_dcp_export, str(src), str(tmp_path / "spread"))
    one, spread_out = folder_bytes(tmp_path / "one"), folder_bytes(tmp_path / "spread")
    assert sorted(one) == sorted(spread_out) and ".metadata" in one
    for name in one:
        assert one[name] == spread_out[name], f"{name} differs"
    first = results[0]["progress"]
    assert first and first[-1][0] == first[-1][1] and all(r["progress"] == [] for r in results[1:])
    # and it reads back: an import of the spread export holds the source's tensors, bit for bit
    convert(tmp_path / "spread", tmp_path / "back")
    report = ckptkit.diff(src, tmp_path / "back")
    assert report.tensors and all(t.identical for t in report.tensors)


def test_a_failing_process_fails_a_spread_dcp_export_everywhere_and_leaves_nothing(worlds, src: Path, tmp_path: Path):
    errors = worlds.run(4, spread_dcp_export, str(src), str(tmp_path / "out"), 1)
    assert all("injected failure writing DCP file" in r["error"] for r in errors), errors
    assert errors[1]["error"].startswith("StorageError") and errors[0]["error"].startswith("SpreadError")
    assert not [p for p in (tmp_path / "out").rglob("*") if p.is_file()]


def test_a_spread_dcp_export_of_a_foreign_source_imports_it_once(worlds, tmp_path: Path):
    from ckptkit_converters.registry import convert

    source = torch_dist_folder(tmp_path / "mlm")
    convert(source, tmp_path / "one", to_format="dcp")
    worlds.run(2, spread_dcp_export, str(source), str(tmp_path / "spread"))
    assert folder_bytes(tmp_path / "one") == folder_bytes(tmp_path / "spread")
    assert not [p for p in tmp_path.rglob("ckptkit-import-*")]


def spread_from_own_folder(sources: list[str], dest: str, what: str) -> str:
    """Each process reads its own folder as the source (nodes that see different checkpoints at one path)."""
    import torch.distributed as dist

    from ckptkit.offline import RunOptions
    from ckptkit.storage.url import open_store
    from ckptkit_converters.registry import convert

    source = sources[dist.get_rank() % len(sources)]
    try:
        if what == "dcp":
            convert(source, dest, to_format="dcp", run=RunOptions(process_group=dist.group.WORLD))
            return "no error"
        # reshard hands every process process 0's URL; a node that sees another folder at that path
        # is simulated by reading the other folder's manifest there
        from ckptkit.offline import resharding

        real = resharding.read_manifest
        if dist.get_rank() == 1:
            resharding.read_manifest = lambda store: real(open_store(sources[1]))
        try:
            reshard(source, dest, ParallelConfig.parse("tp4pp2"), process_group=dist.group.WORLD)
        finally:
            resharding.read_manifest = real
    except Exception as exc:  # noqa: BLE001 - the test looks at what every process raised
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("what", ["dcp", "reshard"])
def test_processes_that_see_different_sources_fail_before_writing(worlds, src: Path, tmp_path: Path, what: str):
    """The same layout saved twice with other values: each a valid checkpoint, the same plan on every
    process. Without the check the output would mix the two under one commit."""
    other = tmp_path / "other"
    write_at(other, {k: (t + 1, rule) for k, (t, rule) in gpt_tensors().items()}, ParallelConfig.parse("tp2pp2"),
             values={"step": 7, "sched": {"lr": 0.5}})
    errors = worlds.run(2, spread_from_own_folder, [str(src), str(other)], str(tmp_path / "out"), what)
    assert all(e.startswith("SpreadError") and "reads another checkpoint" in e for e in errors), errors
    assert not [p for p in (tmp_path / "out").rglob("*") if p.is_file()]


def spread_hf_export(source: str, dest: str, config: str, fail_on: int | None = None) -> dict[str, Any]:
    """One process's part of a spread HF export (many small shards); ``fail_on``: that process's shard
    writes fail."""
    import torch.distributed as dist

    from ckptkit.offline import RunOptions
    from ckptkit_converters.hf import exporter
    from ckptkit_converters.hf.options import HFExportOptions
    from ckptkit_converters.registry import convert

    calls: list[tuple[int, int]] = []
    real = exporter._shard_bytes
    if fail_on is not None and dist.get_rank() == fail_on:
        def failing(shard, header, *a, **k):
            yield header
            raise OSError("injected failure writing a shard")

        exporter._shard_bytes = failing
    try:
        convert(source, dest, to_format="hf", target_options=HFExportOptions(config=config, max_shard_bytes=64 << 10),
                run=RunOptions(process_group=dist.group.WORLD, progress=lambda d, t: calls.append((d, t))))
    except Exception as exc:  # noqa: BLE001 - the test looks at what every process raised
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        exporter._shard_bytes = real
    return {"progress": calls}


@pytest.fixture(scope="module")
def qwen3_source(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    pytest.importorskip("torchtitan")
    from tests.test_convert_hf_moe import qwen3_moe, write_config

    folder = tmp_path_factory.mktemp("qwen3")
    _, _, sd, hf_cfg = qwen3_moe()
    ckptkit.save({"model": sd, "train": {"step": 1}}, str(folder / "ckpt"))
    return str(folder / "ckpt"), write_config(folder / "config.json", hf_cfg)


def test_a_spread_hf_export_is_the_one_process_export_byte_for_byte(worlds, qwen3_source, tmp_path: Path):
    from ckptkit_converters.hf.options import HFExportOptions
    from ckptkit_converters.registry import convert

    src, config = qwen3_source
    one = convert(src, tmp_path / "one", to_format="hf", target_options=HFExportOptions(config=config,
                                                                                       max_shard_bytes=64 << 10))
    assert len(one.shards) > 4
    results = worlds.run(4, spread_hf_export, src, str(tmp_path / "spread"), config)
    a = {str(p.relative_to(tmp_path / "one")): p.read_bytes() for p in (tmp_path / "one").rglob("*") if p.is_file()}
    b = {str(p.relative_to(tmp_path / "spread")): p.read_bytes() for p in (tmp_path / "spread").rglob("*") if p.is_file()}
    assert sorted(a) == sorted(b)
    for name in a:  # the index names the source's URL, the same for both
        assert a[name] == b[name], f"{name} differs"
    first = results[0]["progress"]
    assert first and first[-1] == (one.nbytes, one.nbytes) and all(r["progress"] == [] for r in results[1:])


def test_a_failing_process_fails_a_spread_hf_export_everywhere_and_removes_the_shards(worlds, qwen3_source,
                                                                                      tmp_path: Path):
    src, config = qwen3_source
    errors = worlds.run(4, spread_hf_export, src, str(tmp_path / "out"), config, 2)
    assert all("injected failure writing a shard" in r["error"] for r in errors), errors
    assert errors[0]["error"].startswith("SpreadError") and "process 2" in errors[0]["error"]
    assert not [p for p in (tmp_path / "out").rglob("*") if p.is_file()]


def spread_megatron_export(source: str, dest: str, layout: str, fail_on: int | None = None) -> dict[str, Any]:
    """One process's part of a spread Megatron torch_dist export; ``fail_on``: that process's DCP file
    writes fail."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    from ckptkit.offline import RunOptions
    from ckptkit_converters.megatron.options import MegatronExportOptions
    from ckptkit_converters.registry import convert

    real = FileSystemWriter.write_data
    if fail_on is not None and dist.get_rank() == fail_on:
        def failing(self, plan, planner):
            raise OSError("injected failure writing a torch_dist file")

        FileSystemWriter.write_data = failing
    try:
        convert(source, dest, to_format="megatron", target_options=MegatronExportOptions(layout=ParallelConfig.parse(layout)),
                run=RunOptions(process_group=dist.group.WORLD))
    except Exception as exc:  # noqa: BLE001 - the test looks at what every process raised
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        FileSystemWriter.write_data = real
    return {}


@pytest.mark.parametrize("processes,layout", [(2, "tp2pp2"), (4, "tp2pp1")])
def test_a_spread_megatron_export_is_the_one_process_export_byte_for_byte(worlds, tmp_path: Path, processes: int,
                                                                           layout: str):
    """tp2pp1 from 4 processes: two of them write no file."""
    from ckptkit_converters.megatron.options import MegatronExportOptions
    from ckptkit_converters.registry import convert
    from tests.format_samples import GOLDEN

    source = str(GOLDEN / "megatron" / "ckpt")
    convert(source, tmp_path / "one", to_format="megatron",
            target_options=MegatronExportOptions(layout=ParallelConfig.parse(layout)))
    worlds.run(processes, spread_megatron_export, source, str(tmp_path / "spread"), layout)
    one, spread_out = folder_bytes(tmp_path / "one"), folder_bytes(tmp_path / "spread")
    assert sorted(one) == sorted(spread_out) and "common.pt" in one and "metadata.json" in one
    for name in one:
        assert one[name] == spread_out[name], f"{name} differs"


def test_a_failing_process_fails_a_spread_megatron_export_everywhere(worlds, tmp_path: Path):
    from tests.format_samples import GOLDEN

    errors = worlds.run(2, spread_megatron_export, str(GOLDEN / "megatron" / "ckpt"), str(tmp_path / "out"),
                        "tp2pp2", 1)
    assert all("injected failure writing a torch_dist file" in r["error"] for r in errors), errors
    assert errors[1]["error"].startswith("SaveError") and errors[0]["error"].startswith("SpreadError")
    assert not (tmp_path / "out").exists()


def spread_deepspeed_export(source: str, dest: str, dp: int, zero_stage: int, fail_on: int | None = None) -> dict:
    """One process's part of a spread DeepSpeed export; ``fail_on``: that process's file writes fail."""
    import torch.distributed as dist

    from ckptkit.offline import RunOptions
    from ckptkit_converters.deepspeed import exporter
    from ckptkit_converters.deepspeed.options import DeepSpeedExportOptions
    from ckptkit_converters.registry import convert

    real = exporter._save
    if fail_on is not None and dist.get_rank() == fail_on:
        def failing(obj, path, tick):
            raise OSError(f"injected failure writing {os.path.basename(path)}")

        exporter._save = failing
    try:
        result = convert(source, dest, to_format="deepspeed",
                         target_options=DeepSpeedExportOptions(dp=dp, zero_stage=zero_stage),
                         run=RunOptions(process_group=dist.group.WORLD))
    except Exception as exc:  # noqa: BLE001 - the test looks at what every process raised
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        exporter._save = real
    return {"nbytes": result.nbytes}


@pytest.mark.parametrize("zero_stage,dp,processes", [(2, 3, 2), (3, 4, 4), (1, 2, 4)])
def test_a_spread_deepspeed_export_is_the_one_process_export_byte_for_byte(worlds, tmp_path: Path, zero_stage: int,
                                                                            dp: int, processes: int):
    """dp2 at ZeRO 1 from 4 processes: the model states are a unit of their own, one process writes nothing."""
    pytest.importorskip("deepspeed")
    from ckptkit_converters.deepspeed.importer import import_deepspeed
    from ckptkit_converters.deepspeed.options import DeepSpeedExportOptions
    from ckptkit_converters.registry import convert
    from tests.test_import_trust_folders import deepspeed_folder

    import_deepspeed(deepspeed_folder(tmp_path / "src", stage=2, dp=2), tmp_path / "ckpt")
    one = convert(tmp_path / "ckpt", tmp_path / "one", to_format="deepspeed",
                  target_options=DeepSpeedExportOptions(dp=dp, zero_stage=zero_stage))
    results = worlds.run(processes, spread_deepspeed_export, str(tmp_path / "ckpt"), str(tmp_path / "spread"), dp,
                         zero_stage)
    assert [r["nbytes"] for r in results] == [one.nbytes] * processes
    a = {str(p.relative_to(tmp_path / "one")): p.read_bytes() for p in (tmp_path / "one").rglob("*") if p.is_file()}
    b = {str(p.relative_to(tmp_path / "spread")): p.read_bytes() for p in (tmp_path / "spread").rglob("*") if p.is_file()}
    assert sorted(a) == sorted(b) and "latest" in a
    for name in a:
        assert a[name] == b[name], f"{name} differs"


def test_a_failing_process_fails_a_spread_deepspeed_export_and_commits_nothing(worlds, tmp_path: Path):
    pytest.importorskip("deepspeed")
    from ckptkit_converters.deepspeed.importer import import_deepspeed
    from tests.test_import_trust_folders import deepspeed_folder

    import_deepspeed(deepspeed_folder(tmp_path / "src", stage=2, dp=2), tmp_path / "ckpt")
    errors = worlds.run(2, spread_deepspeed_export, str(tmp_path / "ckpt"), str(tmp_path / "out"), 4, 2, 1)
    assert all("injected failure writing" in r["error"] for r in errors), errors
    assert errors[0]["error"].startswith("SpreadError")
    assert not (tmp_path / "out" / "latest").exists()  # never committed
    assert not [p for p in (tmp_path / "out").rglob("*") if p.is_file()]  # the tag folder is removed


def test_a_conversion_that_does_not_spread_refuses_a_process_group(worlds, tmp_path: Path):
    """An import (to ckptkit) does not spread: under a process group every process would write DEST."""
    from tests.test_import_trust_folders import dcp_folder

    source = dcp_folder(tmp_path / "dcp")
    errors = worlds.run(2, spread_convert, str(source), str(tmp_path / "imported"), "ckptkit")
    assert all("a conversion to ckptkit runs in one process" in e for e in errors), errors
    assert not (tmp_path / "imported").exists()


def spread_convert(source: str, dest: str, target: str, fail_on: int | None = None) -> str:
    """One process's part of ``convert(source, dest, to_format=target)`` over the world; ``fail_on``: that
    process's zarr shard writes fail. Returns its error, or "no error"."""
    import torch.distributed as dist

    from ckptkit.offline import RunOptions
    from ckptkit_converters.registry import convert
    from ckptkit_converters.zarr import convert as zarr_convert

    real = zarr_convert._ZarrExport.write
    if fail_on is not None and dist.get_rank() == fail_on:
        def failing(self, mine, options, tick):
            raise OSError(f"injected failure writing zarr shards {mine[:3]}")

        zarr_convert._ZarrExport.write = failing
    try:
        convert(source, dest, to_format=target, run=RunOptions(process_group=dist.group.WORLD))
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    finally:
        zarr_convert._ZarrExport.write = real
    return "no error"


@pytest.mark.parametrize("processes", [2, 4])
def test_a_spread_zarr_export_is_the_one_process_export_byte_for_byte(worlds, src: Path, tmp_path: Path,
                                                                       processes: int):
    """Process 0 creates the arrays, every process writes the shards dealt to it, process 0 writes the root
    attributes last: every file equal to the one-process export's, and the group converts back bit for bit."""
    from ckptkit_converters.registry import convert
    from ckptkit_converters.zarr.options import ZarrExportOptions

    small = ZarrExportOptions(shard_bytes=1 << 16, chunk_bytes=1 << 14)  # many shards, so every process writes some
    convert(src, tmp_path / "one", to_format="zarr", target_options=small)
    results = worlds.run(processes, spread_zarr_export, str(src), str(tmp_path / "spread"))
    assert results == ["no error"] * processes, results
    one, spread_out = _files(tmp_path / "one"), _files(tmp_path / "spread")
    assert sorted(one) == sorted(spread_out) and "zarr.json" in one and len(one) > 8
    for root in (one, spread_out):  # the root attributes say when the export ran: compared without that
        doc = json.loads(root["zarr.json"])
        assert doc["attributes"]["ckptkit"].pop("exported")
        root["zarr.json"] = json.dumps(doc, sort_keys=True).encode()
    for name in one:
        assert one[name] == spread_out[name], f"{name} differs"
    convert(tmp_path / "spread", tmp_path / "back", to_format="ckptkit")
    report = ckptkit.diff(src, tmp_path / "back")
    assert report.tensors and all(t.identical for t in report.tensors)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def spread_zarr_export(source: str, dest: str) -> str:
    import torch.distributed as dist

    from ckptkit.offline import RunOptions
    from ckptkit_converters.registry import convert
    from ckptkit_converters.zarr.options import ZarrExportOptions

    try:
        convert(source, dest, to_format="zarr", target_options=ZarrExportOptions(shard_bytes=1 << 16, chunk_bytes=1 << 14),
                run=RunOptions(process_group=dist.group.WORLD))
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_failing_process_fails_a_spread_zarr_export_everywhere_and_leaves_nothing(worlds, src: Path,
                                                                                     tmp_path: Path):
    errors = worlds.run(2, spread_convert, str(src), str(tmp_path / "z"), "zarr", 1)
    assert all("injected failure writing zarr shards" in e for e in errors), errors
    assert errors[0].startswith("SpreadError") and errors[1].startswith("OSError")
    assert not (tmp_path / "z").exists() or not [p for p in (tmp_path / "z").rglob("*") if p.is_file()]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1 << 30), min_size=0, max_size=64), st.integers(1, 16))
def test_shares_deal_every_rank_once_balanced_and_alike_everywhere(sizes: list[int], processes: int):
    rank_bytes = dict(enumerate(sizes))
    shares = share_of(rank_bytes, len(sizes), processes)
    assert shares == share_of(dict(reversed(list(rank_bytes.items()))), len(sizes), processes)  # order-free
    assert sorted(r for s in shares for r in s) == list(range(len(sizes)))
    assert all(s == sorted(s) for s in shares)
    loads = [sum(sizes[r] for r in s) for s in shares]
    # greedy largest-first: no process exceeds the mean by more than one rank's bytes
    if sizes:
        assert max(loads) <= sum(sizes) / processes + max(sizes)
        counts = [len(s) for s in shares]
        if not any(sizes):
            assert max(counts) - min(counts) <= 1  # ranks storing nothing are dealt by count
