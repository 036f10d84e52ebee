"""One storage interface over s3:// (boto3) and local directories.

Both give the same guarantees, which the rest of the system is built on:
- a reader never sees a partial object (local: write a temporary file, then rename; S3: an object
  appears only when its (multipart) upload completes);
- `put_if_absent` creates a marker only if none exists (local: link(2); S3: If-None-Match: *);
- every put returns the size and sha256 of what was written.

Keys are '/'-separated and relative to the storage root; a key that would escape the root is refused.
No torch here: the control plane uses this module too.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, Protocol, TypeVar, Union

from dflash_jobs.errors import StorageError, StorageUnavailable

HASH_BLOCK = 8 << 20
# Objects above this go up in parallel parts; S3 caps a single PUT at 5 GiB and parts help retries.
MULTIPART_THRESHOLD = 64 << 20
MULTIPART_CHUNK = 64 << 20
TEMP_PREFIX = ".tmp-"
PART_THREADS = 8
FIRST_WAIT_S = 5.0
LONGEST_WAIT_S = 120.0
"""Waits between attempts while storage is unavailable (see Patience): doubling from the first to the longest."""
# S3 error codes of a store that is down or overloaded; HEAD answers carry only the status ("503").
_UNAVAILABLE_CODES = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "Throttling", "ThrottlingException"}

Buffer = Union[bytes, bytearray, memoryview]
"""Anything with the buffer protocol: put_parts reads it in place, without a copy."""
T = TypeVar("T")


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


def _byte_views(parts: Sequence[Buffer]) -> list[memoryview]:
    return [memoryview(part).cast("B") for part in parts]


class _Digest:
    """sha256 of a sequence of buffers, computed on its own thread while the caller moves the bytes
    (hashlib releases the GIL on large buffers, so both run at once)."""

    def __init__(self, parts: Sequence[memoryview]) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sha256")
        self._future = self._pool.submit(self._digest, parts)

    @staticmethod
    def _digest(parts: Sequence[memoryview]) -> str:
        digest = hashlib.sha256()
        for part in parts:
            for start in range(0, len(part), HASH_BLOCK):
                digest.update(part[start:start + HASH_BLOCK])
        return digest.hexdigest()

    def __enter__(self) -> _Digest:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown()  # after a failed write too: the hashing thread ends with the put

    def result(self) -> str:
        return self._future.result()


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


class Storage(Protocol):
    url: str

    def put_bytes(self, key: str, data: bytes) -> PutResult: ...
    def put_file(self, key: str, path: str | Path) -> PutResult: ...
    def put_parts(self, key: str, parts: Sequence[Buffer]) -> PutResult: ...
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


# ---- local directories -------------------------------------------------------------------------


class LocalStorage:
    """A directory. Atomic visibility by write-to-temp-then-rename in the same directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.url = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    @contextmanager
    def _temp_beside(self, path: Path) -> Iterator[Path]:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.parent / f"{TEMP_PREFIX}{path.name}.{uuid.uuid4().hex}"
        try:
            yield temp
        finally:
            temp.unlink(missing_ok=True)

    def put_bytes(self, key: str, data: bytes) -> PutResult:
        path = self._path(key)
        with self._temp_beside(path) as temp:
            with open(temp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, path)
        return PutResult(len(data), hashlib.sha256(data).hexdigest(), None)

    def put_file(self, key: str, path: str | Path) -> PutResult:
        target = self._path(key)
        digest = hashlib.sha256()
        size = 0
        with self._temp_beside(target) as temp:
            with open(path, "rb") as src, open(temp, "wb") as dst:
                while block := src.read(HASH_BLOCK):
                    digest.update(block)
                    dst.write(block)
                    size += len(block)
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(temp, target)
        return PutResult(size, digest.hexdigest(), None)

    def put_parts(self, key: str, parts: Sequence[Buffer]) -> PutResult:
        """One object from buffers written in order, hashed while written: each byte is written once."""
        target = self._path(key)
        views = _byte_views(parts)
        with _Digest(views) as digest, self._temp_beside(target) as temp:
            with open(temp, "wb") as f:
                for view in views:
                    f.write(view)
                f.flush()
                os.fsync(f.fileno())
            sha256 = digest.result()
            os.replace(temp, target)
        return PutResult(sum(len(v) for v in views), sha256, None)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        with self._temp_beside(path) as temp:
            temp.write_bytes(data)
            try:
                os.link(temp, path)  # fails if the name exists: create-if-absent, atomically
            except FileExistsError:
                return False
        return True

    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                if start:
                    f.seek(start)
                return f.read() if end is None else f.read(end - (start or 0))
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.url}/{key} does not exist") from None

    def get_file(self, key: str, path: str | Path) -> None:
        path = Path(path)
        source = self._path(key)
        if not source.is_file():
            raise ObjectNotFound(f"{self.url}/{key} does not exist")
        with self._temp_beside(path) as temp:
            shutil.copyfile(source, temp)
            os.replace(temp, path)

    def open_read(self, key: str) -> BinaryIO:
        try:
            return open(self._path(key), "rb")
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.url}/{key} does not exist") from None

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            return ObjectInfo(self._path(key).stat().st_size, None)
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        return sorted(self._walk(prefix))

    def list_modified(self, prefix: str = "") -> dict[str, float]:
        modified = {}
        for key, path in sorted(self._walk(prefix).items()):
            try:
                modified[key] = path.stat().st_mtime
            except FileNotFoundError:  # deleted since the walk
                continue
        return modified

    def _walk(self, prefix: str) -> dict[str, Path]:
        base = self.root / prefix.rstrip("/") if prefix else self.root
        if prefix and not prefix.endswith("/") and not base.is_dir():
            base = base.parent
        if not base.is_dir():
            return {}
        found = {}
        for dirpath, _, filenames in os.walk(base):
            for name in filenames:
                if name.startswith(TEMP_PREFIX):
                    continue
                key = os.path.relpath(os.path.join(dirpath, name), self.root).replace(os.sep, "/")
                if key.startswith(prefix):
                    found[key] = Path(dirpath, name)
        return found

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


# ---- S3 ----------------------------------------------------------------------------------------


def _s3_error(exc: Exception, url: str) -> StorageError:
    """Turns boto errors into messages that say what to fix."""
    from botocore.exceptions import ClientError, ConnectionError, HTTPClientError, NoCredentialsError, PartialCredentialsError

    if isinstance(exc, PartialCredentialsError):
        return CredentialsMissing(f"incomplete S3 credentials for {url} ({exc})", "Set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (in pods: the cluster.s3_secret Secret)")
    if isinstance(exc, NoCredentialsError):
        return CredentialsMissing(f"no S3 credentials for {url}", "Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (in pods: the cluster.s3_secret Secret)")
    if isinstance(exc, ConnectionError):
        return EndpointUnreachable(f"cannot reach the S3 endpoint for {url} ({exc})", "Check AWS_ENDPOINT_URL or storage.endpoint_url, and the network")
    if isinstance(exc, HTTPClientError):  # reset or timed out mid-request
        return StorageUnavailable(f"S3 call on {url} failed: {exc}", "Check the endpoint and the network; the call was retried")
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        if code in _UNAVAILABLE_CODES or status >= 500:
            return StorageUnavailable(f"S3 call on {url} failed: {code or status} (the store is down or overloaded)", "Retried with backoff; check the store's health")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "Forbidden"):
            return AccessDenied(f"S3 refused access to {url} ({code})", "Check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) and the bucket policy")
        if code in ("NoSuchBucket",):
            return BucketNotFound(f"the S3 bucket of {url} does not exist", "Create the bucket or fix the URL")
        if code in ("NoSuchKey", "404", "NotFound"):
            return ObjectNotFound(f"{url} does not exist")
        return StorageError(f"S3 call on {url} failed: {code or exc}", "See the message above; retried calls exhausted their attempts")
    return StorageError(f"S3 call on {url} failed: {exc}", "Check the endpoint, credentials and network")


class Patience:
    """How long S3 calls outlast an outage. A call that fails with StorageUnavailable (after the
    client's own quick retries) is made again after a wait, doubling from FIRST_WAIT_S to
    LONGEST_WAIT_S, until `seconds` have passed since its first failure; then the error goes up.
    `on_wait(error, seconds)` hears of every wait (a log line: an outage must be visible).

    The default, 0 seconds, fails at once: right for a command a person waits on. The pipeline,
    which runs for days in the cluster, gives it minutes."""

    def __init__(self, seconds: float = 0.0, on_wait: Callable[[StorageUnavailable, float], None] | None = None) -> None:
        self.seconds = seconds
        self.on_wait = on_wait

    def call(self, attempt: Callable[[], T]) -> T:
        deadline, delay = None, FIRST_WAIT_S
        while True:
            try:
                return attempt()
            except StorageUnavailable as error:
                if self.seconds <= 0:
                    raise
                now = time.monotonic()
                deadline = deadline or now + self.seconds
                if now >= deadline:
                    raise StorageUnavailable(f"{error.what}; still so after {self.seconds:.0f} s of retries", error.fix) from None
                wait = min(delay, deadline - now)
                if self.on_wait is not None:
                    self.on_wait(error, wait)
                time.sleep(wait)
                delay = min(2 * delay, LONGEST_WAIT_S)


class _BodyReader(io.RawIOBase):
    """A botocore StreamingBody as a raw stream, so io.BufferedReader gives it readline()."""

    def __init__(self, body, url: str) -> None:
        self.body = body
        self.url = url

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        from botocore.exceptions import BotoCoreError

        try:
            data = self.body.read(len(buffer))
        except BotoCoreError as exc:  # the connection broke mid-object: the reader starts over
            raise _s3_error(exc, self.url) from None
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self.body.close()
        super().close()


def _slices(views: Sequence[memoryview], size: int) -> Iterator[list[memoryview]]:
    """The concatenation of `views` cut into pieces of `size` bytes (the last one shorter), each
    piece a list of slices of the views: nothing is copied."""
    piece: list[memoryview] = []
    room = size
    for view in views:
        while len(view):
            take = view[:room]
            piece.append(take)
            view = view[len(take):]
            room -= len(take)
            if room == 0:
                yield piece
                piece, room = [], size
    if piece:
        yield piece


class S3Storage:
    """A bucket prefix. Multipart uploads for large objects; standard botocore retries in adaptive
    mode, so 503 SlowDown and throttling back off instead of failing the pod; past those, `patience`
    decides whether a call waits out an outage."""

    def __init__(
        self, url: str, *, endpoint_url: str | None = None, region: str | None = None, max_attempts: int = 10,
        patience: Patience | None = None,
    ) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise StorageError(f"{url!r} names no bucket", "Use s3://<bucket>/<prefix>")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or endpoint_url
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or region or "us-east-1"
        config = Config(
            retries={"max_attempts": max_attempts, "mode": "adaptive"},
            connect_timeout=10,
            read_timeout=120,
            max_pool_connections=32,
            # MinIO and most S3-compatible stores want path-style addressing.
            s3={"addressing_style": "path"} if endpoint else {},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self.client = boto3.session.Session().client("s3", endpoint_url=endpoint, region_name=region, config=config)
        self.transfer = TransferConfig(
            multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_CHUNK, max_concurrency=8
        )
        self.patience = patience or Patience()

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, key: str, fn, /, **kwargs):
        return self.patience.call(lambda: self._once(key, fn, **kwargs))

    def _once(self, key: str, fn, /, **kwargs):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(**kwargs)
        except (BotoCoreError, ClientError) as exc:
            raise _s3_error(exc, f"{self.url}/{key}") from None

    def put_bytes(self, key: str, data: bytes) -> PutResult:
        response = self._call(key, self.client.put_object, Bucket=self.bucket, Key=self._key(key), Body=data)
        return PutResult(len(data), hashlib.sha256(data).hexdigest(), response.get("ETag"))

    def put_file(self, key: str, path: str | Path) -> PutResult:
        self._call(key, self.client.upload_file, Filename=str(path), Bucket=self.bucket, Key=self._key(key), Config=self.transfer)
        info = self.stat(key)
        assert info is not None
        return PutResult(info.size, sha256_file(path), info.etag)

    def put_parts(self, key: str, parts: Sequence[Buffer]) -> PutResult:
        """One object from buffers in memory: a multipart upload of slices of them, hashed meanwhile
        (no spool file). A failed part stops the parts not yet sent, and the upload is aborted, so no
        parts are left behind."""
        views = _byte_views(parts)
        size = sum(len(v) for v in views)
        with _Digest(views) as digest:
            return self._put_views(key, views, size, digest)

    def _put_views(self, key: str, views: list[memoryview], size: int, digest: _Digest) -> PutResult:
        if size < MULTIPART_THRESHOLD:
            response = self._call(key, self.client.put_object, Bucket=self.bucket, Key=self._key(key), Body=b"".join(views))
            return PutResult(size, digest.result(), response.get("ETag"))
        full = self._key(key)
        upload = self._call(key, self.client.create_multipart_upload, Bucket=self.bucket, Key=full)["UploadId"]

        failed = threading.Event()

        def send(number: int, piece: list[memoryview]) -> dict | None:
            if failed.is_set():  # the upload will be aborted: this part's transfer would be thrown away
                return None
            try:
                # One copy of the part (botocore takes bytes or a file), sent in one go and rewound for a retry.
                response = self._call(key, self.client.upload_part, Bucket=self.bucket, Key=full, UploadId=upload,
                                      PartNumber=number, Body=b"".join(piece))
            except BaseException:
                failed.set()
                raise
            return {"PartNumber": number, "ETag": response["ETag"]}

        try:
            with ThreadPoolExecutor(PART_THREADS, thread_name_prefix="s3-part") as pool:
                sent = [pool.submit(send, n + 1, piece) for n, piece in enumerate(_slices(views, MULTIPART_CHUNK))]
                # A part skipped (None) means another failed, whose result() raises: `done` never holds None.
                done = [future.result() for future in sent]
            response = self._call(key, self.client.complete_multipart_upload, Bucket=self.bucket, Key=full, UploadId=upload,
                                  MultipartUpload={"Parts": done})
        except BaseException:
            with suppress(Exception):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload)
            raise
        return PutResult(size, digest.result(), response.get("ETag"))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self.patience.call(lambda: self._put_if_absent_once(key, data))

    def _put_if_absent_once(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
        except BotoCoreError as exc:  # connection errors after the client's retries
            raise _s3_error(exc, f"{self.url}/{key}") from None
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("PreconditionFailed", "ConditionalRequestConflict", "412"):
                # A retried PUT whose first attempt landed (its answer was lost) meets its own object.
                return self.get_bytes(key) == data
            raise _s3_error(exc, f"{self.url}/{key}") from None
        return True

    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        kwargs = {}
        if start is not None or end is not None:
            kwargs["Range"] = f"bytes={start or 0}-{'' if end is None else end - 1}"
        # The body is read inside the call: a connection lost mid-body is retried like one lost before.
        return self._call(key, lambda **call: self.client.get_object(**call)["Body"].read(), Bucket=self.bucket, Key=self._key(key), **kwargs)

    def get_file(self, key: str, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=path.parent)
        os.close(fd)
        try:
            self._call(key, self.client.download_file, Bucket=self.bucket, Key=self._key(key), Filename=temp, Config=self.transfer)
            os.replace(temp, path)
        finally:
            Path(temp).unlink(missing_ok=True)

    def open_read(self, key: str) -> BinaryIO:
        response = self._call(key, self.client.get_object, Bucket=self.bucket, Key=self._key(key))
        return io.BufferedReader(_BodyReader(response["Body"], f"{self.url}/{key}"), buffer_size=1 << 20)

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            response = self._call(key, self.client.head_object, Bucket=self.bucket, Key=self._key(key))
        except ObjectNotFound:
            return None
        return ObjectInfo(response["ContentLength"], response.get("ETag"))

    def exists(self, key: str) -> bool:
        return self.stat(key) is not None

    def list(self, prefix: str = "") -> list[str]:
        return sorted(self.list_modified(prefix))

    def list_modified(self, prefix: str = "") -> dict[str, float]:
        return self.patience.call(lambda: self._list_once(prefix))

    def _list_once(self, prefix: str) -> dict[str, float]:
        """One listing, every page; a page that fails fails the listing (the next attempt starts over)."""
        from botocore.exceptions import BotoCoreError, ClientError

        full = self._key(prefix) if prefix else (f"{self.prefix}/" if self.prefix else "")
        strip = len(self.prefix) + 1 if self.prefix else 0
        modified: dict[str, float] = {}
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                modified.update((obj["Key"][strip:], obj["LastModified"].timestamp()) for obj in page.get("Contents", []))
        except (BotoCoreError, ClientError) as exc:
            raise _s3_error(exc, f"{self.url}/{prefix}") from None
        return dict(sorted(modified.items()))

    def delete(self, key: str) -> None:
        self._call(key, self.client.delete_object, Bucket=self.bucket, Key=self._key(key))


# ---- opening -----------------------------------------------------------------------------------


def open_storage(
    url: str, *, endpoint_url: str | None = None, region: str | None = None, max_attempts: int = 10,
    patience: Patience | None = None,
) -> Storage:
    """Storage rooted at an s3:// prefix, a file:// URL or a local path.

    `max_attempts` bounds the client's quick S3 retries: lower it where failing fast beats riding
    out throttling (a reachability check). `patience` waits out longer outages (see Patience)."""
    if url.startswith("s3://"):
        return S3Storage(url, endpoint_url=endpoint_url, region=region, max_attempts=max_attempts, patience=patience)
    if url.startswith("file://"):
        url = url[len("file://"):]
    return LocalStorage(url)


def open_url(url: str, *, endpoint_url: str | None = None, region: str | None = None, max_attempts: int = 10) -> tuple[Storage, str]:
    """A single object's URL, as (storage of its parent, its key)."""
    parent, _, name = url.rstrip("/").rpartition("/")
    if not name or not parent or parent in ("s3:", "s3:/"):
        raise StorageError(f"{url!r} does not name an object", "Use s3://bucket/path/file or a file path")
    return open_storage(parent, endpoint_url=endpoint_url, region=region, max_attempts=max_attempts), name


def read_head(url: str, size: int, *, endpoint_url: str | None = None, region: str | None = None, max_attempts: int = 10) -> tuple[int, bytes]:
    """The size of the object at `url` and its first `size` bytes. Why it cannot be read is the
    error's type: CredentialsMissing, EndpointUnreachable, AccessDenied, BucketNotFound, ObjectNotFound."""
    storage, key = open_url(url, endpoint_url=endpoint_url, region=region, max_attempts=max_attempts)
    try:
        info = storage.stat(key)
        if info is None:
            # A HEAD answers 404 for a missing bucket as for a missing object: a listing tells them apart.
            storage.list_modified(key)
            fix = "Upload it there, or fix the URL" if url.startswith("s3://") else "Fix the path (it is read on this machine)"
            raise ObjectNotFound(f"{url} does not exist", fix)
        return info.size, storage.get_bytes(key, 0, min(size, info.size)) if info.size else b""
    except PermissionError as exc:  # a local file this user may not read
        raise AccessDenied(f"{url} is not readable ({exc.strerror})", "Fix its permissions, or run where it is readable") from None


def storage_for(spec, *, patience: Patience | None = None) -> Storage:
    """The run's output root (`spec` is a RunSpec, not imported: this module stays dependency-free)."""
    return open_storage(spec.output, endpoint_url=spec.storage.endpoint_url, region=spec.storage.region, patience=patience)
