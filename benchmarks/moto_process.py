"""moto's S3 server as a child process on 127.0.0.1, for the object-store benchmark.

A separate process, not moto's in-process threaded server: the server is
CPU-heavy Python and would otherwise compete with the client for the GIL.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from typing import Any

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "ckptkit-bench",
    "AWS_SECRET_ACCESS_KEY": "ckptkit-bench-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # never wait for an instance-metadata lookup
}


# Runs in the server process: die with the benchmark (PR_SET_PDEATHSIG), even if it is SIGKILLed.
_MOTO_BOOT = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)
from moto.server import main
main(sys.argv[2:])
"""


class MotoProcess:
    """moto's S3 server in its own process on 127.0.0.1, on a free port."""

    def __init__(self, log_path: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-c", _MOTO_BOOT, str(os.getpid()), "-H", "127.0.0.1", "-p", str(port)]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._wait_ready(port)

    def _wait_ready(self, port: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                self.client().list_buckets()
                return
            except Exception as exc:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server on port {port} did not answer in {timeout:.0f}s: {exc}") from None
                time.sleep(0.2)

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"], aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )

    def new_bucket(self) -> str:
        name = f"bench-s3-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)  # boto3: s3fs mkdir with a region fails against moto
        return name

    def objects(self, bucket: str, prefix: str) -> list[tuple[str, int]]:
        out = []
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out.extend((o["Key"], int(o["Size"])) for o in page.get("Contents", []))
        return out

    def delete_prefix(self, bucket: str, prefix: str) -> None:
        keys = [k for k, _ in self.objects(bucket, prefix)]
        client = self.client()
        for i in range(0, len(keys), 1000):
            client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
        left = self.objects(bucket, prefix)
        if left:
            raise RuntimeError(f"s3://{bucket}/{prefix}: {len(left)} objects survived deletion")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
