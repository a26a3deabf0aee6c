"""A fault-injecting HTTP proxy in front of an S3 endpoint (the session moto server), for tests.

It forwards each request to the upstream endpoint and, at a configurable rate
and with a seeded RNG, answers some of them badly instead:

- ``internal_error``: HTTP 500 ``InternalError`` (S3 XML error body), not forwarded;
- ``slow_down``: HTTP 503 ``SlowDown``, not forwarded;
- ``drop``: the connection is closed with no response, the request forwarded or not
  (a lost request, or a lost response to a request the store applied);
- ``cut``: forwarded, then the connection is closed in the middle of the response headers;
- ``stall``: forwarded or not, then nothing is sent for ``stall_s`` (longer than the
  client's read timeout) and the connection is closed;
- ``truncate``: forwarded, the headers (with the full Content-Length) and half the body
  are sent, then the connection is closed. Responses without a body get ``cut`` instead;
- ``flip``: forwarded, and the whole response sent with one bit of its body flipped (a
  corruption in transit that no length check sees), for GETs of objects; others get ``cut``
  (a listing's XML carries no checksum that any client could check: only TLS protects it).

``conflict`` (HTTP 409 ``ConditionalRequestConflict``, as AWS answers concurrent
conditional writes) is available to ``script`` only. With ``strip_if_none_match``
the proxy removes ``If-None-Match`` from PUTs: a store that ignores conditional writes.

Counts of injected faults are kept per kind and per S3 operation (GET, PUT, HEAD,
LIST, DELETE). The proxy runs an asyncio loop in a daemon thread; start() and
stop() are bounded in time.
"""

from __future__ import annotations

import asyncio
import random
import threading
import uuid
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
from yarl import URL

RANDOM_KINDS = ("internal_error", "slow_down", "drop", "cut", "stall", "truncate", "flip")
KINDS = RANDOM_KINDS + ("conflict",)
OPERATIONS = ("GET", "PUT", "HEAD", "LIST", "DELETE")

_ERRORS = {  # kind -> (status, reason, S3 error code, message)
    "internal_error": (500, "Internal Server Error", "InternalError",
                       "We encountered an internal error. Please try again."),
    "slow_down": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "conflict": (409, "Conflict", "ConditionalRequestConflict",
                 "A conflicting operation occurred. If using PutObject you can retry the request."),
}
#: Faults that need the store's answer.
_FORWARDED = ("cut", "truncate", "flip")
_HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"expect",
               b"host", b"proxy-connection", b"te", b"trailer", b"upgrade"}
_MAX_HEAD = 64 * 1024


@dataclass
class _Request:
    method: str
    target: str
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name), None)


@dataclass
class _Script:
    kind: str
    op: str | None
    key_suffix: str | None
    forward: bool | None
    times: int


def operation(method: str, target: str) -> str:
    """The S3 operation of a path-style request: GET, PUT, HEAD, LIST or DELETE."""
    path, _, query = target.partition("?")
    has_key = "/" in path.strip("/")
    if method == "GET":
        return "GET" if has_key else "LIST"
    if method == "POST":
        return "DELETE" if "delete" in query.split("&") else "PUT"
    return method if method in OPERATIONS else "GET"


class FaultProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 (port chosen by the OS) that injects S3 faults."""

    def __init__(self, upstream: str, *, seed: int = 0, stall_s: float = 1.0):
        self.upstream = upstream.rstrip("/")
        self.stall_s = stall_s
        self.strip_if_none_match = False
        self.url = ""
        self._rng = random.Random(seed)
        self._rate = 0.0
        self._kinds: tuple[str, ...] = RANDOM_KINDS
        self._scripts: list[_Script] = []
        self._lock = threading.Lock()
        self._injected: Counter[tuple[str, str]] = Counter()
        self._requests: Counter[str] = Counter()
        self._stripped = 0
        #: Unexpected exceptions while serving (tests assert there were none).
        self.errors: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="s3-fault-proxy", daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task] = set()

    # -- control (any thread) ------------------------------------------------
    def start(self, timeout: float = 10) -> FaultProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout)
        return self

    def stop(self, timeout: float = 10) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._loop.close()

    def set_faults(self, rate: float, kinds: tuple[str, ...] = RANDOM_KINDS) -> None:
        """Inject a fault into each request with probability ``rate``, of a kind drawn from ``kinds``."""
        unknown = set(kinds) - set(KINDS)
        if unknown or not kinds or not 0 <= rate <= 1:
            raise ValueError(f"bad fault plan: rate {rate}, kinds {kinds}")
        with self._lock:
            self._rate, self._kinds = rate, tuple(kinds)

    @contextmanager
    def faults(self, rate: float, kinds: tuple[str, ...] = RANDOM_KINDS):
        """Faults on inside the block, off again after it."""
        self.set_faults(rate, kinds)
        try:
            yield self
        finally:
            self.set_faults(0.0)

    def script(self, kind: str, *, op: str | None = None, key_suffix: str | None = None,
               forward: bool | None = None, times: int = 1) -> None:
        """Inject ``kind`` into the next ``times`` requests of ``op`` whose key ends with ``key_suffix``.

        ``forward`` decides, for ``drop`` and ``stall``, whether the store receives the request first.
        """
        if kind not in KINDS or (op is not None and op not in OPERATIONS):
            raise ValueError(f"bad script: {kind} {op}")
        with self._lock:
            self._scripts.append(_Script(kind, op, key_suffix, forward, times))

    def unscript(self) -> None:
        """Drop the scripted faults not yet injected."""
        with self._lock:
            self._scripts.clear()

    def injected(self) -> Counter[tuple[str, str]]:
        """Faults injected so far, per (kind, operation)."""
        with self._lock:
            return Counter(self._injected)

    def requests(self) -> Counter[str]:
        """Requests received so far, per operation."""
        with self._lock:
            return Counter(self._requests)

    @property
    def stripped(self) -> int:
        """How many PUTs lost their If-None-Match header."""
        with self._lock:
            return self._stripped

    def reset_counts(self) -> None:
        with self._lock:
            self._injected.clear()
            self._requests.clear()
            self._stripped = 0

    # -- the loop's side ------------------------------------------------------
    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=30),
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
        )
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        if self._session is not None:
            await self._session.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            while True:
                request = await _read_request(reader, writer)
                if request is None or not await self._answer(request, writer):
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # a bug here, or the upstream failing: the client sees a dropped connection
            with self._lock:
                self.errors.append(repr(exc))
        finally:
            self._tasks.discard(task)
            writer.close()

    def _plan(self, request: _Request, op: str) -> tuple[str | None, bool]:
        """The fault for this request (None for none) and whether to forward it first."""
        key = request.target.partition("?")[0]
        with self._lock:
            self._requests[op] += 1
            for script in self._scripts:
                if (script.op in (None, op)) and (script.key_suffix is None or key.endswith(script.key_suffix)):
                    script.times -= 1
                    if script.times <= 0:
                        self._scripts.remove(script)
                    return script.kind, script.kind in _FORWARDED or bool(script.forward)
            if self._rate and self._rng.random() < self._rate:
                kind = self._rng.choice(self._kinds)
                forward = kind in _FORWARDED or (kind in ("drop", "stall") and self._rng.random() < 0.5)
                return kind, forward
        return None, True

    def _count(self, kind: str, op: str) -> None:
        with self._lock:
            self._injected[(kind, op)] += 1

    async def _answer(self, request: _Request, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; returns whether the connection stays open."""
        op = operation(request.method, request.target)
        kind, forward = self._plan(request, op)
        if kind in _ERRORS:
            self._count(kind, op)
            writer.write(_error_response(kind, request.method == "HEAD"))
            await writer.drain()
            return True
        response = await self._forward(request) if forward else None
        if kind is None:
            writer.write(response.head() + response.body)
            await writer.drain()
            return True
        if (kind == "truncate" and (request.method == "HEAD" or len(response.body) < 2)) or (
                kind == "flip" and (op != "GET" or response.status not in (200, 206) or not response.body)):
            kind = "cut"
        self._count(kind, op)
        if kind == "stall":
            await asyncio.sleep(self.stall_s)
        elif kind == "cut":
            head = response.head()
            writer.write(head[: len(head) // 2])
        elif kind == "truncate":
            writer.write(response.head() + response.body[: len(response.body) // 2])
        elif kind == "flip":
            body = bytearray(response.body)
            with self._lock:
                position = self._rng.randrange(len(body) * 8)
            body[position // 8] ^= 1 << position % 8
            writer.write(response.head() + bytes(body))
            await writer.drain()
            return True
        await writer.drain()
        return False

    async def _forward(self, request: _Request) -> _Response:
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers
                   if k.lower() not in _HOP_BY_HOP]
        if self.strip_if_none_match and request.method == "PUT":
            kept = [(k, v) for k, v in headers if k.lower() != "if-none-match"]
            if len(kept) != len(headers):
                with self._lock:
                    self._stripped += 1
            headers = kept
        async with self._session.request(
            request.method, URL(self.upstream + request.target, encoded=True), headers=headers,
            data=request.body if request.body or request.method in ("PUT", "POST") else None,
            allow_redirects=False,
        ) as upstream:
            body = await upstream.read()
            return _Response(upstream.status, upstream.reason or "", list(upstream.raw_headers), body,
                             request.method == "HEAD")


@dataclass
class _Response:
    status: int
    reason: str
    headers: list[tuple[bytes, bytes]]
    body: bytes
    head_request: bool

    def head(self) -> bytes:
        """Status line and headers, framed by Content-Length (a HEAD keeps the upstream's)."""
        lines = [f"HTTP/1.1 {self.status} {self.reason}".encode()]
        length = None
        for name, value in self.headers:
            if name.lower() == b"content-length":
                length = value
            elif name.lower() not in _HOP_BY_HOP:
                lines.append(name + b": " + value)
        if not self.head_request:
            length = str(len(self.body)).encode()
        lines.append(b"Content-Length: " + (length or b"0"))
        return b"\r\n".join(lines) + b"\r\n\r\n"


def _error_response(kind: str, head_request: bool) -> bytes:
    status, reason, code, message = _ERRORS[kind]
    request_id = uuid.uuid4().hex[:16].upper()
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>{request_id}</RequestId><HostId>fault-proxy</HostId></Error>").encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nx-amz-request-id: {request_id}\r\n"
            f"Content-Length: {0 if head_request else len(body)}\r\n\r\n").encode()
    return head if head_request else head + body


async def _read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> _Request | None:
    """One HTTP/1.1 request (Content-Length or chunked body), or None at a clean end of the connection.

    Answers ``Expect: 100-continue`` (botocore sends it with PutObject, and aiohttp then waits).
    """
    line = await reader.readline()
    if not line:
        return None
    method, target, _ = line.decode("latin-1").split(" ", 2)
    headers: list[tuple[bytes, bytes]] = []
    size = len(line)
    while True:
        line = await reader.readline()
        size += len(line)
        if size > _MAX_HEAD:
            raise ValueError("request head too large")
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.partition(b":")
        headers.append((name.strip(), value.strip()))
    request = _Request(method, urlsplit(target)._replace(scheme="", netloc="").geturl() or "/", headers, b"")
    if (request.header(b"expect") or b"").lower() == b"100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
    if (request.header(b"transfer-encoding") or b"").lower() == b"chunked":
        parts = []
        while True:
            length = int((await reader.readline()).split(b";")[0], 16)
            if length == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
                break
            parts.append(await reader.readexactly(length))
            await reader.readexactly(2)
        request.body = b"".join(parts)
    else:
        request.body = await reader.readexactly(int(request.header(b"content-length") or 0))
    return request
