"""``make gpu-check``'s harness (benchmarks/gpu_check.py) and ``make gpu-wheels``' checks
(benchmarks/gpu_wheels.py), on any machine: without CUDA every check is SKIPPED and the verdict is
not a pass; the verdict rules; the wheel folder's size and installability checks. A few seconds.

On a GPU machine the harness runs this file too (it matches tests/test_gpu_*.py): it hides the GPU
from the harness it starts (``CUDA_VISIBLE_DEVICES=""``), so it checks the same thing there."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


gpu_check = _module("gpu_check")
gpu_wheels = _module("gpu_wheels")


def test_without_cuda_every_check_is_skipped_and_the_verdict_is_no_gpu(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    checks = [ln for ln in lines[2:-1]]
    names = gpu_check.check_names(ROOT)
    assert {"paths", "megatron", "deepspeed", "torchtitan", "check", "bench-staging", "bench-vs-dcp"} <= set(names)
    if os.path.exists(os.path.join(ROOT, "tests", "test_gpu_overlap.py")):
        assert "overlap" in names
    assert len(checks) == len(names)
    for name, ln in zip(names, checks):
        assert ln.split()[1:4] == [name, "SKIPPED", "no"] and ln.endswith("no CUDA device"), ln
    assert lines[-1].startswith("gpu-check: NO-GPU") and "PASS" not in lines[-1] and "not a pass" in lines[-1]
    assert not any(" PASS " in ln for ln in lines)
    assert os.path.exists(tmp_path / "gpu-check.json")


def test_verdict_rules():
    R = gpu_check.Result
    ok, skip, bad = R("a", "PASS", ""), R("b", "SKIPPED", "framework missing"), R("c", "FAIL", "")
    assert gpu_check.verdict([ok, ok], gpu=True) == "PASS"
    assert gpu_check.verdict([ok, skip], gpu=True) == "INCOMPLETE"  # a skipped check is never a pass
    assert gpu_check.verdict([ok, skip, bad], gpu=True) == "FAIL"
    assert gpu_check.verdict([], gpu=True) == "INCOMPLETE"
    assert gpu_check.verdict([skip], gpu=False) == "NO-GPU"
    assert gpu_check.VERDICT_EXIT["PASS"] == 0 and all(v for k, v in gpu_check.VERDICT_EXIT.items() if k != "PASS")


def test_a_test_file_is_judged_from_its_junit_report(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="t" name="test_ok" time="0.1"><properties><property name="note" value="with a stub"/>'
        '</properties></testcase>'
        '<testcase classname="t" name="test_skip" time="0"><skipped message="megatron-core cannot be imported"/>'
        '</testcase><testcase classname="t" name="test_bad" time="0"><failure message="assert 1 == 2">x</failure>'
        '</testcase></testsuite></testsuites>')
    passed, failed, skipped, notes = gpu_check.junit(str(xml))
    assert passed == 1 and notes == ["with a stub"]
    assert failed == ["test_bad: assert 1 == 2"]
    assert skipped == ["test_skip: megatron-core cannot be imported"]


def test_the_size_check_counts_the_wheels_and_the_tree(tmp_path):
    folder = tmp_path / "w"
    folder.mkdir()
    (folder / "a-1.0-py3-none-any.whl").write_bytes(b"x" * (3 << 20))
    (folder / "b-2.0-py3-none-any.whl").write_bytes(b"y" * (1 << 20))
    ok, line = gpu_wheels.check_size(str(folder), tree=50 << 20)
    assert ok and "4.0 MiB of wheels" in line and "54.0 MiB" in line and "within" in line
    ok, line = gpu_wheels.check_size(str(folder), tree=61 << 20)
    assert not ok and "OVER" in line


def test_wheel_tags_for_the_gpu_machine(tmp_path):
    fits = gpu_wheels.runs_on_gpu_machine
    assert fits("torchtitan-0.3.0-py3-none-any.whl")
    assert fits("crc32c-2.9.post0-cp312-cp312-manylinux1_x86_64.manylinux_2_28_x86_64.manylinux_2_5_x86_64.whl")
    assert fits("torchao-0.18.0-cp310-abi3-manylinux_2_28_x86_64.whl")
    assert not fits("crc32c-2.9.post0-cp311-cp311-manylinux_2_28_x86_64.whl")  # this machine's Python, not 3.12
    assert not fits("x-1.0-cp312-cp312-macosx_11_0_arm64.whl")
    assert not fits("x-1.0-cp312-cp312-manylinux_2_28_aarch64.whl")
    folder = tmp_path / "w"
    folder.mkdir()
    for name in ("a-1.0-py3-none-any.whl", "a-1.1-py3-none-any.whl", "b-1.0-cp311-cp311-manylinux_2_28_x86_64.whl"):
        (folder / name).write_bytes(b"")
    problems = gpu_wheels.check_folder(str(folder), {"a": "1.0", "b": "1.0", "c": "2.0"})
    assert any("two versions of a" in p for p in problems)
    assert any("b-1.0" in p and "not installable" in p for p in problems)
    assert any(p == "c: no wheel" for p in problems)


def test_built_wheels_fit_and_install_on_the_gpu_machine():
    """``make gpu-wheels``' folder, where it has been built: 64 MiB with the tree, one cp312-installable wheel
    per package, at the CPU suite's versions."""
    folder = os.path.join(ROOT, "gpu-wheels")
    if not os.path.isdir(folder):
        pytest.skip("gpu-wheels/ is not built here (make gpu-wheels)")
    ok, line = gpu_wheels.check_size(folder, gpu_wheels.tree_bytes(ROOT))
    assert ok, line
    try:
        want = gpu_wheels.wanted()
    except SystemExit:
        want = None  # an environment without the frameworks: check installability and duplicates only
    assert gpu_wheels.check_folder(folder, want) == []


def test_pyproject_lists_every_package():
    """A non-editable install (the wheel gpu-wheels builds, a user's pip install) holds only the packages
    pyproject.toml lists: every package folder must be there (ckptkit.memory once was not)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = set()
    for top, name in (("ckptkit", "ckptkit"), ("converters", "ckptkit_converters")):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            if "__init__.py" in files:
                rel = os.path.relpath(dirpath, os.path.join(ROOT, top))
                found.add(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    assert found == listed, (sorted(found - listed), sorted(listed - found))


def test_install_without_wheels_fails_plainly(tmp_path):
    """``make gpu-check`` on a machine where gpu-wheels/ was not carried: a FAIL line, exit 1, nothing run."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--install",
                           str(tmp_path / "none"), "--site", str(tmp_path / "site"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines()[-1].startswith("gpu-check: FAIL: no wheels in")
