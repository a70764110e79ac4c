"""ckptkit's pickle loads are call-local: they neither read nor change torch's process-wide
``weights_only`` allow-list (converters/common/safe_unpickle.py), so they can run on many threads next to
a user's own ``torch.load(weights_only=True)``.

While worker threads run ckptkit's loads (Megatron and DeepSpeed ``.pt`` files, DCP blobs, whole
DCP imports whose chunks decode on reader threads, and a file naming the user's class), the user's
threads keep loading their own file, which names a class they registered with
``torch.serialization.add_safe_globals`` (or inside the ``safe_globals`` context manager):

* the user's loads never fail (a load that cleared or swapped the process-wide set for its duration,
  as converters/common/safe_unpickle.py did before, makes them fail in that window);
* ckptkit never accepts the user's class, registered or not (nor anything else off its allow-list);
* the user's registration is exactly what it was afterwards.
"""

from __future__ import annotations

import argparse
import io
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ckptkit_converters.deepspeed import files as deepspeed_format
from ckptkit_converters.megatron import files as megatron_format
from ckptkit_converters.dcp.files import load_blob
from ckptkit_converters.registry import convert
from ckptkit_converters.common.safe_unpickle import UnsafeCheckpointError
from tests.conftest import trials
from tests.test_import_trust_folders import dcp_folder


class UserThing:
    """The user's own class, registered by the user for their own loads."""

    def __init__(self, n: int = 0) -> None:
        self.n = n


class ScopedThing:
    """Another user class, trusted only inside ``torch.serialization.safe_globals([...])``."""


@pytest.fixture
def user_registration():
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([UserThing])
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def _files(tmp: Path) -> dict[str, Path]:
    out = {"user": tmp / "user.pt", "scoped": tmp / "scoped.pt", "mg": tmp / "common.pt", "ds": tmp / "optim.pt",
           "bad": tmp / "bad.pt"}
    torch.save({"thing": UserThing(7), "w": torch.arange(3)}, out["user"])
    torch.save({"s": ScopedThing()}, out["scoped"])
    torch.save({"args": argparse.Namespace(num_layers=4), "w": torch.ones(4)}, out["mg"])
    torch.save({"optimizer_state_dict": {"zero_stage": 2}, "w": torch.ones(3)}, out["ds"])
    torch.save({"x": [1, {"y": UserThing(1)}]}, out["bad"])
    return out


@pytest.mark.timeout(300)
def test_user_loads_never_lose_their_registration_while_ckptkit_loads(tmp_path, user_registration):
    files = _files(tmp_path)
    buf = io.BytesIO()
    torch.save(torch.arange(5), buf)
    blob = buf.getvalue()
    src = tmp_path / "dcp"
    src.mkdir()
    dcp_folder(src)
    stop = threading.Event()
    counts = {"user": 0, "user_failed": 0, "scoped": 0, "scoped_failed": 0, "ours": 0, "ours_accepted_user_class": 0,
              "ours_failed": 0, "imports": 0}
    lock = threading.Lock()
    failures: list[str] = []

    def bump(key: str, note: str = "") -> None:
        with lock:
            counts[key] += 1
            if note:
                failures.append(note)

    def user_loop() -> None:
        while not stop.is_set():
            try:
                assert torch.load(files["user"], weights_only=True)["thing"].n == 7
                bump("user")
            except Exception as exc:  # noqa: BLE001 - what the test counts
                bump("user_failed", f"user load: {type(exc).__name__}: {str(exc)[:200]}")

    def scoped_loop() -> None:
        while not stop.is_set():
            try:
                with torch.serialization.safe_globals([ScopedThing]):
                    assert isinstance(torch.load(files["scoped"], weights_only=True)["s"], ScopedThing)
                bump("scoped")
            except Exception as exc:  # noqa: BLE001
                bump("scoped_failed", f"scoped load: {type(exc).__name__}: {str(exc)[:200]}")

    def ours(i: int) -> None:
        try:
            k = i % 5
            if k == 0:
                assert megatron_format.load_pt(str(files["mg"]))["args"].num_layers == 4
            elif k == 1:
                assert deepspeed_format.load_file(str(files["ds"]))["optimizer_state_dict"]["zero_stage"] == 2
            elif k == 2:
                assert torch.equal(load_blob(blob, "blob"), torch.arange(5))
            elif k == 3:
                try:
                    megatron_format.load_pt(str(files["bad"]))
                    bump("ours_accepted_user_class", "ckptkit accepted the user's registered class")
                except UnsafeCheckpointError as exc:
                    assert "UserThing" in str(exc)
            else:
                convert(src, tmp_path / f"imported-{i}")  # chunks decode on the import's reader threads
                bump("imports")
            bump("ours")
        except Exception as exc:  # noqa: BLE001
            bump("ours_failed", f"ours {i}: {type(exc).__name__}: {str(exc)[:200]}")

    users = [threading.Thread(target=user_loop) for _ in range(2)] + [threading.Thread(target=scoped_loop)]
    for t in users:
        t.start()
    try:
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(ours, range(trials(150, 1500))))
    finally:
        stop.set()
        for t in users:
            t.join()
    print(f"\nconcurrent loads: {counts}")
    assert not failures, failures[:5]
    assert counts["user"] > 50 and counts["ours"] == trials(150, 1500) and counts["imports"] > 0
    assert UserThing in torch.serialization.get_safe_globals()
    assert ScopedThing not in torch.serialization.get_safe_globals()


def test_ckptkit_never_trusts_what_the_process_registered(tmp_path, user_registration):
    """Registered process-wide (as importing megatron.core registers Megatron's classes), and still refused:
    by every ``.pt`` reader and the DCP blob decoder, and the registration is left as it was."""
    files = _files(tmp_path)
    assert isinstance(torch.load(files["bad"], weights_only=True)["x"][1]["y"], UserThing)  # torch would
    for load in (megatron_format.load_pt, deepspeed_format.load_file):
        with pytest.raises(UnsafeCheckpointError, match="UserThing"):
            load(str(files["bad"]))
    with pytest.raises(UnsafeCheckpointError, match="UserThing"):
        load_blob(files["bad"].read_bytes(), "blob")
    assert torch.serialization.get_safe_globals().count(UserThing) == 1
