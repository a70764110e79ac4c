"""A real S3-compatible server for tests: moto in server mode on 127.0.0.1, started by the suite.

No s3fs or botocore call is mocked: every test talks HTTP to this server.
"""

from __future__ import annotations

import os
import threading
import uuid

import pytest

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "ckptkit-test",
    "AWS_SECRET_ACCESS_KEY": "ckptkit-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


_CONDITIONAL_WRITES = threading.Lock()


def _make_conditional_writes_atomic() -> None:
    """Keep S3's promise that a conditional write is atomic: of writers racing ``If-None-Match: *`` PUTs
    (or completing multipart uploads so) to one key, exactly one succeeds. ckptkit's commit rests on it.
    moto 5.2 checks whether the key exists and then writes, with nothing between, and its threaded
    server runs requests side by side: two of eight racing conditional PUTs both succeeded once (the
    store conformance race test). Here conditional writes (``If-None-Match``/``If-Match``) run one at
    a time; everything else in the server is untouched."""
    from moto.s3.responses import S3Response

    if getattr(S3Response, "_ckptkit_atomic_conditional_writes", False):
        return
    for name in ("put_object", "_key_response_post"):  # PutObject; CompleteMultipartUpload
        original = getattr(S3Response, name)

        def serialized(self, *args, _original=original, **kwargs):
            if self.headers.get("If-None-Match") or self.headers.get("If-Match"):
                with _CONDITIONAL_WRITES:
                    return _original(self, *args, **kwargs)
            return _original(self, *args, **kwargs)

        setattr(S3Response, name, serialized)
    S3Response._ckptkit_atomic_conditional_writes = True


class MotoS3:
    def __init__(self) -> None:
        os.environ.update(CREDENTIALS)
        from moto.server import ThreadedMotoServer

        _make_conditional_writes_atomic()

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    def client(self, endpoint: str | None = None):
        import boto3

        return boto3.client("s3", endpoint_url=endpoint or self.endpoint, region_name="us-east-1")

    def new_bucket(self) -> str:
        name = f"ckptkit-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)  # boto3: s3fs mkdir with a region fails against moto
        return name

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="session")
def s3_server():
    try:
        srv = MotoS3()
    except ImportError:
        pytest.skip("moto[server] is not installed")
    yield srv
    srv.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The endpoint in AWS_ENDPOINT_URL (as a user would set it) and a fresh bucket."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    return s3_server.new_bucket()
