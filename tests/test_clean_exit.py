"""``ckptkit.resilience.restart.destroy_process_group``: the end-of-job pair of ``init_process_group``.

Whether it prevents the exit abort it is for (a gloo worker thread asking for the GIL while the
interpreter finalizes) is a race measured outside the suite (its docstring gives the figures); here:
it destroys the world, leaves none behind, is a no-op without one, and a job that ends with it exits 0.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

JOB = textwrap.dedent("""
    import os, sys, tempfile
    import torch, torch.distributed as dist
    from ckptkit.resilience.restart import destroy_process_group, init_process_group

    store = os.path.join(tempfile.mkdtemp(), "store")
    init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    t = torch.ones(4)
    dist.all_reduce(t)
    out = [torch.empty(4)]
    dist.all_gather(out, t)
    destroy_process_group()
    assert not dist.is_initialized()
    destroy_process_group()  # no world: nothing to do
    print("clean", flush=True)
""")


def test_destroy_process_group_ends_the_world_and_the_job_exits_cleanly():
    proc = subprocess.run([sys.executable, "-c", JOB], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "clean"
    assert "terminate called" not in proc.stderr
