"""What every store is: the Storage protocol, what its calls return and raise, the rule a key
follows, and the hashing both stores do while they write."""

from __future__ import annotations

import hashlib
import queue
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol, Union

from dflash_jobs.errors import StorageError, StorageUnavailable

HASH_BLOCK = 8 << 20
TEMP_PREFIX = ".tmp-"

Buffer = Union[bytes, bytearray, memoryview]
"""Anything with the buffer protocol: put_parts reads it in place, without a copy."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    size: int
    etag: str | None


@dataclass(frozen=True, slots=True)
class PutResult:
    size: int
    sha256: str
    etag: str | None


class ObjectNotFound(StorageError):
    """The object does not exist."""


# Why S3 cannot be read, told apart for the checks and the plan (`dflashctl check`, `dflashctl plan`).
# Each is a StorageError or StorageUnavailable as before, so every existing handler still applies.


class CredentialsMissing(StorageError):
    """No S3 credentials were found (environment, shared files, instance or workload identity)."""


class AccessDenied(StorageError):
    """S3 refused the credentials (unknown key, bad signature) or the call (a policy)."""


class BucketNotFound(StorageError):
    """The bucket does not exist."""


class EndpointUnreachable(StorageUnavailable):
    """The endpoint did not answer: a wrong AWS_ENDPOINT_URL, DNS, a firewall, or a store that is down."""


def check_key(key: str) -> str:
    """Refuses keys that could escape the storage root or alias another key."""
    if not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise StorageError(f"storage key {key!r} is not a relative '/'-separated path", "Use keys like extract/chunks/000000.safetensors")
    parts = key.split("/")
    if any(part in ("", ".", "..") for part in parts[:-1]) or parts[-1] in (".", ".."):
        raise StorageError(f"storage key {key!r} contains an empty, '.' or '..' segment", "Keys must stay inside the output prefix")
    return key


def byte_views(parts: Iterable[Buffer]) -> Iterator[memoryview]:
    """Each part as flat bytes, in place, taken from `parts` only as the caller goes."""
    for part in parts:
        yield memoryview(part).cast("B")


class Digest:
    """sha256 of the buffers fed to it in order, computed on its own thread while the caller moves
    the bytes (hashlib releases the GIL on large buffers, so both run at once): a part is hashed
    while it is written, and a stream of parts as it comes."""

    def __init__(self) -> None:
        self._parts: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sha256")
        self._future = self._pool.submit(self._digest)

    def _digest(self) -> str:
        digest = hashlib.sha256()
        while (part := self._parts.get()) is not None:
            for start in range(0, len(part), HASH_BLOCK):
                digest.update(part[start:start + HASH_BLOCK])
        return digest.hexdigest()

    def fed(self, views: Iterable[memoryview]) -> Iterator[memoryview]:
        """`views` as they come, each handed to the hashing thread first."""
        for view in views:
            self._parts.put(view)
            yield view

    def __enter__(self) -> Digest:
        return self

    def __exit__(self, *exc) -> None:
        self._parts.put(None)  # after a failed write too: the hashing thread ends with the put
        self._pool.shutdown()

    def result(self) -> str:
        """The digest of everything fed; nothing may be fed after."""
        self._parts.put(None)
        return self._future.result()


def check_size(url: str, written: int, size: int | None) -> None:
    """A put of parts made as it went stored the size it announced (before the object becomes visible)."""
    if size is not None and written != size:
        raise StorageError(f"{url}: the parts held {written} bytes, {size} were announced", "A bug in the writer: report it with this line")


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return sha256_stream(f)


def sha256_stream(stream: BinaryIO) -> str:
    """The sha256 of what `stream` reads to its end, a block at a time."""
    digest = hashlib.sha256()
    while block := stream.read(HASH_BLOCK):
        digest.update(block)
    return digest.hexdigest()


class Storage(Protocol):
    url: str

    def put_bytes(self, key: str, data: bytes) -> PutResult: ...
    def put_file(self, key: str, path: str | Path) -> PutResult: ...
    def put_parts(self, key: str, parts: Iterable[Buffer], size: int | None = None) -> PutResult:
        """One object, the parts' bytes in order, each byte read in place once and hashed meanwhile.
        `parts` may be produced as the store goes (a generator: a chunk whose rows are still being
        filled), then `size` gives the total; an error it raises aborts the store, leaving nothing."""
    def put_if_absent(self, key: str, data: bytes) -> bool: ...
    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes: ...
    def get_file(self, key: str, path: str | Path) -> None: ...
    def open_read(self, key: str) -> BinaryIO: ...
    def stat(self, key: str) -> ObjectInfo | None: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str = "") -> list[str]: ...
    def list_modified(self, prefix: str = "") -> dict[str, float]:
        """Keys under `prefix` and when each was last written (Unix time), from the listing alone."""
    def delete(self, key: str) -> None: ...
