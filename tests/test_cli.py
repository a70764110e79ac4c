"""The ckptkit command line, in process (click's CliRunner) and as the installed console script."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from ckptkit.cli.main import cli
from tests.test_catalog import piece_of, save_single, save_two
from tests.ckpt_files import data_object, index_file, object_key


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run_path = tmp_path / "run"
    save_single(run_path / "step-0000100", metadata={"step": 100})
    save_two(run_path / "step-0000200")
    shutil.copytree(run_path / "step-0000100", run_path / "step-0000300")
    (run_path / "step-0000300" / "manifest.json").unlink()
    return run_path


def flip_byte(ckpt: Path, tensor: str) -> None:
    entry = piece_of(ckpt, tensor)
    path = ckpt / entry[4]
    data = bytearray(path.read_bytes())
    data[entry[5] + 3] ^= 0xFF
    path.write_bytes(bytes(data))


def test_help_texts_carry_examples():
    assert "ckptkit verify runs/exp1" in run("--help").stdout
    for cmd in ("ls", "inspect", "verify"):
        result = run(cmd, "--help")
        assert result.exit_code == 0 and "Example:" in result.stdout and f"ckptkit {cmd} runs/exp1" in result.stdout


def test_ls_table_flags_committed_and_uncommitted(run_dir: Path):
    result = run("ls", str(run_dir))
    assert result.exit_code == 0, result.output
    rows = {line.split()[1]: line for line in result.stdout.splitlines() if "step-" in line}
    assert list(rows) == ["step-0000100", "step-0000200", "step-0000300"]
    assert "yes" in rows["step-0000100"] and " 100 " in rows["step-0000100"] and "│     1 │" in rows["step-0000100"]
    assert "yes" in rows["step-0000200"] and "│     2 │" in rows["step-0000200"]
    assert "no: no manifest.json" in rows["step-0000300"] and "yes" not in rows["step-0000300"]
    size = sum(f.stat().st_size for f in (run_dir / "step-0000100").rglob("*") if f.is_file())
    assert f"{size / 1024:.1f} KiB" in rows["step-0000100"]


def test_ls_json(run_dir: Path):
    result = run("ls", str(run_dir), "--json")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    got = [(c["name"], c["step"], c["committed"], c["world_size"]) for c in doc["checkpoints"]]
    assert got == [("step-0000100", 100, True, 1), ("step-0000200", 200, True, 2), ("step-0000300", 300, False, None)]
    assert "did not finish" in doc["checkpoints"][2]["reason"]


def test_inspect_json_dtypes_shapes_and_pieces_per_rank(run_dir: Path):
    result = run("inspect", str(run_dir / "step-0000200"), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    tensors = {t["key"]: t for t in doc["tensors"]}
    assert {k: (t["dtype"], t["shape"]) for k, t in tensors.items()} == {
        "b": ("float16", [40]), "e": ("int32", [8, 6]), "w": ("float32", [16, 16]),
    }
    assert tensors["e"]["layout_kind"] == "explicit" and tensors["e"]["stored_pieces"] == 2
    assert doc["world_size"] == 2 and [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert sorted(r["nbytes"] for r in doc["ranks"]) == [80 + 96, 1024 + 96]
    assert all(r["pieces"] == 2 and r["value_keys"] == ["pos"] for r in doc["ranks"])
    assert doc["meta"]["user"] == {"step": 200}

    only = json.loads(run("inspect", str(run_dir / "step-0000200"), "--json", "--tensor", "[we]").stdout)
    assert [t["key"] for t in only["tensors"]] == ["e", "w"]


def test_inspect_text(run_dir: Path):
    result = run("inspect", str(run_dir / "step-0000100"), "--tensor", "b*")
    assert result.exit_code == 0
    out = result.stdout
    assert "world size 1" in out and "2 tensors matching 'b*'" in out and "user metadata: {\"step\": 100}" in out
    assert "│ big │ float32  │ [64, 50] │ 12.5 KiB │ grid mesh (rank=1) [Replicate] │      1 │" in out
    assert "│ b   │ bfloat16 │ [3]      │      6 B │" in out
    tensor_table = out.split("\ntensors", 1)[1].split("pieces per rank")[0]
    assert "emb" not in tensor_table and "│ w " not in tensor_table
    assert "│    0 │      6 │" in out and "rng" in out


def test_verify_ok(run_dir: Path):
    result = run("verify", str(run_dir / "step-0000200"))
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("OK ") and "3 tensors, 4 pieces" in result.stdout
    doc = json.loads(run("verify", str(run_dir / "step-0000200"), "--json").stdout)
    assert doc["ok"] is True and doc["problems"] == [] and doc["bytes_checked"] == 80 + 96 + 1024 + 96


def test_verify_flipped_byte_exits_1_and_names_tensor(run_dir: Path):
    ckpt = run_dir / "step-0000100"
    flip_byte(ckpt, "big")
    result = run("verify", str(ckpt))
    assert result.exit_code == 1
    assert "checksum mismatch in tensor 'big'" in result.stdout and "FAILED" in result.stdout
    doc = json.loads(run("verify", str(ckpt), "--json").stdout)
    assert doc["ok"] is False and [(p["kind"], p["tensor"], p["rank"]) for p in doc["problems"]] == [("checksum", "big", 0)]


def test_verify_truncated_object(run_dir: Path):
    ckpt = run_dir / "step-0000100"
    os.truncate(data_object(ckpt), 100)
    result = run("verify", str(ckpt))
    assert result.exit_code == 1
    assert "is truncated: 100 bytes" in result.stdout and data_object(ckpt).name in result.stdout


def test_verify_tampered_index(run_dir: Path):
    ckpt = run_dir / "step-0000100"
    path = index_file(ckpt)
    path.write_bytes(path.read_bytes().replace(b'"block":4096', b'"block":8192'))
    result = run("verify", str(ckpt), "--json")
    assert result.exit_code == 1
    problems = json.loads(result.stdout)["problems"]
    assert problems[0]["kind"] == "index" and problems[0]["file"] == object_key(ckpt, 0, "index")
    assert "does not match the manifest's digest" in problems[0]["message"]


def test_verify_uncommitted_exits_1_inspect_exits_2(run_dir: Path):
    result = run("verify", str(run_dir / "step-0000300"))
    assert result.exit_code == 1 and "uncommitted" in result.stdout
    result = run("inspect", str(run_dir / "step-0000300"))
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("error: ") and "no committed manifest" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("cmd", ["verify", "inspect", "ls", "report"])  # report said "0 incidents", exit 0
def test_missing_path_exits_2_with_one_line(tmp_path: Path, cmd: str):
    result = run(cmd, str(tmp_path / "nowhere"), "--json")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("error: ") and str(tmp_path / "nowhere") in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_verify_and_inspect_never_unpickle(run_dir: Path, monkeypatch: pytest.MonkeyPatch):
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle was used")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    for ckpt in ("step-0000100", "step-0000200"):
        result = run("verify", str(run_dir / ckpt))
        assert result.exit_code == 0 and result.stdout.startswith("OK "), result.output
        result = run("inspect", str(run_dir / ckpt), "--json")
        assert result.exit_code == 0 and json.loads(result.stdout)["tensors"]
    assert run("ls", str(run_dir)).exit_code == 0


def test_installed_console_script(run_dir: Path, tmp_path: Path):
    script = Path(sys.executable).with_name("ckptkit")
    assert script.exists(), "the ckptkit console script is not installed next to this python"
    ok = subprocess.run([str(script), "verify", str(run_dir / "step-0000200"), "--json"],
                        capture_output=True, text=True, timeout=120, check=False)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ok"] is True
    missing = subprocess.run([str(script), "verify", str(tmp_path / "nowhere")],
                             capture_output=True, text=True, timeout=120, check=False)
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr == f"error: no checkpoint at {tmp_path / 'nowhere'}\n"


@pytest.mark.parametrize("cmd", ["verify", "inspect"])
def test_a_folder_that_is_no_checkpoint_is_named_for_what_it_is(run_dir: Path, tmp_path: Path, cmd: str):
    """A run folder, or a folder of other files (a DCP or zarr checkpoint, the user's own), was reported
    as a save that did not finish, "saving to this path again replaces the leftovers" (verify: exit 1,
    FAILED). Found by a hunt, 2026-12-06: now exit 2 saying what the folder is; a save's leftovers
    (only ``data/`` and ``index/``) are still an unfinished save."""
    result = run(cmd, str(run_dir))
    assert result.exit_code == 2 and "is a run folder" in result.stderr and "ckptkit ls" in result.stderr, result.output
    other = tmp_path / "dcp"
    other.mkdir()
    (other / ".metadata").write_bytes(b"x")
    (other / "__0_0.distcp").write_bytes(b"x")
    result = run(cmd, str(other))
    assert result.exit_code == 2 and "which no ckptkit save writes" in result.stderr and ".metadata" in result.stderr
    leftovers = tmp_path / "crashed"
    (leftovers / "data").mkdir(parents=True)
    (leftovers / "data" / "rank-00000-abc.bin").write_bytes(b"x")
    result = run(cmd, str(leftovers))
    assert result.exit_code == (1 if cmd == "verify" else 2) and "did not finish" in result.output
