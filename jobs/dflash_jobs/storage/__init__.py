"""One storage interface over s3:// (boto3) and local directories.

Both give the same guarantees, which the rest of the system is built on:
- a reader never sees a partial object (local: write a temporary file, then rename; S3: an object
  appears only when its (multipart) upload completes);
- `put_if_absent` creates a marker only if none exists (local: link(2); S3: If-None-Match: *);
- every put returns the size and sha256 of what was written.

Keys are '/'-separated and relative to the storage root; a key that would escape the root is refused.
No torch here: the control plane uses this package too. Import from the package itself; its modules:
`interface` (the Storage protocol, its results and errors, the key rule), `local` (a directory) and
`s3` (a bucket prefix, and how long its calls wait out an outage: Patience); the package opens
either from a URL.
"""

from __future__ import annotations

from dflash_jobs.errors import StorageError
from dflash_jobs.storage.interface import (
    HASH_BLOCK, TEMP_PREFIX, AccessDenied, Buffer, BucketNotFound, CredentialsMissing, EndpointUnreachable, ObjectInfo,
    ObjectNotFound, PutResult, Storage, check_key, sha256_file, sha256_stream,
)
from dflash_jobs.storage.local import LocalStorage
from dflash_jobs.storage.s3 import FIRST_WAIT_S, LONGEST_WAIT_S, MULTIPART_CHUNK, MULTIPART_THRESHOLD, Patience, S3Storage

__all__ = [
    "FIRST_WAIT_S", "HASH_BLOCK", "LONGEST_WAIT_S", "MULTIPART_CHUNK", "MULTIPART_THRESHOLD", "TEMP_PREFIX",
    "AccessDenied", "Buffer", "BucketNotFound", "CredentialsMissing", "EndpointUnreachable", "LocalStorage", "ObjectInfo",
    "ObjectNotFound", "Patience", "PutResult", "S3Storage", "Storage",
    "check_key", "open_storage", "open_url", "read_head", "sha256_file", "sha256_stream", "storage_for",
]

def open_storage(
    url: str, *, endpoint_url: str | None = None, region: str | None = None, max_attempts: int = 10,
    patience: Patience | None = None,
) -> Storage:
    """Storage rooted at an s3:// prefix, a file:// URL or a local path.

    `max_attempts` bounds the client's quick S3 retries: lower it where failing fast beats riding
    out throttling (a reachability check). `patience` waits out longer outages (see Patience)."""
    if url.startswith("s3://"):
        return S3Storage(url, endpoint_url=endpoint_url, region=region, max_attempts=max_attempts, patience=patience or Patience())
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
    """The run's output root (`spec` is a RunSpec, not imported: this package stays dependency-free)."""
    return open_storage(spec.output, endpoint_url=spec.storage.endpoint_url, region=spec.storage.region, patience=patience)
