"""A test double of the part of the Hugging Face Hub's HTTP API that huggingface_hub downloads through.

A real HTTP server on 127.0.0.1 in a thread, answering as the hub does:
- GET  /api/models/<org>/<repo>/revision/<rev>[?blobs=True]: the commit a revision resolves to and
  its files (size, blobId, and for LFS files lfs {size, sha256, pointerSize});
- HEAD /<org>/<repo>/resolve/<rev>/<file>: X-Repo-Commit and the file's ETag; an LFS file answers a
  302 to its blob on another host ("the CDN", here `localhost` where the hub is `127.0.0.1`), with
  X-Linked-Etag (its sha256) and X-Linked-Size;
- GET of both, with Range requests (206);
- errors with the hub's X-Error-Code: RepoNotFound, RevisionNotFound, GatedRepo (a gated repository
  wants `Authorization: Bearer <its token>`).

On the test's command: `hub.cut(file, times, after=bytes)` cuts the connection mid-body,
`hub.fail(file, times, status)` answers an error, `hub.corrupt(file)` serves other bytes than listed.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

from loopback import LoopbackServer

LFS_SUFFIXES = (".safetensors", ".bin")
POINTER_SIZE = 134


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    revisions: dict[str, str] = field(default_factory=lambda: {"main": "a" * 40})
    """Branch or tag -> commit. Every commit serves the same files here."""
    token: str | None = None
    """Set: the repository is gated, and this token opens it."""

    def commit_of(self, revision: str) -> str | None:
        if revision in self.revisions.values():
            return revision
        return self.revisions.get(revision)


@dataclass
class _Fault:
    file: str
    times: int
    status: int | None = None
    cut_after: int | None = None


class HubServer(LoopbackServer):
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        """(method, path, headers) of every request."""
        self.faults: list[_Fault] = []
        self.corrupted: set[str] = set()
        self.lock = threading.Lock()
        super().__init__(_Handler)
        self._server.hub = self  # type: ignore[attr-defined]

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def cut(self, file: str, times: int = 1, *, after: int) -> None:
        self.faults.append(_Fault(file, times, cut_after=after))

    def fail(self, file: str, times: int = 1, *, status: int = 500) -> None:
        self.faults.append(_Fault(file, times, status=status))

    def corrupt(self, file: str) -> None:
        self.corrupted.add(file)

    def downloads(self, file: str) -> list[dict[str, str]]:
        """The headers of every GET of a file's bytes (from the hub or the CDN)."""
        return [headers for method, path, headers in self.requests if method == "GET" and path.endswith("/" + file)]

    def take_fault(self, file: str) -> _Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.file == file and fault.times > 0:
                    fault.times -= 1
                    return fault
        return None


_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/revision/(?P<revision>[^/]+)$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<file>.+)$")
_CDN = re.compile(r"^/cdn/(?P<repo>[^/]+/[^/]+)/(?P<file>.+)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ThreadingHTTPServer

    def log_message(self, *args) -> None:
        pass

    @property
    def hub(self) -> HubServer:
        return self.server.hub  # type: ignore[attr-defined]

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, *, body: bool) -> None:
        path = unquote(urlparse(self.path).path)
        self.hub.requests.append((self.command, path, {k.lower(): v for k, v in self.headers.items()}))
        if match := _INFO.match(path):
            return self._info(match["repo"], match["revision"])
        if match := _RESOLVE.match(path):
            return self._resolve(match["repo"], match["revision"], match["file"], body=body)
        if match := _CDN.match(path):
            repo = self.hub.repos.get(match["repo"])
            if repo is None or match["file"] not in repo.files:
                return self._error(404, "EntryNotFound")
            return self._bytes(repo, match["file"], body=body, headers={})
        self._error(404, "RepoNotFound")

    def _repo(self, name: str) -> Repo | None:
        repo = self.hub.repos.get(name)
        if repo is None:
            self._error(401, "RepoNotFound")  # the hub answers 401 for a missing repo too
            return None
        if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
            self._error(401, "GatedRepo", message="Access to this model is restricted")
            return None
        return repo

    def _at(self, name: str, revision: str) -> tuple[Repo, str] | None:
        """The repository and the commit the revision names; None once the error is answered."""
        repo = self._repo(name)
        commit = None if repo is None else repo.commit_of(revision)
        if repo is not None and commit is None:
            self._error(404, "RevisionNotFound")
        return None if commit is None else (repo, commit)

    def _info(self, name: str, revision: str) -> None:
        if (found := self._at(name, revision)) is None:
            return
        repo, commit = found
        siblings = []
        for file, data in sorted(repo.files.items()):
            sibling = {"rfilename": file, "size": len(data), "blobId": git_blob_id(data)}
            if file.endswith(LFS_SUFFIXES):
                sibling["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": POINTER_SIZE}
                sibling["blobId"] = hashlib.sha1(file.encode()).hexdigest()  # the pointer file's id
            siblings.append(sibling)
        self._json(200, {"id": name, "modelId": name, "sha": commit, "private": False, "gated": "auto" if repo.token else False,
                         "siblings": siblings})

    def _resolve(self, name: str, revision: str, file: str, *, body: bool) -> None:
        if (found := self._at(name, revision)) is None:
            return
        repo, commit = found
        if file not in repo.files:
            return self._error(404, "EntryNotFound", commit=commit)
        data = repo.files[file]
        if file.endswith(LFS_SUFFIXES):
            # LFS: a redirect to the blob on another host, the metadata on the redirect itself.
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.hub.port}/cdn/{name}/{file}")
            self.send_header("X-Repo-Commit", commit)
            self.send_header("X-Linked-Etag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("ETag", f'"{git_blob_id(data)}"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._bytes(repo, file, body=body, headers={"X-Repo-Commit": commit, "ETag": f'"{git_blob_id(data)}"'})

    def _bytes(self, repo: Repo, file: str, *, body: bool, headers: dict[str, str]) -> None:
        data = repo.files[file]
        if body and file in self.hub.corrupted:
            data = bytes(b ^ 0xFF for b in data[:16]) + data[16:]
        fault = self.hub.take_fault(file) if body else None
        if fault is not None and fault.status is not None:
            return self._error(fault.status, "")
        start = 0
        ranged = re.match(r"bytes=(\d+)-$", self.headers.get("Range", ""))
        if ranged:
            start = int(ranged[1])
        self.send_response(206 if ranged else 200)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if not body:
            return
        if fault is not None and fault.cut_after is not None:
            self.wfile.write(data[start:start + fault.cut_after])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)  # the connection drops mid-body
            return
        self.wfile.write(data[start:])

    def _json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, code: str, *, message: str = "", commit: str | None = None) -> None:
        data = f'{{"error": "{code or status} {message}"}}'.encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        if message:
            self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
