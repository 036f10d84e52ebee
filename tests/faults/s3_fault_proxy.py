"""A misbehaving network path to the test S3 server: an HTTP proxy on 127.0.0.1 that, on a seeded
schedule, resets connections, answers 500 InternalError or 503 SlowDown (with S3's XML error
body), loses responses of requests it did forward, or delays responses.

    proxy = S3FaultProxy(upstream="http://127.0.0.1:PORT", seed=3, rate=0.3, max_faults=12).start()
    ... point AWS_ENDPOINT_URL at proxy.url ...
    proxy.injected   # Counter of faults by kind, proxy.events: what happened to each request

Faults are bounded in count (`max_faults`) and in time (`active_s`), after which every request
passes, so a client with ordinary retries must always finish. An outage is the other shape:
`proxy.outage(kind)` fails every request with `kind` until `proxy.recover()`, longer than any
client's own retries. The proxy only ever connects to the upstream on 127.0.0.1.
"""

from __future__ import annotations

import http.client
import os
import random
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

from loopback import LOOPBACK, LoopbackServer

RESET = "reset"
"""The connection is reset before the request reaches S3 (nothing happened)."""
LOST_RESPONSE = "lost-response"
"""The request reaches S3 and takes effect, then the connection is reset before the answer."""
ERROR_500 = "500"
ERROR_503 = "503-slowdown"
INVALID_KEY = "403-invalid-key"
"""Wrong credentials, as AWS answers them (not in KINDS: not retried, so not a transient fault)."""
SLOW = "slow"
"""The answer comes after a delay (well under the client's read timeout)."""
KINDS = (RESET, LOST_RESPONSE, ERROR_500, ERROR_503, SLOW)

_ERRORS = {
    ERROR_500: (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
    ERROR_503: (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    INVALID_KEY: (403, "Forbidden", "InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist in our records."),
}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


def s3_error_body(code: str, message: str, resource: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message><Resource>{resource}</Resource>"
        "<RequestId>FAULTPROXY</RequestId></Error>"
    ).encode()


@dataclass
class FaultSchedule:
    """Decides, request by request in arrival order, what goes wrong: a pure function of the seed.

    A request is faulted with probability `rate`, never two in a row (so one request is retried a
    few times at most), at most `max_faults` times and only within `active_s` of the first request."""

    seed: int
    rate: float = 0.3
    max_faults: int = 12
    active_s: float = 30.0
    kinds: tuple[str, ...] = KINDS
    slow_s: tuple[float, float] = (0.05, 0.3)
    methods: tuple[str, ...] = ("GET", "PUT", "POST", "HEAD", "DELETE")
    """Only requests with these methods are faulted."""
    _rng: random.Random = field(init=False)
    _faults: int = field(init=False, default=0)
    _previous_faulted: bool = field(init=False, default=False)
    _started: float | None = field(init=False, default=None)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def next(self, method: str) -> tuple[str | None, float]:
        """(fault kind or None, delay for SLOW) for the next request."""
        with self._lock:
            now = time.monotonic()
            if self._started is None:
                self._started = now
            draw, kind, delay = self._rng.random(), self._rng.choice(self.kinds), self._rng.uniform(*self.slow_s)
            eligible = (
                method in self.methods and not self._previous_faulted
                and self._faults < self.max_faults and now - self._started < self.active_s
            )
            if eligible and draw < self.rate:
                self._faults += 1
                self._previous_faulted = True
                return kind, delay
            self._previous_faulted = False
            return None, 0.0


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as boto3 uses its pool
    server: _ProxyServer

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._proxy()

    do_PUT = do_POST = do_HEAD = do_DELETE = do_GET

    def _proxy(self) -> None:
        proxy = self.server.proxy
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        kind, delay = proxy.fault_for(self.command)
        proxy.record(self.command, self.path, kind)
        if kind == RESET:
            return self._reset()
        if kind in _ERRORS:
            status, reason, code, message = _ERRORS[kind]
            return self._answer(status, reason, [("Content-Type", "application/xml")], s3_error_body(code, message, self.path))
        status, reason, headers, payload = proxy.forward(self.command, self.path, self.headers, body)
        if kind == LOST_RESPONSE:
            return self._reset()
        if kind == SLOW:
            time.sleep(delay)
        self._answer(status, reason, headers, payload)

    def _answer(self, status: int, reason: str, headers: list[tuple[str, str]], payload: bytes) -> None:
        self.send_response_only(status, reason)
        for name, value in headers:
            if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                self.send_header(name, value)
        # A HEAD answer has no body but the object's length, which the client reads.
        length = dict((k.lower(), v) for k, v in headers).get("content-length") if self.command == "HEAD" else None
        self.send_header("Content-Length", length or str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)
        self.wfile.flush()

    def _reset(self) -> None:
        """Closes with RST (SO_LINGER 0): the client sees 'connection reset by peer'."""
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        # Detached first, so the server's own shutdown/close of this socket is a no-op, not a FIN.
        os.close(self.connection.detach())


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    proxy: S3FaultProxy

    def handle_error(self, request, client_address) -> None:
        """Clients killed mid-request (the SIGKILL tests) are expected: no traceback."""


class S3FaultProxy(LoopbackServer):
    """The proxy: `url` is what clients use as their S3 endpoint."""

    def __init__(self, upstream: str, *, seed: int, **schedule) -> None:
        parsed = urlparse(upstream)
        if parsed.hostname != LOOPBACK or parsed.scheme != "http":
            raise ValueError(f"the fault proxy only forwards to http://{LOOPBACK}, not {upstream!r}")
        self.upstream_port = parsed.port
        self.schedule = FaultSchedule(seed=seed, **schedule)
        self.injected: Counter[str] = Counter()
        self.events: list[tuple[str, str, str | None]] = []
        self.outage_kind: str | None = None
        self._lock = threading.Lock()
        super().__init__(_Handler, _ProxyServer)
        self._server.proxy = self

    def __enter__(self) -> S3FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def outage(self, kind: str = ERROR_503) -> None:
        """From now on every request fails with `kind` (RESET: the store unreachable), until `recover()`."""
        self.outage_kind = kind

    def recover(self) -> None:
        self.outage_kind = None

    def fault_for(self, method: str) -> tuple[str | None, float]:
        """(fault kind or None, delay for SLOW): the outage's, else the seeded schedule's."""
        if self.outage_kind is not None:
            return self.outage_kind, 0.0
        return self.schedule.next(method)

    def record(self, method: str, path: str, kind: str | None) -> None:
        with self._lock:
            self.events.append((method, path, kind))
            if kind is not None:
                self.injected[kind] += 1

    @property
    def faults(self) -> int:
        return sum(self.injected.values())

    def forward(self, method: str, path: str, headers, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """One request to the upstream on loopback, on a fresh connection; the whole answer."""
        connection = http.client.HTTPConnection(LOOPBACK, self.upstream_port, timeout=60)
        try:
            # The Host header travels unchanged: it is part of what SigV4 signed.
            connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for name, value in headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    connection.putheader(name, value)
            connection.endheaders(body if body else None)
            response = connection.getresponse()
            payload = response.read()
            return response.status, response.reason, response.getheaders(), payload
        finally:
            connection.close()
