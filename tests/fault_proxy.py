"""A small fault-injecting HTTP/1.1 proxy for the S3 fault tests.

It listens on 127.0.0.1 (a free port) in front of the moto server and forwards
requests one by one over kept-alive client connections. For requests that
match the current :class:`Faults` policy it can:

* answer ``500 InternalError`` / ``503 SlowDown`` / ``409 ConditionalRequestConflict`` itself
  (an S3 XML error body, ``Connection: close``) instead of forwarding;
* drop the connection *before* forwarding (the server never sees the request);
* drop the connection *after* forwarding (the server did the work, the client
  never hears back: the dangerous case for non-idempotent requests);
* forward, then send the headers and only half the body, then close (a
  truncated response; only for responses with a body of 2 bytes or more);
* the same, but close with a TCP reset (``SO_LINGER`` 0): the client's read
  fails with "connection reset" rather than an early end of the stream;
* forward, then answer a complete but short response: ``Content-Length`` and
  the body are half the real body, the connection stays open (a lying
  middlebox; the status and other headers, ``Content-Range`` included, are
  the server's);
* add latency before any of the above;
* hold the body back (``hold`` seconds after the headers): a client that
  hangs up meanwhile, as one refusing an over-large body should, gets none of
  it, and the proxy counts an ``abandoned`` response.

Nothing is mocked: real HTTP on both sides. The policy can be swapped at any
time (thread-safe); a seeded RNG makes sequential requests replay the same
faults. ``counts`` says what was done (and ``connections``, ``requests``,
``forwarded``); ``events`` lists each fault as ``(fault, method, target)``.
Request bodies (``Content-Length`` or chunked) are read in full, answering
``Expect: 100-continue`` ourselves, and forwarded with a ``Content-Length`` on
a fresh upstream connection; responses (length-delimited or chunked) are read
in full and returned with a ``Content-Length``.
"""

from __future__ import annotations

import http.client
import random
import re
import select
import socket
import struct
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from urllib.parse import urlsplit

_BODY_FAULTS = ("truncate", "reset", "short", "chunked")
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "expect", "proxy-connection", "te", "upgrade"}
_ERRORS = {500: ("Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
           503: ("Slow Down", "SlowDown", "Please reduce your request rate."),
           # what S3 answers a conditional write racing another conditional write to the same key
           409: ("Conflict", "ConditionalRequestConflict",
                 "A conflicting operation occurred. If using PutObject, you can retry the request.")}


@dataclass(frozen=True)
class Faults:
    """What to do to matching requests. The probabilities are exclusive, drawn once per request."""

    error: float = 0.0  # answer one of `statuses` instead of forwarding
    drop_before: float = 0.0  # close the connection without forwarding
    drop_after: float = 0.0  # forward, then close without answering
    truncate: float = 0.0  # forward, answer half the body, close
    reset: float = 0.0  # forward, answer half the body, reset the connection
    short: float = 0.0  # forward, answer a consistent response with half the body, keep the connection
    chunked: float = 0.0  # forward, answer the whole body as Transfer-Encoding: chunked (64-byte chunks, no length)
    delay: float = 0.0  # seconds of latency added to every affected request
    hold: float = 0.0  # seconds between an affected response's headers and its body (see `abandoned`)
    statuses: tuple[int, ...] = (500, 503)
    methods: frozenset[str] = frozenset()  # empty: every method
    path: str = ""  # regex searched in the request target (path?query); empty: every target
    header: str = ""  # only requests carrying this header, e.g. "range", "if-none-match"
    skip: int = 0  # let the first `skip` matching requests through untouched
    limit: int | None = None  # affect (fault or delay) at most this many requests
    # The first affected request waits here (up to 60 s) until every proxy sharing the barrier has one too:
    # two writers then meet at the same point (their commit) however a loaded machine schedules them.
    meet: threading.Barrier | None = None

    def matches(self, method: str, target: str, headers: dict[str, str]) -> bool:
        return ((not self.methods or method in self.methods)
                and (not self.path or re.search(self.path, target) is not None)
                and (not self.header or self.header.lower() in headers))


@dataclass
class _Request:
    method: str
    target: str
    headers: list[tuple[str, str]]
    lookup: dict[str, str]  # lower-cased names
    body: bytes


class FaultProxy:
    """``FaultProxy(upstream_endpoint)``; clients use ``.endpoint`` (``http://127.0.0.1:PORT``)."""

    def __init__(self, upstream: str, faults: Faults = Faults(), seed: int = 0) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._lock = threading.Lock()
        self._faults, self._rng, self._matched, self._affected = faults, random.Random(seed), 0, 0
        self.counts: Counter[str] = Counter()
        self.events: list[tuple[str, str, str]] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._clients: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, name="fault-proxy", daemon=True).start()

    def set(self, faults: Faults = Faults(), seed: int | None = None) -> None:
        """Swap the policy, restart its skip/limit bookkeeping, reseed if ``seed`` is given."""
        with self._lock:
            self._faults, self._matched, self._affected = faults, 0, 0
            if seed is not None:
                self._rng = random.Random(seed)

    def injected(self) -> int:
        """Faults injected so far (errors, drops, truncations, resets, short bodies; not delays or holds)."""
        with self._lock:
            return sum(n for k, n in self.counts.items()
                       if k not in ("connections", "requests", "forwarded", "delay", "abandoned"))

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            clients = list(self._clients)
        for c in clients:
            _close(c)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ plumbing
    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._clients.add(client)
                self.counts["connections"] += 1
            threading.Thread(target=self._serve, args=(client,), name="fault-proxy-conn", daemon=True).start()

    def _record(self, what: str, req: _Request | None = None) -> None:
        with self._lock:
            self.counts[what] += 1
            if req is not None:
                self.events.append((what, req.method, req.target))

    def _decide(self, req: _Request) -> tuple[str, float, float]:
        """``(action, delay, hold)`` for one request."""
        with self._lock:
            self.counts["requests"] += 1
            f = self._faults
            if not f.matches(req.method, req.target, req.lookup):
                return "forward", 0.0, 0.0
            self._matched += 1
            if self._matched <= f.skip or (f.limit is not None and self._affected >= f.limit):
                return "forward", 0.0, 0.0
            r, action = self._rng.random(), "forward"
            for name, p in (("error", f.error), ("drop_before", f.drop_before),
                            ("drop_after", f.drop_after), ("truncate", f.truncate),
                            ("reset", f.reset), ("short", f.short), ("chunked", f.chunked)):
                if r < p:
                    action = name
                    break
                r -= p
            if action == "error":
                action = str(self._rng.choice(f.statuses))
            self._affected += action != "forward" or f.delay > 0 or f.hold > 0
            first = f.meet is not None and action != "forward" and self._affected == 1
        if first:
            try:
                f.meet.wait(timeout=60)  # type: ignore[union-attr]
            except threading.BrokenBarrierError:  # the other side never came: the test's own checks say so
                pass
        if f.delay:
            self._record("delay", req)
        if action not in ("forward",) + _BODY_FAULTS:  # those are recorded when they happen
            self._record(action, req)
        return action, f.delay, f.hold

    def _serve(self, client: socket.socket) -> None:
        rfile = client.makefile("rb")
        try:
            while (req := _read_request(rfile, client)) is not None:
                action, delay, hold = self._decide(req)
                time.sleep(delay)
                if action == "drop_before":
                    return
                if action.isdigit():
                    client.sendall(_error_response(int(action), req))
                    return
                status, reason, headers, body = self._forward(req)
                if action == "drop_after":
                    return
                head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers if k.lower() not in _HOP)
                if req.method == "HEAD":  # keeps the length a GET would have; no body
                    head += "".join(f"{k}: {v}\r\n" for k, v in headers if k.lower() == "content-length")
                    body = b""
                elif action == "chunked" and req.method == "GET" and status in (200, 206):
                    # what an S3-compatible gateway streaming an object may send: no Content-Length
                    self._record("chunked", req)
                    client.sendall(head.encode("latin-1") + b"Transfer-Encoding: chunked\r\n\r\n")
                    for i in range(0, len(body), 64):
                        part = body[i:i + 64]
                        client.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                        time.sleep(0.01)  # each chunk its own packet: a read gets what has arrived
                    client.sendall(b"0\r\n\r\n")
                    continue
                elif status >= 200 and status not in (204, 304):
                    if action == "short" and len(body) >= 2:
                        self._record("short", req)
                        body = body[: len(body) // 2]
                    head += f"Content-Length: {len(body)}\r\n"
                    if action in ("truncate", "reset") and len(body) >= 2:
                        self._record(action, req)
                        client.sendall(head.encode("latin-1") + b"\r\n" + body[: len(body) // 2])
                        if action == "reset":  # close() then sends RST, not FIN; after the client
                            time.sleep(0.05)  # has taken the headers, so the reset hits the body
                            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                            client.close()
                        return
                self._record("forwarded")
                if hold and body:
                    client.sendall(head.encode("latin-1") + b"\r\n")
                    if _hangs_up(client, hold):
                        self._record("abandoned", req)
                        return
                    client.sendall(body)
                else:
                    client.sendall(head.encode("latin-1") + b"\r\n" + body)
                if req.lookup.get("connection", "").lower() == "close":
                    return
        except (OSError, ValueError, http.client.HTTPException):
            return
        finally:
            rfile.close()
            _close(client)
            with self._lock:
                self._clients.discard(client)

    def _forward(self, req: _Request) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.putrequest(req.method, req.target, skip_host=True, skip_accept_encoding=True)
            for k, v in req.headers:
                if k.lower() not in _HOP:
                    conn.putheader(k, v)
            if req.body or "content-length" in req.lookup or "transfer-encoding" in req.lookup:
                conn.putheader("Content-Length", str(len(req.body)))
            conn.putheader("Connection", "close")
            conn.endheaders(req.body or None)
            resp = conn.getresponse()
            return resp.status, resp.reason, resp.getheaders(), resp.read()
        finally:
            conn.close()


def _read_request(rfile, client: socket.socket) -> _Request | None:
    line = rfile.readline(65537)
    if not line.strip():
        return None  # the client closed its connection
    method, target, _version = line.decode("latin-1").split()
    headers: list[tuple[str, str]] = []
    while (h := rfile.readline(65537)) not in (b"\r\n", b"\n", b""):
        name, _, value = h.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    lookup = {k.lower(): v for k, v in headers}
    if lookup.get("expect", "").lower() == "100-continue":
        client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    if "chunked" in lookup.get("transfer-encoding", "").lower():
        parts = []
        while size := int(rfile.readline(65537).split(b";")[0].strip(), 16):
            parts.append(rfile.read(size))
            rfile.readline(65537)
        while rfile.readline(65537) not in (b"\r\n", b"\n", b""):  # trailers
            pass
        body = b"".join(parts)
    else:
        n = int(lookup.get("content-length", "0") or 0)
        body = rfile.read(n) if n else b""
        if len(body) != n:
            raise ValueError("the client closed its connection mid-body")
    return _Request(method, target, headers, lookup, body)


def _hangs_up(client: socket.socket, seconds: float) -> bool:
    """Whether the client closes its connection within ``seconds`` (it sends nothing meanwhile:
    HTTP/1.1 clients do not pipeline)."""
    ready, _, _ = select.select([client], [], [], seconds)
    if not ready:
        return False
    try:
        return client.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _error_response(status: int, req: _Request) -> bytes:
    reason, code, message = _ERRORS.get(status, ("Error", "InternalError", "Injected fault."))
    rid = uuid.uuid4().hex[:16].upper()
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<Resource>{req.target.split('?')[0]}</Resource><RequestId>{rid}</RequestId></Error>").encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nx-amz-request-id: {rid}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode("latin-1") + (b"" if req.method == "HEAD" else body)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
