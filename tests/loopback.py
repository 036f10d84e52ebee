"""The HTTP server of a test double (the fake Kubernetes API, the fake Hugging Face Hub, the S3 fault
proxy): on 127.0.0.1 at a free port, served from a thread between start() and stop()."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

LOOPBACK = "127.0.0.1"


class LoopbackServer:
    """Subclass it with the double; its handler reaches the double through an attribute the double
    sets on `self._server`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], server: type[ThreadingHTTPServer] = ThreadingHTTPServer) -> None:
        self._server = server((LOOPBACK, 0), handler)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
