"""What importing ckptkit costs: the modules and commands that must not pull torch (or other heavy libraries).

Each promise is checked in a fresh interpreter, since an import made by an earlier test would hide one.
One interpreter serves them all: it runs the steps below in order, strictest first (``ckptkit --help``
imports nothing heavy at all; the listing API imports neither torch, numpy nor the pickle module; ``ls``,
``inspect`` and ``verify`` import no torch, numpy, converters or tensorstore; the torch-free library
modules import no torch), and after each step reports which watched libraries are loaded so far and,
for each, the ckptkit line whose import first pulled it. Checking what accumulates is as strict as a
fresh interpreter per step: a step that imports torch finds it not loaded before it (the earlier steps
were checked free of it), so the step that pulls it is the one named, with the line that did.

Run as ``python -m tests.test_import_costs PLAN_JSON`` it is that interpreter: this module imports only
the standard library at its top, so loading it watches from a clean start.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WATCHED = ("torch", "numpy", "pickle", "rich", "ckptkit_converters", "tensorstore", "s3fs", "torchtitan")
"""Top-level libraries whose first import the probe records, with the ckptkit line that made it."""


@dataclass(frozen=True)
class Step:
    """One thing the fresh interpreter does: run ``ckptkit ARGV`` (``cli``), import a module (``import``), or
    run a line of library code (``code``); then none of ``forbidden`` may be loaded."""

    label: str
    forbidden: tuple[str, ...]
    cli: tuple[str, ...] = ()
    module: str = ""
    code: str = ""


@dataclass
class StepReport:
    """What one step left behind: the watched libraries loaded so far, where each was first imported from,
    ckptkit.offline's modules loaded so far, and a command's exit code and standard output."""

    label: str
    loaded: dict[str, str] = field(default_factory=dict)
    offline_modules: list[str] = field(default_factory=list)
    exit_code: Any = None
    stdout: str = ""


# ------------------------------------------------------------------ the fresh interpreter's side


class _FirstImports:
    """A meta-path finder that finds nothing: it only notes, for each watched library, the innermost ckptkit
    frame (module and line) that was running when the library was first imported."""

    def __init__(self) -> None:
        self.where: dict[str, str] = {}

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        top = name.partition(".")[0]
        if top in WATCHED and top not in self.where and top not in sys.modules:
            self.where[top] = self._importer()
        return None

    @staticmethod
    def _importer() -> str:
        frame = sys._getframe(2)
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            if module.partition(".")[0] in ("ckptkit", "ckptkit_converters"):
                return f"{module} line {frame.f_lineno}"
            frame = frame.f_back
        return "outside ckptkit"


def _run_step(step: Step) -> tuple[Any, str]:
    """Do ``step``; a command's exit code and what it printed (a command's output goes to a buffer)."""
    if step.module:
        importlib.import_module(step.module)
        return None, ""
    if step.code:
        exec(step.code, {})  # noqa: S102 - the test's own line of library code
        return None, ""
    from ckptkit.cli.main import main

    out = io.StringIO()
    code: Any = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(list(step.cli))
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue()


def probe(steps: list[Step]) -> list[StepReport]:
    """Run ``steps`` in this interpreter, in order; what each left loaded."""
    watch = _FirstImports()
    sys.meta_path.insert(0, watch)
    reports = []
    for step in steps:
        code, stdout = _run_step(step)
        loaded = {top: watch.where.get(top, "before the first step") for top in WATCHED if top in sys.modules}
        offline = sorted(m for m in sys.modules if m.startswith("ckptkit.offline."))
        reports.append(StepReport(step.label, loaded, offline, code, stdout))
    return reports


def _main() -> None:
    steps = [Step(**{**s, "forbidden": tuple(s["forbidden"]), "cli": tuple(s["cli"])}) for s in json.loads(sys.argv[1])]
    reports = probe(steps)
    sys.stdout.write(json.dumps([asdict(r) for r in reports]))


# ------------------------------------------------------------------ the test


def run_in_fresh_interpreter(steps: list[Step]) -> list[StepReport]:
    proc = subprocess.run([sys.executable, "-m", "tests.test_import_costs", json.dumps([asdict(s) for s in steps])],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    return [StepReport(**r) for r in json.loads(proc.stdout)]


HELP_FREE = ("torch", "numpy", "pickle", "rich", "ckptkit_converters", "tensorstore", "s3fs")
LISTING_FREE = ("torch", "numpy", "pickle")
COMMAND_FREE = ("torch", "numpy", "ckptkit_converters", "tensorstore")
LIBRARY_FREE = ("torch", "torchtitan")


def plan(ckpt: Path) -> list[Step]:
    """Every promise, strictest first (see the module docstring)."""
    run = str(ckpt.parent)
    listing = ("import ckptkit.offline.listing as l, ckptkit.offline.description as d, "
               "ckptkit.offline.verification as v\n"
               f"l.list_checkpoints({run!r}); d.describe({str(ckpt)!r}); assert v.verify({str(ckpt)!r}).ok")
    steps = [Step("ckptkit --help", HELP_FREE, cli=("--help",)),
             Step("list, describe and verify through the library", LISTING_FREE, code=listing)]
    # (rich's console imports the pickle *module* from here on; nothing unpickles: tests/test_cli.py patches pickle.load)
    for argv in (("ls", run), ("inspect", str(ckpt)), ("verify", str(ckpt))):
        steps += [Step(f"ckptkit {argv[0]}", COMMAND_FREE, cli=argv),
                  Step(f"ckptkit {argv[0]} --json", COMMAND_FREE, cli=(*argv, "--json"))]
    for module in ("ckptkit", "ckptkit.adapters", "ckptkit.adapters.dataloader_remap", "ckptkit.layout.zero_partition"):
        steps.append(Step(f"import {module}", LIBRARY_FREE, module=module))
    steps.append(Step("list the installed source formats", ("torch",),
                      code="from ckptkit.offline.formats import source_formats; source_formats()"))
    return steps


def test_modules_and_commands_import_no_torch(tmp_path: Path) -> None:
    from tests.test_catalog import save_single

    ckpt = tmp_path / "run" / "step-0000001"
    save_single(ckpt, metadata={"step": 1})
    steps = plan(ckpt)
    reports = run_in_fresh_interpreter(steps)
    assert [r.label for r in reports] == [s.label for s in steps]
    for step, report in zip(steps, reports):
        pulled = {lib: where for lib, where in report.loaded.items() if lib in step.forbidden}
        assert not pulled, f"{step.label} imported " + "; ".join(f"{lib} (first from {where})" for lib, where in pulled.items())
        if step.cli:
            assert report.exit_code in (0, None), (step.label, report.stdout)
        if "--json" in step.cli:
            json.loads(report.stdout)
    help_report = reports[0]
    assert help_report.exit_code == 0
    assert help_report.offline_modules == [], help_report.offline_modules  # no library behind --help
    assert "ckptkit verify runs/exp1" in help_report.stdout


def test_the_probe_names_the_module_that_pulled_a_library() -> None:
    """The check has teeth: a step that draws a console loads rich, reported with the ckptkit line whose import
    pulled it (ckptkit.cli.output imports rich only when something is drawn)."""
    reports = run_in_fresh_interpreter([Step("import the output sink", (), module="ckptkit.cli.output"),
                                        Step("draw", ("rich",), code="import ckptkit.cli.output as o\no.console()")])
    assert "rich" not in reports[0].loaded
    assert reports[1].loaded["rich"].startswith("ckptkit.cli.output line "), reports[1].loaded


if __name__ == "__main__":
    _main()
