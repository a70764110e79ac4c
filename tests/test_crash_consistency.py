"""kill -9 of a rank at a random moment while checkpoints are being persisted.

After every crash: the newest committed checkpoint and all older ones load with
exactly the right bytes, an interrupted save is never picked by
restore_latest, and gc removes what the crash left behind. Runs a few times by
default; ``--run-slow`` runs the full 50.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import ckptkit
from tests.crash_job import N, expected_values
from tests.worlds import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_and_kill(run: str, pid_dir: str, rng: random.Random) -> None:
    os.makedirs(pid_dir, exist_ok=True)
    job = subprocess.Popen(
        [sys.executable, "-m", "tests.crash_job", run, pid_dir, "--port", str(free_port())],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 90
        while not os.path.exists(os.path.join(run, "step-0000002", "manifest.json")):
            if time.monotonic() > deadline or job.poll() is not None:
                pytest.fail("the crash job did not produce its first checkpoints")
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.0))  # somewhere in snapshot / persist / commit / retention
        victim = rng.randrange(2)
        with open(os.path.join(pid_dir, f"rank-{victim}.pid")) as f:
            os.kill(int(f.read()), signal.SIGKILL)
        job.wait(timeout=90)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def check_run(run: str) -> None:
    names = sorted(n for n in os.listdir(run) if n.startswith("step-"))
    committed = [n for n in names if os.path.exists(os.path.join(run, n, "manifest.json"))]
    assert committed, names
    for name in committed:  # every committed checkpoint holds exactly its step's bytes
        step = int(name.split("-")[1])
        target = {"x": torch.zeros(2 * N), "rep": torch.zeros(1024, dtype=torch.bfloat16), "step": -1}
        ckptkit.load(target, os.path.join(run, name))
        exp = expected_values(step, 2)
        assert target["step"] == step and torch.equal(target["x"], exp["x"]) and torch.equal(target["rep"], exp["rep"])
    newest = max(int(n.split("-")[1]) for n in committed)
    with ckptkit.CheckpointManager(run) as mgr:
        target = {"x": torch.zeros(2 * N), "rep": torch.zeros(1024, dtype=torch.bfloat16), "step": -1}
        assert mgr.restore_latest(target) == newest  # never an interrupted save
        removed = set(mgr.gc())
    leftovers = set(names) - set(committed)
    assert removed == leftovers
    assert sorted(n for n in os.listdir(run) if n.startswith("step-")) == committed


def test_kill_minus_nine_during_persist(tmp_path, request):
    iterations = 50 if request.config.getoption("--run-slow") else 4
    rng = random.Random(1234)
    for i in range(iterations):
        run = str(tmp_path / f"run{i}")
        run_and_kill(run, str(tmp_path / f"pids{i}"), rng)
        check_run(run)
