"""S3 (and S3-compatible) byte store, through s3fs and its aiobotocore client.

* Large objects are multipart uploads: parts of ``part_size`` bytes uploaded
  with at most ``max_concurrency`` in flight (memory stays bounded at about
  ``part_size * max_concurrency``), completed at the end, aborted on failure.
* Reads are ranged GETs of exactly the bytes asked for.
* The commit is a conditional PUT (``If-None-Match: *``): S3 has no rename,
  and two writers can never both create the manifest. If the answer to a
  conditional PUT is lost and the retry sees 412, the stored object is read
  back: if it is ours, the commit succeeded. A ``409 ConditionalRequestConflict``
  (another conditional write to the key was in progress) decides nothing: if the
  read-back finds no object yet, the conditional PUT is tried again, with backoff,
  until one writer's object is visible — bounded by ``commit_attempts`` and
  ``commit_seconds``, then a StorageError (nothing was created by this writer).
  Two writers that both met 409 would otherwise both give up, and neither commits.
* Retries: every HTTP request is retried by botocore's "standard" retry mode
  (5xx, throttling, connection resets and timeouts, with exponential backoff
  and jitter; up to ``MAX_ATTEMPTS`` retries after the first attempt, so a
  persistent outage fails a request after about two minutes). s3fs adds its own retry for a
  few transport errors on the calls it makes itself (listing). botocore's retry
  ends when an answer's headers arrive: a GET whose body then breaks off or
  comes short of its Content-Length is retried here (``SHORT_READ_RETRIES``).
  Errors that survive the retries become :class:`~ckptkit.errors.StorageError`
  naming the object — never "missing" or "truncated", which only the server's
  own answer (404, 416, a Content-Range total) can say.

A multipart upload whose creation answer was lost cannot be aborted by the
client (it never learned the upload id): give the bucket a lifecycle rule
that aborts incomplete multipart uploads after a day.

Credentials and the endpoint come from the usual places (environment,
``AWS_ENDPOINT_URL``, config files) or ``storage_options`` (passed to
``s3fs.S3FileSystem``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Future
from typing import Any

from ckptkit.errors import CheckpointNotFoundError, CkptkitError, CorruptCheckpointError, StorageError
from ckptkit.storage.base import ByteStore, too_large

PART_SIZE = 64 << 20
MAX_CONCURRENCY = 8
MAX_ATTEMPTS = 10  # botocore: retries after the first attempt
SHORT_READ_RETRIES = 3  # retries of a GET whose body broke off, after the first attempt
SHORT_READ_BACKOFF = 0.05  # seconds before the first such retry; doubled before each next one
COMMIT_ATTEMPTS = 12  # conditional PUTs of one commit, while each answers 409 and nothing is visible
COMMIT_SECONDS = 60.0  # and at most this long in all
COMMIT_BACKOFF = 0.05  # seconds before the first retry after a 409; doubled (with jitter) up to 5 s
_PRECONDITION = ("PreconditionFailed", "412")
_CONFLICT = ("ConditionalRequestConflict", "409")


class _CutResponse(Exception):
    """A GET's body ended early or failed in transit: retried, never taken for the object's state."""


async def _read_body(r: dict[str, Any], expected: int | None, cap: int | None = None) -> bytes:
    """The body of GET answer ``r``: ``expected`` bytes (its Content-Length) or _CutResponse.

    ``cap`` bounds what is read when the answer declares no length (``cap + 1`` bytes at most, so that
    the caller sees a body over its limit); such a body (``Transfer-Encoding: chunked``, from an
    S3-compatible gateway or proxy) is read to its end: one read returned only the first chunk, so
    every manifest looked cut short, every checkpoint damaged (2026-12-06). Any exception while reading
    (aiohttp's ClientPayloadError, botocore's ResponseStreamingError or IncompleteReadError, a
    reset, a read timeout) happens after the server answered, so it is a transport failure.
    """
    try:
        async with r["Body"] as body:
            if expected is not None or cap is None:
                data = await body.read()
            else:  # read(n) returns what has arrived so far (a chunked body comes in pieces): up to EOF or cap + 1
                parts: list[bytes] = []
                got = 0
                while got <= cap:
                    chunk = await body.read(cap + 1 - got)
                    if not chunk:
                        break
                    parts.append(chunk)
                    got += len(chunk)
                data = b"".join(parts)
    except Exception as exc:  # noqa: BLE001 - every failure mid-body is one of transport
        raise _CutResponse(f"the response body broke off ({type(exc).__name__}: {exc})") from exc
    if expected is not None and len(data) != expected:
        raise _CutResponse(f"the response body ended after {len(data)} of {expected} bytes")
    return data


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        err = response.get("Error", {})
        return str(err.get("Code", "")) or str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return ""


_FILESYSTEMS: dict[tuple, Any] = {}
_FILESYSTEMS_LOCK = threading.Lock()
_ENV_KEYS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
             "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_REGION")


def _filesystem(s3fs: Any, storage_options: dict[str, Any] | None) -> Any:
    """One s3fs client per process and configuration, reused by every save and load.

    A fresh client costs 0.1-0.5 s (botocore session, credential lookup, a new
    connection pool) — the whole gap to raw s3fs on a 256 MiB load in
    benchmarks/bench_s3.py. The key holds the options and the AWS environment,
    so a changed endpoint or credentials gets a new client, and the pid, because
    an event loop and its connections do not survive a fork.
    """
    options = dict(storage_options or {})
    key = (os.getpid(), json.dumps(options, sort_keys=True, default=repr),
           tuple(os.environ.get(k) for k in _ENV_KEYS))
    with _FILESYSTEMS_LOCK:
        fs = _FILESYSTEMS.get(key)
        if fs is None:
            config = dict(options.pop("config_kwargs", {}) or {})
            config.setdefault("retries", {"max_attempts": MAX_ATTEMPTS, "mode": "standard"})
            fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, config_kwargs=config, **options)
            _FILESYSTEMS[key] = fs
        return fs


class S3Store(ByteStore):
    """Objects under ``s3://bucket/prefix``."""

    streams_writes = True  # each chunk is copied into the part buffer before the next is taken

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *, _fs: Any = None,
                 part_size: int = PART_SIZE, max_concurrency: int = MAX_CONCURRENCY,
                 commit_attempts: int = COMMIT_ATTEMPTS, commit_seconds: float = COMMIT_SECONDS) -> None:
        import s3fs

        path = url.split("://", 1)[1] if "://" in url else url
        self.bucket, _, prefix = path.partition("/")
        self.prefix = prefix.strip("/")
        self.url = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self.commit_attempts = max(1, int(commit_attempts))
        self.commit_seconds = float(commit_seconds)
        self.fs = _fs if _fs is not None else _filesystem(s3fs, storage_options)
        self._storage_options = storage_options

    # ---------------------------------------------------------------- plumbing
    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix and key else (key or self.prefix)

    def _run(self, coro: Any) -> Any:
        from fsspec.asyn import sync

        return sync(self.fs.loop, lambda: coro)

    async def _client(self) -> Any:
        return await self.fs.set_session()

    async def _call(self, method: str, **kwargs: Any) -> Any:
        client = await self._client()
        return await getattr(client, method)(Bucket=self.bucket, **kwargs)

    def _error(self, exc: BaseException, what: str) -> StorageError:
        code = _code(exc)
        return StorageError(f"{what} in {self.url}: {code + ': ' if code else ''}{exc}")

    def child(self, name: str) -> S3Store:
        url = f"s3://{self.bucket}/{self._key(name)}"
        # the options go along (only the filesystem was shared): tensorstore's data path reads the endpoint
        # from them, and a step folder's data went to AWS_ENDPOINT_URL's server (a hunt, 2026-12-06)
        return S3Store(url, self._storage_options, _fs=self.fs, part_size=self.part_size,
                       max_concurrency=self.max_concurrency, commit_attempts=self.commit_attempts,
                       commit_seconds=self.commit_seconds)

    # ----------------------------------------------------------------- writing
    def write_object(self, key: str, chunks: Iterable[memoryview | bytes]) -> int:
        full = self._key(key)
        buf = bytearray()
        upload_id: str | None = None
        futures: list[Future] = []
        slots = threading.Semaphore(self.max_concurrency)
        total = 0
        source = iter(chunks)
        from_source = False  # the caller's iterator raised: its error propagates unchanged
        try:
            while True:
                try:
                    chunk = next(source)
                except StopIteration:
                    break
                except BaseException:
                    from_source = True
                    raise
                view = memoryview(chunk).cast("B")
                total += len(view)
                while view:
                    take = min(len(view), self.part_size - len(buf))
                    buf += view[:take]
                    view = view[take:]
                    if len(buf) == self.part_size:
                        if upload_id is None:
                            upload_id = self._run(self._call("create_multipart_upload", Key=full))["UploadId"]
                        futures.append(self._submit_part(full, upload_id, len(futures) + 1, bytes(buf), slots))
                        buf = bytearray()
            if upload_id is None:
                self._run(self._call("put_object", Key=full, Body=bytes(buf)))
                return total
            if buf:
                futures.append(self._submit_part(full, upload_id, len(futures) + 1, bytes(buf), slots))
            etags = [f.result() for f in futures]
            done = {"Parts": [{"ETag": e, "PartNumber": i + 1} for i, e in enumerate(etags)]}
            self._complete(key, upload_id, done, total)
            return total
        except Exception as exc:
            for f in futures:
                f.cancel()
            if upload_id is not None:
                try:
                    self._run(self._call("abort_multipart_upload", Key=full, UploadId=upload_id))
                except Exception:  # noqa: BLE001 - best effort; lifecycle rules clean up the rest
                    pass
            if from_source or isinstance(exc, StorageError):
                raise
            raise self._error(exc, f"writing {key}") from exc

    def _submit_part(self, key: str, upload_id: str, number: int, data: bytes, slots: threading.Semaphore) -> Future:
        slots.acquire()

        async def upload() -> str:
            try:
                r = await self._call("upload_part", Key=key, UploadId=upload_id, PartNumber=number, Body=data)
                return r["ETag"]
            finally:
                slots.release()

        return asyncio.run_coroutine_threadsafe(upload(), self.fs.loop)

    def _complete(self, key: str, upload_id: str, parts: dict, total: int) -> None:
        try:
            self._run(self._call("complete_multipart_upload", Key=self._key(key), UploadId=upload_id, MultipartUpload=parts))
        except Exception as exc:
            # A retried completion whose first attempt succeeded answers NoSuchUpload: check the object.
            if _code(exc) == "NoSuchUpload" and self.size(key) == total:
                return
            raise

    def put_bytes(self, key: str, data: bytes) -> None:
        try:
            self._run(self._call("put_object", Key=self._key(key), Body=bytes(data)))
        except Exception as exc:
            raise self._error(exc, f"writing {key}") from exc

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """The commit (see the module docstring): True if ``key`` now holds ``data`` because of this
        call, False if another writer's object is there. 409 answers are retried while no object is
        visible; StorageError once ``commit_attempts`` or ``commit_seconds`` run out."""
        body = bytes(data)
        start = time.monotonic()
        deadline = start + self.commit_seconds
        backoff = COMMIT_BACKOFF
        for attempt in range(1, self.commit_attempts + 1):
            try:
                self._run(self._call("put_object", Key=self._key(key), Body=body, IfNoneMatch="*"))
                return True
            except Exception as exc:
                code = _code(exc)
                if code not in _PRECONDITION + _CONFLICT:
                    raise self._error(exc, f"committing {key}") from exc
            # Someone created it first, or our own earlier attempt did and its answer was lost — or,
            # on 409, a concurrent conditional write was in progress and nothing may exist yet.
            try:
                return self.read_bytes(key) == body
            except CheckpointNotFoundError:
                if code in _PRECONDITION:
                    return False  # it existed when S3 answered; it was deleted since (not ours)
            pause = min(backoff, 5.0) * random.uniform(0.5, 1.0)
            if attempt == self.commit_attempts or time.monotonic() + pause > deadline:
                break
            time.sleep(pause)
            backoff *= 2
        raise StorageError(
            f"committing {key} in {self.url}: every conditional PUT answered 409 ConditionalRequestConflict "
            f"and no object became visible ({attempt} attempts in {time.monotonic() - start:.1f} s); "
            "nothing was committed by this writer"
        )

    # ----------------------------------------------------------------- reading
    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        view = memoryview(out).cast("B")
        if not len(view):
            return
        data = self._get_range(key, offset, len(view))
        view[:] = data

    def read_into_vectored(self, key: str, offset: int, buffers: list[memoryview]) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        total = sum(len(v) for v in views)
        if not total:
            return
        data = memoryview(self._get_range(key, offset, total))
        pos = 0
        for v in views:
            v[:] = data[pos:pos + len(v)]
            pos += len(v)

    def _get_range(self, key: str, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of ``key``, exactly, or a ckptkit error.

        Only what the server declares is the object's state: 404 is a missing object, 416 or a
        Content-Range total below the end a truncated one (CorruptCheckpointError). A body that
        comes short or breaks in transit is retried, then a StorageError.
        """
        where = f"object {self.url}/{key}"

        async def get() -> bytes:
            r = await self._call("get_object", Key=self._key(key), Range=f"bytes={offset}-{offset + length - 1}")
            content_range = str(r.get("ContentRange", "") or "")
            total = content_range.rsplit("/", 1)[-1]
            if (total.isascii() and total.isdigit()) and int(total) < offset + length:
                r["Body"].close()
                raise CorruptCheckpointError(
                    f"{where} is truncated: needed bytes up to {offset + length}, it has {total}"
                )
            declared = r.get("ContentLength")
            if declared is not None and int(declared) != length:
                r["Body"].close()
                raise _CutResponse(f"the server answered {declared} bytes ({content_range or 'no Content-Range'}) "
                                   f"for a range of {length}")
            return await _read_body(r, length)

        try:
            return self._get_whole(key, get, f"bytes {offset}-{offset + length - 1}")
        except CkptkitError:
            raise
        except Exception as exc:
            code = _code(exc)
            if code in ("NoSuchKey", "404"):
                raise CorruptCheckpointError(f"{where} is missing") from None
            if code in ("InvalidRange", "416"):
                raise CorruptCheckpointError(f"{where} is truncated: needed bytes up to {offset + length}") from None
            raise self._error(exc, f"reading {key}") from exc

    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        """The whole object; over ``limit``, TooLargeError from the response's Content-Length,
        its body left unread (the connection is closed instead)."""

        async def get() -> bytes:
            r = await self._call("get_object", Key=self._key(key))
            declared = r.get("ContentLength")
            if limit is not None and declared is not None and int(declared) > limit:
                r["Body"].close()
                raise too_large(f"{self.url}/{key}", int(declared), limit)
            data = await _read_body(r, None if declared is None else int(declared),
                                    None if limit is None else limit + 1)
            if limit is not None and len(data) > limit:  # no Content-Length to check first
                raise too_large(f"{self.url}/{key}", len(data), limit)
            return data

        try:
            return self._get_whole(key, get, "the whole object")
        except CkptkitError:
            raise
        except Exception as exc:
            if _code(exc) in ("NoSuchKey", "404"):
                raise CheckpointNotFoundError(f"{self.url}/{key} does not exist") from None
            raise self._error(exc, f"reading {key}") from exc

    def _get_whole(self, key: str, get: Callable[[], Awaitable[bytes]], what: str) -> bytes:
        """Run the GET ``get`` until its body arrives whole.

        botocore retries a request until its answer's headers arrive, but not a body that breaks
        off afterwards (a connection cut mid-body, a short body): that is retried here, after a
        short exponential backoff. It is never reported as a missing or truncated object — a
        restore that took a network failure for a damaged checkpoint would silently go back to an
        older one. Errors of the request itself propagate to the caller.
        """
        reason = ""
        for attempt in range(SHORT_READ_RETRIES + 1):
            if attempt:
                time.sleep(SHORT_READ_BACKOFF * 2 ** (attempt - 1))
            try:
                return self._run(get())
            except _CutResponse as cut:
                reason = str(cut)
        raise StorageError(
            f"{self.url}/{key} could not be read ({what}): {reason}, in each of {SHORT_READ_RETRIES + 1} attempts"
        )

    def size(self, key: str) -> int | None:
        try:
            r = self._run(self._call("head_object", Key=self._key(key)))
        except Exception as exc:
            if _code(exc) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise self._error(exc, f"inspecting {key}") from exc
        return int(r["ContentLength"])

    # ------------------------------------------------------- listing, deletion
    def _list(self, prefix: str, delimiter: bool) -> tuple[list[str], list[str]]:
        async def run() -> tuple[list[str], list[str]]:
            client = await self._client()
            keys: list[str] = []
            dirs: list[str] = []
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            if delimiter:
                kwargs["Delimiter"] = "/"
            paginator = client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(**kwargs):
                keys.extend(o["Key"] for o in page.get("Contents", []))
                dirs.extend(p["Prefix"] for p in page.get("CommonPrefixes", []))
            return keys, dirs

        try:
            return self._run(run())
        except Exception as exc:
            raise self._error(exc, "listing") from exc

    def list_keys(self, prefix: str = "") -> list[str]:
        """Keys on ``/`` boundaries: the root is listed as ``prefix/`` (a sibling ``prefix-b`` or
        ``prefixb`` shares its leading characters and must not appear), a ``prefix`` argument as
        itself (it may be an object) and filtered to itself and what lies under ``prefix/``."""
        root = f"{self.prefix}/" if self.prefix else ""
        base = f"{root}{prefix}" if prefix else root
        keys, _ = self._list(base, delimiter=False)
        out = []
        for k in keys:
            if prefix and not (k == base or k.startswith(base.rstrip("/") + "/")):
                continue
            out.append(k[len(root):])
        return sorted(out)

    def list_children(self) -> list[str]:
        root = f"{self.prefix}/" if self.prefix else ""
        keys, dirs = self._list(root, delimiter=True)
        names = {k[len(root):] for k in keys} | {d[len(root):].rstrip("/") for d in dirs}
        return sorted(n for n in names if n)

    def delete(self, key: str) -> None:
        try:
            self._run(self._call("delete_object", Key=self._key(key)))
        except Exception as exc:
            if _code(exc) not in ("NoSuchKey", "404"):
                raise self._error(exc, f"deleting {key}") from exc

    def delete_all(self) -> None:
        keys = [self._key(k) for k in self.list_keys()]
        for i in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True}
            try:
                self._run(self._call("delete_objects", Delete=batch))
            except Exception as exc:
                raise self._error(exc, "deleting") from exc
