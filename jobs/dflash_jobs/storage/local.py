"""The local store: a directory, whose writes become visible whole by a rename in the same directory."""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

from dflash_jobs.storage.interface import HASH_BLOCK, TEMP_PREFIX, Buffer, Digest, ObjectInfo, ObjectNotFound, PutResult, byte_views, check_key, check_size


SYNC_EVERY = 256 << 20
"""Bytes of a large write flushed to the disk at a time, as it goes: the closing fsync then waits for the
last of them only. Left to the page cache, a 3 GB chunk's pages stay dirty (the kernel's background
writeback starts at 10% of memory or after 30 s) and its closing fsync wrote them all, seconds spent
after the GPU's last forward (the extraction's drain)."""


def write_synced(f: BinaryIO, views: Iterable[Buffer]) -> int:
    """Writes `views` to `f` in order, syncing its data every SYNC_EVERY bytes; the bytes written."""
    written = unsynced = 0
    for view in views:
        f.write(view)
        written += len(view)
        unsynced += len(view)
        if unsynced >= SYNC_EVERY:
            f.flush()
            os.fdatasync(f.fileno())
            unsynced = 0
    return written


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

        def blocks(src: BinaryIO) -> Iterator[bytes]:
            while block := src.read(HASH_BLOCK):
                digest.update(block)
                yield block

        with self._temp_beside(target) as temp:
            with open(path, "rb") as src, open(temp, "wb") as dst:
                size = write_synced(dst, blocks(src))
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(temp, target)
        return PutResult(size, digest.hexdigest(), None)

    def put_parts(self, key: str, parts: Iterable[Buffer], size: int | None = None) -> PutResult:
        """One object from buffers written in order as they come, hashed while written: each byte is written once."""
        target = self._path(key)
        with Digest() as digest, self._temp_beside(target) as temp:
            with open(temp, "wb") as f:
                written = write_synced(f, digest.fed(byte_views(parts)))
                f.flush()
                os.fsync(f.fileno())
            check_size(f"{self.url}/{key}", written, size)
            sha256 = digest.result()
            os.replace(temp, target)
        return PutResult(written, sha256, None)

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
