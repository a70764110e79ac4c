"""How the command line is built: shared option types, one output sink, lazy imports, one error boundary.

* commands never import one another (ckptkit/cli/commands_*.py), and nothing renders outside
  ckptkit/cli/output.py's sink;
* ``ckptkit --help`` imports neither torch, rich nor the library; ``ckptkit ls``, ``inspect`` and
  ``verify`` run without importing torch (nor numpy, nor the converters) at all (checked in one fresh
  interpreter with the other import promises: tests/test_import_costs.py);
* sizes, layouts, layer counts and ``--storage-option KEY=VALUE`` parse one way everywhere;
* every command's help carries examples; an unexpected exception is one line and exit code 3.
"""

from __future__ import annotations

import ast
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ckptkit.cli import options as cli_options
from ckptkit.cli.main import cli
from tests.test_catalog import save_single

CLI_DIR = Path(__file__).resolve().parents[1] / "ckptkit" / "cli"
COMMANDS = ["ls", "inspect", "verify", "diff", "convert", "reshard", "report", "plan"]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_commands_never_import_sibling_commands():
    modules = sorted(CLI_DIR.glob("commands_*.py"))
    assert len(modules) == len(COMMANDS)
    for path in modules:
        siblings = {m for m in _imports(path) if "commands_" in m}
        assert not siblings, f"{path.name} imports {siblings}"
        assert not any(m.startswith("ckptkit.cli.render") for m in _imports(path)), path.name


def test_rich_only_in_the_output_sink():
    for path in CLI_DIR.glob("*.py"):
        if path.name != "output.py":
            assert not any(m.split(".")[0] == "rich" for m in _imports(path)), f"{path.name} imports rich"


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_command_has_examples(cmd: str):
    result = CliRunner().invoke(cli, [cmd, "--help"])
    assert result.exit_code == 0, result.output
    assert "Example" in result.output and f"ckptkit {cmd} " in result.output


def test_shared_option_types():
    assert [cli_options.parse_size(t) for t in ("4GiB", "512MiB", "2G", "1.5g", "64KiB", "100", "7b")] == \
        [4 << 30, 512 << 20, 2 << 30, int(1.5 * (1 << 30)), 64 << 10, 100, 7]
    for bad in ("lots", "4XB", "-1G", ""):
        with pytest.raises(ValueError):
            cli_options.parse_size(bad)
    layout = cli_options.LAYOUT.convert("tp4pp2", None, None)
    assert (layout.tp, layout.pp, layout.dp) == (4, 2, 1)
    with pytest.raises(click.BadParameter, match="invalid parallel config"):
        cli_options.LAYOUT.convert("tp4xx", None, None)
    assert cli_options.LAYER_COUNTS.convert("15,17", None, None) == (15, 17)
    assert cli_options.KEY_VALUE.convert("anon=true", None, None) == ("anon", True)
    assert cli_options.KEY_VALUE.convert("endpoint_url=http://h:9000", None, None) == ("endpoint_url", "http://h:9000")
    assert cli_options.KEY_VALUE.convert('client_kwargs={"region_name": "x"}', None, None) == \
        ("client_kwargs", {"region_name": "x"})
    with pytest.raises(click.BadParameter, match="KEY=VALUE"):
        cli_options.KEY_VALUE.convert("novalue", None, None)


def test_bad_sizes_and_layouts_are_usage_errors(tmp_path: Path):
    save_single(tmp_path / "c")
    for args, where in ((["--to", "tp2pp1", "--max-memory", "lots"], "--max-memory"),
                        (["--to", "tp2zz"], "--to"), (["--to", "tp2pp1", "--pp-layers", "1,x"], "--pp-layers")):
        result = CliRunner().invoke(cli, ["reshard", str(tmp_path / "c"), str(tmp_path / "o"), *args])
        assert result.exit_code == 2 and where in result.output, result.output
        assert not (tmp_path / "o").exists()


def test_storage_options_reach_the_library(tmp_path: Path):
    save_single(tmp_path / "run" / "step-1")
    for cmd, target in (("ls", tmp_path / "run"), ("inspect", tmp_path / "run" / "step-1"),
                        ("verify", tmp_path / "run" / "step-1")):
        ok = CliRunner().invoke(cli, [cmd, str(target), "--storage-option", "io_engine=native"])
        assert ok.exit_code == 0, ok.output
        bad = CliRunner().invoke(cli, [cmd, str(target), "--storage-option", "io_engine=bogus"])
        assert bad.exit_code == 2 and bad.stderr.startswith("error: ") and "unknown io_engine 'bogus'" in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1


def test_an_unexpected_exception_is_one_line_and_exit_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import ckptkit.offline

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("kaboom")

    monkeypatch.setattr(ckptkit.offline, "list_checkpoints", boom, raising=False)
    monkeypatch.delenv("CKPTKIT_DEBUG", raising=False)
    result = CliRunner().invoke(cli, ["ls", str(tmp_path), "--json"])
    assert result.exit_code == 3 and result.stdout == ""
    assert result.stderr.startswith("error: internal error (RuntimeError: kaboom)") and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_json_output_is_one_document_and_errors_go_to_stderr(tmp_path: Path):
    save_single(tmp_path / "c")
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "c"), str(tmp_path / "x"), "--format", "ckptkit",
                                      "--json"])
    assert result.exit_code == 2 and result.stdout == "" and "a zarr group" in result.stderr
