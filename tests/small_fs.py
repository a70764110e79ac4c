"""A real small tmpfs for the tests of a full memory folder (a full ``/dev/shm`` in small).

Mounting needs root and a ``mount`` the container allows; where either is missing the test is
skipped with that reason (it is never faked with an injected error: the failure it finds is the
kernel's, a store into a memory-mapped file that tmpfs cannot back)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def small_tmpfs(path: str, size: str) -> Iterator[str]:
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)
