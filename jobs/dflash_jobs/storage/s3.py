"""The S3 store: a bucket prefix through boto3, whose objects appear only when their (multipart)
upload completes, and whose errors say what to fix."""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from typing import BinaryIO, Iterator, TypeVar

from dflash_jobs.errors import StorageError, StorageUnavailable
from dflash_jobs.storage.interface import (
    TEMP_PREFIX, AccessDenied, Buffer, BucketNotFound, CredentialsMissing, Digest, EndpointUnreachable, ObjectInfo, ObjectNotFound,
    PutResult, byte_views, check_key, check_size, sha256_file,
)

FIRST_WAIT_S = 5.0
LONGEST_WAIT_S = 120.0
"""Waits between attempts while storage is unavailable (see Patience): doubling from the first to the longest."""
T = TypeVar("T")


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


# Objects above this go up in parallel parts; S3 caps a single PUT at 5 GiB and parts help retries.
MULTIPART_THRESHOLD = 64 << 20
MULTIPART_CHUNK = 64 << 20
PART_THREADS = 8
# S3 error codes of a store that is down or overloaded; HEAD answers carry only the status ("503").
_UNAVAILABLE_CODES = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "Throttling", "ThrottlingException"}


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


def _slices(views: Iterable[memoryview], size: int) -> Iterator[list[memoryview]]:
    """The concatenation of `views` cut into pieces of `size` bytes (the last one shorter), each
    piece a list of slices of the views: nothing is copied, and a piece is given as soon as its
    views have come."""
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
        patience: Patience,
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
        self.patience = patience

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

    def put_parts(self, key: str, parts: Iterable[Buffer], size: int | None = None) -> PutResult:
        """One object from buffers in memory: a multipart upload of slices of them, each part sent as
        soon as its bytes have come, hashed meanwhile (no spool file). A failed part, or an error of
        `parts`, stops the parts not yet sent, and the upload is aborted, so no parts are left behind."""
        if size is None:
            parts = list(byte_views(parts))
            size = sum(len(v) for v in parts)
        with Digest() as digest:
            return self._put_views(key, digest.fed(byte_views(parts)), size, digest)

    def _put_views(self, key: str, views: Iterator[memoryview], size: int, digest: Digest) -> PutResult:
        if size < MULTIPART_THRESHOLD:
            body = b"".join(views)
            check_size(f"{self.url}/{key}", len(body), size)
            response = self._call(key, self.client.put_object, Bucket=self.bucket, Key=self._key(key), Body=body)
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
                sent, sent_bytes = [], 0
                try:
                    for number, piece in enumerate(_slices(views, MULTIPART_CHUNK), 1):
                        if failed.is_set():  # a part failed: its result() below raises; the rest is not sent
                            break
                        sent.append(pool.submit(send, number, piece))
                        sent_bytes += sum(len(view) for view in piece)
                except BaseException:
                    failed.set()  # the parts queued behind the error are not sent
                    raise
                # A part skipped (None) means another failed, whose result() raises: `done` never holds None.
                done = [future.result() for future in sent]
            check_size(f"{self.url}/{key}", sent_bytes, size)
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
