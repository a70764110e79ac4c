"""Preemption and crashes of a real torchrun job under the resilience controller."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


import ckptkit
from ckptkit.resilience.incidents import IncidentLog
from ckptkit.storage import open_store
from tests import resilience_model as rm
from tests.worlds import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(run: str, *extra: str, restarts: int = 0) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--max-restarts={restarts}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "tests.resilience_job", run, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_step(run: str, step: int, job: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    path = os.path.join(run, "trajectory.txt")
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                lines = f.read().split("\n")
            if any(line and int(line.split()[1]) >= step for line in lines):
                return
        if job.poll() is not None:
            raise AssertionError(f"job ended early:\n{job.stdout.read()}")
        time.sleep(0.05)
    raise AssertionError("job did not reach the step in time")


def final_trajectory(run: str) -> list[int]:
    """first sample of each step as the final model saw it (later attempts override earlier ones)."""
    seen: dict[int, int] = {}
    with open(os.path.join(run, "trajectory.txt")) as f:
        for line in f:
            _, step, first = map(int, line.split())
            for s in [s for s in seen if s > step]:
                del seen[s]  # a restart rewound past these
            seen[step] = first
    return [seen[s] for s in sorted(seen)]


def committed_steps(run: str) -> list[int]:
    root = os.path.join(run, "ckpt")
    return sorted(int(n.split("-")[1]) for n in os.listdir(root)
                  if n.startswith("step-") and os.path.exists(os.path.join(root, n, "manifest.json")))


def kinds(run: str) -> list[str]:
    return [i.kind for i in IncidentLog(open_store(os.path.join(run, "ckpt")), writer=False).read()]


def sigterm_workers(run: str) -> None:
    for name in os.listdir(os.path.join(run, "pids")):
        with open(os.path.join(run, "pids", name)) as f:
            os.kill(int(f.read()), signal.SIGTERM)


def test_sigterm_saves_an_emergency_checkpoint_and_the_run_resumes_exactly(tmp_path):
    run = str(tmp_path / "run")
    job = launch(run, "--steps", "400", "--every", "50", "--grace", "60")
    wait_for_step(run, 12, job)
    sigterm_workers(run)
    assert job.wait(timeout=120) == 0, job.stdout.read()
    steps = committed_steps(run)
    assert steps and 12 <= steps[-1] < 50  # an emergency save, not a periodic one
    assert "preempt" in kinds(run) and "emergency_save" in kinds(run)
    report = ckptkit.catalog.verify(os.path.join(run, "ckpt", f"step-{steps[-1]:07d}"))
    assert report.ok, report.problems
    job = launch(run, "--steps", str(steps[-1] + 10), "--every", "50")
    assert job.wait(timeout=120) == 0, job.stdout.read()
    assert final_trajectory(run) == [rm.BATCH * i for i in range(steps[-1] + 10)]  # exact data position


def test_sigterm_with_too_short_a_grace_abandons_cleanly(tmp_path):
    run = str(tmp_path / "run")
    job = launch(run, "--steps", "400", "--every", "5", "--grace", "0")
    wait_for_step(run, 12, job)
    sigterm_workers(run)
    assert job.wait(timeout=120) == 0, job.stdout.read()
    root = os.path.join(run, "ckpt")
    dirs = sorted(n for n in os.listdir(root) if n.startswith("step-"))
    steps = committed_steps(run)
    assert steps and all(s % 5 == 0 for s in steps)  # only periodic checkpoints are committed
    assert [d for d in dirs if int(d.split("-")[1]) not in steps] == []  # nothing half-committed left
    assert "save_abandoned" in kinds(run)
    target = rm.state_of(*rm.build(seed=3))
    ckptkit.load(target, os.path.join(root, f"step-{steps[-1]:07d}"), strict=False)


def test_kill_minus_nine_mid_step_under_torchrun_restarts_and_completes(tmp_path):
    run = str(tmp_path / "run")
    job = launch(run, "--steps", "30", "--every", "5", "--crash-at", "13", restarts=2)
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 0, out
    assert committed_steps(run)[-1] == 30
    assert "restart" in kinds(run)
    assert final_trajectory(run) == [rm.BATCH * i for i in range(30)]
    with open(os.path.join(run, "trajectory.txt")) as f:
        attempts = {int(line.split()[0]) for line in f}
    assert attempts == {0, 1}
