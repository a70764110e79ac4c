"""Read-once loads over real gloo worlds: data-parallel replicas of the weights read each stored
byte from storage once in the job (counted at the store, locally and through the S3 server), the
values are bit-exact, and a reader that fails or dies makes every rank fail clearly."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import ckptkit
from ckptkit.engine.collective import resolve_comm
from ckptkit.engine.loader import load_state
from ckptkit.engine.state import flatten_state
from ckptkit.storage.counting import CountingStore
from ckptkit.storage.url import open_store
from tests.s3_server import CREDENTIALS, s3_env, s3_server  # noqa: F401 - fixtures

ROWS = 512  # x 256 float32 = 512 KiB of weights; optimizer rows split over the ranks


def _state(fill: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    weights = torch.randn(ROWS, 256, generator=g) if fill else torch.zeros(ROWS, 256)
    rows = ROWS // world
    moments = torch.arange(ROWS * 256, dtype=torch.float32).view(ROWS, 256)[rank * rows:(rank + 1) * rows].clone()
    return {
        "model": {"w": weights, "b": weights[0].clone() + 1},  # every rank holds the same: data parallel
        "optim": {"m": ckptkit.Sharded(moments if fill else torch.zeros_like(moments),
                                       [ckptkit.box_piece("optim/m", (ROWS, 256), (rank * rows, 0), (rows, 256))])},
    }


def _endpoint(endpoint: str | None) -> None:
    if endpoint is not None:
        os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint)  # the world may predate the server


def save(path: str, endpoint: str | None = None) -> None:
    _endpoint(endpoint)
    ckptkit.save(_state(True), path)


def load(path: str, read_once: bool, endpoint: str | None = None) -> dict:
    _endpoint(endpoint)
    state = _state(False)
    store = CountingStore(open_store(path))
    result = load_state(flatten_state(state), store, resolve_comm(), options=ckptkit.LoadOptions(read_once=read_once))
    want = _state(True)
    same = all(torch.equal(a, b) for a, b in ((state["model"]["w"], want["model"]["w"]),
                                              (state["model"]["b"], want["model"]["b"]),
                                              (state["optim"]["m"].local, want["optim"]["m"].local)))
    return {"read": store.nbytes, "reported": result.bytes_read, "same": same}


WEIGHTS, MOMENTS = ROWS * 256 * 4 + 256 * 4, ROWS * 256 * 4  # bytes stored once each


@pytest.mark.parametrize("where", ["local", "s3"])
def test_dp4_reads_every_stored_byte_once(worlds, tmp_path, where, request):
    if where == "s3":
        bucket, endpoint = request.getfixturevalue("s3_env"), request.getfixturevalue("s3_server").endpoint
        path = f"s3://{bucket}/read-once"
    else:
        path, endpoint = str(tmp_path / "ckpt"), None
    worlds.run(4, save, path, endpoint)
    weights, moments = WEIGHTS, MOMENTS
    shared = worlds.run(4, load, path, True, endpoint)
    alone = worlds.run(4, load, path, False, endpoint)
    assert all(r["same"] for r in shared + alone)
    # byte counts include the alignment gaps a coalesced read spans (at most one 4 KiB gap per data object)
    gaps = 4 * 4096
    assert 4 * weights + moments <= sum(r["read"] for r in alone) <= 4 * weights + moments + 4 * gaps
    assert weights + moments <= sum(r["read"] for r in shared) <= weights + moments + gaps  # 1.0x the unique bytes
    assert sum(r["read"] for r in alone) - sum(r["read"] for r in shared) >= 3 * weights
    assert [r["reported"] for r in shared] == [r["read"] for r in shared]


def load_corrupt(path: str) -> dict:
    try:
        load(path, True)
    except ckptkit.CkptkitError as exc:
        return {"type": type(exc).__name__, "text": str(exc)}
    return {"type": None}


def test_a_failing_reader_fails_every_rank_naming_it(worlds, tmp_path):
    path = str(tmp_path / "ckpt")
    worlds.run(4, save, path)
    # damage the largest data object (the one holding the replicated weights, read by one reader)
    data = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(path, "data")) for f in fs]
    big = max(data, key=os.path.getsize)
    with open(big, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    res = worlds.run(4, load_corrupt, path)
    kinds = [r["type"] for r in res]
    assert None not in kinds and kinds.count("CorruptCheckpointError") >= 1
    for r in res:  # every rank that needs the damaged bytes checks them itself, reads them again, and fails
        assert r["type"] == "CorruptCheckpointError" and "checksum mismatch" in r["text"] and "data/" in r["text"]


def test_a_reader_killed_mid_load_fails_every_other_rank_clearly(tmp_path):
    import subprocess
    import sys

    from tests.worlds import free_port

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = str(free_port())
    procs = []
    for rank in range(4):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.read_once_job", str(tmp_path)], cwd=root, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert procs[1].returncode == 3, outs[1][-2000:]
    for rank in (0, 2, 3):
        assert procs[rank].returncode == 0, outs[rank][-2000:]
        text = (tmp_path / f"rank-{rank}.txt").read_text()
        assert text.startswith("PeerFailureError") and "stopped answering" in text, text
