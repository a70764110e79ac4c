"""A lost node under torchrun: two ranks SIGKILLed and their node's memory deleted mid-training;
the restarted job resumes from the memory tier (peer copies), not the older persistent
checkpoint, and ends bit-exact with an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from tests import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reference() -> dict:
    model, optim = models.build("fsdp", torch.float32, seed=0)
    for s in range(1, 9):
        models.train(model, optim, 1, start=s)
    return models.full_state(model, optim)


def test_killed_node_resumes_from_memory_under_torchrun(worlds, tmp_path):
    run = str(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "--max-restarts=1",
           "--standalone", "-m", "tests.memory_job", run]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    job = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=400)
    assert job.returncode == 0, job.stdout[-4000:]
    with open(os.path.join(run, "restore.json")) as f:
        record = json.load(f)
    assert record["step"] == 6  # the persistent checkpoint is step 4
    assert record["sources"] == ["memory", "memory", "peer", "peer"]
    final = torch.load(os.path.join(run, "final.pt"), weights_only=True)
    ref = worlds.run(4, reference)[0]
    assert final.keys() == ref.keys()
    for k in ref:
        assert torch.equal(final[k], ref[k]), k
