"""The value checks every section shares: DNS labels, Kubernetes quantities, whole numbers, and
where a location points (an s3:// prefix, a local path or a file:// URL)."""

from __future__ import annotations

import posixpath
import re
from typing import Any

from dflash_jobs.errors import SpecError

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
BINARY_QUANTITY = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti)?$")


def is_s3(url: str) -> bool:
    return url.startswith("s3://")


def _check_location(path: str, value: str, *, what: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise SpecError(path, value, f"an s3://bucket/prefix URL or a local path ({what})")
    if "://" in value and not (value.startswith("s3://") or value.startswith("file://")):
        raise SpecError(path, value, f"an s3://bucket/prefix URL, a file:// URL or a local path ({what})")
    scheme = value.split(":", 1)[0]
    if ":" in value and scheme.lower() in ("s3", "file") and "://" not in value:
        # `s3:/bucket/x` would otherwise be a relative local path named "s3:".
        raise SpecError(path, value, f"{scheme.lower()}:// with two slashes, e.g. {scheme.lower()}://{value.split(':', 1)[1].lstrip('/')}")
    if is_s3(value):
        bucket = value[len("s3://"):].split("/", 1)[0]
        if not bucket:
            raise SpecError(path, value, "s3://<bucket>[/<prefix>] with a bucket name")
        problem = s3_bucket_problem(bucket)
        if problem:
            raise SpecError(path, value, f"an S3 bucket name S3 accepts: {bucket!r} {problem}")


S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]*[a-z0-9]$")
IPV4 = re.compile(r"^\d+\.\d+\.\d+\.\d+$")


def s3_bucket_problem(bucket: str) -> str | None:
    """Why S3 refuses a bucket name (its naming rules for general purpose buckets), or None."""
    if not 3 <= len(bucket) <= 63:
        return f"has {len(bucket)} characters (3 to 63)"
    if not S3_BUCKET.match(bucket):
        return "has characters other than lower-case letters, digits, '.' and '-', or does not start and end with a letter or digit"
    if ".." in bucket:
        return "has two adjacent periods"
    if IPV4.match(bucket):
        return "is formatted as an IP address"
    if bucket.startswith(("xn--", "sthree-")) or bucket.endswith(("-s3alias", "--ol-s3")):
        return "uses a prefix or suffix S3 reserves (xn--, sthree-, -s3alias, --ol-s3)"
    return None


def local_path(location: str) -> str | None:
    """The filesystem path of a local location (a path or a file:// URL); None for s3://."""
    return None if is_s3(location) else location.removeprefix("file://")


def under(path: str, directory: str) -> bool:
    """Whether `path` is `directory` or inside it (lexically: both absolute, normalized)."""
    path, directory = posixpath.normpath(path), posixpath.normpath(directory)
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _positive(path: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(path, value, f"an integer >= {minimum}")


def _binary_quantity(path: str, value: Any) -> None:
    # Whole binary units only: the renderer multiplies memory by the GPUs of a pod.
    if not isinstance(value, str) or not BINARY_QUANTITY.match(value):
        raise SpecError(path, value, "a whole binary quantity such as 96Gi or 512Mi")


def _dns_label(path: str, value: Any, *, limit: int) -> None:
    if not isinstance(value, str) or not DNS1123_LABEL.match(value) or len(value) > limit:
        raise SpecError(
            path, value,
            f"a DNS-1123 label: lower-case letters, digits and '-', starting and ending with a letter or digit, at most {limit} characters",
        )
